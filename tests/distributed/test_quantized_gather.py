"""qwZ (``quantize_weights=True``) on 4 CPU ranks over gloo as 2 nodes x 2, flat and hybrid (``shard_group_size=2``):
every all-gather of a step (forward and backward) sends the int8 payloads exactly; a small GPT's losses track the
unquantized run; the weights a forward computes with are, bit for bit, every rank's segment
quantized and dequantized (blocks not filling a segment, 0-d and 1-element parameters, all-zero weights); the fp32
masters stay exact; a NaN in a weight stops every rank with one error. One fork runs every case."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfigError, ZeroStrategy
from lightning_zero.models import GPTConfig, LanguageModel
from lightning_zero.sharding.flat_param import ShardSpec
from lightning_zero.sharding.quantize import BlockFormat, dequantize, quantize
from tests.harness import run_on_ranks
from tests.models import Recorder, make_trainer, pattern_loader

WORLD, K, NODE = 4, 2, 2
STEPS = 60
LR = 3e-3
GPT = GPTConfig(vocab_size=128, n_layer=2, n_head=2, d_model=64, seq_len=32)
#: Block gathers in a steady step: each block's in forward and again in backward, but the last block's (kept
#: gathered between them).
BLOCK_GATHERS = 2 * GPT.n_layer - 1
INT8 = BlockFormat(bits=8)


def _payload_bytes(numel: int) -> int:
    """An int8 payload of ``numel`` elements, from the formula: a byte per element, 4 per block of 4096, rounded up
    to a multiple of 4."""
    raw = numel + 4 * -(-numel // 4096)
    return -(-raw // 4) * 4


def _segment(shapes, n: int) -> int:
    return sum(ShardSpec(torch.Size(shape), 0, n).padded_numel for shape in shapes)


def _quantized(shapes, n: int) -> int:
    """The payload of one rank's segment of these parameters: blocks restart at each parameter's padded chunk."""
    return sum(_payload_bytes(ShardSpec(torch.Size(shape), 0, n).padded_numel) for shape in shapes)


class StepBytes(pl.Callback):
    """Per step: the bytes of each kind of collective, and those sent across nodes."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.cross: list[int] = []

    def _now(self, trainer) -> tuple[dict[str, int], int]:
        stats = trainer.strategy.comm_stats
        return {op: s.bytes for op, s in stats.by_op.items()}, stats.cross_group_bytes

    def on_train_batch_start(self, trainer, *args) -> None:
        self._start = self._now(trainer)

    def on_train_batch_end(self, trainer, *args) -> None:
        (end, cross), (start, cross0) = self._now(trainer), self._start
        self.steps.append({op: end[op] - start.get(op, 0) for op in end if end[op] != start.get(op, 0)})
        self.cross.append(cross - cross0)


class ExactGather(pl.Callback):
    """Before each backward, while the root unit is gathered quantized: ``gathered_parameters`` gives every rank's
    rows exactly as its shards hold them (the root gathered again in full precision)."""

    def __init__(self) -> None:
        self.quantized_before: list[bool] = []
        self.exact: list[bool] = []

    def on_before_backward(self, trainer, *args) -> None:
        runtime = trainer.strategy.runtime
        self.quantized_before.append(runtime.parameters.root.quantized)
        with trainer.strategy.gathered_parameters():
            self.exact.append(all(torch.equal(s.spec.local_view(s.param.detach()).reshape(-1), s.local.reshape(-1))
                                  for s in runtime.shards))


def _patterns() -> DataLoader:
    return pattern_loader(GPT.vocab_size, GPT.seq_len, rows=256)


def _gpt(quantize: bool, group: int | None, steps: int = STEPS, precision: str = "32-true",
         check: bool = False, seed: int = 3, **options) -> dict:
    pl.seed_everything(seed, verbose=False)
    model = LanguageModel(GPT, lr=LR, warmup_steps=5)
    log, recorder, exact = StepBytes(), Recorder(), ExactGather()  # exact: its gathers would count in log's
    topology = {"shard_group_size": group} if group else {"node_size": NODE}
    strategy = ZeroStrategy(3, units=("Block",), quantize_weights=quantize, **topology, **options)
    trainer = make_trainer(strategy, WORLD, max_steps=steps, callbacks=[log, recorder, *([exact] if check else [])],
                           precision=precision)
    trainer.fit(model, train_dataloaders=_patterns())
    blocks = [p.shape for p in model.model.blocks.parameters()]
    root = [p.shape for name, p in model.model.named_parameters() if not name.startswith("blocks.")]
    return {"losses": recorder.losses, "first": recorder.params[0], "bytes": log.steps, "cross": log.cross,
            "shapes": (blocks, root), "exact": (exact.quantized_before, exact.exact)}


