"""The link model (lightning_zero/link_model.py): the bytes a node sends across per step for each layout, against
what benchmarks/nodes.py measured across two emulated nodes, and the layout it chooses at each link rate."""

from __future__ import annotations

import pytest

from lightning_zero import link_model
from lightning_zero.estimate import EstimateError

PSI = 842_496  # the small GPT (benchmarks/nodes.py)
ROOT = 49_408  # of it in the root unit (tied embedding, positions, final norm), gathered once a step


def test_a_nodes_bytes_across_are_those_measured_on_the_link() -> None:
    # 2 nodes x 2 ranks, fp32. Measured (comm_stats, both nodes, per step): flat zero3 9.91 MB, hybrid 6.74 MB,
    # DDP 10.3 MB on the link; the model counts the root unit's two gathers where zero3 does one.
    def sent(option: str, kind: str) -> int:
        return link_model.node_bytes(option, kind, PSI, PSI, ranks=4, node_size=2, element_bytes=4)

    assert sent("zero3", "flat") == 3 * PSI * 4 // 2 == 5_054_976
    assert 2 * sent("zero3", "flat") - ROOT * 4 == pytest.approx(9.91e6, rel=0.01)
    assert sent("zero3", "hybrid") == sent("zero1", "hybrid") == 2 * PSI * 4 // 2
    assert 2 * sent("zero3", "hybrid") == pytest.approx(6.74e6, rel=0.01)
    assert sent("ddp", "flat") == 2 * 3 * PSI * 4 // 4  # a ring of 4 leaves each node once
    assert sent("zero1", "flat") == 2 * PSI * 4 // 2
    # ZeRO++: one int8 gather across (1 + 4/4096 bytes an element) and the int4 partial sums of qgZ.
    assert sent("zero3", "zero++") == pytest.approx(PSI / 2 * (1 + 4 / 4096) + PSI / 4, rel=0.01)
    assert sent("zero1", "zero++") == pytest.approx(PSI * 4 / 2 + PSI / 4, rel=0.01)


@pytest.mark.parametrize(("gbps", "kind"), [(1.0, "flat"), (0.04, "hybrid"), (0.01, "zero++")])
def test_the_layout_follows_the_link(gbps: float, kind: str) -> None:
    # The benchmark's small GPT, about 1.3 s of compute a step: flat zero3 at 1 Gbit/s (ZeRO++ measured 1.19-1.55x
    # there), hybrid at 40 Mbit/s (ZeRO++ within 5% of it), ZeRO++ at 10 Mbit/s.
    options = link_model.link_options("zero3", PSI, PSI, 4, 2, 4, gbps, compute_s=1.3)
    assert [o.kind for o in options] == ["flat", "hybrid", "zero++"]
    chosen = link_model.choose(options)
    assert chosen.kind == kind
    assert chosen.settings == link_model.settings(kind, 3)
    assert link_model.settings("zero++", 3) == (("quantize_weights", True), ("hpz_group_size", "node"),
                                               ("quantize_grads", "int4"))
    assert link_model.settings("zero++", 2) == (("quantize_grads", "int4"),)


def test_the_modelled_step_is_compute_plus_link_and_zeropps_share() -> None:
    flat, hybrid, zeropp = link_model.link_options("zero3", PSI, PSI, 4, 2, 4, 0.01, compute_s=2.0)
    assert flat.link_s == pytest.approx(5_054_976 / 1.25e6)
    assert flat.step_s == pytest.approx(2.0 + flat.link_s)
    assert zeropp.step_s == pytest.approx(2.0 * (1 + link_model.ZEROPP_COMPUTE) + zeropp.link_s)
    assert [o.kind for o in link_model.link_options("ddp", PSI, PSI, 4, 2, 4, 1.0, 1.0)] == ["flat"]


def test_one_node_or_a_bad_link_is_refused() -> None:
    with pytest.raises(EstimateError, match="node_size=4 is invalid for 4 ranks: the link model needs several nodes"):
        link_model.node_bytes("zero3", "flat", PSI, PSI, 4, 4, 4)
    with pytest.raises(EstimateError, match="link_gbps=0 and compute_s=1 are invalid"):
        link_model.link_options("zero3", PSI, PSI, 4, 2, 4, 0, 1)
