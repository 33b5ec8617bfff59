"""A real causal-LM architecture from Hugging Face ``transformers``, built from its config (optional extra ``hf``).

Nothing is ever downloaded: the network is built from ``AutoConfig.for_model(model_type, **config)`` with random
weights, or loaded from a local directory (``pretrained``) with ``local_files_only=True``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

INSTALL_HINT = "pip install 'lightning_zero[hf]'"


@dataclass(frozen=True)
class HFModelConfig:
    """Args:
    model_type: a ``transformers`` model type with a causal-LM head, e.g. ``"llama"``, ``"gpt2"``, ``"qwen2"``.
    config: fields of that model type's config (``vocab_size``, ``hidden_size``, ...); the rest keep their defaults.
    pretrained: a local directory holding a saved model (``save_pretrained``) to fine-tune from; its own config
        is used and ``model_type``/``config`` are ignored. ZeRO stage 3 builds the model on the meta device, where
        only the architecture is built and the checkpoint's weights are never loaded, so stage 3 refuses it at
        setup: fine-tune it with stage 1 or 2.
    """

    model_type: str = "llama"
    config: Mapping[str, Any] = field(default_factory=dict)
    pretrained: str | None = None

    def __post_init__(self) -> None:
        if importlib.util.find_spec("transformers") is None:
            raise ModuleNotFoundError(
                f"model_type={self.model_type!r} needs the optional dependency transformers: {INSTALL_HINT}"
            )

    def build(self) -> HFCausalLM:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.pretrained is None:
            return HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.for_model(self.model_type, **self.config)))
        if torch.get_default_device().type == "meta":  # counting parameters: the architecture is enough
            config = AutoConfig.from_pretrained(self.pretrained, local_files_only=True)
            return HFCausalLM(AutoModelForCausalLM.from_config(config))
        return HFCausalLM(AutoModelForCausalLM.from_pretrained(self.pretrained, local_files_only=True))


class HFCausalLM(nn.Module):
    """Adapts a ``transformers`` causal LM to the ``token ids -> logits`` interface of ``LanguageModel``."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits
