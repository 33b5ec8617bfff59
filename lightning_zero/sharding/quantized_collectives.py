"""ZeRO++'s quantized collectives, the part of ``Collectives`` (collectives.py) that sends block-quantized payloads
(quantize.py): qgZ's reduce-scatter in two stages, node by node ([Note: the quantized reduce-scatter], [Note: qgZ's
two formats]), and qwZ's all-gather ([Note: the quantized all-gather]). ``Collectives`` inherits them; they use its
point-to-point exchange, its row gathers, its links and its byte accounting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero.sharding.buckets import Bucket
from lightning_zero.sharding.in_flight import QuantizedGathered, QuantizedReduced, payload_pieces
from lightning_zero.sharding.process_groups import CollectiveDeviceError
from lightning_zero.sharding.quantize import INTRA_NODE_BITS, BlockFormat, TwoStageReduce, quantize

if TYPE_CHECKING:
    from lightning_zero.sharding.comm_stats import CommStats
    from lightning_zero.sharding.in_flight import WeightCheck
    from lightning_zero.sharding.topology import Links


class QuantizedCollectives:
    """The quantized collectives of a :class:`~lightning_zero.sharding.collectives.Collectives`, which defines the
    attributes and methods declared here."""

    rank: int
    world_size: int
    node_size: int | None
    native: bool
    device: torch.device
    device_backend: str | None
    links: Links
    stats: CommStats
    weight_check: WeightCheck

    def _exchange(self, pairs: Sequence[tuple[int, Tensor, Tensor]]) -> list:
        raise NotImplementedError

    def _gather_rows(self, table: Tensor, op: str) -> list:
        raise NotImplementedError

    def two_stage(self, parts: Sequence[int], fmt: BlockFormat) -> TwoStageReduce:
        """The plan of a quantized reduce-scatter of segments made of ``parts`` (a bucket's padded parameter rows)
        over this group's nodes (``node_size`` consecutive ranks; ``None``: one node): ``fmt`` across nodes, int8
        at the same block size inside them ([Note: qgZ's two formats]). Raises where it cannot run: a group that is
        not the world in rank order, or device tensors on a backend that sends host tensors only.

        [Note: qgZ's two formats]
        ``quantize_grads`` names the format of what crosses nodes, the links ZeRO++ saves bytes on; the first
        stage, inside the node, sends int8 whichever it is. With int4 in both stages every gradient element takes
        two int4 roundings (relative L2 error 0.21 each on a GPT's gradient), and the loss pays for it: on the
        small GPT (benchmarks/zeropp.py --curves, at a learning rate where the unquantized seeds end within 0.8%
        of one another) the mean of the last 50 of 300 steps ended +2.5% and +1.2% above the unquantized run of
        each seed, outside the 2% and the seeds' spread; int8 inside the node took the first of them to +0.8%
        (the curves give the figures of this code). The bytes across nodes do not change; inside the node a rank
        sends ``S + 4 ceil(S/4096)`` bytes per segment instead of about half that, still a quarter of fp32's, on
        links (NVLink, PCIe) an order of magnitude faster than those between nodes."""
        n = self.world_size
        members = self.links.members
        node = n if self.node_size is None else self.node_size
        if tuple(members) != tuple(range(n)) or n % node:
            raise ValueError(
                f"quantize_grads runs over the world's nodes of node_size={self.node_size} consecutive ranks; this "
                f"group's ranks are {list(members)}"
            )
        if not self.native and self.device.type != "cpu":
            raise CollectiveDeviceError(
                f"quantize_grads sends its payloads point to point, which the {self.device_backend} backend does for "
                f"host tensors only, but the gradients are on {self.device}: use nccl for them, or drop quantize_grads"
            )
        intra = BlockFormat(bits=INTRA_NODE_BITS, block_size=fmt.block_size)
        return TwoStageReduce(n // node, node, sum(parts), intra=intra, inter=fmt, parts=tuple(parts))

    def _reduce_scatter_quantized(
        self, bucket: Bucket, buffer: Tensor, guard: Callable[[], None] | None, fmt: BlockFormat
    ) -> QuantizedReduced:
        """[Note: the quantized reduce-scatter] ZeRO++'s qgZ (``quantize_grads``): the averaged bucket buffer
        (divided by ``N`` before anything is quantized, as the full-precision reduce-scatter divides) is reduced in
        ``quantize.py``'s two stages (``TwoStageReduce``, [Note: segments and the two-stage reduce-scatter]) over
        ``G`` nodes of ``K = node_size`` consecutive ranks. First this rank quantizes its buffer into ``(K, G, P)``
        and sends row ``j`` to member ``j`` of its node (the rows of every node's rank ``j``), receiving the other
        members' rows of its own position; ``QuantizedReduced.wait`` sums the ``K`` rows in fp32 (its own row
        dequantized too, in order of member), quantizes the ``G`` partial sums and sends partial ``h`` to the rank
        at this position on node ``h``, then sums the ``G`` it holds, in order of node, into its segment.

        Blocks restart at each parameter's padded rows in the segment (``TwoStageReduce.parts``), as qwZ's do
        ([Note: the quantized all-gather]): a LayerNorm's or a bias's gradients are far smaller than an embedding's,
        and a block spanning both quantizes the small ones to a few codes or to zero. Measured on the test's GPT
        (stage 3, 2 nodes x 2, int4, 300 steps, two seeds), blocks over the whole segment left the mean loss of the
        last 50 steps 2.2% and 17% away from the unquantized run's (qwZ with it: 4.6% and 15%); see the README for
        the figures per parameter. So the result equals ``reference_two_stage_reduce_scatter`` of every rank's
        divided buffer, applied to each parameter's rows on their own, bit for bit.

        The bytes a rank sends: ``(K - 1) G P8`` inside its node and ``(G - 1) P`` across (``P``: a segment's
        payload, the sum over its parameters of ``S_p/2 + 4 ceil(S_p / 4096)`` rounded up to 4 bytes for int4, ``P8
        = S_p + 4 ceil(S_p / 4096)`` for int8, the format inside the node: [Note: qgZ's two formats]), recorded as
        ``"reduce_scatter_quantized"``; a flat reduce-scatter of fp32
        sends ``(N - 1) 4 S``, of which ``(N - K) 4 S`` across nodes on gloo's exchange. So across nodes int4 sends
        about ``1/8`` of what fp32 sends per peer node, and one peer node's worth instead of ``N - K`` ranks' worth.

        Both exchanges are point to point in one batch each (``_exchange``): gloo has no all-to-all, and on NCCL a
        batch of sends and receives is one group launch, as its ``all_to_all_single`` itself is; no process group
        more is needed. The second exchange is issued once the first is waited on, so the wait of a quantized
        reduce-scatter runs the dequantizing sums and the second exchange.

        An inf or a NaN in a gradient makes its block's scale NaN, and every element of the block NaN on the rank
        that reduces it (the partial sum, requantized, carries it across nodes alike): the gradient shard holds a
        NaN, which the step's non-finite check (fp16's loss scaler, ``nonfinite_grads``) sees as it sees an inf."""
        plan = self.two_stage(bucket.padded_numels, fmt)
        node, member = divmod(self.rank, plan.group_size)
        sent = plan.quantize_intra(buffer).payload
        received = torch.empty_like(sent)
        received[member].copy_(sent[member])
        pairs = [(node * plan.group_size + j, sent[j], received[j]) for j in range(plan.group_size) if j != member]
        works = self._exchange(pairs)
        peers = [peer for peer, _, _ in pairs]
        across = [h * plan.group_size + member for h in range(plan.groups) if h != node]
        cross = (self.links.to_peers(sent[0].numel(), peers)
                 + self.links.to_peers(plan.payload_bytes(plan.inter), across))
        logical = plan.intra_bytes + plan.inter_bytes
        self.stats.record("reduce_scatter_quantized", logical, logical, cross)
        return QuantizedReduced(bucket=bucket, segment=bucket.segment(buffer), received=received, works=works,
                                guard=guard, plan=plan, comms=self, held_bytes=2 * sent.numel())

    def _reduce_across_nodes(self, plan: TwoStageReduce, partial: Tensor) -> Tensor:
        """The second stage of a quantized reduce-scatter: this rank's segment summed over every node, from the
        node's partial sums ``partial`` ``(G, S)`` of the segments at this rank's position (fp32)."""
        node, member = divmod(self.rank, plan.group_size)
        sent = plan.quantize_inter(partial).payload
        received = torch.empty_like(sent)
        received[node].copy_(sent[node])
        works = self._exchange([(h * plan.group_size + member, sent[h], received[h])
                                for h in range(plan.groups) if h != node])
        for work in works:
            work.wait()
        return plan.reduce_inter(received)

    def _all_gather_quantized(
        self, bucket: Bucket, buffer: Tensor, guard: Callable[[], None] | None, fmt: BlockFormat
    ) -> QuantizedGathered:
        """[Note: the quantized all-gather] ZeRO++'s qwZ (stage 3's gathers in a step, ``quantize_weights``): this
        rank's segment is quantized (``quantize.py``: int8 codes, an fp32 scale per block) parameter by parameter,
        blocks restarting at each parameter's (padded) chunk ``S_p``, into its row of a ``(n, P)`` uint8 table, ``P =
        sum_p layout(S_p).nbytes``; the rows are all-gathered as bytes, and every rank dequantizes every row, its own
        included, into the bucket's buffer, so that every rank computes with bitwise the same gathered weights. A rank
        sends ``(n - 1) * P`` bytes where an unquantized gather sends ``(n - 1) * S * b``: about ``1/4`` of fp32 and
        ``1/2`` of bf16. ``stats`` records it as ``"all_gather_quantized"``, with the payload's bytes.

        Why blocks stop at each parameter: a segment puts a LayerNorm's weights (about 1) next to a projection's
        (about 0.02); a block spanning both takes its scale from the 1s, and the projection's values, quantized in
        steps of 1/127, lose about a tenth of their size. Measured on the test's GPT (4 ranks, 300 steps, two seeds),
        blocks over the whole segment left the mean loss of the last 50 steps 5.5% and 6.8% above the unquantized
        run's; blocks per parameter cost a partial block's scale per parameter (bytes) and a few more kernels.

        A block holding an inf or a NaN gets a NaN scale, and dequantizes to NaN in every element: every rank sees
        it in the gathered table, notes it on the device (``WeightCheck``), and raises ``NonFiniteWeightsError``
        naming the parameter at the end of the step, after its backward and before its update (all ranks alike, no
        rank left waiting on a collective), rather than step with gradients of weights the quantizer could not
        represent. Checked per gather, the host would wait on CUDA for every gather, where it otherwise only queues
        the wait on the stream; at the end of the step it is one host synchronisation."""
        segment = bucket.segment(buffer)
        pieces = payload_pieces(bucket, fmt)
        nbytes = sum(piece.layout.nbytes for piece in pieces)
        payloads = torch.empty(self.world_size, nbytes, dtype=torch.uint8, device=buffer.device)
        for piece in pieces:
            values = segment[piece.start : piece.start + piece.layout.numel]
            quantize(values, fmt, out=piece.of(payloads[self.rank]))
        works = self._gather_rows(payloads, "all_gather_quantized")
        return QuantizedGathered(buffer=buffer, works=works, guard=guard, payloads=payloads, bucket=bucket,
                                 pieces=pieces, check=self.weight_check)
