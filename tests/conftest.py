import os

import torch

# One thread per process: the multi-rank tests fork one process per rank on a 2-core machine, and a forked child must
# not inherit a parent's busy OpenMP pool.
torch.set_num_threads(1)
os.environ.setdefault("PYTHONWARNINGS", "ignore")
