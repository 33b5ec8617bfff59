"""benchmarks/zeropp.py without processes: its formulas of the bytes that cross nodes at 2 nodes x 2, and the curve
table's verdicts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import zeropp  # noqa: E402


def test_the_small_gpt_splits_into_blocks_and_root() -> None:
    sizes = zeropp.sizes(zeropp.MODEL)
    assert (sizes.units, sizes.root, sizes.psi, sizes.last) == (793_088, 49_408, 842_496, 793_088 // 4)


def test_cross_node_formulas_at_two_nodes_of_two() -> None:
    s = zeropp.Sizes(units=800, root=200, b=4, last=200)
    configs = {c.name: c for c in zeropp.CONFIGS}
    a = zeropp.AG_SHARE
    # ZeRO-3, node by node: per all-gather and per reduce-scatter a rank sends its quarter across once; units gathered
    # twice but the last (kept gathered from its forward to its backward), the root once.
    assert a == 0.25
    assert configs["zero3"].gloo(s, a) == 0.25 * (2 * 800 - 200 + 200) * 4 + 0.25 * 1000 * 4 == 2600
    assert configs["zero3"].gloo(zeropp.Sizes(units=800, root=200), a) == 2800  # results from before it did
    assert configs["zero1"].gloo(s, a) == configs["zero2"].gloo(s, a) == 1000 * 4 * (0.25 + 0.25)
    # qwZ: both gathers at 1 + 4/4096 bytes an element.
    assert configs["zero3_qwz"].gloo(s, a) == 0.25 * (2 * 800 - 200 + 200) * (1 + 4 / 4096) + 1000
    # hpZ: the backward gather stays in the node; qgZ: the reduce-scatter becomes one int4 payload of a quarter to the
    # other node; all three: the forward's int8 gather and qgZ's payload only.
    assert configs["zero3_hpz"].gloo(s, a) == 0.25 * 1000 * 4 + 0.25 * 1000 * 4 == 2000
    qgz = 250 * (0.5 + 4 / 4096)
    assert configs["zero3_qgz"].gloo(s, a) == 0.25 * (2 * 800 - 200 + 200) * 4 + qgz
    assert configs["zero3_zeropp"].gloo(s, a) == 0.25 * 1000 * (1 + 4 / 4096) + qgz
    assert configs["zero3_zeropp"].gloo(s, a) / configs["zero3"].gloo(s, a) < 0.22
    # Hybrid: the shard (Psi/2) all-reduced over a ring of 2, whatever the all-gather does.
    for name in ("zero1_hybrid", "zero2_hybrid", "zero3_hybrid", "zero3_hybrid_qwz"):
        assert configs[name].gloo(s, a) == 2000


def test_curve_table_checks_the_tolerance_and_twice_the_seed_spread() -> None:
    def run(label, seed, tail_loss, tolerance=None):
        return dict(name=label, label=label, seed=seed, tolerance=tolerance, losses=[9.0] * 10 + [tail_loss] * 4)

    part = dict(started="now", command="c", model=zeropp.MODEL, steps=14, tail=4, runs=[
        run("plain", 1, 2.00), run("plain", 2, 2.01), run("close", 1, 2.015, 0.01), run("far", 1, 2.03, 0.02)])
    rows = [line for line in zeropp.render_curves(part, None) if line.startswith("| ")][1:]
    assert rows[2] == "| close | 1 | 2.0150 | +0.75% | 1%: yes | yes |"  # 0.015 <= 2 x 0.01
    assert rows[3] == "| far | 1 | 2.0300 | +1.50% | 2%: yes | NO |"  # 0.03 > 2 x 0.01
    assert rows[1].startswith("| plain | 2 | 2.0100 | +0.50% | - | - |")
