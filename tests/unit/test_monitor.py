"""ZeroMonitor's summary and report, without a Trainer (the CLI tests run it in real fits)."""

import torch

from lightning_zero.monitor import CompileStats, MonitorSummary, ZeroMonitor, _count_items, format_report
from lightning_zero.sharding.param_hooks import UNIT_HOOK_REASON

SUMMARY = MonitorSummary(
    option="zero2",
    precision="32-true",
    world_size=2,
    steps=10,
    num_params=1000,
    trainable_params=1000,
    held=(4000, 2000, 4008),
    predicted=(4000, 2000, 4000),
    bucket_bytes=1024,
    ddp=(4000, 4000, 8000),
    comm_bytes_per_step=4000,
    ideal_comm_bytes_per_step=4000,
    throughput=1234.5,
    throughput_unit="tokens/s",
    steps_timed=9,
)


def test_report_sets_measured_against_the_model_and_ddp():
    report = format_report(SUMMARY)
    assert report.splitlines()[0] == "ZeroMonitor: zero2 on 2 rank(s), 10 steps, precision 32-true, 1,000 parameters"
    rows = {line.split()[0]: line.split()[1:] for line in report.splitlines()[2:6]}
    assert rows["optimizer"] == ["3.91", "KiB", "3.91", "KiB", "7.81", "KiB"]  # 4008, 4000 and 8000 bytes
    assert rows["total"] == ["9.77", "KiB", "9.77", "KiB", "15.62", "KiB"]
    assert "measured / DDP: 0.63x; plus up to 1.00 KiB of communication buckets" in report
    assert "communication per step and rank: 3.91 KiB (model: 3.91 KiB, ratio 1.00)" in report
    assert "throughput: 1,234 tokens/s over all ranks (median step of 9 timed)" in report


def test_report_without_byte_accounting():
    report = format_report(MonitorSummary(**{**SUMMARY.__dict__, "comm_bytes_per_step": None, "option": "ddp"}))
    assert "communication per step: not counted (the strategy keeps no comm_stats)" in report


def test_summary_round_trips_through_the_file_the_launching_process_reads(tmp_path):
    path = tmp_path / "zero_monitor.json"
    path.write_text(SUMMARY.to_json())
    assert MonitorSummary.from_json(path.read_text()) == SUMMARY
    assert ZeroMonitor(summary_file=str(path)).report() == format_report(SUMMARY)
    assert ZeroMonitor().report() == "ZeroMonitor: no training step was measured"


def test_compile_counts_split_unit_hook_breaks_from_the_models_own():
    hook = f"Skip calling `torch.compiler.disable()`d function\n  Explanation: ... (reason: {UNIT_HOOK_REASON})"
    logging = "logging.Logger method not supported for non-export cases\n  Explanation: ..."
    start = (3, 2, {logging: 1})  # a compile before this fit: its counts are not this fit's
    first = (7, 6, {logging: 2, hook: 4})
    stats = CompileStats.between(start, first, (7, 6, {logging: 2, hook: 4}))
    assert stats == CompileStats(frames_first_step=4, frames_after=0, graphs=4, unit_breaks=4,
                                 other_breaks={"logging.Logger method not supported for non-export cases": 1})
    assert CompileStats.between(start, start, start) is None  # nothing compiled: no line in the report
    summary = MonitorSummary(**{**SUMMARY.__dict__, "compiled": stats})
    assert MonitorSummary.from_json(summary.to_json()) == summary
    assert format_report(summary).splitlines()[-1] == (
        "  torch.compile: 4 frames compiled in the first step, 0 after it; 4 graphs; graph breaks: 4 at zero3 unit "
        "hooks, 1 others (1 logging.Logger method not supported for non-export cases)")
    assert "torch.compile" not in format_report(SUMMARY)


def test_items_are_tokens_of_the_first_integer_tensor_else_samples():
    tokens = torch.zeros(4, 16, dtype=torch.long)
    assert _count_items((tokens, tokens)) == (64, "tokens/s")
    assert _count_items({"input_ids": tokens}) == (64, "tokens/s")
    assert _count_items((torch.zeros(8, 3), torch.zeros(8))) == (8, "samples/s")


def test_report_gives_each_placement_measured_and_modelled():
    offloaded = MonitorSummary(**{**SUMMARY.__dict__, "option": "zero2_offload", "placement": (6000, 4008, 0),
                                  "predicted_placement": (6000, 4000, 0)})
    lines = format_report(offloaded).splitlines()
    where = lines.index("  where they live per rank: device 5.86 KiB, host 3.91 KiB, disk 0 B")
    assert lines[where + 1] == "     model (zero2_offload): device 5.86 KiB, host 3.91 KiB, disk 0 B"
    # a summary written before placement was measured still reads, and reports no placement
    old = {k: v for k, v in SUMMARY.__dict__.items() if k not in ("placement", "predicted_placement")}
    assert MonitorSummary.from_json(MonitorSummary(**old).to_json()).placement is None
    assert "where they live" not in format_report(SUMMARY)


