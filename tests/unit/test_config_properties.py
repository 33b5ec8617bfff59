"""Property tests of bad configuration: every combination of options, valid or not, is either accepted, and then
round-trips, or refused with one error naming an offending option; from Python (``ZeroConfig.from_options``,
``ZeroStrategy(**options)``) and from the command line (``lightning-zero train`` overrides, checked the way ``train``
checks them before any process starts). Which combinations actually train is tests/distributed/test_config_fits.py.

Each generated value carries whether the documentation allows it; the rules that tie options together are written
out again here (``_blamed``), from the docstrings of ``lightning_zero.config``, so that the tests catch a value that
is wrongly refused as well as one that is wrongly accepted.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_zero import ZeroConfig, ZeroConfigError, ZeroStrategy
from lightning_zero.cli import main
from lightning_zero.cli.errors import UsageError
from lightning_zero.cli.train import _check

INF, NAN = float("inf"), float("nan")
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.*]{0,10}", fullmatch=True)
PATHS = st.from_regex(r"/[a-z0-9_]{1,8}(/[a-z0-9_]{1,8}){0,2}", fullmatch=True)
NOT_A_LIST = st.sampled_from(["Block", 5, None, {"a": 1}, True])
#: Values an option allows, and values it does not.
Pair = tuple[st.SearchStrategy, st.SearchStrategy]


def _values(name: str, any_value: bool = True) -> st.SearchStrategy:
    """``(value, allowed)`` pairs for option ``name``: half of them allowed, or all with ``any_value=False``."""
    valid, invalid = OPTION_VALUES[name]
    allowed = valid.map(lambda v: (v, True))
    return st.one_of(allowed, invalid.map(lambda v: (v, False))) if any_value else allowed


def _mib(optional: bool = False) -> Pair:
    valid = st.floats(min_value=0, max_value=1e12, exclude_min=True) | st.integers(1, 10**6)
    invalid = [INF, -INF, NAN, True, False, "25", [1]] + ([] if optional else [None])
    return (valid | st.none() if optional else valid, st.floats(max_value=0) | st.sampled_from(invalid))


def _flag() -> Pair:
    return (st.booleans(), st.sampled_from([0, 1, 1.0, "true", "yes", None]))


def _one_of(allowed: list, refused: list) -> Pair:
    return (st.sampled_from(allowed), st.sampled_from(refused))


def _seconds(least: float, optional: bool) -> Pair:
    valid = st.floats(min_value=least, max_value=1e6, exclude_min=least == 0) | st.integers(max(1, int(least)), 10**6)
    invalid = st.floats(max_value=least, exclude_max=least > 0) | st.sampled_from([INF, NAN, True, "300"])
    return (valid | st.just(None), invalid) if optional else (valid, invalid | st.just(None))


#: Every option of ZeroStrategy: values the documentation allows, values it does not.
OPTION_VALUES: dict[str, Pair] = {
    "stage": _one_of([1, 2, 3], [0, 4, -1, 3.0, 2.0, True, "3", None, [3]]),
    "activation_checkpointing_policy": (
        st.lists(NAMES | st.sampled_from([nn.Linear, nn.Embedding]), max_size=3),
        NOT_A_LIST | st.sampled_from([nn.Linear, [""], [3], ["Block", None]]),
    ),
    "nonfinite_grads": _one_of(["skip", "raise", "ignore"], ["warn", "", "SKIP", None, 1, {"a": 1}]),
    "optimizer_sharding": _one_of(["auto", "rows", "params"], ["row", "", "AUTO", None, 1, ["rows"]]),
    "bucket_mb": _mib(),
    "inplace_mb": _mib(optional=True),
    "reduce_dtype": _one_of(
        [None, "fp32", "bf16", "fp16"], ["float32", "int8", "", "FP32", 32, True, {"a": 1}, ["fp32"]]
    ),
    "find_unused_parameters": _flag(),
    "broadcast_buffers": _flag(),
    "shortcut_single_rank": _flag(),
    "quantize_grads": _one_of([None, "int4", "int8"], ["int2", "", "INT4", 4, True, {"a": 1}, ["int4"]]),
    "units": (st.lists(NAMES, max_size=3), NOT_A_LIST | st.sampled_from([[""], ["Block", 3], [None]])),
    "unit_mb": _mib(),
    "prefetch": (st.integers(1, 10**6), st.integers(max_value=0) | st.sampled_from([1.5, 2.0, True, "2", None])),
    "reshard_after_forward": _flag(),
    "overlap_gather": _one_of([None, True, False], ["true", "", 1, 0, [True]]),
    "lean_memory": _one_of([None, True, False], ["true", "", 1, 0, [True]]),
    "verify_unit_order": _flag(),
    "quantize_weights": _flag(),
    "buffer_pool_mb": (
        st.none() | st.floats(min_value=0, max_value=1e12) | st.integers(0, 10**6),
        st.floats(max_value=0, exclude_max=True) | st.sampled_from([INF, -INF, NAN, True, False, "25", [1]]),
    ),
    "offload_optimizer": _one_of([None, "cpu", "disk"], ["gpu", "", "CPU", True, 1, {"a": 1}]),
    "offload_params": _one_of([None, "cpu", "disk"], ["gpu", "", "nvme", False, 0]),
    "offload_dir": (st.none() | PATHS, st.sampled_from(["", 5, True, ["/tmp"]])),
    "offload_subgroup_mb": _mib(optional=True),
    "offload_resident_subgroups": (
        st.none() | st.integers(2, 1000), st.integers(max_value=1) | st.sampled_from([2.5, 3.0, True, "3"])
    ),
    "shard_group_size": (st.none() | st.integers(1, 10**6), st.integers(max_value=0) | st.sampled_from([2.0, True, "2"])),
    "node_size": (st.none() | st.integers(1, 10**6), st.integers(max_value=0) | st.sampled_from([4.0, False, "4"])),
    "hpz_group_size": (st.none() | st.integers(1, 8), st.integers(max_value=0) | st.sampled_from([2.0, True, "2"])),
    "failure_timeout_s": _seconds(1.0, optional=True),
    "heartbeat_s": _seconds(0.0, optional=False),
}
UNKNOWN = ["stages", "bucket", "bucket_size_mb", "offload", "prefetch_units", "zero_stage"]


def test_every_option_is_generated():
    assert set(OPTION_VALUES) == set(ZeroConfig().options())


@st.composite
def option_dicts(draw) -> dict[str, tuple[Any, bool]]:
    """A few options (tagged values), now and then an unknown name."""
    names = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), unique=True, max_size=6))
    options = {name: draw(_values(name)) for name in names}
    if draw(st.integers(0, 9)) == 0:
        options[draw(st.sampled_from(UNKNOWN))] = (1, False)
    return options


def _blamed(options: dict[str, tuple[Any, bool]]) -> set[str]:
    """The options an error may name: those not allowed on their own, and those of a rule that the combination of
    allowed values breaks (rules from the docstrings of lightning_zero.config, over the values given and the
    defaults). Empty: the options must be accepted."""
    bad = {name for name, (_, allowed) in options.items() if not allowed}
    value = {**ZeroConfig().options(), **{name: v for name, (v, allowed) in options.items() if allowed}}
    rules = [
        ({"offload_params", "offload_optimizer"}, value["offload_params"] is not None
         and (value["offload_optimizer"] is None or value["offload_params"] == "disk" != value["offload_optimizer"])),
        ({"offload_params", "stage"}, value["offload_params"] is not None and value["stage"] != 3),
        *[({name, "stage"}, value["stage"] != 3 and _stored(value[name]) != default)
          for name, default in STAGE3_DEFAULTS.items()],
        ({"hpz_group_size", "stage", "reshard_after_forward", "shard_group_size"},
         value["hpz_group_size"] is not None and _hpz_refused(value)),
        ({"quantize_grads", "shard_group_size"}, value["quantize_grads"] is not None
         and value["shard_group_size"] is not None),
        ({"heartbeat_s", "failure_timeout_s"}, value["failure_timeout_s"] is not None
         and not value["heartbeat_s"] < value["failure_timeout_s"]),
    ]
    return bad.union(*(names for names, broken in rules if broken and not names & bad))


#: Stage 3's options (``Stage3Config``) with their defaults: set to anything else under stage 1 or 2, refused.
STAGE3_DEFAULTS = {"units": (), "unit_mb": 16.0, "prefetch": 1, "reshard_after_forward": True,
                   "verify_unit_order": True, "buffer_pool_mb": None, "quantize_weights": False}


def _hpz_refused(value: dict[str, Any]) -> bool:
    """hpZ needs stage 3, units freed after forward, and to fit a given shard group."""
    hpz, group = value["hpz_group_size"], value["shard_group_size"]
    misfit = group is not None and (hpz >= group or group % hpz)
    return value["stage"] != 3 or not value["reshard_after_forward"] or bool(misfit)


def _names_one_of(message: str, names: set[str]) -> bool:
    """``name=value is invalid: ...`` (or ``needs``), or Python's ``unexpected keyword argument 'name'``."""
    return "\n" not in message and any(
        message.startswith(f"{name}=") or message.endswith(f"unexpected keyword argument {name!r}") for name in names
    )


def _stored(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _outcome(build, values: dict[str, Any]) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an option is accepted or refused, never warned about
            return build(**values)
    except (ZeroConfigError, TypeError) as err:
        return err


@settings(max_examples=300, **SETTINGS)
@given(options=option_dicts())
def test_options_are_accepted_and_round_trip_or_refused_naming_one(options):
    values = {name: v for name, (v, _) in options.items()}
    blamed = _blamed(options)
    config = _outcome(ZeroConfig.from_options, values)
    if blamed:
        assert isinstance(config, Exception), f"accepted, though {sorted(blamed)} should be refused"
        assert _names_one_of(str(config), blamed), f"{config!r} names none of {sorted(blamed)}"
        return
    assert isinstance(config, ZeroConfig), f"refused a valid combination: {config!r}"
    flat = config.options()
    assert {name: flat[name] for name in values} == {name: _stored(v) for name, v in values.items()}
    assert ZeroConfig.from_options(**flat) == config
    assert ZeroConfig.from_options(**{k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}) == config


@settings(max_examples=150, **SETTINGS)
@given(options=option_dicts())
def test_the_strategy_takes_the_same_options_with_the_same_errors(options):
    values = {name: v for name, (v, _) in options.items()}
    expected = _outcome(ZeroConfig.from_options, values)
    strategy = _outcome(ZeroStrategy, values)
    if isinstance(expected, Exception):
        assert type(strategy) is type(expected) and str(strategy) == str(expected)
    else:
        assert isinstance(strategy, ZeroStrategy) and strategy.config == expected


# ------------------------------------------------------------------------------------------- the command line


def _yaml(value: Any) -> str:
    """A Python value as a Hydra override value that parses back to it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == INF else "-inf" if value == -INF else repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, list):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_yaml(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def _on_command_line(value: Any) -> bool:
    try:
        _yaml(value)
    except TypeError:
        return False
    return not (isinstance(value, list) and any(isinstance(v, type) for v in value))


#: Override and whether it is allowed; an error must name its key (``trainer.devices``), or the field after the
#: group (Lightning's own: ``trainer: `devices` selected with ...``).
OTHER_OVERRIDES = {
    "model": [("model=gpt_tiny", True), ("model=gpt_small", True), ("model=gpt_large", True),
              ("model=gpt_huge", False)],
    "data": [("data=stdlib", True), ("data=nope", False), ("data.batch_size=0", False)],
    "trainer.devices": [("trainer.devices=1", True), ("trainer.devices=3", True), ("trainer.devices=auto", True),
                        ("trainer.devices=0", False), ("trainer.devices=-1", False), ("trainer.devices=abc", False),
                        ("trainer.devices=2.5", False)],
    "trainer.precision": [(f"trainer.precision={p}", True) for p in ("32-true", "bf16-mixed", "32", "bf16")]
    + [(f"trainer.precision={p}", False) for p in ("bf16-true", "64", "fp17", "16-true")],
    "trainer.accumulate_grad_batches": [("trainer.accumulate_grad_batches=2", True),
                                        ("trainer.accumulate_grad_batches=0", False),
                                        ("trainer.accumulate_grad_batches=-1", False)],
    "trainer.val_check_interval": [("trainer.val_check_interval=5", True), ("trainer.val_check_interval=null", True),
                                   ("trainer.val_check_interval=0", False), ("trainer.val_check_interval=-3", False)],
    "unknown": [("strategy.bucket_m=1", False), ("trainer.max_stepz=1", False), ("+strategy.foo=1", False),
                ("foo=1", False), ("strateg=zero2", False)],
}
#: Launch settings a ZeRO strategy takes besides its options (added with +).
LAUNCH_OVERRIDES = [
    ("+strategy.process_group_backend=gloo", True),
    ("+strategy.process_group_backend=bogus", False),
    ("+strategy.timeout=5", False),
    ("+strategy.timeout={_target_:datetime.timedelta,seconds:60}", True),
    ("strategy.start_method=fork", True),
    ("strategy.start_method=bogus", False),
]
#: units and activation_checkpointing_policy on the command line: (value, allowed by ZeroConfig, matches the model
#: as units, as a policy), the matches checked before launch. Units take module paths too, a policy only classes.
MODEL_NAMES = [([], True, True, True), (["Block"], True, True, True), (["model.blocks.*"], True, True, False),
               (["Block", "Nope"], True, True, True), (["Nope"], True, False, False), ("Block", False, True, True),
               ([""], False, True, True), (None, False, True, True)]
MISSING_DIR = "/nonexistent/offload"


@st.composite
def command_lines(draw) -> tuple[list[str], set[str], dict[str, Any]]:
    """Overrides, the keys an error may name (empty: it must be accepted), and the ZeRO options they set. Half of
    them are made of allowed values only (the options together may still break a rule)."""
    any_value = draw(st.booleans())
    group = draw(st.sampled_from(["zero1", "zero2", "zero3", "ddp", "auto", None] + ["zero4"] * any_value))
    overrides, blamed = ([f"strategy={group}"] if group else []), set()
    if group == "zero4":
        blamed.add("strategy")
    options: dict[str, tuple[Any, bool]] = {}
    if group in ("zero1", "zero2", "zero3", None):
        options["stage"] = (3 if group is None else int(group[-1]), True)
        names = sorted(set(OPTION_VALUES) - {"units", "activation_checkpointing_policy"})  # see _checked_before_launch
        for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=4)):
            options[name] = draw(_values(name, any_value).filter(lambda tagged: _on_command_line(tagged[0])))
            overrides.append(f"strategy.{name}={_yaml(options[name][0])}")
        checked = _checked_before_launch(draw, options, overrides, any_value)
        refused = {f"strategy.{name}" for name in _blamed(options)}
        blamed |= refused or checked
        overrides, blamed = _add(draw, [LAUNCH_OVERRIDES], overrides, blamed, any_value)
    overrides, blamed = _add(draw, OTHER_OVERRIDES.values(), overrides, blamed, any_value)
    return overrides, blamed, {name: v for name, (v, _) in options.items()}


def _add(draw, choices: Any, overrides: list[str], blamed: set[str], any_value: bool) -> tuple[list[str], set[str]]:
    """Now and then one override of each list of choices; a refused one is blamed by its key."""
    for choice in choices:
        allowed_only = [c for c in choice if c[1]]
        if draw(st.integers(0, 2)) == 0 and (any_value or allowed_only):
            override, allowed = draw(st.sampled_from(choice if any_value else allowed_only))
            overrides, blamed = [*overrides, override], blamed | (set() if allowed else {_key(override)})
    return overrides, blamed


def _key(override: str) -> str:
    return override.lstrip("+").split("=")[0]


def _checked_before_launch(draw, options: dict, overrides: list[str], any_value: bool) -> set[str]:
    """Now and then units, activation_checkpointing_policy or a disk offload_dir, which must also match the model or
    the filesystem; the keys to blame if they do not."""
    blamed = set()
    stage = options["stage"][0]
    for name in ("units", "activation_checkpointing_policy"):
        if draw(st.booleans()):
            names, allowed, as_units, as_policy = draw(st.sampled_from(MODEL_NAMES).filter(lambda c: c[1] or any_value))
            options[name] = (names, allowed)
            overrides.append(f"strategy.{name}={_yaml(names)}")
            matches = (as_units or stage != 3) if name == "units" else as_policy
            blamed |= set() if matches else {f"strategy.{name}"}
    if not {"offload_optimizer", "offload_params", "offload_dir"} & set(options) and draw(st.booleans()):
        where = draw(st.sampled_from([tempfile.gettempdir(), MISSING_DIR] if any_value else [tempfile.gettempdir()]))
        options |= {"offload_optimizer": ("disk", True), "offload_dir": (where, True)}
        overrides += ["strategy.offload_optimizer=disk", f"strategy.offload_dir={where}"]
        blamed |= {"strategy.offload_dir"} if where == MISSING_DIR else set()
    return blamed


def _mentions(message: str, key: str) -> bool:
    """The message names ``key`` (``strategy.bucket_mb``), or its field after the group's own prefix."""
    group, _, field = key.partition(".")
    return key in message or bool(field) and message.startswith(f"{group}: ") and field in message


# Not shrunk: each try composes and builds a whole run (~0.3 s), and the unshrunk list of overrides reads well.
@settings(max_examples=20, phases=[Phase.explicit, Phase.reuse, Phase.generate], **SETTINGS)
@given(case=command_lines())
# Found by a random draw in CI: strategy=auto sized the run for trainer.devices before the Trainer parsed it.
@example(case=(["strategy=auto", "trainer.devices=abc"], {"trainer.devices"}, {}))
@example(case=(["strategy=auto", "trainer.devices=0"], {"trainer.devices"}, {}))
def test_the_command_line_is_accepted_or_refused_with_one_line_before_any_launch(case):
    overrides, blamed, options = case
    event("refused" if blamed else "accepted")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            job = _check(overrides)
    except UsageError as err:
        message = str(err)
        assert blamed, f"refused a valid command line: {message}"
        assert message and "\n" not in message
        assert any(_mentions(message, key) for key in blamed), f"{message!r} names none of {sorted(blamed)}"
        _assert_train_exits_with(overrides, message)
        return
    assert not blamed, f"accepted, though {sorted(blamed)} should be refused"
    if isinstance(job.strategy, ZeroStrategy):
        flat = job.strategy.config.options()
        assert {k: flat[k] for k in options} == {k: _stored(v) for k, v in options.items()}


def _assert_train_exits_with(overrides: list[str], message: str) -> None:
    """``lightning-zero train`` prints that one line, exits with 2 and never made its run directory."""
    run_dir = Path(tempfile.gettempdir()) / "lightning_zero_never_made"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["train", *overrides, f"hydra.run.dir={run_dir}"])
    assert (code, stderr.getvalue()) == (2, f"lightning-zero train: error: {message}\n")
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # Each passed every check and then failed on every rank, with a traceback per rank, before the checks of
        # lightning_zero/cli/preflight.py.
        ("strategy.units=[Nope]", "strategy.units=['Nope']: ['Nope'] match no module of LanguageModel"),
        ("strategy.activation_checkpointing_policy=[Nope]",
         "strategy.activation_checkpointing_policy=['Nope'] matches no module of LanguageModel"),
        (f"strategy.offload_optimizer=disk strategy.offload_dir={MISSING_DIR}",
         f"strategy.offload_dir='{MISSING_DIR}' does not exist or is not a directory"),
        ("strategy=ddp +strategy.stage=1", "strategy.stage is not a parameter of lightning.pytorch.strategies."
         "DDPStrategy or of the DistributedDataParallel it builds: allowed fields are accelerator,"),
        ("+strategy.process_group_backend=bogus", "strategy.process_group_backend='bogus' is invalid: allowed values "
         "are gloo"),
        ("+strategy.timeout=5", "strategy.timeout=5 is invalid: it must be a datetime.timedelta"),  # ZeroStrategy's
        ("strategy=ddp +strategy.timeout=5", "strategy.timeout=5 is invalid: it must be a timedelta, e.g. "
         "'+strategy.timeout={_target_:datetime.timedelta,seconds:5}'"),
        ("trainer.accumulate_grad_batches=0",
         "trainer.accumulate_grad_batches=0 is invalid: it must be an integer >= 1"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval=0 is invalid: it must be a number of steps >= 1"),
        # Refused by ZeroConfig itself, which let them through before.
        ("strategy.stage=3.0", "strategy.stage=3.0 is invalid: allowed values are 1, 2 or 3"),
        ("strategy.activation_checkpointing_policy=null",
         "strategy.activation_checkpointing_policy=None is invalid: it must be a list of module classes"),
        ("strategy.reduce_dtype={a:1}", "strategy.reduce_dtype={'a': 1} is invalid: allowed values are None, 'fp32'"),
        ("strategy.failure_timeout_s=0.01 strategy.heartbeat_s=0.001",
         "strategy.failure_timeout_s=0.01 is invalid: it must be a number of seconds >= 1, or null (no watchdog)"),
    ],
)
def test_what_once_failed_on_every_rank_is_refused_before_launch(override, message):
    with pytest.raises(UsageError) as caught:
        _check(override.split())
    assert str(caught.value).startswith(message)
