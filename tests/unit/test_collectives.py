"""collectives.py refuses tensors that are not on the process group's device, naming the caller's tensor: NCCL would
refuse a CPU tensor with "No backend type associated with device type cpu", deep inside the first step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from lightning_zero.sharding.collectives import CollectiveDeviceError, Collectives
from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.flat_param import shard_parameters


def _cuda_group() -> Collectives:
    # No process group: a local group whose device is a CUDA device, as an NCCL group's would be.
    return Collectives(device=torch.device("cuda", 0))


def test_a_cpu_tensor_is_refused_naming_what_it_is() -> None:
    comms = _cuda_group()
    with pytest.raises(CollectiveDeviceError) as err:
        comms.all_reduce_(torch.zeros(1), "the gradient norm")
    assert str(err.value) == (
        "the gradient norm is on cpu, but this process group's collectives (local) work on cuda:0: move it to cuda:0 "
        "before handing it to a collective"
    )
    with pytest.raises(CollectiveDeviceError, match="the module's buffers is on cpu"):
        comms.broadcast_([torch.zeros(2)], "the module's buffers")


def test_a_bucket_on_the_wrong_device_is_refused_naming_its_first_parameter() -> None:
    comms = _cuda_group()
    bucket = Bucket(shard_parameters([("encoder.weight", torch.nn.Parameter(torch.zeros(4, 2)))], 0, 1))
    with pytest.raises(CollectiveDeviceError, match="the gradients of encoder.weight is on cpu"):
        comms.reduce_scatter(bucket, [torch.zeros(4, 2)])
    with pytest.raises(CollectiveDeviceError, match="the shard of encoder.weight is on cpu"):
        comms.all_gather(bucket)


def test_tensors_on_the_group_device_pass() -> None:
    comms = Collectives(device=torch.device("cpu"))
    flag = torch.ones(1)
    comms.all_reduce_(flag, "a flag")  # no process group: a local no-op
    assert flag.item() == 1.0
    bucket = Bucket(shard_parameters([("w", torch.nn.Parameter(torch.arange(6.0).view(3, 2)))], 0, 1))
    (reduced,) = comms.reduce_scatter(bucket, [torch.full((3, 2), 2.0)]).wait()
    assert reduced.tolist() == [[2.0, 2.0]] * 3


def test_in_flight_bounds_the_memory_pending_collectives_hold() -> None:
    from lightning_zero.sharding.in_flight import Exchanged, InFlight

    done: list[str] = []
    in_flight = InFlight(limit=2)
    names = {}

    def add(name: str, held: int) -> None:
        names[len(names)] = name
        in_flight.add(Exchanged(tensors=[torch.tensor([len(names) - 1])]), lambda v: done.append(names[v[0][0]]), held)

    add("a", 30)
    add("in-place", 0)  # holds nothing: never counts
    add("b", 30)
    assert done == [] and len(in_flight) == 3
    add("c", 1)  # a third holder, however small: the oldest completes first
    assert done == ["a"]
    add("d", 500)
    assert done == ["a", "in-place", "b"]  # in launch order, down to `limit` holders
    assert len(in_flight) == 2
    in_flight.drain()
    assert done == ["a", "in-place", "b", "c", "d"]


def test_buffer_pool_hands_out_the_smallest_buffer_that_fits() -> None:
    from lightning_zero.sharding.in_flight import BufferPool

    pool = BufferPool(torch.device("cpu"), limit=2)
    large, small = pool.take(100, torch.float32), pool.take(10, torch.float32)
    pool.give(large)
    pool.give(small[:5])  # a view: its whole storage goes back
    again = pool.take(8, torch.float32)  # both fit: the 10-element one, leaving the large one for a large bucket
    assert again.numel() == 8 and again.data_ptr() == small.data_ptr()
    assert pool.take(60, torch.float32).data_ptr() == large.data_ptr()
    pool.give(again)
    grown = pool.take(30, torch.float32)  # none fits: the smallest free one is replaced
    assert grown.numel() == 30 and pool.buffers() == []
    pool.give(grown)
    pool.give(torch.empty(7))
    pool.give(torch.empty(9))  # beyond `limit` free buffers: dropped
    assert sorted(b.numel() for b in pool.buffers()) == [7, 30]
    assert pool.take(4, torch.float64).dtype == torch.float64  # one set of buffers per dtype


def fake_process_group(monkeypatch: pytest.MonkeyPatch, backend: str, world_size: int = 2) -> None:
    """torch.distributed as rank 0 of an initialized group whose backend string is ``backend``, without processes:
    the backend config is the one torch resolves from that string."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend(backend))
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: str(BackendConfig(dist.Backend(backend))))


