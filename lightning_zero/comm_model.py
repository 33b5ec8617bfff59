"""The communication model: the ring-equivalent bytes one rank moves per optimizer step under each option, flat, under
hybrid sharding and with ZeRO++'s quantized collectives; estimate.py re-exports it.
"""

from __future__ import annotations

from lightning_zero.estimate_options import LAYOUTS, OPTIONS, EstimateError, _check_choice, _check_counts
from lightning_zero.sharding.quantize import DEFAULT_BLOCK_SIZE, INTRA_NODE_BITS, BlockFormat


def communication_bytes(
    option: str, num_params: int, ranks: int, element_bytes: int, trainable_params: int | None = None,
    quantize_weights: bool = False, hpz_group_size: int | None = None, quantize_grads: str | None = None,
    node_size: int | None = None,
) -> int:
    """Ring-equivalent bytes one rank moves per optimizer step, with no overhead.

    DDP all-reduces the gradients (2 Ψ_t (N-1)/N elements); zero1 and zero2 reduce-scatter the gradients and
    all-gather the updated parameters (the same 2 Ψ_t (N-1)/N); zero3 all-gathers every parameter twice (forward and
    backward) and reduce-scatters the gradients: (2 Ψ + Ψ_t)(N-1)/N (the paper's figure; the strategy moves a little
    less, the unit the forward runs last staying gathered for its backward). Ψ_t counts trainable parameters: frozen
    ones are never reduced nor re-gathered after a step. ZeRO++'s options change one term each:

    - ``quantize_weights`` (zero3's qwZ): the all-gathers move int8 codes and one fp32 scale per block of 4096,
      about ``1 + 4/4096`` bytes per element instead of ``element_bytes`` (blocks restart at each parameter: a
      little more for many small parameters);
    - ``hpz_group_size=K2`` (zero3's hpZ): the backward all-gather runs inside groups of ``K2``, Ψ (K2-1)/K2, in
      full precision (from the secondary shards, which hold what the forward computed with);
    - ``quantize_grads`` (``"int4"``/``"int8"``, qgZ): the reduce-scatter is the two-stage exchange of
      ``quantized_reduce_bytes`` over nodes of ``node_size`` ranks (default: one node of all ``ranks``).
    """
    _check_choice("option", option, OPTIONS)
    trainable = _check_counts(num_params, ranks, trainable_params)
    ring, apart = 0, 0  # bytes of the collectives over all ranks; of those that run otherwise
    if quantize_grads is None:
        ring += trainable * element_bytes
    else:
        _check_choice("quantize_grads", quantize_grads, ("int4", "int8"))
        apart += sum(quantized_reduce_bytes(trainable, ranks, node_size or ranks, int(quantize_grads[3:])))
    if LAYOUTS[option].stage != 3:
        ring += trainable * element_bytes  # the all-gather of the updated parameters
    else:
        gather = (num_params + 4 * -(-num_params // DEFAULT_BLOCK_SIZE) if quantize_weights
                  else num_params * element_bytes)
        ring += gather
        if hpz_group_size is None:
            ring += gather
        else:
            apart += num_params * element_bytes * (hpz_group_size - 1) // hpz_group_size
    return ring * (ranks - 1) // ranks + apart


def hybrid_communication_bytes(
    option: str, num_params: int, ranks: int, shard_group_size: int, element_bytes: int,
    trainable_params: int | None = None, quantize_weights: bool = False, hpz_group_size: int | None = None,
) -> tuple[int, int]:
    """Ring-equivalent bytes one rank moves per optimizer step under hybrid sharding, ``(inside its shard group,
    to the other groups)`` (see [Note: hybrid sharding] in sharding/topology.py): inside, the stage's collectives over
    the ``K = shard_group_size`` ranks of its group (``communication_bytes`` at ``K`` ranks); across, the all-reduce of
    its gradient shard over the ``R = N / K`` replicas, ``2 (Ψ_t / K)(R - 1)/R`` elements. With one group per node the
    second is all that crosses nodes. Offload moves the same bytes: the host steps the shard the collectives left."""
    _check_choice("option", option, tuple(o for o in OPTIONS if LAYOUTS[o].stage >= 1))
    trainable = _check_counts(num_params, ranks, trainable_params)
    if shard_group_size < 1 or ranks % shard_group_size:
        raise EstimateError(
            f"shard_group_size={shard_group_size} is invalid for {ranks} ranks: it must divide the number of ranks"
        )
    inside = communication_bytes(option, num_params, shard_group_size, element_bytes, trainable_params,
                                 quantize_weights, hpz_group_size)
    replicas = ranks // shard_group_size
    return inside, 2 * trainable * element_bytes * (replicas - 1) // (shard_group_size * replicas)


def quantized_reduce_bytes(trainable_params: int, ranks: int, node_size: int, bits: int) -> tuple[int, int]:
    """qgZ (``quantize_grads``): the bytes one rank sends per step in the gradient reduce, ``(inside its node, across
    nodes)``, for ``ranks`` ranks in nodes of ``node_size``: its segment ``S = ceil(Ψ_t / N)`` is sent as block
    payloads (an fp32 scale per 4096 elements), ``(K - 1) G P8`` to the other members of its node as int8 and
    ``(G - 1) P`` across as ``bits`` 4 or 8 (quantized_collectives.py, [Note: the quantized reduce-scatter], [Note:
    qgZ's two formats]). Counted as one block run: blocks restart at each parameter, which adds at most a scale and 3
    bytes of alignment per parameter to each payload."""
    trainable = _check_counts(trainable_params, ranks, None)
    if node_size < 1 or ranks % node_size:
        raise EstimateError(f"node_size={node_size} is invalid for {ranks} ranks: it must divide the number of ranks")
    if bits not in (4, 8):
        raise EstimateError(f"bits={bits} is invalid: qgZ quantizes to 4 or 8 bits")
    segment = -(-trainable // ranks)
    nodes = ranks // node_size
    inside, across = (BlockFormat(bits=b).layout(segment).nbytes for b in (INTRA_NODE_BITS, bits))
    return (node_size - 1) * nodes * inside, (nodes - 1) * across
