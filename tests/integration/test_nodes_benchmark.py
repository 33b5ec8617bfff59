"""benchmarks/nodes.py's table (issue 37's): flat zero3's seconds a step at each rate, every other configuration as a
ratio to it at the same rate, the bytes across as a ratio to flat zero3's, and each goal's verdict. Rendered from
made-up rows: running the benchmark takes a quarter of an hour and root (tests/integration/test_emulated_nodes.py runs
the same harness on every CI run)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import nodes  # noqa: E402


def _row(name: str, rate: float, step_s: float, link_mb: float, stats_mb: float | None = None) -> dict:
    row = dict(name=name, rate=rate, step_s=step_s, link_bytes=link_mb * 1e6, link_use=0.5)
    if stats_mb is not None:
        row["stats_bytes"] = stats_mb * 1e6
    return row


def test_the_table_gives_ratios_to_flat_zero3_at_each_rate_and_the_goals_verdicts() -> None:
    rows = [
        _row("zero3", 40.0, 2.0, 10.0, 9.9), _row("fsdp2", 40.0, 3.0, 20.0), _row("zero3_hybrid", 40.0, 1.0, 6.8, 6.7),
        _row("fsdp2_hsdp", 40.0, 0.9, 6.8), _row("ddp", 40.0, 1.5, 10.3),
        _row("zero3", 1000.0, 1.0, 10.0, 9.9), _row("fsdp2", 1000.0, 1.05, 20.0), _row("ddp", 1000.0, 1.2, 10.3),
    ]
    results = dict(started="now", command="python benchmarks/nodes.py", model=nodes.MODEL, rates=[1000.0, 40.0],
                   warmup=2, steps=4, rows=rows, failed=[], commit="abc")
    lines = nodes.render(results).splitlines()
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines if line.startswith("| ")}
    assert table["flat zero3 (seconds a step)"][:4] == ["1.00", "2.00", "10.00 MB", "9.90 MB"]
    assert table["FSDP2 flat"][:3] == ["1.05x", "1.50x", "2.00x"]
    assert table["Lightning DDP"][:3] == ["1.20x", "0.75x", "1.03x"]
    assert table["hybrid (`shard_group_size=\"node\"`)"][:4] == ["-", "0.50x", "0.68x", "6.70 MB"]
    assert "- 40 Mbit/s: flat zero3 2.00 s against FSDP2 flat 3.00 s (met), bytes across 0.50x FSDP2's (met)." in lines
    assert "- 40 Mbit/s: hybrid 1.00 s against HSDP 0.90 s (NOT met)." in lines
    assert "- 1000 Mbit/s: slower than flat zero3 by more than 10%: Lightning DDP 1.20x." in lines
