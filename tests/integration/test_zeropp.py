"""benchmarks/zeropp.py on a tiny GPT: the bytes hybrid sharding sends across nodes, read from the rank processes'
sockets, agree with the strategy's own accounting (``comm_stats.cross_group_bytes``) and with the formula, rank by
rank; the report renders them. One run of 4 fresh rank processes (2 nodes x 2). And (slow) the curves on the small
GPT meet issue 28's bars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import zeropp  # noqa: E402


def _zeropp(tmp_path: Path, *options: str, timeout: float) -> dict:
    """Run benchmarks/zeropp.py with ``options``; its results."""
    results = tmp_path / "zeropp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "zeropp.py"), *options, "--results", str(results),
                    "--workdir", str(tmp_path / "work")], check=True, cwd=ROOT, env=env, capture_output=True,
                   timeout=timeout)
    return json.loads(results.read_text())


def test_hybrid_cross_node_bytes_on_the_sockets_match_the_strategy_accounting(tmp_path: Path) -> None:
    part = _zeropp(tmp_path, "--quick", "--configs", "zero3_hybrid", "--warmup", "1", "--steps", "2", "--timeout", "600",
                   timeout=900)["bytes"]
    (row,) = part["rows"]
    sizes = zeropp.Sizes(**part["sizes"])
    assert sizes == zeropp.sizes(zeropp.TINY) and sizes.psi == row["n_params"]
    # The replica all-reduce of a quarter... of a half of the model: b * Psi / 2 bytes to the other node per step.
    expected = sizes.psi / 2 * sizes.b
    for rank in range(zeropp.WORLD):
        stats, sockets = row["stats_cross"][rank], row["socket_cross"][rank]
        assert abs(stats - expected) <= 0.005 * expected, (rank, stats, expected)
        assert abs(sockets - stats) <= 0.01 * stats, (rank, sockets, stats)
        # Everything else a rank sends stays inside its node: the shard group's gathers and reductions.
        assert row["socket_total"][rank] > 2 * sockets
    text = zeropp.render({"bytes": part})
    assert "ZeRO-3 hybrid (shard_group_size=2)" in text and "| configuration |" in text


@pytest.mark.slow
def test_the_quantized_options_meet_the_loss_bars_over_300_steps(tmp_path: Path) -> None:
    """Issue 28: flat ZeRO-3 on 4 ranks as 2 x 2, the small GPT, 300 steps at the curves' learning rate; the mean
    loss of the last 50 steps of qwZ, qgZ (int4) and all three options within 1%, 2% and 3% of the unquantized run of
    the same seed, and within twice the spread of two seeds of it. Measured (BENCHMARKS.md): the seeds 0.0178 (0.8%)
    apart; qwZ +0.13% and -0.02%, qgZ +0.83% and +1.33%, all three +0.78% and +1.35%. About 20 minutes on 2
    cores."""
    spread, rows = zeropp.verdicts(_zeropp(tmp_path, "--curves", timeout=3 * 3600)["curves"])
    judged = [row for row in rows if row["tolerance"] is not None]
    assert {(row["name"], row["seed"]) for row in judged} == {(n, s) for n, s, t in zeropp.CURVES if t is not None}
    assert spread < 0.02 * min(row["tail"] for row in rows)  # the unquantized seeds agree: the comparison means something
    for row in judged:
        assert row["within_bar"] and row["within_spread"], row
