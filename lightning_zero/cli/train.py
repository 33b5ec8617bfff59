"""``lightning-zero train``: a Hydra app over the config tree (see config_tree.py for where the tree is).

[Note: how `train` turns a config into a run]
Bad input must fail with one line naming the field and the allowed values, before any process is launched, so
``train`` first composes the config and builds every object with Hydra's compose API (``_check``, through
compose.py, which translates Hydra's and the library's errors); only then does it run the Hydra app, which creates
the output directory and builds the job again for real.

[Note: how ranks are launched]
Through Lightning's own launcher, chosen by ``strategy.start_method``:

* ``popen`` (the default, and the only choice on CUDA): this process is rank 0 and Lightning re-runs the same command
  for ranks 1..N-1 with ``hydra.run.dir`` pointing at this run's directory (its Hydra support in
  ``_SubprocessScriptLauncher``), so every rank shares one output directory. ``train`` makes ``sys.argv`` the
  ``lightning-zero train ...`` command line while the job runs, so the re-run command is this one.
* ``fork`` (CPU only): the ranks are forked from this process, which costs a fraction of a second instead of a fresh
  interpreter per rank; the monitor's summary comes back through a file (see monitor.py).

``strategy=auto`` chooses in the launching process, and re-run ranks take its choice (see auto.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zero import auto
from lightning_zero.cli.compose import compose, instantiate, prefixed
from lightning_zero.cli.config_tree import find_config_tree, register_configs
from lightning_zero.cli.errors import EXIT_USAGE, UsageError, first_line
from lightning_zero.cli.preflight import check_before_launch
from lightning_zero.config import PRECISIONS

#: Lightning's short spellings of the supported precision flags (``trainer.precision=bf16``).
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


@dataclass(frozen=True)
class Job:
    """Everything a ``train`` run needs, built from the config."""

    strategy: Any
    strategy_name: str
    #: strategy=auto: the option chosen and why; None for any other strategy.
    auto_choice: auto.AutoChoice | None
    model: Any
    data: Any
    make_trainer: Callable[..., Any]
    monitor: Any
    precision: str


def add_train(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "train",
        add_help=False,  # `train --help` is Hydra's help, which lists the config groups and their options
        help="train a model (a Hydra app: `lightning-zero train --help` lists the config groups)",
        description="Hydra overrides, e.g. strategy=zero2 trainer.devices=2 trainer.max_steps=5 or recipe=NAME",
    )
    parser.add_argument("hydra_args", nargs=argparse.REMAINDER, help="Hydra overrides and flags")


def train(hydra_args: Sequence[str]) -> int:
    """Check the overrides, then run the Hydra app (see [Note: how `train` turns a config into a run])."""
    import hydra

    # Hydra has no public parser for its own command line; this is the one `hydra.main` parses it with, so the
    # flags read here are always the ones the app below will act on.
    from hydra._internal.utils import get_args_parser

    overrides = _overrides_to_check(get_args_parser().parse_args(list(hydra_args)))
    if overrides is not None:
        _check(overrides)
    register_configs()
    program = sys.argv[0]
    rerun_argv = [program, "train", *hydra_args]

    @hydra.main(version_base="1.3", config_path=str(find_config_tree().conf), config_name="config")
    def app(cfg: Any) -> None:
        with _sys_argv(rerun_argv):
            _run(cfg)

    with _sys_argv([program, *hydra_args]):
        try:
            app()
        except SystemExit as exit_:  # Hydra exits after --help and after errors it reports itself; so do we
            return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        finally:
            _forget_hydra_run()
    return 0


def _forget_hydra_run() -> None:
    """Leave no Hydra run behind: Lightning would take a later fit in this process for a Hydra job."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()


def _overrides_to_check(parsed: argparse.Namespace) -> list[str] | None:
    """The overrides of the one job Hydra will run from our config, or ``None`` when it runs none or other ones.

    Help, ``--cfg``, another primary config and sweeps (``--multirun``) are left to Hydra. Hydra's own overrides are
    dropped except the search path, which ``--config-dir`` extends (recipes kept outside the package).
    """
    if parsed.help or parsed.hydra_help or parsed.info or parsed.shell_completion or parsed.cfg or parsed.multirun:
        return None
    if parsed.config_name or parsed.config_path:
        return None
    overrides = [o for o in parsed.overrides if not o.lstrip("+~").startswith("hydra.")]
    search_path = [o for o in parsed.overrides if o.startswith("hydra.searchpath=")]
    if parsed.config_dir and not search_path:
        search_path = [f"hydra.searchpath=[file://{Path(parsed.config_dir).resolve()}]"]
    return overrides + search_path


def _check(overrides: list[str]) -> Job:
    """Compose the config and build every object once, the Trainer too, so that bad input fails here with one line,
    before Hydra makes the run directory."""
    import logging

    job = _build_job(compose(overrides))
    quiet = logging.getLogger("lightning.pytorch")  # the Trainer announces its devices; the real one will again
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        _make_trainer(job, Path("lightning_zero_check"))  # only named: a Trainer makes no directory until it runs
    finally:
        quiet.setLevel(level)
    return job


