"""Model states off the training device: optimizer states and master weights on the host (``host.py``) or on disk
(``disk.py``, through ``files.py``), stage-3 parameter shards on the host or on disk, and the host buffers and
host-device copies both move them through (``staging.py``).

``make_offload`` is what the strategy hands the runtime: the runtime calls it with the shards it made."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.host_memory import host_memory
from lightning_zero.offload.disk import DiskOffload, private_directory
from lightning_zero.offload.files import OffloadDiskError
from lightning_zero.offload.host import HostOffload
from lightning_zero.offload.sizing import SubgroupPlan, per_master_byte, plan_subgroups
from lightning_zero.offload.staging import Transfers
from lightning_zero.sharding.collectives import Collectives
from lightning_zero.sharding.flat_param import ParamShard

__all__ = ["DiskOffload", "HostOffload", "OffloadDiskError", "make_offload"]


def make_offload(shards: Sequence[ParamShard], config: ZeroConfig, comms: Collectives, host_ranks: int) -> HostOffload:
    """The host or disk offload of ``config`` for ``shards``; a disk that cannot hold the states fails on every rank
    at once. ``host_ranks``: ranks on this machine (sharing its disk), for the space check."""
    offload = config.offload
    transfers = Transfers(comms.device)
    grad_dtype = config.comm.reduce_torch_dtype
    if not offload.on_disk:
        return HostOffload(shards, config.stage, config.comm.bucket_bytes, transfers, grad_dtype,
                           params_on_host=offload.offload_params == "cpu")
    params_on_disk = offload.offload_params == "disk"
    # fp32 masters and, as for Adam, two fp32 moments per element; the parameter shards too when they go to disk.
    needed = sum(s.spec.local_numel * (12 + (s.dtype.itemsize if params_on_disk else 0)) for s in shards)
    plan = _plan_subgroups(shards, config, comms, host_ranks, grads_in_files=not transfers.stages)
    failure: OffloadDiskError | None = None
    result = None
    try:
        directory = private_directory(offload.offload_dir, comms.rank, needed, host_ranks)
        result = DiskOffload(list(shards), config.stage, plan, transfers, directory, grad_dtype, params_on_disk)
    except OffloadDiskError as err:
        failure = err
    failed = torch.tensor([float(failure is not None)], device=comms.device)
    comms.world.all_reduce_(failed, "the disk offload set-up flags", op="max")  # every replica's ranks, too
    if failed.item():
        if result is not None:
            result.close()
        raise failure or OffloadDiskError("disk offload could not be set up on another rank (its error says why)")
    return result


def _plan_subgroups(shards: Sequence[ParamShard], config: ZeroConfig, comms: Collectives, host_ranks: int,
                    grads_in_files: bool) -> SubgroupPlan:
    """Disk offload's sub-group sizes (offload/sizing.py, [Note: sizing disk offload's sub-groups]) from this rank's
    share of the host budget and what moving its states into files frees, the smallest over the ranks: every rank
    plans the same."""
    floating = [s for s in shards if s.spec.local_numel]
    rows = max((s.dtype.itemsize for s in floating), default=0) if config.offload.offload_params == "disk" else 0
    grad_dtype = config.comm.reduce_torch_dtype
    grads = 0
    if grads_in_files and config.stage >= 2:  # a host run keeps stages 2-3's gradient shards in files
        grads = max(((grad_dtype or s.dtype).itemsize for s in floating), default=0)
    moving = sum(s.local.numel() * s.local.element_size() for s in floating)
    budget = -torch.tensor([float(host_memory().per_rank(host_ranks) + moving)], dtype=torch.float64,
                           device=comms.device)
    comms.world.all_reduce_(budget, "the host budgets for disk offload", op="max")  # the smallest
    return plan_subgroups(config.offload, sum(4 * s.spec.local_numel for s in floating), per_master_byte(rows, grads),
                          int(-budget.item()), max((4 * s.spec.local_numel for s in floating), default=0))
