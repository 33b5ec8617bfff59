"""Models that know nothing of parallelism, and the LightningModule that trains them."""

from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.models.language_model import LanguageModel, ParameterCounts

__all__ = ["GPT", "GPTConfig", "LanguageModel", "ParameterCounts"]