@pytest.mark.parametrize(
    ("backend", "device", "served_by"),
    [
        ("cpu:gloo,cuda:nccl", "cuda:0", "nccl"),  # the composite backend: NCCL serves the CUDA tensors
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("nccl", "cuda:0", "nccl"),
        ("gloo", "cuda:0", "gloo"),  # CUDA tensors on gloo: gloo's algorithms
        ("gloo", "cpu", "gloo"),
    ],
)
def test_the_native_algorithms_follow_the_backend_that_serves_the_device(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: str, served_by: str
) -> None:
    fake_process_group(monkeypatch, backend)
    comms = Collectives(device=torch.device(device))
    assert (comms.device_backend, comms.native) == (served_by, served_by == "nccl")
    assert comms.backend == backend and not comms.local


def test_a_device_the_backend_does_not_serve_is_refused_naming_what_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_process_group(monkeypatch, "nccl")
    with pytest.raises(CollectiveDeviceError) as err:
        Collectives(device=torch.device("cpu"))
    assert str(err.value) == "the process group (nccl) serves cuda tensors (nccl), but the model is on cpu"


@pytest.mark.parametrize(
    ("backend", "device", "aborts"),
    [("nccl", "cuda:0", 1), ("cpu:gloo,cuda:nccl", "cuda:0", 1), ("cpu:gloo,cuda:nccl", "cpu", 0), ("gloo", "cuda:0", 0)],
)
def test_abort_ends_the_group_only_where_nccl_serves_its_device(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: str, aborts: int
) -> None:
    class Group:  # records ProcessGroup.abort
        aborted = 0

        def abort(self) -> None:
            self.aborted += 1

    fake_process_group(monkeypatch, backend)
    group = Group()
    Collectives(device=torch.device(device), group=group).abort()
    assert group.aborted == aborts


@pytest.mark.parametrize("native", [True, False])
def test_hpz_gathers_the_rows_in_place(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """hpZ's backward gather (``all_gather_rows``) hands NCCL's all-gather the table itself as output and this rank's
    row of it as input (an in-place all-gather: nothing to unpack), or on gloo broadcasts each row from its rank;
    counted as ``all_gather_hpz``, ``(n-1)/n`` of the table, all of it across nodes of one rank each."""
    fake_process_group(monkeypatch, "gloo", world_size=4)
    calls = []
    monkeypatch.setattr(dist, "all_gather_single", lambda out, inp, group, async_op: calls.append((out, inp)) or "w")
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group, async_op: calls.append((t, src)) or "w")
    comms = Collectives(device=torch.device("cpu"), node_size=1)
    comms.native = native  # the algorithm NCCL would run (no CUDA here)
    table = torch.zeros(4, 6)
    gathered = comms.all_gather_rows(table, "the secondary shard of w")
    if native:
        assert len(calls) == 1
        out, inp = calls[0]
        assert (out.data_ptr(), out.numel()) == (table.data_ptr(), 24)
        assert (inp.data_ptr(), inp.numel()) == (table[0].data_ptr(), 6)  # rank 0's row, inside the output
    else:
        assert [src for _, src in calls] == [0, 1, 2, 3]
        assert all(t.data_ptr() == table[r].data_ptr() for r, (t, _) in enumerate(calls))
    assert gathered.buffer is table and gathered.works == (["w"] if native else ["w"] * 4)
    stats = comms.stats.by_op["all_gather_hpz"]
    assert (stats.calls, stats.bytes) == (1, 3 * 6 * 4)
    # a ring sends (n-1)/n of the table to its next member; gloo's broadcasts send the row to each other member
    assert stats.cross_bytes == 3 * 6 * 4


def test_quantize_grads_refuses_device_tensors_on_a_backend_that_sends_host_tensors_only() -> None:
    from lightning_zero.sharding.quantize import BlockFormat

    comms = _cuda_group()
    comms.device_backend = "gloo"  # CUDA tensors on gloo (process_group_backend="gloo" on GPUs)
    with pytest.raises(CollectiveDeviceError) as err:
        comms.two_stage([8], BlockFormat(bits=4))
    assert str(err.value) == (
        "quantize_grads sends its payloads point to point, which the gloo backend does for host tensors only, but the "
        "gradients are on cuda:0: use nccl for them, or drop quantize_grads"
    )
    plan = Collectives(device=torch.device("cpu"), node_size=None).two_stage([3, 5], BlockFormat(bits=4))
    assert (plan.groups, plan.group_size, plan.segment_numel, plan.parts) == (1, 1, 8, (3, 5))  # no process group: a world of one
