"""ZeroStrategy's evaluation hooks: validation, test and predict steps run on the runtime's parameters (stage 3
gathers each unit as its forward needs it), with the step's begin and end around each, and the runtime told how many
batches each rank's evaluation loop runs (under stage 3, ranks that run different numbers gather the whole model once
for the loop instead of unit by unit: ``outside_step.EvaluationLoops``).

A mixin placed before ``DDPStrategy`` in ``ZeroStrategy``'s bases; it uses the strategy's ``runtime`` and
``lightning_module``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class EvaluationHooks:
    """Evaluation steps through the runtime (see the module docstring)."""

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        self.runtime.begin_step(training=False, fitting=trainer.state.fn == TrainerFn.FITTING)
        try:
            return step(*args, **kwargs)
        finally:
            self.runtime.end_step()

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self.runtime.begin_evaluation(sum(counts), "validation")

    @override
    def on_test_start(self) -> None:
        self.runtime.begin_evaluation(sum(self.lightning_module.trainer.num_test_batches), "test")

    @override
    def on_predict_start(self) -> None:
        self.runtime.begin_evaluation(sum(self.lightning_module.trainer.num_predict_batches), "predict")

    @override
    def on_validation_end(self) -> None:
        self.runtime.end_evaluation()

    @override
    def on_test_end(self) -> None:
        self.runtime.end_evaluation()

    @override
    def on_predict_end(self) -> None:
        self.runtime.end_evaluation()