# ------------------------------------------------------------------------------------------------- edge cases


class Tiny(nn.Module):
    """A 0-d and a 1-element parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.shift = nn.Parameter(torch.tensor([-1.3]))

    def forward(self, x):
        return x * self.scale + self.shift


class EdgeModel(pl.LightningModule):
    """Units: ``odd`` (a 130 x 130 linear: 33 rows a rank, 4290 elements of weight, a block of 4096 and a partial
    one, the last rank's rows padded), ``tiny`` (0-d and 1-element parameters) and ``zero`` (all-zero weights)."""

    def __init__(self, nan_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.odd, self.tiny, self.zero = nn.Linear(130, 130), Tiny(), nn.Linear(130, 130)
        nn.init.zeros_(self.zero.weight)
        nn.init.zeros_(self.zero.bias)
        if nan_at is not None:
            with torch.no_grad():
                self.odd.weight[nan_at] = float("nan")
        #: Per unit, the parameters as the first training forward saw them (gathered).
        self.seen: dict[str, list[torch.Tensor]] = {}
        for name in ("odd", "tiny", "zero"):
            getattr(self, name).register_forward_hook(self._record(name))

    def _record(self, name: str):
        def hook(module, _args, _out):
            if name not in self.seen:
                self.seen[name] = [p.detach().clone() for p in module.parameters()]

        return hook

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h = self.tiny(self.odd(x))
        return (self.zero(h) + h).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 130, generator=torch.Generator().manual_seed(0))), batch_size=4)


def _edges(nan_at: tuple[int, int] | None = None) -> dict:
    pl.seed_everything(5, verbose=False)
    model = EdgeModel(nan_at)
    names = ("odd", "tiny", "zero")
    initial = {name: [p.detach().clone() for p in getattr(model, name).parameters()] for name in names}
    strategy = ZeroStrategy(3, units=names, quantize_weights=True, node_size=NODE)
    trainer = make_trainer(strategy, WORLD, max_steps=2)
    try:
        trainer.fit(model)
    except RuntimeError as err:
        return {"error": f"{type(err).__name__}: {err}", "steps": trainer.global_step}
    return {"initial": initial, "seen": model.seen}


def _run_all(rank: int, world_size: int) -> dict:
    out = {"gpt": {(q, g): _gpt(q, g) for q, g in ((False, None), (True, None), (True, K))}}
    out["bf16"] = _gpt(True, None, steps=4, precision="bf16-mixed")
    out["exact"] = {q: _gpt(q, None, steps=3, check=True)["exact"] for q in (False, True)}
    out["options"] = {"checkpointing": _gpt(True, None, steps=4, activation_checkpointing_policy=["Block"]),
                      "kept": _gpt(True, None, steps=4, reshard_after_forward=False)}
    out["edges"] = _edges()
    out["nan"] = _edges(nan_at=(129, 0))  # row 129: in rank 3's shard only
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_run_all, WORLD)


