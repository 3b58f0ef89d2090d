"""The learning-rate sweep's report: ``results.csv``, ``table.md`` and two plots.

A sweep varies three knobs (peak LR, warm-up, depth); each table and each panel of
``val_loss_vs_lr.png`` is one *slice*: the cells that differ in one knob with the other two
fixed, so every comparison on it is at equal budget. ``loss_curves.png`` has one panel per
(depth, warm-up, LR) with every scheme's training loss.

Kept apart from the runner so the report can be rebuilt from finished cells alone
(``python -m lab.lr_sweep --preset ... --report-only``). matplotlib is not a dependency of
training, so it is imported only when a plot is drawn (headless); without it the CSV and the
table are still written and the plots are skipped with one warning line.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from model.schemes import ResidualScheme
from runtime.markdown import markdown_table

COLUMNS = ["name", "grid", "scheme", "layers", "lr", "warmup", "status", "final_val_loss",
           "val_loss_step0", "final_train_loss", "max_grad_norm", "skipped_steps",
           "loss_spikes", "merge_x_share", "merge_cosine", "steps_logged", "tokens_per_s",
           "wall_s", "returncode", "seed", "commit"]
ORDER = [s.value for s in ResidualScheme]
# Runs that trained to the end but did not learn: NaN/Inf or no better than at step 0
# ("diverged"), or stuck above the preset's collapse_loss ("collapsed").
FAILED_TRAINING = ("diverged", "collapsed")
KNOBS = ("lr", "layers", "warmup")
AXIS = {"lr": "peak learning rate", "layers": "blocks", "warmup": "warm-up steps"}


def scheme_key(scheme: str) -> int:
    return ORDER.index(scheme) if scheme in ORDER else len(ORDER)


def fixed_text(knob: str, fixed: dict) -> str:
    parts = {"layers": f"{fixed.get('layers')} blocks", "warmup": f"warm-up {fixed.get('warmup')}",
             "lr": f"lr {fixed.get('lr', 0):g}"}
    return ", ".join(parts[k] for k in ("layers", "warmup", "lr") if k != knob)


def slices(rows: list[dict], knob: str, minimum: int = 2) -> list[tuple[dict, list[dict]]]:
    """Groups of rows that share the two other knobs and take >= ``minimum`` values of
    ``knob``; for depth and warm-up only the schemes run at two or more values stay."""
    others = [k for k in KNOBS if k != knob]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in others), []).append(row)
    out = []
    for key in sorted(groups, key=lambda k: (k[0], -k[1]) if others == ["layers", "warmup"]
                      else k):
        subset = groups[key]
        if knob != "lr":
            counts = {s: len({r[knob] for r in subset if r["scheme"] == s})
                      for s in {r["scheme"] for r in subset}}
            subset = [r for r in subset if counts[r["scheme"]] >= 2]
        if len({r[knob] for r in subset}) >= minimum:
            out.append((dict(zip(others, key, strict=True)), subset))
    return out


def cell_text(row: dict | None) -> str:
    if row is None:
        return ""
    loss = row["final_val_loss"]
    if row["status"] in FAILED_TRAINING:
        return row["status"] + (f" ({loss:.3f})" if math.isfinite(loss) else "")
    return f"{loss:.3f}" if row["status"] == "ok" else row["status"]


def value_text(knob: str, value) -> str:
    return {"lr": f"lr {value:g}", "layers": f"{value} blocks", "warmup": f"warm-up {value}"}[knob]


def best_row(rows: list[dict]) -> dict | None:
    """The trained row with the lowest final validation loss."""
    trained = [r for r in rows if r["status"] == "ok" and math.isfinite(r["final_val_loss"])]
    return min(trained, key=lambda r: r["final_val_loss"]) if trained else None


def slice_table(rows: list[dict], knob: str, bold_best: bool = False,
                every: tuple[str, ...] = ()) -> str:
    """Final validation loss, schemes x the values of ``knob`` in one slice (the other two
    knobs fixed); with ``bold_best`` the lowest loss in bold; a scheme of ``every`` without a
    cell in the slice gets a row saying "not run" (a scheme registered after the sweep ran)."""
    values = sorted({r[knob] for r in rows})
    lookup = {(r["scheme"], r[knob]): r for r in rows}
    best = best_row(rows) if bold_best else None
    table = []
    ran = {r["scheme"] for r in rows}
    for scheme in sorted(ran | set(every), key=scheme_key):
        if scheme not in ran:
            table.append([scheme, *("not run" for _ in values)])
            continue
        cells = []
        for value in values:
            row = lookup.get((scheme, value))
            text = cell_text(row)
            cells.append(f"**{text}**" if best is not None and row is best else text)
        table.append([scheme, *cells])
    return markdown_table(["scheme", *(value_text(knob, v) for v in values)], table)


def markdown_tables(rows: list[dict]) -> str:
    """Final validation loss, schemes x knob values: by peak LR for every (depth, warm-up),
    then by depth and by warm-up wherever the sweep varied them."""
    parts = []
    for knob, minimum in (("lr", 1), ("layers", 2), ("warmup", 2)):
        for fixed, subset in slices(rows, knob, minimum):
            parts.append(f"{fixed_text(knob, fixed)}: final validation loss by "
                         f"{AXIS[knob]}\n")
            parts.append(slice_table(subset, knob))
            parts.append("")
    return "\n".join(parts)


def _smooth(values: list[float], width: int = 10) -> list[float]:
    out, window = [], []
    for value in values:
        window = [*window[-(width - 1):], value]
        finite = [v for v in window if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


# matplotlib's tab10, then tab20's lighter shades: one distinct colour per registered scheme
# (a test holds every scheme to its own colour, so a registry past 20 must extend this).
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ff9896", "#98df8a", "#c5b0d5",
           "#ffbb78", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]


def scheme_colors() -> dict[str, str]:
    return {scheme: PALETTE[i % len(PALETTE)] for i, scheme in enumerate(ORDER)}


class PlottingUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable("the sweep's plots need matplotlib, which is not installed "
                                  "(pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Narrower figures than this are unreadable (a one-panel sweep used to be 288 px wide).
MIN_WIDTH_IN = 7.5


def _figure(plt, panels: int, height: float):
    """A grid of up to four panels per line, at least MIN_WIDTH_IN wide."""
    columns = min(4, panels)
    lines = math.ceil(panels / columns)
    width = max(3.6 * columns, MIN_WIDTH_IN)
    fig, axes = plt.subplots(lines, columns, figsize=(width, height * lines), squeeze=False)
    return fig, axes


def _legend(fig, plt, schemes: list[str], note: str, note_style: dict) -> None:
    """One legend for the whole figure, right of the panels (panels differ in their schemes);
    the figure is saved with bbox_inches="tight", so it is never clipped."""
    colors = scheme_colors()
    handles = [plt.Line2D([], [], color=colors.get(s), marker="o", markersize=4, label=s)
               for s in schemes]
    handles.append(plt.Line2D([], [], color="black", label=note, **note_style))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               frameon=False)


def _failed_y(row: dict, top: float) -> float:
    """Where a failed run's x goes: at its loss (collapsed), else above the panel (diverged)."""
    return row["final_val_loss"] if math.isfinite(row["final_val_loss"]) else top


