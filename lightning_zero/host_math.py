"""Settling the host math library's kernel choice before training uses it from several threads at once.

[Note: MKL picks a VML kernel on first call, and several first calls at once can race]
On the CPU, torch computes contiguous float unary ops (``sqrt``, ``exp``, ``log``, ``tanh``, ``erf``, ...) with
oneMKL's VML, each intra-op thread calling it on its own chunk of the tensor and asking for the high-accuracy
kernel. oneMKL chooses a VML function's kernel on that function's first call in the process. When that first call
comes from several threads at once, one of them can run a low-accuracy kernel over its whole chunk
(pytorch/pytorch#188792; oneMKL 2024.2, the version torch's x86 wheels bundle, torch 2.13's included). The next
calls are correct, so the error shows only as a rare, unrepeatable difference.

Every Adam-family step on the host computes ``exp_avg_sq.sqrt()``. The first step of a fresh process is therefore
such a first call, and so is the first host step of an offloaded optimizer. On this project's 2-core CPU machine,
5 of 427 runs of the tiny bf16-mixed GPT of ``compare.py --gpu`` (zero3 with real collectives at world size 1, two
threads) ended with a different loss:

* one half of the tied embedding's first update, one thread's chunk, was off by up to 3e-4 of the update;
* the square root behind that half is what MKL's AVX2 low-accuracy ("EP") kernel computes, bit for bit (about 12
  bits, where the kernel asked for is exact to about the last bit);
* gradients, moments and all other parameters were bitwise the same.

``settle_mkl_dispatch`` calls ``torch.sqrt``, the one VML function the element-wise optimizers of ``torch.optim``
call on whole tensors (Adam, AdamW, Adagrad, RMSprop, Adadelta, NAdam, RAdam), on one element of each float dtype,
on the calling thread alone, so that its kernel is chosen before the step calls it from several threads (the warm-up
the upstream fix proposes, limited to what the step uses). ``ZeroStrategy`` runs it in ``setup_environment``, before
the model is set up. Settling all 18 VML functions as well would map their kernels' code: 7.6 MB of resident memory
measured here, against about 1 MB that the first step's ``sqrt`` maps anyway. The model's own calls of ``exp``,
``tanh`` and the like are left as they are. A torch built without MKL computes ``sqrt`` itself, and the call just
does a little work.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def settle_mkl_dispatch() -> None:
    """Call ``torch.sqrt`` once on a one-element float32 and float64 CPU tensor, in this thread only
    (see [Note: MKL picks a VML kernel on first call, and several first calls at once can race])."""
    for dtype in (torch.float32, torch.float64):
        torch.sqrt(torch.full((1,), 0.5, dtype=dtype))
