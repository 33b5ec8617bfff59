"""Between nodes: the bytes a ZeRO option sends across the link per step, the seconds the link takes for them at a
given bandwidth, and whether hybrid sharding or ZeRO++'s options pay for themselves there (``strategy=auto`` with
``link_gbps``; ``lightning-zero estimate --link-gbps``).

[Note: the link model]
With ``G`` nodes of ``K`` ranks, an all-gather or reduce-scatter over all of them sends ``(G-1)/G`` of its buffer out
of each node (node by node on gloo: by_node.py, [Note: hierarchical collectives]; NCCL's rings about the same).
Per step and node, with Ψ parameters, Ψ_t trainable, b bytes an element (``node_bytes``):

- flat: zero3 gathers every parameter twice and reduces the gradients, ``(G-1)/G (2Ψ + Ψ_t) b``; zero1/zero2 reduce
  and gather once each, ``(G-1)/G 2Ψ_t b``;
- hybrid sharding, one shard group a node (``shard_group_size="node"``): only the all-reduce of each rank's
  gradient shard over the ``G`` replicas crosses, ``2 (G-1)/G Ψ_t b``, whatever the stage;
- ZeRO++ (flat): zero3 with qwZ, hpZ and qgZ gathers once across in int8 (``1 + 4/4096`` bytes an element: hpZ keeps
  the backward's gather inside the node) and reduces across in int4; zero1/zero2 with qgZ reduce in int4 and still
  gather the updated parameters in full;
- DDP: a ring all-reduce of the gradients in rank order, which leaves each node once: ``2 (N-1)/N Ψ_t b``.

The link's seconds are a node's bytes over the bandwidth, ``link_gbps`` Gbit/s each way. The step is modelled as
the compute plus the link's seconds (no overlap: the measured link use of flat zero3 across two emulated nodes was
25-58%, so most of it is exposed), and ZeRO++'s options add ``ZEROPP_COMPUTE`` of the compute: across two emulated
nodes at 1 Gbit/s, where the link costs flat zero3 a few percent of its step, the three options took 1.19x and 1.55x
its step (issue 37), which their quantizing kernels alone (1-3 GB/s, benchmarks/quantize_speed.py) do not explain;
the rest is their smaller, more numerous messages and the exchanges qgZ waits for. Hybrid sharding costs memory
instead (the model states of a world of ``K``), which ``strategy=auto`` checks against the budget.

The choice (``choose``) is the option of the shortest modelled step, the least complex (by stage, then flat, hybrid,
ZeRO++) among those within ``TIE`` of it, since a few percent is within a shared machine's noise. On that benchmark's
figures (the small GPT, compute about 1.3 s a step) it keeps flat zero3 at 1 Gbit/s, chooses hybrid sharding at 40
Mbit/s (ZeRO++'s modelled step within 5% of it: measured, 0.34-0.40x flat zero3's step against hybrid's 0.44-0.56x)
and ZeRO++ at 10 Mbit/s (measured 0.15x, hybrid 0.28x).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.estimate import LAYOUTS, EstimateError, quantized_reduce_bytes
from lightning_zero.sharding.quantize import DEFAULT_BLOCK_SIZE

#: What ZeRO++'s three options add to a step's compute, as a share of it (see [Note: the link model]).
ZEROPP_COMPUTE = 0.35
#: Modelled steps within this share of the shortest count as equal; the least complex of them is chosen.
TIE = 0.05
#: The layouts between nodes, least complex first.
KINDS = ("flat", "hybrid", "zero++")


@dataclass(frozen=True)
class LinkOption:
    """One layout between nodes of a ZeRO option: the strategy settings it adds, the bytes a node sends across per
    step, the link's seconds for them and the modelled step."""

    option: str
    kind: str
    settings: tuple[tuple[str, object], ...]
    node_bytes: int
    link_s: float
    step_s: float

    def describe(self) -> str:
        added = ", ".join(f"{k}={v!r}" for k, v in self.settings)
        name = f"{self.option} {self.kind}" + (f" ({added})" if added else "")
        return (f"{name}: {self.node_bytes / 1e6:,.2f} MB a node across per step, {self.link_s:.3f} s of link, "
                f"a step of about {self.step_s:.3f} s")


def settings(kind: str, stage: int) -> tuple[tuple[str, object], ...]:
    """The ZeroStrategy options of ``kind`` for a stage (ZeRO++: all three on stage 3, qgZ on stages 1 and 2)."""
    if kind == "hybrid":
        return (("shard_group_size", "node"),)
    if kind == "zero++":
        zero3 = (("quantize_weights", True), ("hpz_group_size", "node")) if stage == 3 else ()
        return (*zero3, ("quantize_grads", "int4"))
    return ()


def node_bytes(option: str, kind: str, num_params: int, trainable: int, ranks: int, node_size: int,
               element_bytes: int) -> int:
    """Bytes one node sends across the link per step (see [Note: the link model])."""
    nodes = _nodes(ranks, node_size)
    stage = LAYOUTS[option].stage
    share = (nodes - 1) / nodes
    if stage == 0:
        return round(2 * (ranks - 1) / ranks * trainable * element_bytes)
    if kind == "hybrid":
        return round(2 * share * trainable * element_bytes)
    if kind == "flat":
        gathered = 2 * num_params if stage == 3 else trainable
        return round(share * (gathered + trainable) * element_bytes)
    reduced = node_size * quantized_reduce_bytes(trainable, ranks, node_size, 4)[1]
    if stage == 3:  # one int8 gather across (hpZ keeps the backward's inside the node)
        return round(share * num_params * (1 + 4 / DEFAULT_BLOCK_SIZE)) + reduced
    return round(share * trainable * element_bytes) + reduced


def link_options(option: str, num_params: int, trainable: int, ranks: int, node_size: int, element_bytes: int,
                 link_gbps: float, compute_s: float, kinds: tuple[str, ...] = KINDS) -> list[LinkOption]:
    """Each of ``kinds`` for ``option`` (of ``estimate.LAYOUTS``; DDP has one layout, ``"flat"``) at ``link_gbps``
    Gbit/s each way and ``compute_s`` seconds of compute a step, least complex first."""
    if not (link_gbps > 0 and compute_s >= 0):
        raise EstimateError(f"link_gbps={link_gbps!r} and compute_s={compute_s!r} are invalid: the bandwidth must be "
                            "> 0 Gbit/s and the compute >= 0 s")
    stage = LAYOUTS[option].stage
    out = []
    for kind in kinds if stage else ("flat",):
        sent = node_bytes(option, kind, num_params, trainable, ranks, node_size, element_bytes)
        link_s = sent / (link_gbps * 1e9 / 8)
        extra = ZEROPP_COMPUTE * compute_s if kind == "zero++" else 0.0
        out.append(LinkOption(option, kind, settings(kind, stage), sent, link_s, compute_s + extra + link_s))
    return out


def choose(options: list[LinkOption]) -> LinkOption:
    """The least complex option whose modelled step is within ``TIE`` of the shortest (``options`` least complex
    first: by option, then by layout)."""
    shortest = min(o.step_s for o in options)
    return next(o for o in options if o.step_s <= shortest * (1 + TIE))


def _nodes(ranks: int, node_size: int) -> int:
    if node_size < 1 or ranks % node_size or ranks // node_size < 2:
        raise EstimateError(f"node_size={node_size} is invalid for {ranks} ranks: the link model needs several nodes "
                            "of node_size ranks")
    return ranks // node_size
