"""Configuration of the ZeRO strategy: small frozen dataclasses, each owned by the component that uses it.

``ZeroConfig`` composes them: ``CommConfig`` (buckets and gradient reduction, used by the reducers and
``collectives.py``), ``Stage3Config`` (units, prefetch and resharding, used by ``param_hooks.py``) and
``OffloadConfig`` (where optimizer states and parameter shards live, used by ``offload/``), ``TopologyConfig`` (which
ranks shard together and which share a host, used by ``sharding/topology.py``) and ``WatchdogConfig`` (how fast a
failed peer is detected, used by ``watchdog.py``). Users never
name the components: ``ZeroStrategy(stage=3, prefetch=2)``, the Hydra config and ``ZeroConfig.from_options`` take
flat option names, each defined once, here, with its default (``option_defaults`` lists them, and the CLI builds the
Hydra schema of ``strategy=zero*`` from it). Every error names the option, the value it got and what is allowed, so a
bad value from the command line or from Python fails before any process is launched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zero.config_checks import (ZeroConfigError, all_ints, check_bool, check_mib, check_names,
                                          check_optional_bool, check_quantize_grads, is_count, is_number,
                                          refuse_stage3_options)

SUPPORTED_STAGES = (1, 2, 3)
#: ``precision=`` flags ZeroStrategy supports, and the 16-bit working dtype each implies (None: full fp32).
PRECISIONS: dict[str, torch.dtype | None] = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
#: Short dtype names used by options and by the CLI (``reduce_dtype="fp32"``, ``consolidate --dtype bf16``).
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


#: ``optimizer_sharding=`` values (sharding/ownership.py).
OPTIMIZER_SHARDINGS = ("auto", "rows", "params")

#: ``quantize_grads=`` values and the bits of the codes each sends (qgZ).
GRAD_QUANTIZATIONS: dict[str, int] = {"int4": 4, "int8": 8}


@dataclass(frozen=True)
class CommConfig:
    """How gradients are reduced and parameters moved.

    Args:
        bucket_mb: size in MiB of the flat buffers that gradients are packed into before each reduce-scatter, and
            that updated parameters are packed into before each all-gather. Bounds the transient memory of a step.
        inplace_mb: stages 1 and 2: a parameter of at least this many MiB whose rows split evenly across the ranks is
            reduced and gathered in its own storage, in a collective of its own, instead of being packed into a
            bucket buffer (no second copy of it, no packing copies, as ``DistributedDataParallel``'s gradient bucket
            views); ``None`` packs every parameter. 4 MiB: on gloo a collective costs ~1 ms of a rank's CPU, a
            4 MiB copy ~0.3 ms (docs/benchmarks/analysis.md, "How large a parameter is reduced in place").
        reduce_dtype: dtype gradients are reduced and their shards kept in: ``None`` (default) uses the working
            dtype (fp32, or bf16/fp16 under mixed precision), as the ZeRO paper's memory figures and DeepSpeed and
            FSDP2 do, halving gradient traffic; ``"fp32"`` sums 16-bit gradients in fp32 for accuracy at twice the
            traffic and gradient-shard memory.
        find_unused_parameters: as in DDP: agree across ranks on which parameters got no gradient in a backward, so
            that a parameter no rank used keeps no gradient and is not stepped (one small extra all-reduce, and
            reduction starts only once backward ends). Without it such a parameter is stepped with a zero gradient.
        broadcast_buffers: broadcast floating-point module buffers (e.g. BatchNorm running stats) from rank 0 before
            every training forward, as ``DistributedDataParallel`` does by default.
        shortcut_single_rank: with one rank there is nothing to communicate and no collective is issued; ``False``
            issues them anyway (to run every NCCL call on a single GPU, or to measure what they cost).
        overlap_gather: stages 1 and 2: leave the all-gathers of the updated parameters in flight after the step,
            completed bucket by bucket in the next forward, where they overlap compute; their buffers are held from
            the step to the next forward (sharding/replicated.py, [Note: what the gathers in flight hold]).
            ``None`` (default): always where the run's memory is not lean (``lean_memory``); in a lean run only where
            they hold at most 1/16 of the parameters (``MAX_IN_FLIGHT`` buckets of ``bucket_mb`` against a model of
            at least 800 MiB of parameters at 25 MiB), so that a rank holds within 6.3% of ZeRO's formula after a
            step; otherwise they complete before the step returns. ``True`` always, ``False`` never.
        quantize_grads: ZeRO++'s qgZ: ``"int4"`` or ``"int8"`` reduces each gradient bucket as block-quantized
            payloads (one fp32 scale per 4096 elements) in two all-to-alls, inside the node then across nodes,
            dequantized before each fp32 sum (quantized_collectives.py, [Note: the quantized reduce-scatter]): int4
            sends about 1/8 of fp32's bytes; with offload the reduced shards go where offload keeps them, as
            unquantized ones do. ``None`` (default) reduces in full precision.
    """

    bucket_mb: float = 25.0
    inplace_mb: float | None = 4.0
    reduce_dtype: str | None = None
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    shortcut_single_rank: bool = True
    overlap_gather: bool | None = None
    quantize_grads: str | None = None

    def __post_init__(self) -> None:
        check_mib("bucket_mb", self.bucket_mb)
        if self.inplace_mb is not None:
            check_mib("inplace_mb", self.inplace_mb)
        if self.reduce_dtype is not None and self.reduce_dtype not in tuple(DTYPES):  # a tuple: a dict value is no key
            allowed = ", ".join(repr(k) for k in (None, *DTYPES))
            raise ZeroConfigError(f"reduce_dtype={self.reduce_dtype!r} is invalid: allowed values are {allowed}")
        check_bool(self, "find_unused_parameters", "broadcast_buffers", "shortcut_single_rank")
        check_optional_bool(self, "overlap_gather")
        if self.quantize_grads is not None and self.quantize_grads not in tuple(GRAD_QUANTIZATIONS):
            allowed = ", ".join(repr(k) for k in (None, *GRAD_QUANTIZATIONS))
            raise ZeroConfigError(f"quantize_grads={self.quantize_grads!r} is invalid: allowed values are {allowed}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def inplace_bytes(self) -> int | None:
        return None if self.inplace_mb is None else max(1, int(self.inplace_mb * 2**20))

    @property
    def reduce_torch_dtype(self) -> torch.dtype | None:
        return None if self.reduce_dtype is None else DTYPES[self.reduce_dtype]


@dataclass(frozen=True)
class Stage3Config:
    """Stage 3: which parameters are gathered together, and when.

    Args:
        units: which submodules are gathered together, by class name, qualified class name or module path
            (wildcards allowed), e.g. ``("Block",)``; empty picks units automatically (each element of an
            ``nn.ModuleList``, else by size, ``unit_mb``). An entry that matches no module is an error.
        unit_mb: with ``units`` empty: a submodule becomes a unit once its parameters not yet in a smaller unit
            reach this many MiB.
        prefetch: how many units ahead of the one computing have their all-gather issued early; at most
            ``prefetch + 1`` gathered units are alive at once (plus, in backward, units whose gradients are pending).
        reshard_after_forward: free a unit's parameters after its forward (but the last unit's) and gather them
            again for backward (ZeRO-3); ``False`` keeps them, trading memory for one all-gather less.
        verify_unit_order: before each unit's collective, ranks check on a host-side channel that they move the
            same unit, so control flow that differs between ranks fails at once naming both units, instead of
            aborting (gloo) or hanging until the process-group timeout (NCCL). Costs one tiny host-side exchange per
            unit collective (through shared memory where the ranks share a host), waited for before issuing only
            where a rank leaves the sequence of the steps before. A model of more units than the shared-memory board
            names (``MAX_UNITS`` in sharding/unit_order.py) checks over the gloo control channel, said in one warning.
        buffer_pool_mb: on a host, the gather and reduction buffers kept across units hold at most this many MiB,
            and are kept from step to step too (on CUDA, whose caching allocator reuses memory already, no pool is
            kept, and a number given is refused at setup);
            ``None`` (default): twice the largest unit's buffer (the root unit, gathered once a step, not counted),
            handed back at the end of each step where the run's memory is lean (``lean_memory``), so that a rank
            holds 16Ψ/N between steps, kept otherwise; 0 keeps none. Counted in ``model_state_bytes()`` as
            ``buffers``. A number trades memory for CPU time where steps are short (BENCHMARKS.md).
        quantize_weights: ZeRO++'s qwZ: each unit's all-gather in a step sends every rank's shard as int8, one fp32
            scale per block of 4096 elements (``sharding/quantize.py``), about a quarter of fp32's bytes and half of
            bf16's; every rank dequantizes the gathered payloads into the unit's working-dtype parameters. The fp32
            master weights and the optimizer step stay exact (offloaded too: shards kept on the host or disk are
            copied to the device by the gather and quantized there). The backward's all-gathers are quantized alike
            (the same weights as the forward's, bitwise), unless hpZ serves them from its secondary shards.
    """

    units: tuple[str, ...] = ()
    unit_mb: float = 16.0
    prefetch: int = 1
    reshard_after_forward: bool = True
    verify_unit_order: bool = True
    buffer_pool_mb: float | None = None
    quantize_weights: bool = False

    def __post_init__(self) -> None:
        check_names("units", self.units)
        check_mib("unit_mb", self.unit_mb)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ZeroConfigError(f"prefetch={self.prefetch!r} is invalid: it must be an integer >= 1")
        check_bool(self, "reshard_after_forward", "verify_unit_order", "quantize_weights")
        pool = self.buffer_pool_mb
        if pool is not None and not (is_number(pool) and 0 <= pool < float("inf")):
            raise ZeroConfigError(f"buffer_pool_mb={pool!r} is invalid: it must be a number of MiB >= 0, or null (auto)")

    @property
    def unit_bytes(self) -> int:
        return max(1, int(self.unit_mb * 2**20))

    @property
    def buffer_pool_bytes(self) -> int | None:
        return None if self.buffer_pool_mb is None else int(self.buffer_pool_mb * 2**20)


#: Below this, ranks that merely start a little apart (one still building its model) are taken for lost.
MIN_FAILURE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class WatchdogConfig:
    """How a rank learns that a peer failed (``watchdog.py``).

    Args:
        failure_timeout_s: a peer whose heartbeat has not moved for this many seconds (at least
            ``MIN_FAILURE_TIMEOUT_S``) is taken as lost, and this rank fails naming it (a rank that raises or dies is
            reported at once, whatever this value). ``None`` turns the watchdog off: a lost peer then blocks the
            others until the process group's own timeout (30 minutes by default).
        heartbeat_s: how often each rank beats and checks its peers (one tiny store request each way).
    """

    failure_timeout_s: float | None = 300.0
    heartbeat_s: float = 2.0

    def __post_init__(self) -> None:
        timeout, heartbeat = self.failure_timeout_s, self.heartbeat_s
        if timeout is not None and not (is_number(timeout) and MIN_FAILURE_TIMEOUT_S <= timeout < float("inf")):
            raise ZeroConfigError(
                f"failure_timeout_s={timeout!r} is invalid: it must be a number of seconds >= "
                f"{MIN_FAILURE_TIMEOUT_S:g}, or null (no watchdog)"
            )
        if not (is_number(heartbeat) and 0 < heartbeat < float("inf")):
            raise ZeroConfigError(f"heartbeat_s={heartbeat!r} is invalid: it must be a number of seconds > 0")
        if timeout is not None and heartbeat >= timeout:
            raise ZeroConfigError(
                f"heartbeat_s={heartbeat!r} is invalid: it must be below failure_timeout_s={timeout!r}"
            )


#: ``shard_group_size`` and ``hpz_group_size``: one group per node, as the launcher laid the nodes out.
PER_NODE = "node"


@dataclass(frozen=True)
class TopologyConfig:
    """Which ranks shard the model states together, and which share a host (see [Note: hybrid sharding] in
    sharding/topology.py).

    Args:
        shard_group_size: hybrid sharding (HSDP, MiCS): consecutive groups of this many ranks each shard parameters,
            gradients and optimizer states among themselves, and the groups hold replicas of one another (gradients
            reduce-scattered inside the group, then all-reduced across groups). It must divide the world size (checked
            at setup). ``"node"``: one group per node (``node_size``). ``None`` (default) shards over every rank.
        node_size: how many consecutive ranks share a host (qgZ's two stages, the hierarchical collectives, the
            accounting of the bytes that cross between hosts, ``comm_stats.cross_group_bytes``); ``None``: the ranks
            per node of the launcher (``LOCAL_WORLD_SIZE`` under torchrun; the Trainer's devices where Lightning
            starts the processes), checked against the Trainer's ``num_nodes``; on one node, a number given as
            ``shard_group_size`` or ``hpz_group_size`` emulates nodes of that size. It must divide the world size, and
            agree with a launcher that started several nodes (see [Note: nodes from the launcher] in
            sharding/topology.py).
        hpz_group_size: ZeRO++'s hpZ (stage 3): after a unit's forward each rank keeps its ``1/K2`` slice of the
            unit's gathered working-dtype weights, shared among consecutive groups of this many ranks (normally one
            node), and the unit's backward all-gather runs inside that group from those slices, so none of it
            crosses nodes; costs ``Psi * b / K2`` bytes per rank from forward to backward (see [Note: hpZ's
            secondary shards] in sharding/unit_state.py). It must divide the shard group (``shard_group_size``, else
            the world) and be smaller (checked at setup); ``"node"``: one group per node. The slices stay on the
            training device, with or without offload (``offload_params`` too). ``None`` (default): off.
    """

    shard_group_size: int | str | None = None
    node_size: int | None = None
    hpz_group_size: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("shard_group_size", "node_size", "hpz_group_size"):
            value, per_node = getattr(self, name), name != "node_size"
            if value is None or (per_node and value == PER_NODE) or is_count(value):
                continue
            named = f", {PER_NODE!r} (one group per node, as the launcher laid them out)" if per_node else ""
            raise ZeroConfigError(
                f"{name}={value!r} is invalid: it must be an integer >= 1 that divides the world size{named}, or null"
            )


OFFLOAD_TARGETS = ("cpu", "disk")
NONFINITE_POLICIES = ("skip", "raise", "ignore")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the model states that do not need the accelerator live (ZeRO-Offload, ZeRO-Infinity).

    Args:
        offload_optimizer: ``"cpu"``: the fp32 master weights and optimizer states live in host memory and the
            optimizer step runs there (torch's fused CPU kernels), bucket by bucket, overlapped with the transfers;
            ``"disk"``: they live in files under ``offload_dir`` and are streamed through host memory, sub-group by
            sub-group, for each step. ``None`` keeps them on the training device.
        offload_params: stage 3: ``"cpu"`` keeps each rank's parameter shards in host memory between uses, brought
            to the device with each unit's all-gather; ``"disk"`` keeps them in files under ``offload_dir``.
        offload_dir: the directory disk offload writes into (a private subdirectory is created and removed at the
            end); ``None`` uses the system's temporary directory.
        offload_subgroup_mb: disk offload streams the states of this many MiB of parameters (fp32 masters) at a time;
            ``None`` (default): chosen at set-up from the rank's host budget and the model, at least 8 MiB and at
            most 256 MiB (offload/sizing.py, [Note: sizing disk offload's sub-groups]).
        offload_resident_subgroups: how many sub-groups disk offload holds in host memory at once (the one
            stepping, the ones being read ahead or written back): bounds host memory to about this many sub-groups;
            ``None`` (default): 2, or 3 where the host budget holds three of the largest sub-groups.
    """

    offload_optimizer: str | None = None
    offload_params: str | None = None
    offload_dir: str | None = None
    offload_subgroup_mb: float | None = None
    offload_resident_subgroups: int | None = None

    def __post_init__(self) -> None:
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if value is not None and value not in OFFLOAD_TARGETS:
                allowed = ", ".join(repr(v) for v in (None, *OFFLOAD_TARGETS))
                raise ZeroConfigError(f"{name}={value!r} is invalid: allowed values are {allowed}")
        if self.offload_params == "disk" and self.offload_optimizer != "disk":
            raise ZeroConfigError(
                f"offload_params='disk' needs offload_optimizer='disk' (got {self.offload_optimizer!r}): parameter "
                "shards go to disk only with the optimizer states they are updated from"
            )
        if self.offload_params is not None and self.offload_optimizer is None:
            raise ZeroConfigError(
                f"offload_params={self.offload_params!r} needs offload_optimizer too: the fp32 masters would otherwise "
                "stay on the device while the parameter shards leave it"
            )
        if self.offload_dir is not None and (not isinstance(self.offload_dir, str) or not self.offload_dir):
            raise ZeroConfigError(f"offload_dir={self.offload_dir!r} is invalid: it must be a directory path")
        if self.offload_subgroup_mb is not None:
            check_mib("offload_subgroup_mb", self.offload_subgroup_mb)
        resident = self.offload_resident_subgroups
        if resident is not None and (isinstance(resident, bool) or not isinstance(resident, int) or resident < 2):
            raise ZeroConfigError(
                f"offload_resident_subgroups={resident!r} is invalid: it must be an integer >= 2 (one stepping, one "
                "read ahead), or null (chosen from the host budget)"
            )

    @property
    def subgroup_bytes(self) -> int | None:
        return None if self.offload_subgroup_mb is None else max(1, int(self.offload_subgroup_mb * 2**20))

    @property
    def on_disk(self) -> bool:
        return "disk" in (self.offload_optimizer, self.offload_params)


@dataclass(frozen=True)
class ZeroConfig:
    """What to shard, and the options of each component (see the module docstring).

    Args:
        stage: 1 shards optimizer states; 2 also shards gradients (reduce-scattered during backward); 3 also shards
            parameters (gathered around each unit's forward and backward).
        activation_checkpointing_policy: module classes (names, qualified names or the classes themselves) whose
            forward is recomputed in backward instead of keeping its activations, as Lightning's FSDP strategies
            take it; under stage 3 the recomputation reuses the gather of the unit's backward.
        nonfinite_grads: what a step does when any rank's gradients hold an inf or NaN (bf16 and fp32; fp16's loss
            scaler always skips and backs off): ``"ignore"`` (default) steps as DDP does, the non-finite values
            spreading through the averaged gradients alike on every rank; ``"skip"`` skips the step on every rank and
            warns, ``"raise"`` raises on every rank, both naming the ranks, at the cost of one tiny all-reduce and a
            host synchronisation per step.
        optimizer_sharding: how each optimizer's state and step are split: ``"rows"``, this rank's rows of every
            parameter (right for element-wise updates: Adam, SGD, ...); ``"params"``, whole parameters owned by one
            rank each (right for any optimizer that steps a parameter from its own gradient and state: Muon,
            Adafactor, LARS, LAMB); ``"auto"`` (default) picks rows for torch's element-wise classes and params for
            every other (sharding/ownership.py).
        lean_memory: hold what the ZeRO formulas say between steps (``True``) or keep buffers and freed memory for
            speed (``False``); ``None`` (default): lean where the model states exceed an eighth of this rank's memory
            budget, and under disk offload ([Note: lean or fast memory] in memory_policy.py).
    """

    stage: int = 2
    activation_checkpointing_policy: tuple[Any, ...] = ()
    nonfinite_grads: str = "ignore"
    optimizer_sharding: str = "auto"
    lean_memory: bool | None = None
    comm: CommConfig = field(default_factory=CommConfig)
    stage3: Stage3Config = field(default_factory=Stage3Config)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in SUPPORTED_STAGES:
            raise ZeroConfigError(f"stage={self.stage!r} is invalid: allowed values are 1, 2 or 3")
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            allowed = ", ".join(repr(p) for p in OPTIMIZER_SHARDINGS)
            raise ZeroConfigError(
                f"optimizer_sharding={self.optimizer_sharding!r} is invalid: allowed values are {allowed}"
            )
        check_optional_bool(self, "lean_memory")
        if self.nonfinite_grads not in NONFINITE_POLICIES:
            allowed = ", ".join(repr(p) for p in NONFINITE_POLICIES)
            raise ZeroConfigError(f"nonfinite_grads={self.nonfinite_grads!r} is invalid: allowed values are {allowed}")
        if self.offload.offload_params is not None and self.stage != 3:
            raise ZeroConfigError(
                f"offload_params={self.offload.offload_params!r} needs stage=3 (stages 1 and 2 keep full parameters "
                f"on every rank), got stage={self.stage}: use offload_optimizer to offload stage {self.stage}'s states"
            )
        refuse_stage3_options(self.stage, self.stage3, Stage3Config())
        _refuse_with_hpz(self)
        check_quantize_grads(self.comm.quantize_grads, self.topology.shard_group_size)
        policy = self.activation_checkpointing_policy
        entries = policy if isinstance(policy, (tuple, list, set, frozenset)) else [None]  # a str or class: no list
        if not all(isinstance(p, type) or (isinstance(p, str) and p) for p in entries):
            raise ZeroConfigError(
                f"activation_checkpointing_policy={policy!r} is invalid: it must be a list of module classes or "
                "class names"
            )

    @classmethod
    def from_options(cls, **options: Any) -> ZeroConfig:
        """Build from flat option names (``stage=3, prefetch=2, bucket_mb=50``), each routed to its component.

        Lists (from YAML and the command line) and sets (``activation_checkpointing_policy={Block}``, as Lightning's
        FSDP takes it) are accepted where a tuple is expected.
        """
        unknown = sorted(set(options) - set(option_defaults()))
        if unknown:
            raise TypeError(f"ZeroStrategy() got an unexpected keyword argument {unknown[0]!r}")
        options = {k: tuple(v) if isinstance(v, (list, set, frozenset)) else v for k, v in options.items()}
        parts = {name: component(**_own(component, options)) for name, component in _COMPONENTS.items()}
        return cls(**_own(cls, options), **parts)

    def options(self) -> dict[str, Any]:
        """The flat option names and values of this config (the inverse of ``from_options``)."""
        flat = {f.name: getattr(self, f.name) for f in _own_fields(ZeroConfig)}
        for name in _COMPONENTS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat


