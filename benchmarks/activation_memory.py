"""Activation memory with and without activation checkpointing, counted in bytes, for a long-sequence GPT.

What a training step holds for backward is measured by counting: every tensor an operator creates during the
forward is recorded (a ``TorchDispatchMode`` keeps a weak reference to its storage), and the bytes of the storages
still alive when the forward returns are the activations the step keeps until backward (parameters excluded).
Checkpointing ``Block`` (``activation_checkpointing_policy=["Block"]``, applied by the same function the strategy
uses) keeps only each block's input; backward recomputes one block at a time, whose activations are the extra peak
it adds during backward (reported too: the largest block's own activations, measured the same way). Gradients are
checked to match between the two runs, so the saving costs nothing but recomputation.

    python benchmarks/activation_memory.py                  # seq 2048, d 256, 8 layers, batch 2
    python benchmarks/activation_memory.py --seq 2048 --d-model 128 --layers 4 --heads 4 --batch 4  # the recipe
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_zero.lightning_compat import apply_activation_checkpointing
from lightning_zero.models import GPTConfig


class LiveStorages(TorchDispatchMode):
    """Weak references to the storage of every tensor an operator returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs:  # a view or an in-place result: memory that existed before (a weight's transpose)
                continue
            if key not in self.refs or self.refs[key][0].expired():  # an address freed and reused is a new storage
                self.refs[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.refs.values() if not ref.expired())


def held_for_backward(forward: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes the tensors created by ``forward()`` still hold when it returns (its output excluded), and the output."""
    with LiveStorages() as mode:
        out = forward()
    return mode.live_bytes() - out.untyped_storage().nbytes(), out


def training_step(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, float]:
    """Bytes held for backward after the forward of one step, and the seconds of forward and backward."""
    started = time.perf_counter()
    held, loss = held_for_backward(
        lambda: torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    )
    loss.backward()
    return held, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                       seq_len=args.seq)
    plain = config.build()
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, ("Block",))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))

    for model in (plain, checkpointed):  # warm-up: first calls pay for allocations and kernel selection
        training_step(model, tokens)
        model.zero_grad(set_to_none=True)
    held_plain, t_plain = training_step(plain, tokens)
    held_ckpt, t_ckpt = training_step(checkpointed, tokens)
    block_input = torch.randn(args.batch, args.seq, args.d_model, requires_grad=True)
    one_block, _ = held_for_backward(lambda: plain.blocks[0](block_input))  # what backward recomputes at a time

    grads_plain = [p.grad for p in plain.parameters()]
    grads_ckpt = [p.grad for p in checkpointed.parameters()]
    worst = max(float((a - b).abs().max()) for a, b in zip(grads_plain, grads_ckpt))
    mib = 2**20
    print(f"GPT {config.num_parameters / 1e6:.2f}M parameters: d_model {args.d_model}, {args.layers} layers, "
          f"seq {args.seq}, batch {args.batch}, fp32, CPU")
    print("| run | held for backward after forward MiB | step s (fwd+bwd) |")
    print("|---|---|---|")
    print(f"| no checkpointing | {held_plain / mib:.1f} | {t_plain:.2f} |")
    print(f"| activation_checkpointing_policy=[Block] | {held_ckpt / mib:.1f} | {t_ckpt:.2f} |")
    print(f"saved: {(held_plain - held_ckpt) / mib:.1f} MiB ({1 - held_ckpt / held_plain:.1%}); backward recomputes "
          f"one block at a time: +{one_block / mib:.1f} MiB transient; max gradient difference {worst:.1e}")


if __name__ == "__main__":
    main()