class RecordingCuda:
    """``torch.cuda`` as ZeroMonitor meets it on a GPU, recorded: events on one stream, whose device time the test
    sets (``now_ms``) and which have completed only once the device passed them (``device_passes_everything``, or
    waiting on a later one); reading one before raises, as CUDA's "device not ready" does. And ``synchronize`` calls."""

    def __init__(self, monkeypatch) -> None:
        self.now_ms = 0.0
        self.events: list = []
        self.synchronized: list = []
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.stream = self.at_ms = None
                self.completed = self.waited = False
                cuda.events.append(self)

            def record(self, stream=None) -> None:
                self.stream, self.at_ms = stream, cuda.now_ms

            def query(self) -> bool:
                return self.completed

            def synchronize(self) -> None:  # the stream ran up to here: every event recorded before it completed
                self.waited = True
                for event in cuda.events[: cuda.events.index(self) + 1]:
                    event.completed = True

            def elapsed_time(self, end) -> float:
                if not (self.completed and end.completed):
                    raise RuntimeError("CUDA error: device not ready")
                return end.at_ms - self.at_ms

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("compute stream", device))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.synchronized.append(device))

    def device_passes_everything(self) -> None:
        for event in self.events:
            event.completed = True


class LoggingModule(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.device = torch.device("cpu")
        self.logged: list[dict] = []

    def log_dict(self, figures: dict, **kwargs) -> None:
        self.logged.append(figures)


def test_on_a_gpu_steps_are_timed_by_events_without_synchronizing(monkeypatch) -> None:
    from types import SimpleNamespace

    from lightning_zero.memory import ModelStateBytes

    cuda = RecordingCuda(monkeypatch)
    gpu = torch.device("cuda", 0)
    strategy = SimpleNamespace(
        root_device=gpu, comm_stats=SimpleNamespace(total_bytes=0),
        model_state_bytes=lambda: ModelStateBytes(100, 100, 200), reduce=lambda tensor, reduce_op: tensor,
    )
    trainer = SimpleNamespace(strategy=strategy, global_step=0, world_size=2, num_devices=2, precision="32-true")
    module, monitor, batch = LoggingModule(), ZeroMonitor(), torch.zeros(2, 8, dtype=torch.long)  # 16 tokens
    monitor.on_fit_start(trainer, module)

    def step(start_ms: float, end_ms: float) -> dict:
        cuda.now_ms = start_ms
        monitor.on_train_batch_start(trainer, module, batch, trainer.global_step)
        cuda.now_ms, trainer.global_step = end_ms, trainer.global_step + 1
        strategy.comm_stats.total_bytes += 1000
        monitor.on_train_batch_end(trainer, module, None, batch, trainer.global_step - 1)
        return module.logged[-1]

    first = step(0, 100)  # the device has not passed its events yet: no throughput, nothing waited for
    assert "zero/tokens_per_s" not in first and first["zero/comm_bytes_per_step"] == 1000.0
    cuda.device_passes_everything()
    assert step(100, 150)["zero/tokens_per_s"] == 16 * 2 / 0.100  # the first step's, read once the device passed it
    cuda.device_passes_everything()
    assert step(150, 250)["zero/tokens_per_s"] == 16 * 2 / 0.050
    monitor.on_train_end(trainer, module)  # waits for the last event only
    assert cuda.synchronized == []
    assert [e.waited for e in cuda.events] == [False] * 5 + [True]
    assert {e.stream for e in cuda.events} == {("compute stream", gpu)}
    assert [s.seconds for s in monitor._steps] == [0.1, 0.05, 0.1]
    assert monitor.summary.throughput == (640 + 320) / 2  # the median over the steps after the first


def _fit_steps(config, world_size: int, steps: int = 3, node_size: int | None = None) -> ZeroMonitor:
    """``steps`` steps of a run under ``config`` on ``world_size`` ranks (in nodes of ``node_size``), on the host,
    each moving 3000 bytes of which 500 cross to other nodes; the module records 1000 fp32 parameters."""
    from types import SimpleNamespace

    from lightning_zero.memory import ModelStateBytes

    stats = SimpleNamespace(total_bytes=0, cross_group_bytes=0)
    strategy = SimpleNamespace(config=config, root_device=torch.device("cpu"), comm_stats=stats,
                               model_state_bytes=lambda: ModelStateBytes(2000, 2000, 4000),
                               reduce=lambda tensor, reduce_op: tensor,
                               topology=lambda: SimpleNamespace(node_size=node_size or world_size))
    trainer = SimpleNamespace(strategy=strategy, global_step=0, world_size=world_size, num_devices=world_size,
                              precision="32-true")
    module, monitor, batch = LoggingModule(), ZeroMonitor(), torch.zeros(2, 8, dtype=torch.long)
    module.num_parameters = module.num_trainable_parameters = 1000
    monitor.on_fit_start(trainer, module)
    for _ in range(steps):
        monitor.on_train_batch_start(trainer, module, batch, trainer.global_step)
        trainer.global_step += 1
        stats.total_bytes += 3000
        stats.cross_group_bytes += 500
        monitor.on_train_batch_end(trainer, module, None, batch, trainer.global_step - 1)
    monitor.on_train_end(trainer, module)
    assert module.logged[-1]["zero/comm_bytes_per_step"] == 3000.0
    return monitor


def test_under_hybrid_sharding_the_models_are_a_world_of_the_group_and_the_bytes_between_groups() -> None:
    from lightning_zero import estimate
    from lightning_zero.config import ZeroConfig

    config = ZeroConfig.from_options(stage=3, shard_group_size=2)
    summary = _fit_steps(config, world_size=4).summary
    at_group = estimate.estimate("zero3", 1000, 2, "32-true", config.comm.bucket_mb, 1000, config.offload,
                                 host_run=True)
    at_world = estimate.estimate("zero3", 1000, 4, "32-true", config.comm.bucket_mb, 1000, config.offload,
                                 host_run=True)
    assert summary.predicted == (at_group.params, at_group.grads, at_group.optimizer) == (2000, 2000, 4000)
    assert summary.predicted != (at_world.params, at_world.grads, at_world.optimizer)
    # Inside the group of 2: zero3's (2 Psi + Psi_t)(K-1)/K elements of 4 bytes = 6000; across the 2 replicas the
    # all-reduce of the half shard, 2 Psi_t b (R-1)/(K R) = 2000.
    assert (summary.ideal_comm_bytes_per_step, summary.ideal_cross_bytes_per_step) == (8000, 2000)
    assert (summary.comm_bytes_per_step, summary.cross_bytes_per_step, summary.shard_group_size) == (3000, 500, 2)
    report = format_report(summary)
    assert report.splitlines()[0].endswith(
        "1,000 parameters, hybrid sharding: 2 replicas of 2 ranks (model states as at world size 2)")
    assert "  of it sent to other nodes: 500 B (model, between shard groups: 1.95 KiB, ratio 0.25)" in report
    assert MonitorSummary.from_json(summary.to_json()) == summary


def test_flat_runs_keep_the_world_and_count_quantized_weight_gathers() -> None:
    from lightning_zero import estimate
    from lightning_zero.config import ZeroConfig

    summary = _fit_steps(ZeroConfig.from_options(stage=3, quantize_weights=True), world_size=4).summary
    assert summary.shard_group_size is None and summary.ideal_cross_bytes_per_step is None
    assert summary.ideal_comm_bytes_per_step == estimate.communication_bytes("zero3", 1000, 4, 4, 1000, True)
    assert summary.ideal_comm_bytes_per_step < estimate.communication_bytes("zero3", 1000, 4, 4, 1000)
    assert summary.predicted[0] == 1000  # fp32 parameters sharded over the 4 ranks
    assert "of it sent to other nodes: 500 B" in format_report(summary)


def test_the_communication_model_counts_hpz_and_qgz() -> None:
    from lightning_zero.config import ZeroConfig

    config = ZeroConfig.from_options(stage=3, hpz_group_size=2, quantize_grads="int4", node_size=2)
    summary = _fit_steps(config, world_size=4, node_size=2).summary
    # Psi = 1000 fp32 at 4 ranks in 2 nodes: the forward all-gather over the 4 ranks, 4000 B * 3/4 = 3000; hpZ's
    # backward all-gather inside pairs, 4000 B * 1/2 = 2000; qgZ's reduce: a segment of 250 elements, sent to the
    # other member of the node for each of the 2 nodes' segments as int8 payloads of 256 B (a 4 B scale, 250 B of
    # codes, 2 B of alignment), 512 B, and across to one rank as an int4 payload of 132 B (125 B of codes, 3 of
    # alignment). Unquantized and without hpZ: 9000.
    assert summary.ideal_comm_bytes_per_step == 3000 + 2000 + 512 + 132
