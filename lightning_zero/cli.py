"""The ``lightning-zero`` command: ``train`` (a Hydra app over ``conf/``), ``estimate`` (the memory model) and
``consolidate`` (a sharded checkpoint to one file).

Each subcommand is one ``_add_<name>`` function in ``_SUBCOMMANDS`` that declares its parser and the function that
runs it; a new subcommand is one more such function.

[Note: how `train` turns a config into a run]
The config tree ships inside the package (``lightning_zero/conf``; the repository's top-level ``conf`` and
``recipes`` are links to it), so an installed ``lightning-zero`` finds it. Every node with a ``_target_`` is built
with ``hydra.utils.instantiate(..., _convert_="all")``: the library only ever receives its own classes, dataclasses
and plain containers, never a ``DictConfig``. Bad input must fail with one line naming the field and the allowed
values, before any process is launched, so ``train`` first composes the config and builds every object with Hydra's
compose API (``_check``), translating Hydra's and the library's errors; only then does it run the Hydra app, which
creates the output directory and builds the job again for real.

[Note: how ranks are launched]
Through Lightning's own launcher, chosen by ``strategy.start_method``:

* ``popen`` (the default, and the only choice on CUDA): this process is rank 0 and Lightning re-runs the same command
  for ranks 1..N-1 with ``hydra.run.dir`` pointing at this run's directory (its Hydra support in
  ``_SubprocessScriptLauncher``), so every rank shares one output directory. ``train`` makes ``sys.argv`` the
  ``lightning-zero train ...`` command line while the job runs, so the re-run command is this one.
* ``fork`` (CPU only): the ranks are forked from this process, which costs a fraction of a second instead of a fresh
  interpreter per rank; the monitor's summary comes back through a file (see monitor.py).

``strategy=auto`` picks its option in the launching process; re-run ranks read the choice from the environment
(``LIGHTNING_ZERO_AUTO_STRATEGY``) rather than measuring free memory again and possibly choosing differently.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).parent / "conf"
_AUTO_ENV = "LIGHTNING_ZERO_AUTO_STRATEGY"
_EXIT_USAGE = 2
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


class UsageError(Exception):
    """Bad input from the command line: the message is one line naming the field and the allowed values."""


@dataclass(frozen=True)
class AutoStrategy:
    """``strategy=auto``: the least complex option whose model states fit each device (``estimate.recommend``).

    Args:
        budget_gb: per-device budget in GiB when running on CPU. On CUDA the free memory of the run's devices is used.
        reserve_gb: GiB kept for activations and workspace, subtracted from the budget on CPU and CUDA alike.
        bucket_mb, start_method: passed to the chosen strategy.
    """

    budget_gb: float = 4.0
    reserve_gb: float = 0.0
    bucket_mb: float = 25.0
    start_method: str = "popen"

    def __post_init__(self) -> None:
        if not self.budget_gb > 0:
            raise ValueError(f"budget_gb={self.budget_gb!r} is invalid: it must be a number of GiB > 0")
        if not self.reserve_gb >= 0:
            raise ValueError(f"reserve_gb={self.reserve_gb!r} is invalid: it must be a number of GiB >= 0")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb={self.bucket_mb!r} is invalid: it must be a number of MiB > 0")


@dataclass(frozen=True)
class Job:
    """Everything a ``train`` run needs, built from the config."""

    strategy: Any
    strategy_name: str
    #: strategy=auto: the option chosen in this process and why (None when taken from the launching process).
    auto_choice: str | None
    auto_reason: str | None
    model: Any
    data: Any
    make_trainer: Callable[..., Any]
    monitor: Any
    precision: str


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="lightning-zero", description="ZeRO data parallelism for PyTorch Lightning: train and plan runs."
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subcommands)
    if argv[:1] == ["train"]:  # everything after `train` is Hydra's, flags included (argparse would take --help)
        args = argparse.Namespace(command="train", run=lambda _: train(argv[1:]))
    else:
        args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as err:
        print(f"lightning-zero {args.command}: error: {err}", file=sys.stderr)
        return _EXIT_USAGE


# --------------------------------------------------------------------------------------------------------- train


def _add_train(subcommands: argparse._SubParsersAction) -> None:
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
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses

    _register_resolvers()
    overrides = _overrides_to_check(get_args_parser().parse_args(list(hydra_args)))
    if overrides is not None:
        _check(overrides)
    program = sys.argv[0]
    rerun_argv = [program, "train", *hydra_args]

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
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


def _check(overrides: list[str]) -> None:
    """Compose the config and build every object once, so that bad input fails here with one line."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = _compose(compose, overrides)
        _build_job(cfg)


def _compose(compose: Callable[..., Any], overrides: list[str]) -> Any:
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    try:
        return compose("config", overrides=overrides)
    except MissingConfigException as err:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if not group or not err.options:
            raise UsageError(_first_line(err)) from None
        raise UsageError(f"{group}={option} is not an option: allowed values are {', '.join(err.options)}") from None
    except OverrideParseException as err:
        raise UsageError(f"cannot parse the overrides: {_first_line(err)}") from None
    except ConfigCompositionException as err:
        if not isinstance(err.__cause__, (ConfigAttributeError, ConfigKeyError)):
            raise UsageError(_first_line(err)) from None
        key = err.__cause__.full_key
        others = [o for o in overrides if o.lstrip("+~").split("=")[0] != key]
        raise UsageError(_unknown_field(key, compose("config", overrides=others))) from None


def _unknown_field(key: str, cfg: Any) -> str:
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import DictConfig, OmegaConf

    parent, _, _ = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    fields = [k for k in node.keys() if not str(k).startswith("_")] if isinstance(node, DictConfig) else []
    if not parent:  # a misspelt group is the likely mistake at the top level
        groups = GlobalHydra.instance().config_loader().list_groups("")
        fields = sorted(set(fields) | {g for g in groups if g != "hydra"})
    where = f"a field of {parent}" if parent else "a config group or field"
    return f"{key} is not {where}: allowed fields are {', '.join(map(str, fields))} (+{key}=VALUE adds a new one)"


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
        raise SystemExit(_EXIT_USAGE) from None
    if job.auto_reason is not None:
        print(f"strategy=auto chose {job.auto_reason}", file=sys.stderr)
    started = time.perf_counter()
    with _auto_choice_env(job.auto_choice), warnings.catch_warnings():
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
        raise UsageError(f"trainer: {_first_line(err)}") from None


def _build_job(cfg: Any) -> Job:
    from lightning_zero.monitor import option_of

    precision = _check_precision(cfg.trainer.get("precision", "32-true"))
    model = _instantiate("model", cfg.model)
    counts = _parameter_counts(model)
    strategy = _instantiate("strategy", cfg.strategy)
    auto_choice = auto_reason = None
    if isinstance(strategy, AutoStrategy):
        auto_choice, auto_reason = _resolve_auto(strategy, counts, cfg.trainer, precision)
        strategy = _strategy_for(auto_choice, strategy)
    return Job(
        strategy=strategy,
        strategy_name=option_of(strategy) or type(strategy).__name__,
        auto_choice=auto_choice,
        auto_reason=auto_reason,
        model=model,
        data=_instantiate("data", cfg.data),
        make_trainer=_instantiate("trainer", cfg.trainer),
        monitor=_instantiate("monitor", cfg.monitor),
        precision=precision,
    )


def _parameter_counts(model: Any) -> Any:
    """The model's unsharded parameter counts (a ``LanguageModel`` builds its network on the meta device for them,
    which also checks its config, e.g. ``frozen``, before any launch); ``None`` for a LightningModule of one's own."""
    if not hasattr(model, "parameter_counts"):
        return None
    try:
        return model.parameter_counts()
    except ValueError as err:
        raise UsageError(_prefixed("model", _first_line(err))) from None


def _instantiate(group: str, node: Any) -> Any:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as err:
        raise UsageError(_instantiation_message(group, node, err)) from None
    except (ValueError, TypeError, ModuleNotFoundError) as err:
        raise UsageError(f"{group}: {_first_line(err)}") from None


def _instantiation_message(group: str, node: Any, err: Exception) -> str:
    """``strategy.stage=5 is invalid: ...``: the failing node's key, then the library's own message."""
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    cause = err.__cause__ or err
    lines = str(err).splitlines()
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), group)
    message = _first_line(cause)
    if isinstance(cause, TypeError) and "unexpected keyword argument" in message:
        field = message.rsplit(" ", 1)[-1].strip("'")
        sub_key = key.removeprefix(group).lstrip(".")
        target = (OmegaConf.select(node, sub_key) if sub_key else node)._target_
        obj = get_object(target)
        names = obj.option_names() if hasattr(obj, "option_names") else [
            p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")
        ]
        return f"{key}.{field} is not a parameter of {target}: allowed fields are {', '.join(names)}"
    return _prefixed(key, message)


def _prefixed(key: str, message: str) -> str:
    field = message.split("=", 1)[0]
    return f"{key}.{message}" if "=" in message and field.isidentifier() else f"{key}: {message}"


def _check_precision(value: Any) -> str:
    precision = _PRECISION_ALIASES.get(str(value), str(value))
    if precision not in _PRECISIONS:
        raise UsageError(f"trainer.precision={value!r} is invalid: allowed values are {', '.join(_PRECISIONS)}")
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


# --------------------------------------------------------------------------------------------- strategy=auto


def _resolve_auto(auto: AutoStrategy, counts: Any, trainer_cfg: Any, precision: str) -> tuple[str, str | None]:
    """The option ``estimate.recommend`` picks for this model on these devices, and why.

    A rank re-run by the launching process takes the launching process's choice (see [Note: how ranks are launched]).
    """
    from lightning_zero import estimate

    chosen = os.environ.get(_AUTO_ENV)
    if chosen is not None:
        return chosen, None
    if counts is None:
        raise UsageError("strategy=auto needs the model's parameter count: the model has no parameter_counts()")
    if precision not in estimate.PRECISIONS:
        raise UsageError(
            f"trainer.precision={precision!r} is not supported by strategy=auto: "
            f"allowed values are {', '.join(estimate.PRECISIONS)}"
        )
    devices = _devices(trainer_cfg)
    budget = _device_budget(auto, trainer_cfg, devices)
    ranks = len(devices) * int(trainer_cfg.get("num_nodes", 1))
    recommendation = estimate.recommend(
        counts.total, ranks, budget, precision, auto.bucket_mb, counts.trainable, options=available_options()
    )
    if recommendation.choice is None:
        raise UsageError(f"strategy=auto: {recommendation.explain()}")
    return recommendation.choice, recommendation.explain()


def available_options() -> tuple[str, ...]:
    """``ddp`` and the ZeRO stages, least complex first."""
    from lightning_zero.config import SUPPORTED_STAGES

    return ("ddp", *(f"zero{s}" for s in sorted(SUPPORTED_STAGES)))


def _strategy_for(option: str, auto: AutoStrategy) -> Any:
    if option == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(start_method=auto.start_method)
    from lightning_zero import ZeroStrategy

    stage = int(option.removeprefix("zero"))
    return ZeroStrategy(stage=stage, bucket_mb=auto.bucket_mb, start_method=auto.start_method)


def _devices(trainer_cfg: Any) -> list[int]:
    """Indexes of the devices of one node the run will use."""
    import torch

    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    on_cuda = accelerator in ("cuda", "gpu") or accelerator == "auto" and torch.cuda.is_available()
    devices = trainer_cfg.get("devices", "auto")
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return [int(d) for d in devices]
    if str(devices) in ("auto", "-1"):
        return list(range(torch.cuda.device_count())) if on_cuda else [0]
    return list(range(int(devices)))


def _device_budget(auto: AutoStrategy, trainer_cfg: Any, devices: list[int]) -> int:
    import torch

    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    budget = auto.budget_gb * 2**30
    if accelerator in ("cuda", "gpu") or accelerator == "auto" and torch.cuda.is_available():
        budget = min(_cuda_free_bytes(d) for d in devices)
    budget -= auto.reserve_gb * 2**30
    if budget <= 0:
        raise UsageError(f"strategy.reserve_gb={auto.reserve_gb} is invalid: it leaves no memory for model states")
    return int(budget)


def _cuda_free_bytes(device: int) -> int:
    import torch

    # NVML reads the usage without creating a CUDA context on every device in this (rank-0) process.
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        return total - torch.cuda.device_memory_used(device)
    except Exception:  # no NVML: fall back to the CUDA runtime
        return torch.cuda.mem_get_info(device)[0]


@contextmanager
def _auto_choice_env(choice: str | None) -> Iterator[None]:
    if choice is None or _AUTO_ENV in os.environ:
        yield
        return
    os.environ[_AUTO_ENV] = choice
    try:
        yield
    finally:
        del os.environ[_AUTO_ENV]


# ------------------------------------------------------------------------------------------------------ estimate


def _add_estimate(subcommands: argparse._SubParsersAction) -> None:
    from lightning_zero.estimate import PRECISIONS

    parser = subcommands.add_parser(
        "estimate",
        help="model-state memory per rank for ddp and zero1/2/3, and the least complex option that fits",
        description="Model-state bytes per rank (parameters, gradients, Adam states; activations not included) for "
        "ddp and ZeRO stages 1-3, and the least complex option that fits a per-device budget.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", help="parameter count, e.g. 350000, 125M, 1.3B, 7e9")
    size.add_argument("--model", help="a model config of conf/model (e.g. gpt_small, gpt_large, hf_llama)")
    size.add_argument("--recipe", help="the model of a recipe of conf/recipe (e.g. gpt_large_zero3)")
    parser.add_argument("--trainable", help="trainable parameter count when some are frozen (default: all)")
    parser.add_argument("--ranks", type=int, default=None, help="data-parallel ranks (default: GPUs, else 2)")
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="ZeRO bucket size in MiB (default: 25)")
    parser.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="per-device budget in GiB (2^30 bytes); default: the free memory of GPU 0 when there is one",
    )
    parser.set_defaults(run=estimate_command)


def estimate_command(args: argparse.Namespace) -> int:
    from lightning_zero import estimate

    total, trainable, what = _estimate_size(args)
    ranks = args.ranks if args.ranks is not None else _default_ranks()
    try:
        if args.trainable is not None:
            trainable = estimate.parse_count(args.trainable)
        budget = _estimate_budget(args.budget_gb)
        estimates = estimate.estimate_all(total, ranks, args.precision, args.bucket_mb, trainable)
        recommendation = (
            estimate.recommend(total, ranks, budget, args.precision, args.bucket_mb, trainable)
            if budget is not None
            else None
        )
    except estimate.EstimateError as err:
        raise UsageError(str(err)) from None
    print(estimate.format_table(what, total, trainable, ranks, args.precision, estimates, budget))
    if recommendation is None:
        print("\nno budget given (--budget-gb) and no GPU: no recommendation")
    else:
        print(f"\nrecommendation: {recommendation.explain()}")
    return 0


def _estimate_size(args: argparse.Namespace) -> tuple[int, int, str]:
    from lightning_zero import estimate

    if args.params is not None:
        try:
            count = estimate.parse_count(args.params)
        except estimate.EstimateError as err:
            raise UsageError(str(err)) from None
        return count, count, f"{count:,} parameters"
    from hydra import compose, initialize_config_dir

    _register_resolvers()
    override = f"model={args.model}" if args.model is not None else f"recipe={args.recipe}"
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = _compose(compose, [override])
        counts = _instantiate("model", cfg.model).parameter_counts()
    what = f"model {args.model}" if args.model is not None else f"recipe {args.recipe}"
    return counts.total, counts.trainable, f"{what} ({counts.total:,} parameters)"


def _estimate_budget(budget_gb: float | None) -> int | None:
    import torch

    if budget_gb is not None:
        if not budget_gb > 0:
            raise UsageError(f"--budget-gb={budget_gb} is invalid: it must be a number of GiB > 0")
        return int(budget_gb * 2**30)
    return _cuda_free_bytes(0) if torch.cuda.is_available() else None


def _default_ranks() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


# ------------------------------------------------------------------------------------------------------ helpers


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("lz.devices", _default_devices, replace=True)


def _default_devices(cpu_processes: int) -> int:
    """Every GPU when there are any, else ``cpu_processes`` CPU processes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else int(cpu_processes)


@contextmanager
def _sys_argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


from lightning_zero.consolidate_cli import add_consolidate  # noqa: E402  (after UsageError, which it raises)

_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_train, _add_estimate, add_consolidate)

if __name__ == "__main__":
    # `python -m lightning_zero.cli`: run the imported module, so that the classes the config names
    # (lightning_zero.cli.AutoStrategy) are the ones this code checks for, not copies in __main__.
    from lightning_zero.cli import main as _main

    sys.exit(_main())
