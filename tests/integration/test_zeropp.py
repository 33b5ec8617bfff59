"""benchmarks/zeropp.py on a tiny GPT: the bytes hybrid sharding sends across nodes, read from the rank processes'
sockets, agree with the strategy's own accounting (``comm_stats.cross_group_bytes``) and with the formula, rank by
rank; the report renders them. One run of 4 fresh rank processes (2 nodes x 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import zeropp  # noqa: E402


def test_hybrid_cross_node_bytes_on_the_sockets_match_the_strategy_accounting(tmp_path: Path) -> None:
    results = tmp_path / "zeropp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "zeropp.py"), "--quick", "--configs", "zero3_hybrid",
                    "--warmup", "1", "--steps", "2", "--results", str(results), "--workdir", str(tmp_path / "work"),
                    "--timeout", "600"], check=True, cwd=ROOT, env=env, capture_output=True, timeout=900)
    part = json.loads(results.read_text())["bytes"]
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
