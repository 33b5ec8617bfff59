"""The GPT, the LanguageModel around it and the standard-library corpus, without processes or a Trainer."""

import math

import pytest
import torch

from lightning_zero.data import StdlibCorpus, TokenWindows
from lightning_zero.data.corpus import load_corpus, source_files, stdlib_root
from lightning_zero.models import GPT, GPTConfig, LanguageModel
from lightning_zero.models.language_model import warmup_cosine

SMALL = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_formula_matches_the_built_model(tie):
    config = GPTConfig(n_layer=3, n_head=4, d_model=48, seq_len=40, tie_embeddings=tie)
    model = config.build()
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters
    # d=48, 3 blocks of 12d²+13d, V=256, T=40, final LayerNorm 2d, untied head V·d.
    head = 0 if tie else 256 * 48
    assert config.num_parameters == 256 * 48 + 40 * 48 + 3 * (12 * 48 * 48 + 13 * 48) + 2 * 48 + head


def test_tied_embeddings_share_one_parameter():
    model = SMALL.build()
    assert model.lm_head.weight is model.wte.weight


def test_forward_gives_next_token_logits_and_is_causal():
    torch.manual_seed(0)
    model = SMALL.build().eval()
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % 256
    assert torch.equal(model(changed)[:, :-1], logits[:, :-1])  # earlier positions never see later tokens


def test_build_on_meta_then_reset_parameters_equals_eager_build():
    """See [Note: initialization in reset_parameters]: what a stage-3 strategy relies on to initialize shards."""
    config = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, tie_embeddings=False)
    torch.manual_seed(0)
    eager = GPT(config)
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = GPT(config)
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for module in lazy.modules():
            if hasattr(module, "reset_parameters") and list(module.parameters(recurse=False)):
                module.reset_parameters()
    for (name, expected), actual in zip(eager.named_parameters(), lazy.parameters()):
        assert torch.equal(expected, actual), name
    assert eager.blocks[0].attn.proj.std == pytest.approx(0.02 / math.sqrt(4))


def test_language_model_builds_once_and_counts_unsharded_parameters():
    lm = LanguageModel(SMALL, frozen=("wpe",))
    assert lm.model is None
    lm.configure_model()
    built = lm.model
    lm.configure_model()
    assert lm.model is built
    assert lm.num_parameters == SMALL.num_parameters
    assert lm.num_trainable_parameters == SMALL.num_parameters - 16 * 32
    assert not built.wpe.weight.requires_grad
    assert lm.parameter_counts().total == SMALL.num_parameters


def test_frozen_prefix_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match="frozen='wtx' matches no parameter: parameter names start with blocks, ln_f"):
        LanguageModel(SMALL, frozen=("wtx",)).parameter_counts()


@pytest.mark.parametrize(
    ("step", "multiplier"),
    [(0, 0.1), (9, 1.0), (10, 1.0), (55, 0.1 + 0.9 * 0.5), (100, 0.1), (150, 0.1)],
)
def test_warmup_then_cosine_decay(step, multiplier):
    assert warmup_cosine(step, warmup_steps=10, total_steps=100, min_ratio=0.1) == pytest.approx(multiplier)


def test_gpt_config_names_the_bad_field():
    with pytest.raises(ValueError, match="n_head=3 is invalid for d_model=32"):
        GPTConfig(n_head=3, d_model=32)
    with pytest.raises(ValueError, match="n_layer=0 is invalid"):
        GPTConfig(n_layer=0)


# ---------------------------------------------------------------------------------------------------------- data


def test_windows_pair_inputs_with_next_tokens():
    windows = TokenWindows(torch.arange(10, dtype=torch.uint8), seq_len=4)
    assert len(windows) == 2  # (10 - 1) // 4
    inputs, targets = windows[1]
    assert inputs.tolist() == [4, 5, 6, 7] and targets.tolist() == [5, 6, 7, 8]
    assert inputs.dtype == torch.long


def test_corpus_is_the_standard_library_in_a_stable_order(tmp_path):
    files = source_files(stdlib_root())
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert load_corpus(stdlib_root(), 5000) == load_corpus(stdlib_root(), 5000)
    assert len(load_corpus(stdlib_root(), 5000)) == 5000


def test_split_is_deterministic_and_disjoint():
    first, second = StdlibCorpus(seq_len=32, max_bytes=50_000), StdlibCorpus(seq_len=32, max_bytes=50_000)
    first.setup("fit")
    second.setup("fit")
    assert torch.equal(first.train_set.tokens, second.train_set.tokens)
    assert len(first.train_set.tokens) + len(first.val_set.tokens) == 50_000
    assert len(first.val_set.tokens) == 50_000 - int(50_000 * 0.95)
    batch_inputs, batch_targets = next(iter(first.val_dataloader()))
    assert batch_inputs.shape == (16, 32) and batch_targets.shape == (16, 32)


def test_corpus_reads_any_tree_of_python_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_bytes(b"x = 1\n" * 200)
    corpus = StdlibCorpus(seq_len=8, batch_size=2, max_bytes=10_000, val_fraction=0.5, root=str(tmp_path))
    corpus.setup()
    assert len(corpus.train_set.tokens) + len(corpus.val_set.tokens) == 1202  # 1200 bytes + the blank-line joint


def test_corpus_too_small_for_a_window_is_refused():
    with pytest.raises(ValueError, match="max_bytes=100 is too small for seq_len=128 and val_fraction=0.05"):
        StdlibCorpus(max_bytes=100)