def _refuse_with_hpz(config: ZeroConfig) -> None:
    """hpZ (``hpz_group_size``) serves stage 3's gathers freed after the forward only, inside the shard group."""
    hpz = config.topology.hpz_group_size
    if hpz is None:
        return
    group = config.topology.shard_group_size
    refusals = [
        (config.stage != 3, f"needs stage=3 (it serves stage 3's backward all-gathers), got stage={config.stage}"),
        (not config.stage3.reshard_after_forward, "with reshard_after_forward=False has nothing to do: the units "
         "stay gathered from forward to backward; drop one of them"),
        (all_ints(group, hpz) and (hpz >= group or group % hpz), f"is invalid with shard_group_size={group}: it "
         "must divide the shard group size and be smaller"),
        (group == PER_NODE and hpz == PER_NODE, "is invalid with shard_group_size='node': hpZ's group must be smaller "
         "than the shard group, which is the node"),
    ]
    for refused, why in refusals:
        if refused:
            raise ZeroConfigError(f"hpz_group_size={hpz!r} {why}")


_COMPONENTS: dict[str, type] = {
    "comm": CommConfig, "stage3": Stage3Config, "offload": OffloadConfig, "topology": TopologyConfig,
    "watchdog": WatchdogConfig,
}


def option_defaults() -> dict[str, Any]:
    """Every flat option of ``ZeroStrategy`` with its default, in a stable order (the Hydra schema is built from it)."""
    return ZeroConfig().options()


def _own_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in _COMPONENTS]


def _own(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    return {f.name: options[f.name] for f in _own_fields(cls) if f.name in options}