def _top(subset: list[dict]) -> float:
    """A height just above every finished run's loss, for the runs that have none."""
    ok = [r["final_val_loss"] for r in subset if r["status"] == "ok"]
    return max(ok) + 0.1 * (max(ok) - min(ok) + 0.1) if ok else 1.0


def _draw_curves(ax, knob: str, subset: list[dict], values: list) -> None:
    """One line per scheme over the knob's values (a log axis for the LR)."""
    colors = scheme_colors()
    position = (lambda v: v) if knob != "warmup" else values.index
    top = _top(subset)
    schemes = sorted({r["scheme"] for r in subset}, key=scheme_key)
    for i, scheme in enumerate(schemes):
        mine = sorted((r for r in subset if r["scheme"] == scheme), key=lambda r: r[knob])
        shift = (i - (len(schemes) - 1) / 2) / max(len(schemes), 1)
        def nudge(v, shift=shift):  # noqa: E306 - small per-scheme offset of a failed marker
            if knob == "lr":
                return v * (1 + 0.12 * shift)
            return position(v) + (0.6 if knob == "layers" else 0.15) * shift
        good = [r for r in mine if r["status"] == "ok"]
        ax.plot([position(r[knob]) for r in good], [r["final_val_loss"] for r in good], "o-",
                color=colors.get(scheme), markersize=4)
        bad = [r for r in mine if r["status"] in FAILED_TRAINING]
        ax.plot([nudge(r[knob]) for r in bad], [_failed_y(r, top) for r in bad], "x",
                color=colors.get(scheme), markersize=8, markeredgewidth=2)
    if knob == "lr":
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks([position(v) for v in values], [f"{v:g}" for v in values])
    if knob == "warmup":
        ax.set_xlim(-0.5, len(values) - 0.5)
    ax.set_xlabel(AXIS[knob])


