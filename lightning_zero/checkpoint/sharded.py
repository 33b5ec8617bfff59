"""Saving and loading a checkpoint file from the live shards: every rank writes and reads only its own rows (see
[Note: checkpoint layout] in layout.py and [Note: one checkpoint file, written by every rank] in torch_file.py)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.layout import (
    FORMAT_KEY,
    CheckpointError,
    check_compatible,
    check_optimizer_class,
    first_line,
    remove,
    shard_dtensor,
)
from lightning_zero.checkpoint.torch_file import (
    Placeholder,
    check_records,
    read_crc,
    record_offsets,
    write_layout,
    write_rows,
)
from lightning_zero.sharding.flat_param import ParamShard, ShardSpec
from lightning_zero.sharding.optimizer import ShardedOptimizer, is_per_element
from lightning_zero.sharding.sharded_grad import ShardedRows

#: Version of ``checkpoint["lightning_zero"]`` in a checkpoint file (1 was the directory format).
FORMAT_VERSION = 2

#: Where a tensor sits in Lightning's checkpoint dictionary: ``("state_dict", name)`` or
#: ``("optimizer_states", i, "state", position, key)``.
Location = tuple


# ------------------------------------------------------------------------------------ what every rank hands over


def model_tensors(module: nn.Module, shards: list[ParamShard], mesh: DeviceMesh) -> dict[str, Any]:
    """The module's ``state_dict`` as a checkpoint holds it on every rank: each parameter (under each of its names,
    for a tied weight) as this rank's rows in a ``Shard(0)`` DTensor of the full shape (the fp32 master under mixed
    precision), the persistent buffers on the CPU (where the file's parameters load), extra state as it is."""
    by_param = {id(s.param): shard_dtensor(s.local.detach(), s.spec, mesh) for s in shards}
    return {
        name: by_param.get(id(value), value.detach().cpu() if torch.is_tensor(value) else value)
        for name, value in module.state_dict(keep_vars=True).items()
    }


def rows_as_dtensors(obj: Any, mesh: DeviceMesh, rank: int, world_size: int) -> Any:
    """``obj`` (a checkpoint, or a part of it) with every ``ShardedRows`` in it (a stage-3 parameter's values in a
    ``state_dict()``, a weight-averaging callback's sharded average: see [Note: Lightning's weight callbacks under
    zero3] in sharded_callbacks.py) replaced by its rows as a ``Shard(0)`` DTensor, which ``save_sharded`` writes
    as it writes the model's; dictionaries and lists are changed in place."""
    if isinstance(obj, ShardedRows):
        spec = ShardSpec(obj.shape, rank, world_size)
        if spec.owned_rows() != (obj._layout.lo, obj._layout.hi):
            raise CheckpointError(f"{obj!r} holds rows {obj._layout.lo}-{obj._layout.hi}; rank {rank} of "
                                  f"{world_size} saves rows {spec.owned_rows()}")
        return shard_dtensor(obj._local.detach(), spec, mesh)
    if isinstance(obj, MutableMapping):
        for key, value in obj.items():
            obj[key] = rows_as_dtensors(value, mesh, rank, world_size)
    elif isinstance(obj, list):
        obj[:] = [rows_as_dtensors(value, mesh, rank, world_size) for value in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(rows_as_dtensors(value, mesh, rank, world_size) for value in obj)
    return obj


def optimizer_tensors(sharded: ShardedOptimizer, mesh: DeviceMesh) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` as DDP's holds it (keyed by position), each per-element entry (moments,
    momentum buffers) as this rank's rows in a ``Shard(0)`` DTensor of the parameter's shape."""
    state_dict = sharded.state_dict()
    shards = sharded.shards
    state = {}
    for index, entry in state_dict["state"].items():
        shard = shards[index]
        state[index] = {
            key: shard_dtensor(value, shard.spec, mesh) if is_per_element(key, value, shard.spec.local_shape, shard)
            else value
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": state_dict["param_groups"]}


# ------------------------------------------------------------------------------------------------------- saving


@dataclass
class _Sharded:
    """One tensor of the checkpoint that the ranks hold in shards: where it sits, this rank's rows, its full form."""

    location: Location
    source: DTensor
    placeholder: Placeholder


def save_sharded(
    path: str | os.PathLike,
    checkpoint: dict[str, Any],
    facts: dict[str, Any],
    model_shapes: dict[str, torch.Size],
    optimizer_shapes: list[list[torch.Size]],
    comms,
) -> None:
    """Write Lightning's ``checkpoint`` (whose ``state_dict`` and ``optimizer_states`` hold this rank's shards as
    ``model_tensors`` and ``optimizer_tensors`` make them) to the one file ``path``: rank 0 lays the file out, every
    rank writes its rows, rank 0 records their checksums and renames the file into place. All ranks call this.
    ``model_shapes`` and ``optimizer_shapes`` are the parameters' shapes (by state_dict key, and per optimizer by
    position): a 0-d parameter's DTensor is 1-d. Under hybrid sharding (``comms`` over a shard group) the ranks of
    replica 0 write the rows, each once, and the world coordinates (see [Note: hybrid sharding] in
    sharding/topology.py)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    sharded = _sharded_tensors(checkpoint, model_shapes, optimizer_shapes)
    world = comms.world
    counts = [count for (count,) in world.exchange([len(sharded)])]
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"saving {path}: the ranks hold different numbers of sharded tensors ({counts}); every rank must save the "
            "same model and optimizers"
        )
    placeholders = [s.placeholder for s in sharded]
    table = Placeholder(torch.Size([len(saved_ranges(placeholders, comms.world_size))]), torch.int64)
    info = dict(facts, version=FORMAT_VERSION, tensors=[s.location for s in sharded], crc32=table)
    offsets = _lay_out(partial, _layout(checkpoint, sharded, info), [table, *placeholders], world)
    crcs = _write_own_rows(partial, sharded, offsets, comms)
    if world.rank == 0:
        table_values = [crcs[position][j] for j, position, _, _ in saved_ranges(placeholders, comms.world_size)]
        fd = os.open(partial, os.O_WRONLY)
        try:
            write_rows(fd, offsets[0], torch.tensor(table_values, dtype=torch.int64))
            os.fsync(fd)
        finally:
            os.close(fd)
        _commit(partial, path)
    world.barrier()


def _sharded_tensors(
    checkpoint: dict[str, Any], model_shapes: dict[str, torch.Size], optimizer_shapes: list[list[torch.Size]]
) -> list[_Sharded]:
    """Every DTensor of the checkpoint, once (a tied weight's two names share one), in the order every rank finds
    them: in ``state_dict`` and ``optimizer_states``, and wherever a callback moved them (``WeightAveraging`` moves
    the state_dict to ``current_model_state``)."""
    found: dict[int, _Sharded] = {}
    for location, value in _dtensors(checkpoint, ()):
        if id(value) not in found:
            shape = _full_shape(location, value, model_shapes, optimizer_shapes)
            found[id(value)] = _Sharded(location, value, Placeholder(shape, value.dtype))
    return list(found.values())


def _dtensors(obj: Any, location: Location) -> Iterator[tuple[Location, DTensor]]:
    if isinstance(obj, DTensor):
        yield location, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _dtensors(value, (*location, key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _dtensors(value, (*location, index))


def _full_shape(location: Location, value: DTensor, model_shapes, optimizer_shapes) -> torch.Size:
    """The shape the tensor is saved at: its parameter's (a 0-d parameter's DTensor is 1-d), found by where it
    sits: an optimizer's state by position, a state_dict entry by name."""
    shape = value.shape
    if len(location) == 5 and location[0] == "optimizer_states" and location[2] == "state":
        shape = optimizer_shapes[location[1]][location[3]]
    elif location and isinstance(location[-1], str) and location[-1] in model_shapes:
        shape = model_shapes[location[-1]]
    return torch.Size(shape) if torch.Size(shape).numel() == value.numel() else value.shape


def saved_ranges(tensors: list[Placeholder], world_size: int) -> list[tuple[int, int, int, int]]:
    """``(tensor index, rank, first byte, end byte)`` of the rows each of ``world_size`` ranks writes, in the order
    of the checkpoint's CRC-32 table: by tensor, then by rank; ranks that own no rows of a tensor write nothing."""
    ranges = []
    for j, tensor in enumerate(tensors):
        for rank in range(world_size):
            lo, hi = ShardSpec(tensor.shape, rank, world_size).owned_rows()
            if hi > lo:
                ranges.append((j, rank, lo * tensor.row_bytes, hi * tensor.row_bytes))
    return ranges


def _layout(checkpoint: dict[str, Any], sharded: list[_Sharded], info: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's checkpoint with every sharded tensor replaced by its placeholder (the containers on the way copied,
    keeping their types), and our key."""
    full = {id(s.source): s.placeholder for s in sharded}
    layout = _replaced(checkpoint, full)
    layout[FORMAT_KEY] = info
    return layout


def _replaced(obj: Any, full: dict[int, Placeholder]) -> Any:
    if id(obj) in full:
        return full[id(obj)]
    if isinstance(obj, (Mapping, list, tuple)) and not any(True for _ in _dtensors(obj, ())):
        return obj
    if isinstance(obj, MutableMapping):
        copied = copy.copy(obj)
        for key, value in obj.items():
            copied[key] = _replaced(value, full)
        return copied
    if isinstance(obj, list):
        return [_replaced(value, full) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_replaced(value, full) for value in obj)
    return obj


def _lay_out(partial: Path, layout: dict[str, Any], placeholders: list[Placeholder], comms) -> list[int]:
    """Rank 0 writes the file with the placeholders' space reserved; every rank learns their offsets."""
    status, failure = [0] * (1 + len(placeholders)), None
    if comms.rank == 0:
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            remove(partial)
            status = [1, *write_layout(partial, layout, placeholders)]
        except Exception as err:  # every rank must hear of it, not wait for offsets that never come
            failure = err
    everyone = comms.exchange(status)
    if not everyone[0][0]:
        message = f"rank 0 could not lay out the checkpoint file {partial}"
        raise CheckpointError(message + (f": {first_line(failure)}" if failure else "; see its error")) from failure
    return everyone[0][1:]


def _write_own_rows(partial: Path, sharded: list[_Sharded], offsets: list[int], comms) -> list[list[int]]:
    """Write this rank's rows of every sharded tensor at their place in the file, unless another replica of them
    writes them (hybrid sharding: replica 0 does); the CRC-32 per tensor of each shard position's writer."""
    writes = comms.replica_rank == 0
    crcs, failure = [0] * len(sharded), None
    try:
        if writes:
            fd = os.open(partial, os.O_WRONLY)
            try:
                for j, tensor in enumerate(sharded):
                    crcs[j] = write_rows(fd, offsets[1 + j] + _first_byte(tensor, comms), tensor.source.to_local())
                os.fsync(fd)
            finally:
                os.close(fd)
    except Exception as err:  # the others must not rename a file this rank did not finish
        failure = err
    world = comms.world
    everyone = world.exchange([int(failure is None), int(writes), comms.rank, *crcs])
    failed = [rank for rank, values in enumerate(everyone) if not values[0]]
    if failed:
        if world.rank == 0:
            remove(partial)
        problem = f"rank {world.rank}: {first_line(failure)}" if failure else "see their errors"
        raise CheckpointError(
            f"writing {partial} failed on rank(s) {failed} ({problem}); the previous checkpoint is kept"
        ) from failure
    by_position = {values[2]: values[3:] for values in everyone if values[1]}
    return [by_position[position] for position in range(comms.world_size)]


def _first_byte(tensor: _Sharded, comms) -> int:
    """Where this rank's rows start in the tensor's record; checks that the shard holds exactly those rows."""
    full = tensor.placeholder
    lo, hi = ShardSpec(full.shape, comms.rank, comms.world_size).owned_rows()
    local = tensor.source.to_local()
    if local.numel() * local.element_size() != (hi - lo) * full.row_bytes:
        raise RuntimeError(
            f"{_describe(tensor.location)}: this rank's shard holds {local.numel()} elements, its rows {lo}-{hi} of "
            f"shape {tuple(full.shape)} need {(hi - lo) * full.row_bytes // local.element_size()}"
        )
    return lo * full.row_bytes


def _commit(partial: Path, path: Path) -> None:
    """Put the finished file in place in one rename (a checkpoint directory of the earlier format there first moves
    aside), and make the rename durable."""
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(path.name + ".old")
        remove(old)
        path.rename(old)
        os.replace(partial, path)
        remove(old)
    else:
        os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# ------------------------------------------------------------------------------------------------------ loading


def open_checkpoint(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dictionary from a checkpoint file (ours, DDP's, one device's, ``consolidate``'s),
    its tensors mapped from the file rather than read (a rank that copies its rows reads only those). The pickle and
    the records ``torch.save`` wrote are checked against their zip CRC-32 first; ``weights_only`` is passed to
    ``torch.load`` as Lightning passes it for a DDP checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    try:
        check_records(path, lambda name: name == "data.pkl")
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        info = format_info(checkpoint)
        if info is not None:  # the rest torch.save's writer wrote; the ranks' rows are checked by verify_rows
            reserved = {f"data/{i}" for i in range(1 + len(info["tensors"]))}
            check_records(path, lambda name: name != "data.pkl" and name not in reserved)
    except ValueError as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {err}") from err
    except RuntimeError as err:  # the archive reader's
        raise CheckpointError(f"checkpoint file {path} cannot be read: {first_line(err)}") from err
    return checkpoint


def format_info(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """Our key of a checkpoint file written by ``save_sharded`` (None for any other checkpoint)."""
    info = checkpoint.get(FORMAT_KEY)
    return info if isinstance(info, dict) and info.get("version") == FORMAT_VERSION else None


def damaged_range(
    path: Path, checkpoint: dict[str, Any], rank: int, world_size: int, optimizer_states: bool = True
) -> tuple[int, str] | None:
    """The first saved range overlapping what rank ``rank`` of ``world_size`` reads (its rows of every sharded
    tensor; of the optimizer states only with ``optimizer_states``) whose CRC-32 differs from the table's: its index
    in the table and what is wrong; None if all match. See [Note: checksums] in layout.py."""
    info, tensors, ranges = _saved(checkpoint)
    table = info["crc32"].tolist()
    if len(table) != len(ranges):
        saved_by = f"the ranges saved by {info['world_size']} ranks {len(ranges)}"
        return 0, f"its CRC-32 table has {len(table)} entries, {saved_by}"
    offsets = record_offsets(path, 1 + len(tensors))
    fd = os.open(path, os.O_RDONLY)
    try:
        for n, (j, _, start, end) in enumerate(ranges):
            if info["tensors"][j][0] == "optimizer_states" and not optimizer_states:
                continue
            lo, hi = ShardSpec(tensors[j].shape, rank, world_size).owned_rows()
            first, last = lo * tensors[j].row_bytes, hi * tensors[j].row_bytes
            if first >= last or end <= first or start >= last:
                continue
            try:
                crc = read_crc(fd, offsets[1 + j] + start, end - start)
            except EOFError:
                crc = -1
            if crc != table[n]:
                return n, describe_range(checkpoint, n)
    finally:
        os.close(fd)
    return None


def _saved(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[Placeholder], list[tuple[int, int, int, int]]]:
    """Our key, the sharded tensors (shape and dtype) and the ranges each rank wrote of them."""
    info = checkpoint[FORMAT_KEY]
    tensors = [Placeholder(t.shape, t.dtype) for t in (tensor_at(checkpoint, loc) for loc in info["tensors"])]
    return info, tensors, saved_ranges(tensors, info["world_size"])


def describe_range(checkpoint: dict[str, Any], index: int) -> str:
    """What entry ``index`` of the CRC-32 table covers, as a damage report."""
    info, tensors, ranges = _saved(checkpoint)
    if index >= len(ranges):
        return f"entry {index} of its CRC-32 table covers nothing"
    j, writer, start, end = ranges[index]
    rows = (start // tensors[j].row_bytes, end // tensors[j].row_bytes)
    return (
        f"bytes {start}-{end} of {_describe(info['tensors'][j])} (rows {rows[0]}-{rows[1]}, written by rank {writer}) "
        "differ from the CRC-32 recorded when they were saved"
    )


def verify_rows(path: Path, checkpoint: dict[str, Any], comms, optimizer_states: bool) -> None:
    """Each rank checks the saved ranges it is about to read; the ranks agree, so that a damaged range fails the
    load on every rank, naming it, before anything is changed."""
    found = damaged_range(path, checkpoint, comms.rank, comms.world_size, optimizer_states)
    verdicts = [code for (code,) in comms.world.exchange([-1 if found is None else found[0]])]
    failed = [rank for rank, code in enumerate(verdicts) if code >= 0]
    if failed:
        problem = found[1] if found is not None else describe_range(checkpoint, verdicts[failed[0]])
        raise CheckpointError(
            f"reading {path} failed on rank(s) {failed} (checkpoint file {path} is corrupt: {problem}); "
            "nothing was changed"
        )


def tensor_at(checkpoint: dict[str, Any], location: Location) -> Tensor:
    value: Any = checkpoint
    for part in location:
        value = value[part]
    return value


def _describe(location: Location) -> str:
    head, *rest = location
    return head + "".join(f"[{part!r}]" for part in rest)


def check_model(state_dict: dict[str, Any], expected: dict[str, torch.Size], strict: bool) -> None:
    """Raise, naming the keys, unless ``state_dict`` fits a model whose state_dict keys have the ``expected`` shapes
    (names are compared only when ``strict``, as ``load_state_dict`` does)."""
    found = {k: v.shape for k, v in state_dict.items() if torch.is_tensor(v)}
    check_compatible(expected, found, names=strict)


def check_optimizer_states(
    states: list[dict[str, Any]], optimizers: list[ShardedOptimizer], classes: list[str] | None
) -> None:
    """Raise, naming the optimizer, unless the saved ``optimizer_states`` fit the live ``optimizers`` (their number,
    class where recorded, parameters, and the shapes of per-element state)."""
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"the checkpoint has {len(states)} optimizer(s), configure_optimizers returned {len(optimizers)}"
        )
    for i, (state, sharded) in enumerate(zip(states, optimizers)):
        check_optimizer_class(classes[i] if classes else None, sharded.optimizer, i)
        name, shards = type(sharded.optimizer).__name__, sharded.shards
        saved = sum(len(g["params"]) for g in state["param_groups"])
        if saved != len(shards):
            raise CheckpointError(f"optimizer {i}: the checkpoint's state covers {saved} parameters, this {name} steps "
                                  f"{len(shards)}")
        for position, entry in state["state"].items():
            shape = shards[int(position)].spec.shape
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != shape and sharded.cuts_rows:
                    raise CheckpointError(
                        f"optimizer {i}: state {key!r} of parameter {shards[int(position)].name!r} has shape "
                        f"{tuple(value.shape)} in the checkpoint, the parameter {tuple(shape)}"
                    )
