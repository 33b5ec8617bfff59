"""``lightning-zero consolidate``: a checkpoint's weights to one file (see ``checkpoint.consolidate``)."""

from __future__ import annotations

import argparse

from lightning_zero.cli.errors import UsageError
from lightning_zero.config import DTYPES


def add_consolidate(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "consolidate",
        help="write a checkpoint's full weights to one file, checked against its checksums",
        description="Write the full weights of a lightning_zero checkpoint (a checkpoint file, or a checkpoint "
        "directory of the earlier format) to one file, after checking every byte against its checksums, reading one "
        "tensor at a time. OUT ending in .safetensors holds the weights only and is streamed (peak memory about the "
        "largest tensor); any other suffix is a Lightning checkpoint file (torch.save of {'state_dict': ...}).",
    )
    parser.add_argument("checkpoint", help="a checkpoint written by ZeroStrategy (or by DDP, or one device)")
    parser.add_argument("out", help="the file to write (.safetensors, .ckpt, .pt)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="cast weights (default: as stored)")
    parser.add_argument("--strip-prefix", default="", help="drop this prefix from every key (e.g. 'model.')")
    parser.add_argument(
        "--training-state",
        action="store_true",
        help="also write full optimizer states and Lightning's loop state, so DDP or one device can resume from OUT",
    )
    parser.set_defaults(run=consolidate_command)


def consolidate_command(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint import CheckpointError, consolidate

    dtype = DTYPES[args.dtype] if args.dtype is not None else None
    try:
        keys = consolidate(args.checkpoint, args.out, dtype, args.strip_prefix, args.training_state)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(f"wrote {len(keys)} tensors to {args.out}")
    return 0
