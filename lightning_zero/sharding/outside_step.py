"""Two parts of ``ZeroRuntime`` (runtime.py) that run outside the training step: an evaluation loop whose ranks run
different numbers of batches (stage 3 gathers the whole model once for it), and full tensors loaded into the shards
(a DDP or single-device checkpoint, ``module.load_state_dict`` after setup). Mixins of ``ZeroRuntime``: they use its
``parameters``, ``comms``, ``shards``, ``module``, ``offload`` and ``_evaluation_hold``."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_zero.memory import MappedPages
from lightning_zero.sharding.flat_param import ParamShard
from lightning_zero.sharding.param_hooks import ShardedParams


class EvaluationLoops:
    """``begin_evaluation``/``end_evaluation`` around each evaluation loop."""

    def begin_evaluation(self, batches: float, loop: str) -> None:
        """Before an evaluation loop: under stage 3, ranks that will run different numbers of batches (Lightning
        does not pad ``predict``; a custom sampler may not pad validate/test) cannot gather unit by unit, as every
        gather is a collective; they gather the whole model once for the loop instead, and say so."""
        if not isinstance(self.parameters, ShardedParams) or self.comms.local:
            return
        counts = torch.tensor([batches, -batches], dtype=torch.float64, device=self.comms.device)
        self.comms.all_reduce_(counts, f"the {loop} batch counts", op="max")
        most, fewest = counts[0].item(), -counts[1].item()
        if most == fewest and most != float("inf"):
            return
        full = sum(s.spec.numel * s.dtype.itemsize for s in self.shards)
        _check_fits(full, self.comms.device, loop)
        rank_zero_info(
            f"zero3 {loop}: ranks run different numbers of batches ({_count(fewest)} to {_count(most)}), so the whole "
            f"model ({full / 2**20:.1f} MiB per rank) is gathered once for this loop instead of unit by unit"
        )
        self._evaluation_hold.enter_context(self.parameters.gathered())

    def end_evaluation(self) -> None:
        self._evaluation_hold.close()


class StateLoading:
    """Full tensors into this rank's rows of the masters."""

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        """Load full tensors (a DDP or single-device checkpoint) into the shards: each rank copies its own rows."""
        self.wait()
        names = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        buffers = {k: v for k, v in self.module.state_dict(keep_vars=True).items() if k not in names}
        expected = names | set(buffers)
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"state_dict does not match the model: missing {missing}, unexpected {unexpected}")
        mapped = MappedPages()
        for shard in self.shards:
            value = state_dict.get(shard.name)
            if value is None:
                continue
            if value.shape != shard.spec.shape:
                raise RuntimeError(
                    f"{shard.name}: the state_dict has shape {tuple(value.shape)}, the model {tuple(shard.spec.shape)}"
                )
            rows = shard.spec.local_view(value)
            self._write_master(shard, rows)
            mapped.release(rows)  # a mapped checkpoint's rows, copied: not kept resident until the load ends
        for name, buffer in buffers.items():
            if name in state_dict and torch.is_tensor(buffer):
                buffer.copy_(state_dict[name])
        self.refresh_full_parameters()

    def _write_master(self, shard: ParamShard, rows: Tensor) -> None:
        """Load a checkpoint's ``rows`` into ``shard``'s master, where it lives."""
        if self.offload is not None:
            self.offload.write_master(shard, rows)
        else:
            shard.local.copy_(rows)

    def _after_state_dict_load(self) -> None:
        """``module.load_state_dict`` wrote the masters: an offload pushes them where the gathers read them."""
        if self.offload is not None:
            self.offload.refresh()


def _check_fits(nbytes: int, device: torch.device, loop: str) -> None:
    if device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    if nbytes > free:
        raise RuntimeError(
            f"zero3 {loop}: ranks run different numbers of batches, and the whole model ({nbytes / 2**30:.2f} GiB) "
            f"does not fit in the {free / 2**30:.2f} GiB free on {device} to be gathered once: give every rank the "
            "same number of batches (pad the dataset to a multiple of the world size)"
        )


def _count(n: float) -> str:
    return "unknown" if n == float("inf") else str(int(n))
