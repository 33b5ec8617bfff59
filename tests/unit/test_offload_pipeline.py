"""The offloaded step's copies between host and device, checked without a GPU (issue 30, points 1, 3 and 4).

``DeferredTransfers`` stands in for ``Transfers`` on a CUDA machine, with the asynchrony made visible: a copy runs only
when someone waits on a ticket that covers it, reading its source at that moment, as a side-stream copy would. So a
consumer that reads without waiting on the ticket of what it reads sees stale values, a buffer written again before
its last copy ran corrupts that copy, and the order of the waits shows whether each group's host step waits for its
own gradients only.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_zero.offload.host import HostOffload, fused_on_host
from lightning_zero.offload.staging import PAGE, HostArena, aligned, allocation_bytes, locked_range
from lightning_zero.sharding.flat_param import shard_parameters
from lightning_zero.sharding.optimizer import ShardedOptimizer


class _Ticket:
    def __init__(self, transfers: DeferredTransfers, count: int) -> None:
        self.transfers, self.count = transfers, count

    def wait(self) -> None:
        self.transfers.run_until(self.count, "host")

    def wait_on_stream(self, stream) -> None:
        self.transfers.run_until(self.count, "compute")


class DeferredTransfers:
    stages, pinned, cuda = True, False, False

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        self.waits: list[tuple[str, int]] = []

    def copy(self, pairs) -> _Ticket:
        self.queue.extend(pairs)
        return _Ticket(self, len(self.queue))

    def record(self) -> _Ticket:
        return _Ticket(self, len(self.queue))

    def wait_on_compute(self, tickets) -> None:
        for ticket in tickets:
            ticket.wait_on_stream(None)

    def run_until(self, count: int, who: str) -> None:
        self.waits.append((who, count))
        while self.done < count:
            dst, src = self.queue[self.done]
            dst.copy_(src)
            self.done += 1


def _offload(transfers: DeferredTransfers, group_bytes: int = 1):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    shards = shard_parameters(module.named_parameters(), 0, 1)
    for shard in shards:
        shard.local = shard.local.float()  # the fp32 masters; the parameters stay bf16 (mixed precision)
    offload = HostOffload(shards, stage=2, group_bytes=group_bytes, transfers=transfers, grad_dtype=torch.bfloat16)
    optimizer = ShardedOptimizer(torch.optim.SGD(module.parameters(), lr=0.5), {s.param: s for s in shards})
    for shard in shards:
        shard.param.grad = torch.randn(shard.spec.local_shape).to(torch.bfloat16)
    return module, shards, offload, optimizer


def test_each_group_steps_once_its_own_gradients_arrived_while_later_ones_are_still_copying() -> None:
    transfers = DeferredTransfers()
    module, shards, offload, optimizer = _offload(transfers)
    copied_at_step = []
    update = optimizer.update

    def logged(grads, only=None, **kwargs):
        copied_at_step.append(transfers.done)
        return update(grads, only=only, **kwargs)

    optimizer.update = logged
    expected = [s.local - 0.5 * s.param.grad.float() for s in shards]
    offload.update(optimizer, shards, 1.0, None)
    # One group per parameter (group_bytes=1): the host steps group i once its gradient copy (copy i, queued first,
    # all at once) ran, and before the next groups' copies ran.
    assert copied_at_step == list(range(1, len(shards) + 1))
    for shard, want in zip(shards, expected):  # and it stepped on the gradients that arrived, not stale arena rows
        torch.testing.assert_close(shard.local, want, rtol=0, atol=0)


def test_the_device_waits_for_the_updated_rows_before_it_reads_them() -> None:
    transfers = DeferredTransfers()
    module, shards, offload, optimizer = _offload(transfers)
    before = [s.param.detach().clone() for s in shards]
    offload.update(optimizer, shards, 1.0, None)
    for shard, old in zip(shards, before):
        assert not torch.equal(shard.param.detach(), old)
        torch.testing.assert_close(shard.param.detach(), shard.local.to(torch.bfloat16), rtol=0, atol=0)
    assert transfers.waits[-1] == ("compute", len(transfers.queue))  # the compute stream waited for the last copy

    # A checkpoint loads new masters: refresh pushes them, and the compute stream waits before any gather reads them.
    for shard in shards:
        shard.local.fill_(0.25)
    offload.refresh()
    for shard in shards:
        assert torch.equal(shard.param.detach(), torch.full_like(shard.param, 0.25))


def test_staging_is_one_arena_per_purpose_sized_from_the_shards_and_reused() -> None:
    transfers = DeferredTransfers()
    module, shards, offload, optimizer = _offload(transfers)
    expected = sum(aligned(s.spec.local_numel * 2) for s in shards)  # bf16 rows, each slot on a page boundary
    assert sorted(offload.arenas) == ["gradient shards", "updated rows"]
    assert {purpose: a.nbytes for purpose, a in offload.arenas.items()} == {
        "gradient shards": expected, "updated rows": expected}
    storages = {a.storage().data_ptr() for a in offload.arenas.values()}
    assert {b.data_ptr() for b in offload.host_buffers()} == storages
    for step in range(2):
        offload.update(optimizer, shards, 1.0, None)
        # Every staging copy went through the two arenas: the host side of each queued copy lies inside one of them.
        for dst, src in transfers.queue:
            host = dst if dst.data_ptr() in _arena_range(offload) else src
            assert host.data_ptr() in _arena_range(offload)
        assert {a.storage().data_ptr() for a in offload.arenas.values()} == storages  # reused, not reallocated
        for shard in shards:
            shard.param.grad = torch.randn(shard.spec.local_shape).to(torch.bfloat16)


def _arena_range(offload: HostOffload):
    class Within:
        def __contains__(self, pointer: int) -> bool:
            return any(a.storage().data_ptr() <= pointer < a.storage().data_ptr() + a.storage().numel()
                       for a in offload.arenas.values())

    return Within()


class _RecordingRuntime:
    """``torch.cuda.cudart()`` without a GPU: records the calls, and refuses a registration that overlaps a page
    registered already, as CUDA does (cudaErrorHostMemoryAlreadyRegistered)."""

    ALREADY_REGISTERED = 712

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.pages: dict[int, set[int]] = {}

    def cudaHostRegister(self, pointer, size, flags):
        self.calls.append(("register", pointer, size))
        pages = set(range(pointer // PAGE, -(-(pointer + size) // PAGE)))
        if any(pages & held for held in self.pages.values()):
            return self.ALREADY_REGISTERED
        self.pages[pointer] = pages
        return 0

    def cudaHostUnregister(self, pointer):
        self.calls.append(("unregister", pointer))
        del self.pages[pointer]
        return 0


def test_a_pinned_arena_registers_whole_pages_of_its_own_once(monkeypatch) -> None:
    runtime = _RecordingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    arena = HostArena("gradient shards", 10_000, pinned=True)
    storage = arena.storage()
    ((_, pointer, size),) = runtime.calls
    assert pointer % PAGE == 0 and size == aligned(10_000) < 2 ** 14  # whole pages; not rounded up to a power of 2
    assert storage.data_ptr() <= pointer and pointer + size <= storage.data_ptr() + storage.numel()
    view = arena.view(_slot(10_000))
    assert view.data_ptr() == pointer  # the arena is the registered pages
    arena.close()
    assert runtime.calls[-1] == ("unregister", pointer)
    with pytest.raises(ValueError, match="passes the arena's"):
        HostArena("small", 100, pinned=False).view(_slot(200))


def test_small_pinned_arenas_never_register_a_page_twice(monkeypatch) -> None:
    runtime = _RecordingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    arenas = [HostArena(f"arena {i}", nbytes, pinned=True) for i, nbytes in enumerate([100, 1, 4000, PAGE, 300] * 4)]
    assert len(runtime.pages) == len(arenas)  # every registration succeeded: no page shared
    for arena in arenas:
        arena.close()
    assert runtime.pages == {}


@pytest.mark.parametrize("page", [4096, 65536])
def test_the_locked_range_is_whole_pages_inside_the_allocation_covering_the_arena(page) -> None:
    for nbytes in (1, 100, page - 1, page, page + 1, 3 * page + 17):
        allocated = allocation_bytes(nbytes, page)
        for address in (0, 16, 64, page - 8, page, 5 * page + 4032):
            start, locked = locked_range(address, nbytes, page)
            assert (address + start) % page == 0 and locked % page == 0
            assert start + locked <= allocated  # no page of a neighbouring allocation
            assert locked >= nbytes  # covers the arena
    # Two allocations side by side (the second right after the first, as a heap places small blocks): their pages
    # are disjoint.
    first, second = 1000, 1000 + allocation_bytes(100, page)
    (s1, n1), (s2, n2) = locked_range(first, 100, page), locked_range(second, 100, page)
    assert first + s1 + n1 <= second + s2


def _slot(nbytes: int):
    from lightning_zero.offload.staging import Slot

    return Slot(0, torch.Size([nbytes]), torch.uint8)


def test_host_rows_a_gather_is_copying_are_not_rewritten_before_that_copy_ran() -> None:
    """``offload_params="cpu"``: a unit's all-gather copies the host rows to the device as part of its pack; an update
    that comes before that copy ran must not change the rows under it (the gather was issued for the old values)."""
    transfers = DeferredTransfers()
    torch.manual_seed(0)
    module = nn.Linear(8, 4)
    shards = shard_parameters(module.named_parameters(), 0, 1, torch.float32)
    offload = HostOffload(shards, stage=3, group_bytes=1, transfers=transfers, params_on_host=True)
    assert all(s.working.data_ptr() != s.local.data_ptr() for s in shards)  # host rows apart from the masters
    old = [s.working.clone() for s in shards]
    packed = [torch.empty_like(s.working) for s in shards]
    with offload.staged(shards):
        transfers.copy(list(zip(packed, [s.working for s in shards])))  # the pack's copies, still in flight
    for shard in shards:
        shard.local.add_(1.0)  # the next update
    offload.push(shards)
    transfers.run_until(len(transfers.queue), "compute")
    for got, want, shard in zip(packed, old, shards):
        assert torch.equal(got, want)  # the gather saw the rows it was issued for
        assert torch.equal(shard.working, shard.local)  # and the rows hold the update afterwards


def test_the_host_step_is_fused_unless_the_optimizer_names_its_implementation(caplog) -> None:
    """Reported in one info line, applied for the step only: the user's param_groups stay as given (they were
    rewritten to fused=True, foreach=False, which checkpoints then saved)."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    default = torch.optim.AdamW(params)
    given = [dict(group) for group in default.param_groups]
    seen = []
    default.step = lambda: seen.append((default.param_groups[0]["fused"], default.param_groups[0]["foreach"]))
    with caplog.at_level(logging.INFO):
        HostOffload.use_fused_kernels(default)
    assert [r.getMessage() for r in caplog.records] == [
        "offload_optimizer: AdamW steps on the host with torch's fused CPU kernel (fused=True, foreach=False for the "
        "step only; its param_groups keep fused=None, foreach=None): give AdamW(foreach=False) for DDP's "
        "single-tensor loop and its results to the bit, or fused=False"
    ]
    assert default.param_groups == given and default.defaults["fused"] is None
    with fused_on_host(default):
        default.step()
    assert seen == [(True, False)] and default.param_groups == given
    caplog.clear()
    for chosen in (dict(foreach=False), dict(foreach=True), dict(fused=False)):
        optimizer = torch.optim.AdamW(params, **chosen)
        before = [dict(group) for group in optimizer.param_groups]
        with caplog.at_level(logging.INFO):
            HostOffload.use_fused_kernels(optimizer)
        with fused_on_host(optimizer):
            assert optimizer.param_groups == before, chosen  # foreach=False keeps DDP's single-tensor loop
    assert caplog.records == []  # nothing to report where the user chose

def test_an_offloaded_fit_steps_fused_and_leaves_the_users_param_groups_as_given(monkeypatch) -> None:
    """One rank in this process, host offload: every step runs torch's fused AdamW kernel, and after fit the
    optimizer's groups (and so its state_dict) hold the fused=None, foreach=None the user gave."""
    from lightning_zero import ZeroStrategy
    from tests.models import ParityModel, make_trainer

    fused_calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (fused_calls.append(1), kernel(*a, **k))[1])
    model = ParityModel("adamw")
    trainer = make_trainer(ZeroStrategy(stage=2, offload_optimizer="cpu"), 1, max_steps=3)
    trainer.fit(model)
    optimizer = trainer.optimizers[0]
    assert len(fused_calls) == 3
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(None, None)]
    assert optimizer.defaults["fused"] is None
