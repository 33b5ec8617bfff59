"""Run as a script in a fresh process on a CUDA machine (tests/gpu/test_cuda.py): builds a zero3 model under
``Trainer.init_module()`` in this process, has Lightning fork its rank (``start_method="fork"``, which Lightning
refuses once this process has initialized CUDA), trains two steps there, and prints as JSON whether this process had
initialized CUDA before and after ``fit`` and whether the parameters the rank materialized equal an eager build's on
the GPU from the same seed (sharding/materialize.py, [Note: the CUDA generator of a process without CUDA])."""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_zero import ZeroStrategy  # noqa: E402
from tests.models import StepSeededLM, flat_params  # noqa: E402

DEVICE = "cuda"


class SaveMaterialized(pl.Callback):
    """Rank 0 saves the parameters setup materialized, before any step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with trainer.strategy.gathered_parameters():
            if trainer.global_rank == 0:
                torch.save(flat_params(pl_module).cpu(), self.path)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    pl.seed_everything(11, verbose=False)
    strategy = ZeroStrategy(stage=3, units=("Block",), start_method="fork", shortcut_single_rank=False)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=DEVICE, devices=1, max_steps=2, callbacks=[SaveMaterialized(out / "init.pt")],
        default_root_dir=str(out), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module():
        model = StepSeededLM()
        model.configure_model()
    before = torch.cuda.is_initialized()
    trainer.fit(model)
    after = torch.cuda.is_initialized()
    pl.seed_everything(11, verbose=False)
    with torch.device(DEVICE):
        eager = StepSeededLM()
        eager.configure_model()
    materialized = torch.load(out / "init.pt")
    print(json.dumps({
        "cuda_initialized_before_fit": before,
        "cuda_initialized_after_fit": after,
        "materialized_equals_eager": torch.equal(materialized, flat_params(eager).cpu()),
    }))
