"""The benchmark's figure: step time and per-rank memory per approach, and how both grow with model size and ranks.

Importing this module needs matplotlib (an optional dependency); report.py skips the plot when it is missing.
"""

from __future__ import annotations

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MB = 2**20

_COLORS = {"none": "#7f7f7f", "zero1": "#1f77b4", "zero2": "#2ca02c", "zero3": "#d62728", "zero3-noreshard": "#9467bd"}
_MARKERS = {"lz": "o", "ds": "s", "fsdp2": "^", "torch": "D", "ddp": "v", "lit": "P", "single": "x"}


def _style(name: str, family: str) -> dict:
    prefix = "lz" if name.startswith("lz_") else "ds" if name.startswith("ds_") else "fsdp2" if name.startswith(
        "fsdp2") else "torch" if name == "torch_zero1" else "lit" if name.startswith("lit") else "single" if (
        name == "single") else "ddp"
    return dict(color=_COLORS.get(family, "k"), marker=_MARKERS[prefix],
                linestyle="-" if prefix == "lz" else "--", linewidth=2.2 if prefix == "lz" else 1.0)


def plot(results: dict, summary: dict, path: str) -> None:
    labels = results["labels"]
    configs = results["configs"]
    main = next((c for c in configs if c["purpose"] == "main"), configs[0])
    rows = summary[main["name"]]
    order = [n for n in labels if rows.get(n, {}).get("ok")]
    fig, axes = plt.subplots(3, 2, figsize=(15, 16))

    # (a) step time per approach, main configuration
    ax = axes[0][0]
    ys = range(len(order))
    med = [1000 * rows[n]["step_s"] for n in order]
    lo = [1000 * (rows[n]["step_s"] - rows[n]["step_min"]) for n in order]
    hi = [1000 * (rows[n]["step_max"] - rows[n]["step_s"]) for n in order]
    colors = [_COLORS.get(labels[n]["family"], "k") for n in order]
    ax.barh(list(ys), med, xerr=[lo, hi], color=colors, alpha=0.85, capsize=3)
    ax.set_yticks(list(ys), [labels[n]["label"] for n in order], fontsize=8)
    ax.invert_yaxis()
    for y, n in zip(ys, order):
        if n.startswith("lz_"):
            ax.get_yticklabels()[y].set_fontweight("bold")
    ax.set_xlabel("median step time, ms (bars: min-max over timed steps of all rounds)")
    ax.set_title(f"{main['name']}: step time ({main['world']} ranks)")

    # (b) per-rank memory per approach, main configuration
    ax = axes[0][1]
    p = [rows[n]["params"] / MB for n in order]
    g = [rows[n]["grads"] / MB for n in order]
    o = [rows[n]["optim"] / MB for n in order]
    ax.barh(list(ys), p, color="#1f77b4", label="params")
    ax.barh(list(ys), g, left=p, color="#2ca02c", label="grads")
    ax.barh(list(ys), o, left=[a + b for a, b in zip(p, g)], color="#ff7f0e", label="optimizer states")
    ax.scatter([rows[n]["all_tensors"] / MB for n in order], list(ys), marker="|", s=200, color="k",
               label="all live tensors", zorder=3)
    ax.scatter([rows[n]["train_peak_above_base"] / MB for n in order], list(ys), marker="*", s=80,
               color="#d62728", label="peak RSS in training, above base", zorder=3)
    ax.set_yticks(list(ys), [labels[n]["label"] for n in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MB per rank (largest rank), after backward")
    ax.set_title(f"{main['name']}: per-rank memory")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.4, -0.1), ncol=3, frameon=False)

    legend = {}

    def lines(ax_t, ax_m, cfgs, x_of, xlabel, title, ticks):
        names = [n for n in labels if sum(1 for c in cfgs if summary[c["name"]].get(n, {}).get("ok")) >= 2]
        for n in names:
            pts = sorted(((x_of(c, summary[c["name"]][n]), summary[c["name"]][n]) for c in cfgs
                          if summary[c["name"]].get(n, {}).get("ok")), key=lambda p: p[0])
            st = _style(n, labels[n]["family"])
            (h,) = ax_t.plot([x for x, _ in pts], [1000 * r["step_s"] for _, r in pts], **st)
            ax_m.plot([x for x, _ in pts], [r["model_state"] / MB for _, r in pts], **st)
            legend.setdefault(labels[n]["label"], h)
        for ax, ylabel in ((ax_t, "median step time, ms"),
                           (ax_m, "model state per rank, MB (params + grads + optimizer)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())

    size_cfgs = [c for c in configs if c["purpose"] in ("size", "main") and c["world"] == main["world"]]
    if len(size_cfgs) >= 2:
        measured = [c for c in size_cfgs if any(r.get("ok") for r in summary[c["name"]].values())]
        ticks = sorted({(next(r["n_params"] for r in summary[c["name"]].values() if r.get("ok")) / 1e6,
                         c["size"]["name"]) for c in measured})
        lines(axes[1][0], axes[1][1], size_cfgs, lambda c, r: r["n_params"] / 1e6, "parameters, millions",
              f"growth with model size ({main['world']} ranks)", [(t, f"{n}\n{t:.1f}M") for t, n in ticks])
    else:
        axes[1][0].set_axis_off()
        axes[1][1].set_axis_off()
    rank_cfgs = [c for c in configs if c["purpose"] in ("ranks", "main") and c["size"]["name"] == main["size"]["name"]]
    if len(rank_cfgs) >= 2:
        lines(axes[2][0], axes[2][1], rank_cfgs, lambda c, r: c["world"], "ranks",
              f"growth with rank count (model {main['size']['name']})",
              [(c["world"], str(c["world"])) for c in rank_cfgs])
    else:
        axes[2][0].set_axis_off()
        axes[2][1].set_axis_off()
    fig.suptitle("lightning_zero vs DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed (CPU, gloo, 1 thread per rank)"
                 + ("  [--quick]" if results.get("quick") else ""))
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if legend else 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)