# -------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("group", [None, K], ids=["flat", "2x2"])
def test_every_gather_sends_the_int8_payloads(ranks, group) -> None:
    """Per steady step and rank: the gathers (``BLOCK_GATHERS`` of the blocks, the root once) send ``(n -
    1)`` payloads each, the sum over the unit's parameters of ``S_p + 4 ceil(S_p / 4096)`` bytes rounded to 4
    (``S_p``: a parameter's padded rows of one rank), against ``(n - 1) 4 sum S_p`` unquantized; no gather is full
    precision, and the reductions move what the unquantized run moves."""
    n = group or WORLD
    blocks, root = ranks[0]["gpt"][(False, None)]["shapes"]
    per_block = [p for p in blocks[: len(blocks) // GPT.n_layer]]
    s_block, s_root = _segment(per_block, n), _segment(root, n)
    quantized = (n - 1) * (BLOCK_GATHERS * _quantized(per_block, n) + _quantized(root, n))
    full = (n - 1) * 4 * (BLOCK_GATHERS * s_block + s_root)
    for rank, out in enumerate(ranks):
        plain, qwz = out["gpt"][(False, None)]["bytes"][1:], out["gpt"][(True, group)]["bytes"][1:]
        for step in qwz:
            assert step["all_gather_quantized"] == quantized and "all_gather" not in step, rank
        if group is None:
            for step, reference in zip(qwz, plain):
                assert reference["all_gather"] == full
                assert step["reduce_scatter"] == reference["reduce_scatter"]
        if group is None:  # bf16-mixed: the same payloads (from the 16-bit working copy), half of bf16's bytes
            for step in out["bf16"]["bytes"][1:]:
                assert step["all_gather_quantized"] == quantized and "all_gather" not in step, rank
            assert all(torch.isfinite(torch.tensor(out["bf16"]["losses"])))
        # About a quarter of fp32's bytes: 1/4 + 1/4096 per element, plus each parameter's last scale and rounding.
        assert 0.25 < quantized / full < 0.26


def test_with_activation_checkpointing_and_without_resharding_after_forward(ranks) -> None:
    """Activation checkpointing recomputes each block inside the backward's quantized gather (no gather more, the
    same losses bitwise: the recomputation runs on the weights the forward ran on); ``reshard_after_forward=False``
    keeps the quantized blocks for the backward (no backward gather at all, the forward's bytes only)."""
    blocks, root = ranks[0]["gpt"][(False, None)]["shapes"]
    per_block = blocks[: len(blocks) // GPT.n_layer]
    forward = (WORLD - 1) * (GPT.n_layer * _quantized(per_block, WORLD) + _quantized(root, WORLD))
    for out in ranks:
        default, checkpointing, kept = out["gpt"][(True, None)], out["options"]["checkpointing"], out["options"]["kept"]
        assert checkpointing["losses"] == default["losses"][:4]
        assert checkpointing["bytes"][1:] == default["bytes"][1:4]
        assert kept["losses"][0] == pytest.approx(default["losses"][0], rel=1e-6)
        for step in kept["bytes"][1:]:
            assert step["all_gather_quantized"] == forward and "all_gather" not in step
        assert all(torch.isfinite(torch.tensor(run["losses"])).all() for run in (checkpointing, kept))


def test_cross_node_bytes_count_the_payloads(ranks) -> None:
    """Flat at 2 nodes x 2 on gloo: a gather runs node by node (by_node.py, [Note: hierarchical collectives]),
    each rank sending its own payload across once; so qwZ saves ``4 S - P`` across per gather (each block twice a
    step but the last, the root once). Hybrid: the gathers stay inside the node, as unquantized."""
    blocks, root = ranks[0]["gpt"][(False, None)]["shapes"]
    per_block = blocks[: len(blocks) // GPT.n_layer]
    saved = sum(count * (4 * _segment(shapes, WORLD) - _quantized(shapes, WORLD)) for count, shapes in
                ((BLOCK_GATHERS, per_block), (1, root)))
    for rank, out in enumerate(ranks):
        plain, qwz = out["gpt"][(False, None)]["cross"][1:], out["gpt"][(True, None)]["cross"][1:]
        assert [p - q for p, q in zip(plain, qwz)] == [saved] * len(qwz), rank
        hybrid = out["gpt"][(True, K)]["cross"][1:]
        assert hybrid == [4 * _segment([*blocks, *root], K)] * len(hybrid), rank  # the replica all-reduce only


@pytest.mark.parametrize("group", [None, K], ids=["flat", "2x2"])
def test_losses_track_the_unquantized_run(ranks, group) -> None:
    for out in ranks:
        plain, qwz = out["gpt"][(False, None)]["losses"], out["gpt"][(True, group)]["losses"]
        assert len(plain) == len(qwz) == STEPS
        assert plain[-1] < 0.7 * plain[0]  # it learns
        tail_plain, tail_qwz = sum(plain[-10:]) / 10, sum(qwz[-10:]) / 10
        assert abs(tail_qwz - tail_plain) <= 0.02 * tail_plain
        assert qwz[0] != plain[0]  # the first forward already ran on quantized weights


def test_masters_after_one_step_differ_only_by_the_quantized_forward(ranks) -> None:
    """AdamW's first step moves each weight by at most about ``lr`` (times the warmup) whatever the gradient, so the
    gradients of the quantized forward can move the masters at most twice that far from the unquantized run's;
    the masters hold no quantized values (they differ, finitely, from the unquantized ones)."""
    first_lr = LR / 5  # warmup_steps=5: the first step runs at a fifth of the peak
    for out in ranks:
        plain, qwz = out["gpt"][(False, None)]["first"], out["gpt"][(True, None)]["first"]
        assert torch.isfinite(qwz).all()
        difference = (qwz - plain).abs()
        assert 0 < difference.max() <= 2 * first_lr * 1.001
        assert (difference > 0).float().mean() > 0.001


def _reference_gather(params: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """Each rank's rows of each parameter, padded to the rows of rank 0, quantized and dequantized on their own, then
    reassembled: what a quantized gather must give, with plain loops."""
    gathered = []
    for p in params:
        spec, parts = ShardSpec(p.shape, 0, n), []
        for r in range(n):
            start, end = spec.owned_rows(r)
            chunk = p.reshape(spec.rows, -1)[start:end].reshape(-1)
            padded = torch.nn.functional.pad(chunk, (0, spec.padded_numel - chunk.numel()))
            parts.append(dequantize(quantize(padded, INT8).payload, INT8, padded.numel())[: chunk.numel()])
        gathered.append(torch.cat(parts).reshape(p.shape))
    return gathered


def test_gathered_parameters_give_the_exact_values(ranks) -> None:
    for out in ranks:
        assert out["exact"][True] == ([True] * 3, [True] * 3)
        assert out["exact"][False] == ([False] * 3, [True] * 3)


def test_forward_weights_are_each_segment_quantized_and_dequantized(ranks) -> None:
    for rank, out in enumerate(ranks):
        edges = out["edges"]
        for name in ("odd", "tiny", "zero"):
            initial, seen = edges["initial"][name], edges["seen"][name]
            for got, want in zip(seen, _reference_gather(initial, WORLD)):
                assert torch.equal(got, want), (rank, name)
        odd = edges["seen"]["odd"][0]
        assert not torch.equal(odd, edges["initial"]["odd"][0])  # quantized, within half a step of its block
        assert (odd - edges["initial"]["odd"][0]).abs().max() <= edges["initial"]["odd"][0].abs().max() / 254 * 1.001
        assert all(not p.any() for p in edges["seen"]["zero"])  # all-zero weights gathered exactly zero
        assert [p.shape for p in edges["seen"]["tiny"]] == [torch.Size([]), torch.Size([1])]


def test_a_nan_weight_stops_every_rank_with_one_error(ranks) -> None:
    """Raised at the end of the first step, after its backward and before its update (one host synchronisation a
    step, not one a gather)."""
    for out in ranks:
        assert out["nan"]["error"].startswith(
            "NonFiniteWeightsError: quantize_weights=True: the shards of odd.weight hold an inf or a NaN"
        )
        assert out["nan"]["steps"] == 0


def test_quantize_weights_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ZeroConfigError, match=r"^quantize_weights=True needs stage=3 .* got stage=2$"):
        ZeroStrategy(2, quantize_weights=True)
    # offload composes (tests/distributed/test_zeropp_offload.py)
    assert ZeroStrategy(3, quantize_weights=True, offload_optimizer="cpu", offload_params="cpu").config.stage3.quantize_weights
    with pytest.raises(ZeroConfigError, match=r"^quantize_weights='yes' is invalid: it must be true or false$"):
        ZeroStrategy(3, quantize_weights="yes")


# ---------------------------------------------------------------------------------------------- 300 steps (slow)


def _long(rank: int, world_size: int) -> dict:
    return {(seed, q): _gpt(q, None, steps=300, seed=seed)["losses"] for seed in (3, 4) for q in (False, True)}


@pytest.mark.slow
def test_over_300_steps_within_one_percent_and_the_spread_of_two_seeds() -> None:
    """Issue 28's bar for qwZ: the mean loss of the last 50 of 300 steps within 1% of the unquantized run's and within
    twice the spread of two seeds of it, the seeds 0.092 apart (about 11%: this GPT is small and its loss near 0.85).
    Measured +0.11% (seed 3) and +0.23% (seed 4) when only the forward's gathers were quantized; passes with the
    backward's quantized too. The small GPT's curves (tests/integration/test_zeropp.py) are the issue's figures."""
    losses = run_on_ranks(_long, WORLD, timeout_s=1200)[0]
    tail = {key: sum(values[-50:]) / 50 for key, values in losses.items()}
    spread = abs(tail[(3, False)] - tail[(4, False)])
    for seed in (3, 4):
        difference = abs(tail[(seed, True)] - tail[(seed, False)])
        assert difference <= 0.01 * tail[(seed, False)] and difference <= 2 * spread, seed