def _run(cfg: Any) -> None:
    import lightning.pytorch as pl
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    try:
        if hydra_config.mode == RunMode.MULTIRUN and cfg.strategy.get("start_method", "popen") == "popen":
            raise UsageError(
                "--multirun runs its jobs in this process, which ranks started with start_method=popen cannot join: "
                "set strategy.start_method=fork (CPU), or run one command per job"
            )
        job = _build_job(cfg)
        trainer = _make_trainer(job, run_dir)
    except UsageError as err:
        print(f"lightning-zero train: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if job.auto_choice is not None and job.auto_choice.reason is not None:
        print(f"strategy=auto chose {job.auto_choice.reason}", file=sys.stderr)
    started = time.perf_counter()
    with auto.shared_with_ranks(job.auto_choice), warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # meant for developers, as Python's default
        warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")  # Lightning's, about torch's pytree
        trainer.fit(job.model, datamodule=job.data)
    elapsed = time.perf_counter() - started
    if trainer.is_global_zero:
        print(_run_report(job, trainer, run_dir, elapsed), flush=True)


def _make_trainer(job: Job, run_dir: Path) -> Any:
    if job.monitor.summary_file is None:
        job.monitor.summary_file = run_dir / "zero_monitor.json"
    kwargs: dict[str, Any] = {"strategy": job.strategy, "callbacks": [job.monitor]}
    if job.make_trainer.keywords.get("default_root_dir") is None:
        kwargs["default_root_dir"] = str(run_dir)
    try:
        return job.make_trainer(**kwargs)
    except Exception as err:  # the Trainer validates its arguments, with Lightning's own messages
        raise UsageError(f"trainer: {first_line(err)}") from None


def _build_job(cfg: Any) -> Job:
    from lightning_zero.monitor import option_of

    precision = _check_precision(cfg.trainer.get("precision", "32-true"))
    model = instantiate("model", cfg.model)
    counts = _parameter_counts(model)
    strategy = instantiate("strategy", cfg.strategy)
    choice = None
    if isinstance(strategy, auto.AutoStrategy):
        step = auto.measured_step(strategy, model, int(cfg.data.batch_size), int(cfg.seq_len),
                                  str(cfg.trainer.get("accelerator", "auto")))
        choice = _choose(strategy, counts, cfg.trainer, precision, step)
        strategy = auto.build(choice.option, strategy, choice.settings)
    check_before_launch(cfg, strategy, model)
    return Job(
        strategy=strategy,
        strategy_name=option_of(strategy) or type(strategy).__name__,
        auto_choice=choice,
        model=model,
        data=instantiate("data", cfg.data),
        make_trainer=instantiate("trainer", cfg.trainer),
        monitor=instantiate("monitor", cfg.monitor),
        precision=precision,
    )


def _choose(
    strategy: auto.AutoStrategy, counts: Any, trainer_cfg: Any, precision: str, step: Any = None
) -> auto.AutoChoice:
    from omegaconf import OmegaConf

    trainer = OmegaConf.to_container(trainer_cfg, resolve=True)
    try:
        return auto.choose(
            strategy,
            counts,
            precision,
            accelerator=str(trainer.get("accelerator", "auto")),
            devices=trainer.get("devices", "auto"),
            num_nodes=trainer.get("num_nodes", 1),
            step=step,
        )
    except auto.AutoStrategyError as err:
        raise UsageError(str(err)) from None


def _parameter_counts(model: Any) -> Any:
    """The model's unsharded parameter counts (a ``LanguageModel`` builds its network on the meta device for them,
    which also checks its config, e.g. ``frozen``, before any launch); ``None`` for a LightningModule of one's own."""
    if not hasattr(model, "parameter_counts"):
        return None
    try:
        return model.parameter_counts()
    except ValueError as err:
        raise UsageError(prefixed("model", first_line(err))) from None


def _check_precision(value: Any) -> str:
    """The precision flag, if ZeroStrategy supports it (``config.PRECISIONS``), in Lightning's long spelling."""
    precision = _PRECISION_ALIASES.get(str(value), str(value))
    if precision not in PRECISIONS:
        raise UsageError(f"trainer.precision={value!r} is invalid: allowed values are {', '.join(PRECISIONS)}")
    return precision


def _run_report(job: Job, trainer: Any, run_dir: Path, elapsed: float) -> str:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    figures = "  ".join(f"{k} {metrics[k]:.4f}" for k in ("train_loss", "val_loss", "val_ppl") if k in metrics)
    devices = f"{trainer.num_devices * trainer.num_nodes} x {trainer.strategy.root_device.type}"
    return "\n".join(
        [
            "",
            f"Run report: {job.strategy_name} on {devices}, precision {job.precision}, fit took {elapsed:.1f} s",
            f"  {figures}" if figures else "  no metrics were logged",
            f"  output directory: {run_dir}",
            job.monitor.report(),
        ]
    )


@contextmanager
def _sys_argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved
