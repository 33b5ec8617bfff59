"""The test model's strategy, and a model that fails on purpose: one rank, at one step, at one point of it (forward,
backward, optimizer step, checkpoint save), by SIGKILL, SIGSTOP or an exception."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import lightning_zero.checkpoint.sharded as sharded
from lightning_zero import ZeroStrategy
from tests.models import StepSeededLM

POINTS = ("forward", "backward", "step", "save")


class WatchedZero(ZeroStrategy):
    """ZeroStrategy (its watchdog on, as by default) with the test model's blocks as stage-3 units, and the
    watchdog's timings as options."""

    def __init__(self, stage: int, **options) -> None:
        if stage == 3:
            options.setdefault("units", ("Block",))
        super().__init__(stage, **options)


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` fails at ``point`` of global step ``step`` (for "save": the ``step``-th save of the run, from 1)
    by ``action``: "kill" (SIGKILL), "stop" (SIGSTOP: a node that vanished) or "raise"."""

    rank: int
    step: int
    point: str
    action: str = "kill"

    def __post_init__(self) -> None:
        assert self.point in POINTS and self.action in ("kill", "stop", "raise"), self

    def strike(self, marker: Path | None) -> None:
        """Fail now. ``marker`` receives the monotonic time of the failure (shared by every process of the host)."""
        if marker is not None:
            marker.write_text(repr(time.monotonic()))
        if self.action == "raise":
            raise InjectedFailure(f"injected failure on rank {self.rank} at the {self.point} of step {self.step}")
        os.kill(os.getpid(), signal.SIGKILL if self.action == "kill" else signal.SIGSTOP)


class InjectedFailure(RuntimeError):
    pass


class FaultyLM(StepSeededLM):
    """StepSeededLM that applies ``fault`` (if any, on its rank); the loss of every step is recorded in ``losses``."""

    def __init__(self, fault: Fault | None = None, marker: Path | None = None) -> None:
        super().__init__()
        self.fault, self.marker = fault, marker
        self.losses: list[float] = []
        self._saves = 0

    def _due(self, point: str) -> bool:
        fault = self.fault
        return fault is not None and fault.point == point and fault.rank == self.global_rank and (
            self._saves if point == "save" else self.global_step) == fault.step

    def configure_model(self) -> None:
        super().configure_model()
        self.lm["blocks"][0].register_forward_hook(self._hook_backward)  # fires between the two blocks' backward

    def _hook_backward(self, module, args, output):
        if output.requires_grad and self._due("backward"):
            output.register_hook(lambda grad: self.fault.strike(self.marker))

    def training_step(self, batch, batch_idx):
        if self._due("forward"):
            self.fault.strike(self.marker)
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        optimizer = FaultyAdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        optimizer.module = self
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint) -> None:
        self._saves += 1
        if self._due("save"):
            fault, marker, write = self.fault, self.marker, sharded.write_rows

            def write_and_die(fd, offset, rows):  # dies while this rank writes its rows into the checkpoint file
                sharded.write_rows = write
                fault.strike(marker)
                return write(fd, offset, rows)

            sharded.write_rows = write_and_die


class FaultyAdamW(torch.optim.AdamW):
    """StepSeededLM's AdamW, failing inside ``step`` when its module's fault is due."""

    module: FaultyLM | None = None

    def step(self, closure=None):
        if self.module is not None and self.module._due("step"):
            self.module.fault.strike(self.module.marker)
        return super().step(closure)
