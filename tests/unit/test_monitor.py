"""ZeroMonitor's summary and report, without a Trainer (the CLI tests run it in real fits)."""

import torch

from lightning_zero.monitor import MonitorSummary, ZeroMonitor, _count_items, format_report

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
