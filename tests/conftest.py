import os

import torch

# One thread per process: the multi-rank tests fork one process per rank on a 2-core machine, and a forked child must
# not inherit a parent's busy OpenMP pool.
torch.set_num_threads(1)
os.environ.setdefault("PYTHONWARNINGS", "ignore")

# Lightning's own test suite with ZeRO swapped in for DDP: it needs Lightning's fetched source and hours of CPU, and
# runs with its own command (tests/conformance/README.md), never as part of the default suite.
collect_ignore = ["conformance"]

try:
    from hypothesis import settings
except ImportError:  # installed with the dev extra; only the property-based tests need it
    pass
else:
    # The default run draws the same examples every time, so its verdict is the code's and not the draw's;
    # HYPOTHESIS_PROFILE=explore draws new ones on every run (see README, "Bad configuration").
    settings.register_profile("default-fixed", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default-fixed"))
