"""``lightning-zero estimate``: the memory model of ``lightning_zero.estimate`` for a parameter count, a model config
or a recipe, by placement (device, host, disk), and the least complex option that fits a per-rank budget."""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import estimate
from lightning_zero.host_memory import HostMemory, host_memory
from lightning_zero.cli.compose import compose, instantiate
from lightning_zero.cli.errors import UsageError


def add_estimate(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "estimate",
        help="model-state memory per rank for ddp, zero1/2/3 and their offload options, and the least complex option "
        "that fits",
        description="Model-state bytes per rank (parameters, gradients, Adam states; activations not included) for "
        "ddp, ZeRO stages 1-3 and their host and disk offload options, on the device, in host memory and on disk, and "
        "the least complex option that fits a per-rank budget: without offload first, then host, then disk.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", help="parameter count, e.g. 350000, 125M, 1.3B, 7e9")
    size.add_argument("--model", help="a model config of conf/model (e.g. gpt_small, gpt_large, hf_llama)")
    size.add_argument("--recipe", help="the model of a recipe of recipes/ (e.g. gpt_large_zero3)")
    parser.add_argument("--trainable", help="trainable parameter count when some are frozen (default: all)")
    parser.add_argument("--ranks", type=int, default=None, help="data-parallel ranks (default: GPUs, else 2)")
    parser.add_argument("--precision", default="32-true", choices=estimate.PRECISIONS)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="ZeRO bucket size in MiB (default: 25)")
    parser.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="per-device budget in GiB (2^30 bytes); default: the free memory of GPU 0 when there is one, else the "
        "host budget per rank (the device is host memory)",
    )
    parser.add_argument(
        "--host-budget-gb",
        type=float,
        default=None,
        help="host memory per rank in GiB for the offload options; default: the host budget divided by "
        "--ranks-per-node: the smaller of this machine's available memory (MemAvailable) and the limit of the memory "
        "cgroup this command runs in less its usage",
    )
    parser.add_argument(
        "--disk-budget-gb",
        type=float,
        default=None,
        help="disk space per rank in GiB for disk offload; default: the free space of --offload-dir divided by "
        "--ranks-per-node",
    )
    parser.add_argument("--offload-dir", default=None, help="where disk offload would write (default: temp directory)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="ranks sharing one host (default: --ranks)")
    parser.add_argument("--no-offload", action="store_true", help="consider only the options without offload")
    parser.add_argument(
        "--quantize-weights", action="store_true", help="zero3's all-gathers as int8 blocks "
        "(ZeroStrategy(quantize_weights=True), ZeRO++'s qwZ)"
    )
    parser.add_argument(
        "--quantize-grads", choices=("int4", "int8"), default=None, help="the gradient reduce as int4 or int8 blocks "
        "in two stages, inside each node of --ranks-per-node ranks then across nodes (ZeroStrategy(quantize_grads=...), "
        "ZeRO++'s qgZ): prints the bytes it sends per rank and step; not with --shard-group-size"
    )
    parser.add_argument(
        "--shard-group-size", type=int, default=None, help="hybrid sharding (ZeroStrategy(shard_group_size=K)): the "
        "model states are sharded over groups of K ranks and replicated across the groups; the table is per rank of "
        "such a group, and the communication per rank is split into inside its group and across groups"
    )
    parser.add_argument(
        "--hpz-group-size", type=int, default=None, help="zero3 with ZeRO++'s hpZ (ZeroStrategy(hpz_group_size=K2)): "
        "the memory the secondary shards add per rank from a unit's forward to its backward, and the backward "
        "all-gather's bytes inside groups of K2 ranks (it must divide --shard-group-size, else --ranks, and be "
        "smaller); with --measure, zero3's peak counts them"
    )
    parser.add_argument(
        "--link-gbps", type=float, default=None, help="the bandwidth between two nodes, Gbit/s each way (with "
        "--ranks-per-node below --ranks): per option, the bytes a node sends across per step with flat sharding, "
        "hybrid sharding (one shard group a node) and ZeRO++'s options, the seconds the link takes for them and the "
        "modelled step, and which layout makes the shortest (the link model of strategy=auto's link_gbps); needs "
        "the step's compute: --step-s, or --measure"
    )
    parser.add_argument(
        "--step-s", type=float, default=None, help="with --link-gbps: seconds a rank computes one step (forward and "
        "backward); default with --measure: the measured step at --batch-size"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with --model or --recipe: run one real step of the model on a tiny batch (in a fresh process, on this "
        "machine's CPU or GPU 0) and predict each option's whole peak per rank: the process baseline, activations "
        "scaled to --batch-size, gathered units, buckets and the optimizer's workspace besides the model states",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="with --measure: sequences per rank and step (default: the "
        "config's data.batch_size)"
    )
    parser.add_argument(
        "--eager", action="store_true", help="with --measure: the model is built in full before setup (in "
        "__init__), so stage 3 holds it until it is sharded (default: built in configure_model, as LanguageModel does)"
    )
    parser.set_defaults(run=estimate_command)


def estimate_command(args: argparse.Namespace) -> int:
    total, trainable, what = _estimate_size(args)
    ranks = args.ranks if args.ranks is not None else _default_ranks()
    peak = _measured_step(args) if args.measure else None
    world, group = ranks, args.shard_group_size
    if args.quantize_grads is not None and group is not None:
        raise UsageError("--quantize-grads with --shard-group-size: hybrid sharding refuses quantize_grads; give the "
                         "node layout with --ranks-per-node")
    if group is not None:
        if group < 1 or ranks % group:
            raise UsageError(f"--shard-group-size={group} is invalid for --ranks={ranks}: it must divide the number of "
                             "ranks")
        ranks = group  # the model states are sharded over one group
    hpz = args.hpz_group_size
    if hpz is not None and (hpz < 1 or hpz >= ranks or ranks % hpz):
        over = "--shard-group-size" if group is not None else "--ranks"
        raise UsageError(f"--hpz-group-size={hpz} is invalid for {over}={ranks}: it must divide it and be smaller")
    try:
        if args.trainable is not None:
            trainable = estimate.parse_count(args.trainable)
        options = estimate.IN_DEVICE_OPTIONS if args.no_offload else estimate.OPTIONS
        if group is not None:
            options = tuple(o for o in options if estimate.LAYOUTS[o].stage >= 1)
        estimate.estimate_all(total, ranks, args.precision, args.bucket_mb, trainable, options)  # bad input first
        budget, host, per_node = _rank_budget(args, ranks)
        estimates = estimate.estimate_all(total, ranks, args.precision, args.bucket_mb, trainable, options,
                                          host_run=budget.shared_host,
                                          host_budget=budget.device if budget.shared_host else budget.host)
        recommendation = estimate.recommend(total, ranks, budget, args.precision, args.bucket_mb, trainable, options,
                                            peak=peak)
        shared_host = not _on_cuda()
        peaks = [
            estimate.peak_estimate(o, total, ranks, peak.measure, peak.batch, args.precision, args.bucket_mb,
                                   trainable, eager=peak.eager, shared_host=shared_host, hpz_group_size=hpz)
            for o in options
        ] if peak is not None else None
    except estimate.EstimateError as err:
        raise UsageError(str(err)) from None
    print(format_table(what, total, trainable, ranks, args.precision, estimates, budget))
    print(f"host budget: {host.describe(per_node)}")
    planned = [e for e in estimates if e.subgroups is not None]  # the recommended option's, else the last one's
    disk = next((e for e in planned if e.option == recommendation.choice), planned[-1] if planned else None)
    if disk is not None:
        print(f"disk offload ({disk.option}): {disk.subgroups.describe()}")
    if group is not None:
        print("\n" + format_hybrid(total, trainable, world, group, args.precision, options, args.quantize_weights))
    if hpz is not None:
        print("\n" + format_hpz(total, ranks, hpz, args.precision))
    if args.quantize_weights and group is None:
        print("\n" + format_qwz(total, trainable, ranks, args.precision, hpz))
    if args.quantize_grads is not None:
        print("\n" + format_qgz(trainable, ranks, args.ranks_per_node or ranks, args.precision, args.quantize_grads))
    if peaks is not None:
        print("\n" + format_peaks(peaks, peak))
    if args.link_gbps is not None:
        print("\n" + format_link(args, total, trainable, world, peak, recommendation))
    print(f"\nrecommendation: {recommendation.explain()}")
    if recommendation.choice is not None:
        registered = frozenset(StrategyRegistry.available_strategies())
        print(f"select it with: {estimate.how_to_select(recommendation.choice, registered)}")
    return 0


def _estimate_size(args: argparse.Namespace) -> tuple[int, int, str]:
    if args.params is not None:
        try:
            count = estimate.parse_count(args.params)
        except estimate.EstimateError as err:
            raise UsageError(str(err)) from None
        return count, count, f"{count:,} parameters"
    override = f"model={args.model}" if args.model is not None else f"recipe={args.recipe}"
    counts = instantiate("model", compose([override]).model).parameter_counts()
    what = f"model {args.model}" if args.model is not None else f"recipe {args.recipe}"
    return counts.total, counts.trainable, f"{what} ({counts.total:,} parameters)"


def _measured_step(args: argparse.Namespace) -> estimate.PeakInputs:
    """One real step of the ``--model``/``--recipe`` model on a tiny batch (``step_measure``), and the run's batch."""
    from lightning_zero.step_measure import measure_step

    if args.params is not None:
        raise UsageError("--measure needs --model or --recipe: a parameter count alone has no model to run")
    cfg = compose([f"model={args.model}" if args.model is not None else f"recipe={args.recipe}"])
    batch = args.batch_size if args.batch_size is not None else int(cfg.data.batch_size)
    if batch < 1:
        raise UsageError(f"--batch-size={batch} is invalid: it must be an integer >= 1")
    model_config = instantiate("model", cfg.model).model_config
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is None:
        raise UsageError(f"--measure: the model config {type(model_config).__name__} has no vocab_size")
    units = tuple(cfg.strategy.get("units", ()) or ())
    measure = measure_step(model_config, vocab, int(cfg.seq_len), "cuda:0" if _on_cuda() else "cpu", units)
    return estimate.PeakInputs(measure, batch, args.eager)


def format_hybrid(total: int, trainable: int, world: int, group: int, precision: str, options: tuple[str, ...],
                  quantize_weights: bool = False) -> str:
    """Per option, the bytes one rank moves per step inside its shard group and across groups (zero3's gathers as
    int8 blocks with ``quantize_weights``, offloaded or not: offload moves the same bytes)."""
    element = estimate.working_bytes(precision)
    lines = [f"hybrid sharding: {world // group} groups of {group} ranks (the table above is per rank of a group); "
             "communication per rank and step (ring-equivalent; with one group per node, 'across groups' is what "
             "crosses nodes):", "", f"{'option':<28}{'inside its group':>18}{'across groups':>16}"]
    for option in options:
        qwz = quantize_weights and estimate.LAYOUTS[option].stage == 3
        inside, across = estimate.hybrid_communication_bytes(option, total, world, group, element, trainable, qwz)
        option = option + " (qwZ)" if qwz else option
        lines.append(f"{option:<28}{estimate.format_bytes(inside):>18}{estimate.format_bytes(across):>16}")
    return "\n".join(lines)


def format_hpz(total: int, ranks: int, hpz: int, precision: str) -> str:
    """hpZ under zero3: the secondary shards' bytes per rank (on the training device, with offload too: they are
    slices of the gathered units), and the backward all-gather inside the hpZ group in place of the one over the
    ``ranks`` that shard the model (ring-equivalent bytes per rank and step)."""
    element, fmt = estimate.working_bytes(precision), estimate.format_bytes
    inside, instead = total * element * (hpz - 1) // hpz, total * element * (ranks - 1) // ranks
    secondary = estimate.hpz_bytes(total, precision, hpz)
    return (f"hpZ (hpz_group_size={hpz}, zero3): the secondary shards add {fmt(secondary)} per rank on the "
            f"training device, offloaded or not, from a unit's forward to its backward (Psi * b / {hpz}); the "
            f"backward all-gather moves "
            f"{fmt(inside)} per rank and step inside groups of {hpz} ranks (none across them) instead "
            f"of {fmt(instead)} over the {ranks} ranks that shard the model")


def format_qwz(total: int, trainable: int, ranks: int, precision: str, hpz: int | None) -> str:
    """qwZ under flat zero3: the bytes one rank moves per step with its all-gathers as int8 blocks, against the same
    run's in the working dtype (ring-equivalent, ``estimate.communication_bytes``; with hpZ the backward's gathers
    come from the secondary shards, unquantized)."""
    element, fmt = estimate.working_bytes(precision), estimate.format_bytes
    full, quantized = (estimate.communication_bytes("zero3", total, ranks, element, trainable, qwz, hpz)
                       for qwz in (False, True))
    gathers = "the forward's all-gathers" if hpz is not None else "every all-gather"
    return (f"qwZ (quantize_weights, zero3): with {gathers} as int8 blocks a rank moves {fmt(quantized)} per step "
            f"instead of {fmt(full)} ({precision}, {ranks} ranks)")


def format_qgz(trainable: int, ranks: int, node_size: int, precision: str, quantize_grads: str) -> str:
    """qgZ: the bytes one rank sends per step in the gradient reduce, inside its node and across nodes, beside the
    full-precision reduce-scatter's (ring-equivalent, all of it; the same for zero1, zero2 and zero3, offloaded or
    not)."""
    if node_size < 1 or ranks % node_size:
        raise UsageError(f"--ranks-per-node={node_size} is invalid for --ranks={ranks}: it must divide the number of "
                         "ranks")
    try:
        inside, across = estimate.quantized_reduce_bytes(trainable, ranks, node_size, int(quantize_grads[3:]))
    except estimate.EstimateError as err:
        raise UsageError(str(err)) from None
    full = trainable * estimate.working_bytes(precision) * (ranks - 1) // ranks
    fmt = estimate.format_bytes
    return (f"qgZ ({quantize_grads}) over {ranks // node_size} node(s) of {node_size} ranks: the gradient reduce "
            f"sends per rank and step {fmt(inside)} inside its node (int8) and {fmt(across)} across nodes "
            f"({quantize_grads}; {fmt(full)} in "
            f"all unquantized, {precision})")


def format_link(args: argparse.Namespace, total: int, trainable: int, ranks: int, peak: estimate.PeakInputs | None,
                recommendation: estimate.Recommendation | None) -> str:
    """Between nodes (``link_model``): each in-device option laid out flat, hybrid (one shard group a node) and with
    ZeRO++'s options, with the bytes a node sends across per step, the link's seconds and the modelled step; the
    shortest (the least complex on a near tie) among the options that fit the budget, if one was given."""
    from lightning_zero import link_model

    node = args.ranks_per_node
    if node is None or node >= ranks:
        raise UsageError(f"--link-gbps needs several nodes: give --ranks-per-node below --ranks={ranks}")
    compute_s = args.step_s if args.step_s is not None else peak.measure.compute_s(peak.batch) if peak else None
    if compute_s is None:
        raise UsageError("--link-gbps needs the step's compute time: give --step-s, or --measure with --model")
    fits = {e.option for e in recommendation.estimates if recommendation.budget.fits(e)} if recommendation else None
    try:
        rows = [row for option in estimate.IN_DEVICE_OPTIONS for row in link_model.link_options(
            option, total, trainable, ranks, node, estimate.working_bytes(args.precision), args.link_gbps, compute_s)]
    except estimate.EstimateError as err:
        raise UsageError(str(err)) from None
    lines = [f"between {ranks // node} nodes of {node} ranks at {args.link_gbps:g} Gbit/s each way, {compute_s:.3g} s "
             f"of compute a step ({args.precision}; the link model: lightning_zero/link_model.py):", "",
             f"{'option':<10}{'layout':<9}{'across a node':>15}{'link s':>10}{'step s':>10}  settings"]
    for row in rows:
        settings = ", ".join(f"{k}={v!r}" for k, v in row.settings)
        lines.append(f"{row.option:<10}{row.kind:<9}{row.node_bytes / 1e6:>12,.2f} MB{row.link_s:>10.3f}"
                     f"{row.step_s:>10.3f}  {settings}")
    candidates = [row for row in rows if fits is None or row.option in fits]
    if candidates:
        best = link_model.choose(candidates)
        fitting = "" if fits is None else " among the options that fit the budget"
        lines += ["", f"between nodes{fitting}: {best.option} {best.kind} makes the shortest step"]
    return "\n".join(lines)


def format_peaks(peaks: list, inputs: estimate.PeakInputs) -> str:
    """Each option's predicted peak per rank, the phase it comes in, and the terms it is made of."""
    m, fmt = inputs.measure, estimate.format_bytes
    lines = [
        f"peak per rank, measured step: baseline {fmt(m.baseline)}, activations {fmt(m.activations(inputs.batch))} "
        f"at {inputs.batch} sequences per rank, largest unit {m.unit_elements:,} elements; model built "
        + ("eagerly" if inputs.eager else "in configure_model"),
        "",
        f"{'option':<22}{'peak':>11}  {'in phase':<16}" + "".join(f"{t:>12}" for t in peaks[0].terms),
    ]
    for p in peaks:
        lines.append(f"{p.states.option:<22}{fmt(p.peak):>11}  {p.peak_phase:<16}"
                     + "".join(f"{fmt(v):>12}" for v in p.terms.values()))
    lines.append("terms: the formula of each phase adds them up, except that stage 3's steps hold the larger of "
                 "activations + reductions and workspace (lightning_zero/peak_model.py, [Note: the peak of a run])")
    return "\n".join(lines)


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _rank_budget(args: argparse.Namespace, ranks: int) -> tuple[estimate.Budget, HostMemory, int]:
    """The device budget, and with offload the host and disk budgets per rank; the host budget and the ranks that
    share it. On CPU, without ``--budget-gb``, the device is host memory: its budget is the host budget's share,
    against which host and device bytes count together."""
    per_node = args.ranks_per_node if args.ranks_per_node is not None else ranks
    if per_node < 1:
        raise UsageError(f"--ranks-per-node={per_node} is invalid: it must be an integer >= 1")
    device = _estimate_budget(args.budget_gb)
    machine = host_memory()
    host_share = machine.per_rank(per_node)
    # A measured peak on the CPU counts every byte of the process: there the device is host memory.
    shared_host = (args.measure or device is None) and not _on_cuda()
    if device is None:
        device = host_share
    if args.no_offload:
        return estimate.Budget(device), machine, per_node
    host = _gib_argument("--host-budget-gb", args.host_budget_gb) or host_share
    disk = _gib_argument("--disk-budget-gb", args.disk_budget_gb)
    if disk is None:
        where = args.offload_dir if args.offload_dir is not None else tempfile.gettempdir()
        try:
            disk = shutil.disk_usage(where).free // per_node or None
        except OSError as err:
            raise UsageError(f"--offload-dir={where!r} is invalid: {err.strerror}") from None
    return estimate.Budget(device, host, disk, shared_host=shared_host), machine, per_node


def _estimate_budget(budget_gb: float | None) -> int | None:
    """``--budget-gb``, else the free memory of GPU 0; None on a CPU-only machine (the host budget then)."""
    from lightning_zero.auto import cuda_free_bytes

    if budget_gb is None:
        return cuda_free_bytes(0) if _on_cuda() else None
    return _gib_argument("--budget-gb", budget_gb)


def _gib_argument(flag: str, value: float | None) -> int | None:
    if value is None:
        return None
    # inf would overflow the byte count and nan compares false with everything: both are refused here.
    if not 0 < value < math.inf:
        raise UsageError(f"{flag}={value} is invalid: it must be a number of GiB > 0 and finite")
    if value * 2**30 < 1:
        raise UsageError(f"{flag}={value} is invalid: it must be at least one byte (2^-30 GiB)")
    return int(value * 2**30)


def _default_ranks() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def format_table(
    what: str, total: int, trainable: int, ranks: int, precision: str, estimates: tuple, budget: estimate.Budget | None
) -> str:
    """The ``lightning-zero estimate`` table: one row per option, its bytes by kind and by placement, and whether it
    fits ``budget`` ("-": it needs host memory or disk the budget does not offer)."""
    frozen = f", {trainable:,} trainable" if trainable != total else ""
    kinds = ("params", "grads", "optimizer", "buckets", "device", "host", "disk")
    head = f"{'option':<22}" + "".join(f"{k:>11}" for k in kinds)
    lines = [
        f"{what}{frozen}, {ranks} ranks, precision {precision}: model states per rank (Adam; activations not included)",
        "",
        head + ("  fits" if budget is not None else ""),
    ]
    for e in estimates:
        cells = [estimate.format_bytes(b) for b in (e.params, e.grads, e.optimizer, e.buckets, e.device, e.host_total, e.disk)]
        fits = ""
        if budget is not None:
            fits = "  " + ("yes" if budget.fits(e) else "no" if budget.offers(e) else "-")
        lines.append(f"{e.option:<22}" + "".join(f"{c:>11}" for c in cells) + fits)
    lines += [
        "",
        "params, grads, optimizer: each kind wherever it lives; device: what stays on the device, buckets included;",
        "host: offloaded states and offload's host buffers (staging, disk offload's resident sub-groups)",
    ]
    if budget is not None:
        lines.append("budget per rank: " + _describe_budget(budget))
    return "\n".join(lines)


def _describe_budget(budget: estimate.Budget) -> str:
    def amount(value: int | None) -> str:
        return "not offered" if value is None else estimate.format_bytes(value)

    if budget.shared_host:
        return f"{estimate.format_bytes(budget.device)} of memory (the device is host memory), disk {amount(budget.disk)}"
    return f"device {estimate.format_bytes(budget.device)}, host {amount(budget.host)}, disk {amount(budget.disk)}"