def _draw_schemes(ax, knob: str, subset: list[dict]) -> None:
    """A slice with one value of its knob (a sweep of one LR) is a comparison of schemes,
    not a curve: one labelled position per scheme, the value in the axis label. (On a
    knob axis every scheme would share one tick, and the sideways nudge that keeps failed
    runs apart would fill the whole axis, so no marker would sit at the tick.)"""
    colors = scheme_colors()
    top = _top(subset)
    schemes = sorted({r["scheme"] for r in subset}, key=scheme_key)
    for x, scheme in enumerate(schemes):
        for row in (r for r in subset if r["scheme"] == scheme):
            if row["status"] == "ok":
                ax.plot([x], [row["final_val_loss"]], "o", color=colors.get(scheme))
            elif row["status"] in FAILED_TRAINING:
                ax.plot([x], [_failed_y(row, top)], "x", color=colors.get(scheme),
                        markersize=8, markeredgewidth=2)
    ax.set_xticks(range(len(schemes)), schemes, fontsize=8)
    ax.set_xlim(-0.5, len(schemes) - 0.5)
    ax.set_xlabel(f"scheme, at {value_text(knob, subset[0][knob])}")


def draw_slice(ax, knob: str, subset: list[dict]) -> None:
    """Final validation loss against one knob; a failed run is an x at its loss (collapsed)
    or above the panel (diverged), nudged sideways per scheme so that none hides another.
    A knob with one value draws the schemes side by side instead (:func:`_draw_schemes`)."""
    values = sorted({r[knob] for r in subset})
    if len(values) == 1:
        _draw_schemes(ax, knob, subset)
    else:
        _draw_curves(ax, knob, subset, values)
    ax.set_ylabel("final validation loss")
    ax.grid(alpha=0.3)


def plot_val_vs_lr(rows: list[dict], path: Path) -> None:
    """Panels: final validation loss against peak LR for each (depth, warm-up) with two or
    more LRs, then against depth and warm-up where those vary (or every (depth, warm-up) if
    nothing varies)."""
    plt = _pyplot()
    panels = [("lr", f, s) for f, s in slices(rows, "lr")]
    panels += [(k, f, s) for k in ("layers", "warmup") for f, s in slices(rows, k)]
    if not panels:
        panels = [("lr", f, s) for f, s in slices(rows, "lr", 1)]
    fig, axes = _figure(plt, len(panels), 3.1)
    for ax, (knob, fixed, subset) in zip(axes.flat, panels, strict=False):
        draw_slice(ax, knob, subset)
        by = AXIS[knob].replace("peak ", "") if len({r[knob] for r in subset}) > 1 else "scheme"
        ax.set_title(f"by {by}: {fixed_text(knob, fixed)}", fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    schemes = sorted({r["scheme"] for r in rows}, key=scheme_key)
    fig.tight_layout()
    _legend(fig, plt, schemes, "collapsed (at its loss) / diverged (on top)",
            {"marker": "x", "linestyle": "none"})
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def plot_loss_curves(rows: list[dict], curves: dict[str, list[dict]], path: Path) -> None:
    plt = _pyplot()
    panels = sorted({(r["layers"], r["warmup"], r["lr"]) for r in rows},
                    key=lambda p: (p[0], -p[1], p[2]))
    fig, axes = _figure(plt, len(panels), 2.8)
    colors = scheme_colors()
    for ax, (layers, warmup, lr) in zip(axes.flat, panels, strict=False):
        low, start = math.inf, -math.inf
        for row in sorted((r for r in rows if (r["layers"], r["warmup"], r["lr"])
                           == (layers, warmup, lr)), key=lambda r: scheme_key(r["scheme"])):
            steps = {m["step"]: m["loss"] for m in curves.get(row["name"], []) if "loss" in m}
            xs = sorted(steps)
            ys = _smooth([steps[s] for s in xs])
            finite = [y for y in ys if math.isfinite(y)]
            if finite:
                low, start = min(low, min(finite)), max(start, finite[0])
            style = ":" if row["status"] in FAILED_TRAINING else "-"
            ax.plot(xs, ys, style, color=colors.get(row["scheme"]), linewidth=1.1)
        if math.isfinite(low):
            ax.set_ylim(low - 0.1, start + 0.2)
        ax.set_title(f"{layers} blocks, warm-up {warmup}, lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (10-step mean)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    schemes = sorted({r["scheme"] for r in rows}, key=scheme_key)
    fig.tight_layout()
    _legend(fig, plt, schemes, "collapsed or diverged", {"linestyle": ":"})
    fig.savefig(path, dpi=72, bbox_inches="tight")
    plt.close(fig)


def write_report(out: Path, rows: list[dict], curves: dict[str, list[dict]]) -> None:
    """Write results.csv, table.md and the two PNGs under ``out`` (nothing without rows)."""
    if not rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "table.md").write_text(markdown_tables(rows))
    try:
        plot_val_vs_lr(rows, out / "val_loss_vs_lr.png")
        plot_loss_curves(rows, curves, out / "loss_curves.png")
    except PlottingUnavailable as err:
        print(f"warning: {err}; wrote results.csv and table.md only", file=sys.stderr)
