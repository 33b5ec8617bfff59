"""lightning_zero: ZeRO data parallelism as a PyTorch Lightning Strategy.

Importing the package registers the strategy names ``"zero1"``, ``"zero2"`` and ``"zero3"`` (plus ``_fork``,
``_spawn`` and ``_notebook`` variants) with Lightning's ``Trainer``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.config import ZeroConfig, ZeroConfigError
from lightning_zero.memory import ModelStateBytes, model_state_bytes
from lightning_zero.sharding.collectives import CommStats
from lightning_zero.sharding.in_flight import NonFiniteWeightsError
from lightning_zero.sharding.joined_reads import OneRankReadError
from lightning_zero.sharding.runtime import NonFiniteGradientsError
from lightning_zero.sharding.sharded_grad import ShardedGradientError
from lightning_zero.strategy import ZeroStrategy
from lightning_zero.watchdog import PeerFailure

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "CommStats",
    "ModelStateBytes",
    "NonFiniteGradientsError",
    "NonFiniteWeightsError",
    "OneRankReadError",
    "PeerFailure",
    "ShardedGradientError",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroStrategy",
    "model_state_bytes",
]
__version__ = "0.1.0"
