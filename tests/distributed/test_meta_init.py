"""Stage 3 meta-device init (see [Note: initial values of a model built on the meta device]): torch.nn layers start
equal to an eager build and train as under DDP; a Hugging Face Llama starts well-distributed and trains as DDP from
the same weights; a tensor nothing initializes is one clear error, with the model left on the meta device."""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.sharding.materialize import materialize_shards, rng_state
from tests.harness import run_on_ranks
from tests.models import CLASSES, SEQ, VOCAB, Recorder, make_trainer, token_dataset

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6
D = 16
CPU = torch.device("cpu")


class ScaledRows(nn.Module):
    """A weight and a buffer both computed in ``reset_parameters()``: what meta init can rebuild."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.register_buffer("scale", torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=1.0, std=0.1)
        self.scale.copy_(torch.arange(len(self.scale), dtype=self.scale.dtype) / len(self.scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * (1 + self.scale)


class TorchLayers(pl.LightningModule):
    """torch.nn's layers built in ``configure_model``: an embedding with a padding row tied to a head that another
    layer follows, a convolution, batch norm, a transformer encoder layer, multi-head attention, RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.ModuleDict | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = nn.ModuleDict(
            {
                "embed": nn.Embedding(VOCAB, D, padding_idx=0),
                "conv": nn.Conv1d(D, D, 3, padding=1),
                "bn": nn.BatchNorm1d(D),
                "encoder": nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True),
                "attn": nn.MultiheadAttention(D, 2, batch_first=True),
                "scaled": ScaledRows(D),
                "norm": nn.RMSNorm(D),
                "head": nn.Linear(D, VOCAB, bias=False),
                "classify": nn.Linear(D, CLASSES),
            }
        )
        self.net["head"].weight = self.net["embed"].weight

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        net = self.net
        x = net["embed"](tokens)
        x = net["bn"](net["conv"](x.transpose(1, 2))).transpose(1, 2)
        x = net["encoder"](x)
        x = x + net["attn"](x, x, x, need_weights=False)[0]
        x = net["norm"](net["scaled"](x))
        next_token = nn.functional.cross_entropy(net["head"](x[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        return next_token + nn.functional.cross_entropy(net["classify"](x.mean(dim=1)), targets)

    def configure_optimizers(self):
        # Not Adam: the convolution's bias before batch norm, and attention's key bias, get gradients that are exactly
        # zero up to float noise, which Adam would scale to lr-sized steps that depend on summation order.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(token_dataset(64), batch_size=4)


class InitialState(pl.Callback):
    """Every parameter and buffer, whole, as ``fit`` starts."""

    def on_fit_start(self, trainer, pl_module):
        with getattr(trainer.strategy, "gathered_parameters", nullcontext)():
            self.params = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
            self.buffers = {k: v.clone() for k, v in pl_module.named_buffers()}


def _fit(strategy, model: pl.LightningModule, world_size: int) -> dict:
    pl.seed_everything(7, verbose=False)
    recorder, initial = Recorder(), InitialState()
    make_trainer(strategy, world_size, max_steps=STEPS, callbacks=[recorder, initial]).fit(model)
    return {
        "initial": initial.params | initial.buffers,
        "initial_params": initial.params,
        "losses": recorder.losses,
        "params": recorder.params,
    }


# ------------------------------------------------------------------------------------------ torch.nn, two ranks


def _torch_layers(rank: int, world_size: int) -> dict:
    return {
        "ddp": _fit(DDPStrategy(), TorchLayers(), world_size),
        "zero3": _fit(ZeroStrategy(3), TorchLayers(), world_size),
    }


@lru_cache(maxsize=None)
def torch_layer_results() -> list[dict]:
    return run_on_ranks(_torch_layers, 2)


def test_torch_layers_start_equal_to_the_eager_build() -> None:
    for per_rank in torch_layer_results():
        ddp, zero3 = per_rank["ddp"]["initial"], per_rank["zero3"]["initial"]
        assert ddp.keys() == zero3.keys()
        for name, want in ddp.items():
            assert torch.equal(zero3[name], want), name
        assert torch.equal(zero3["net.scaled.scale"], torch.arange(D) / D)
        assert not zero3["net.embed.weight"][0].any()  # the padding row


def test_torch_layers_train_as_under_ddp() -> None:
    for per_rank in torch_layer_results():
        ddp, zero3 = per_rank["ddp"], per_rank["zero3"]
        torch.testing.assert_close(torch.tensor(zero3["losses"]), torch.tensor(ddp["losses"]), rtol=RTOL, atol=ATOL)
        assert len(zero3["params"]) == len(ddp["params"]) == STEPS
        for step, (got, want) in enumerate(zip(zero3["params"], ddp["params"])):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}")


# ------------------------------------------------------------------------------- errors, two ranks and in-process


class ScaleFromInit(nn.Module):
    """A buffer computed in ``__init__`` only: on the meta device it is lost, and nothing can compute it again."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0) / 4)

    def reset_parameters(self) -> None:
        self.linear.reset_parameters()


class BareParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class Builds(pl.LightningModule):
    def __init__(self, build) -> None:
        super().__init__()
        self.build = build
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self.build()

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


def _error_of(build, world_size: int) -> tuple[str, str, set[str]]:
    model = Builds(build)
    try:
        make_trainer(ZeroStrategy(3), world_size, max_steps=1).fit(model)
    except Exception as error:
        return type(error).__name__, str(error), {t.device.type for t in [*model.parameters(), *model.buffers()]}
    return "no error", "", set()


def _errors(rank: int, world_size: int) -> dict:
    return {
        "buffer": _error_of(lambda: nn.Sequential(nn.Linear(4, 4), ScaleFromInit()), world_size),
        "bare": _error_of(lambda: nn.Sequential(nn.Linear(4, 4), BareParameter(), BareParameter()), world_size),
    }


def test_a_lost_buffer_is_one_clear_error_at_setup() -> None:
    for per_rank in run_on_ranks(_errors, 2):
        kind, message, devices = per_rank["buffer"]
        assert kind == "RuntimeError"
        assert "'net.1' (ScaleFromInit)" in message and "buffer 'scale'" in message
        assert "reset_parameters()" in message and "instead of configure_model()" in message
        assert devices == {"meta"}  # put back as it was: nothing half-materialized
        kind, message, devices = per_rank["bare"]
        assert kind == "RuntimeError"
        assert "'net.1' (BareParameter) owns ['weight']; 'net.2' (BareParameter) owns ['weight']" in message
        assert devices == {"meta"}


def _materialize(build, world_size: int = 1):
    torch.manual_seed(3)
    state = rng_state(CPU)
    with torch.device("meta"):
        module = build()
    return module, materialize_shards(module, CPU, state, 0, world_size)


def test_every_dtype_of_unwritten_buffer_is_caught() -> None:
    class Masks(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(3, 3).tril().to(dtype))

        def reset_parameters(self) -> None:
            pass

    for dtype in (torch.bool, torch.int64, torch.uint8, torch.bfloat16, torch.complex64):
        with pytest.raises(RuntimeError, match=r"'\(the root\)' \(Masks\).*buffer 'mask'"):
            _materialize(lambda dtype=dtype: Masks(dtype))


def test_a_failing_initializer_is_named() -> None:
    class Fails(nn.Linear):
        def reset_parameters(self) -> None:
            if not self.weight.is_meta:  # at materialization, not at construction
                raise ValueError("no")

    with pytest.raises(RuntimeError, match=r"'1' \(Fails\).*Fails.reset_parameters\(\) failed \(ValueError: no\)"):
        _materialize(lambda: nn.Sequential(nn.Linear(2, 2), Fails(2, 2)))


class V4StyleRotary(nn.Module):
    """The shape of a transformers 4.x rotary embedding: ``inv_freq`` from ``rope_init_fn`` in ``__init__``, and
    ``original_inv_freq`` a plain attribute aliasing it."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.config = {"dim": dim, "base": 10000.0}
        self.rope_init_fn = self._default_rope
        inv_freq, self.attention_scaling = self.rope_init_fn(self.config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    @staticmethod
    def _default_rope(config: dict, device) -> tuple[torch.Tensor, float]:
        dim = config["dim"]
        return 1.0 / (config["base"] ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)), 1.0


def test_a_rotary_embedding_recomputes_its_frequencies() -> None:
    module, _ = _materialize(V4StyleRotary)
    assert torch.equal(module.inv_freq, V4StyleRotary().inv_freq)
    assert module.original_inv_freq is module.inv_freq


def test_a_tied_weight_advances_the_stream_as_eagerly() -> None:
    def build() -> nn.ModuleDict:
        layers = nn.ModuleDict({"embed": nn.Embedding(5, 4), "head": nn.Linear(4, 5, bias=False), "last": nn.Linear(4, 3)})
        layers["head"].weight = layers["embed"].weight
        return layers

    module, rows = _materialize(build)
    torch.manual_seed(3)
    eager = build()
    assert torch.equal(rows[module["last"].weight][1], eager["last"].weight)
    assert torch.equal(rows[module["embed"].weight][1], eager["embed"].weight)


# ------------------------------------------------------------------------------- Hugging Face Llama, two ranks

LLAMA = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
}


def _llama_lm(initial: dict | None = None) -> pl.LightningModule:
    from lightning_zero.models import LanguageModel
    from lightning_zero.models.hf import HFModelConfig

    class LlamaLM(LanguageModel):
        """As conf/model/hf_llama.yaml: embeddings frozen; DDP's copy starts from ``initial``."""

        def configure_model(self) -> None:
            fresh = self.model is None
            super().configure_model()
            if fresh and initial is not None:
                self.model.load_state_dict(initial)

        def train_dataloader(self):
            tokens = torch.randint(0, LLAMA["vocab_size"], (32, SEQ + 1), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)

    return LlamaLM(HFModelConfig("llama", LLAMA), lr=3e-3, warmup_steps=1, frozen=("hf.model.embed_tokens",))


def _llama(rank: int, world_size: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    zero3 = _fit(ZeroStrategy(3), _llama_lm(), world_size)
    weights = {k.removeprefix("model."): v for k, v in zero3["initial_params"].items()}
    ddp = _fit(DDPStrategy(), _llama_lm(weights), world_size)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA))
    return {"zero3": zero3, "ddp": ddp, "eager_buffers": dict(eager.named_buffers())}


@lru_cache(maxsize=None)
def llama_results() -> list[dict]:
    pytest.importorskip("transformers")
    return run_on_ranks(_llama, 2)


def test_hugging_face_llama_starts_well_distributed() -> None:
    for per_rank in llama_results():
        initial, std = per_rank["zero3"]["initial"], 0.02  # LlamaConfig.initializer_range
        linears = [k for k in initial if k.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight"))]
        assert len(linears) == 2 + 7 * LLAMA["num_hidden_layers"]
        for name in linears:
            assert torch.isfinite(initial[name]).all()
            assert math.isclose(initial[name].std().item(), std, rel_tol=0.1), name
        norms = [k for k in initial if k.endswith("norm.weight")]
        assert len(norms) == 1 + 2 * LLAMA["num_hidden_layers"]
        assert all(torch.equal(initial[k], torch.ones(LLAMA["hidden_size"])) for k in norms)


def test_hugging_face_llama_rotary_buffers_equal_the_eager_build() -> None:
    for per_rank in llama_results():
        initial, eager = per_rank["zero3"]["initial"], per_rank["eager_buffers"]
        assert set(eager) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
        for name, want in eager.items():
            assert torch.equal(initial[f"model.hf.{name}"], want), name


def test_hugging_face_llama_trains_as_ddp_from_the_same_weights() -> None:
    for per_rank in llama_results():
        ddp, zero3 = per_rank["ddp"], per_rank["zero3"]
        for name, want in zero3["initial"].items():
            assert torch.equal(ddp["initial"][name], want), name
        torch.testing.assert_close(torch.tensor(zero3["losses"]), torch.tensor(ddp["losses"]), rtol=RTOL, atol=ATOL)
        for step, (got, want) in enumerate(zip(zero3["params"], ddp["params"])):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}")
        assert not torch.equal(zero3["params"][0], zero3["params"][-1])


def test_a_hugging_face_checkpoint_is_not_silently_replaced_by_random_weights(tmp_path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_zero.models.hf import HFModelConfig

    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA)).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = HFModelConfig(pretrained=str(tmp_path)).build()
    with pytest.raises(RuntimeError, match=rf"'hf' \(LlamaForCausalLM\).*checkpoint '{tmp_path}'.*stage 1 or 2"):
        materialize_shards(model, CPU, None, 0, 1)
    assert {p.device.type for p in model.parameters()} == {"meta"}
