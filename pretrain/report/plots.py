"""Draws the report's figures (``pretrain.report.panels``) as PNGs with matplotlib.

matplotlib is not a dependency of training (it is the ``sweep`` extra), so it is imported
only here, on the file-only Agg backend, when a report is drawn. Every panel shares the
report's step axis (0 to the run's last step), so figures line up when read one under
another; the top axis of the first row gives the tokens consumed by then. What a reader must
see at a glance is drawn explicitly: a null (NaN/Inf) value is a gap in its line and a tick
at the bottom of the panel, settings changed on resume and rollbacks are vertical lines with
their label (wrapped to stay inside the panel, clear of the tick labels), legends sit right
of the data, never on it, and a spike does not set the axis:
it is clipped to the body of the data (``pretrain.report.outliers``) and what lies beyond is
a marker on the edge, its count and extreme in the legend. Titles wrap to the figure's width,
and the top axis labels the bottom axis's own ticks, so no label is cut or drawn over another.
"""

from __future__ import annotations

import functools
import math
import textwrap
from pathlib import Path

from pretrain.report.outliers import body_range
from pretrain.report.panels import Curve, Figure, Mark, Plot
from pretrain.report.series import RunMetrics, Series, smooth
from runtime.errors import ConfigError

# A curve with at most this many points gets markers: sparse values (validation, diagnostics,
# downstream scores) would otherwise be invisible where a single point sits between gaps.
MARKERS_UP_TO = 60
# A panel asking for a log axis gets one when its values span more than this factor; over a
# narrower range a log axis shows nothing a linear one does not, with worse tick labels.
LOG_FROM = 10.0
PANEL_INCHES = (6.4, 3.4)
# At most this many intervals on the step axis: a panel beside its legend is ~3.5 inches
# wide, room for six labels of six digits (step 120000) and the tokens above them.
STEP_TICKS = 5
DPI = 100
# The mean width of a character in em (DejaVu Sans, matplotlib's default, with caps and
# digits): a title longer than the width it may take at this estimate wraps instead of
# running off the figure's edge.
CHAR_EM = 0.62
# Mark labels (rollbacks, settings changed on resume) run down their line from MARK_TOP to at
# most MARK_BOTTOM (fractions of the panel's height), in at most MARK_LINES lines of at least
# MARK_MIN_CHARS characters: a label that needs more is cut.
MARK_TOP, MARK_BOTTOM = 0.97, 0.03
MARK_LINES = 3
MARK_MIN_CHARS = 12
MARK_FONT = 7


def pyplot():
    """matplotlib's pyplot on the Agg backend; a one-line error naming how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("python -m pretrain report draws with matplotlib, which is not "
                          "installed: pip install 'matplotlib>=3.8' (the project's `sweep` "
                          "extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _linear(x, xs, ys):
    """Piecewise-linear through (xs, ys), extended beyond both ends by the end segments
    (np.interp would clamp, piling every tick past the run's end onto its last step)."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    inside = np.interp(x, xs, ys)
    below = ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
    above = ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.where(x < xs[0], below, np.where(x > xs[-1], above, inside))


def _tokens_axis(ax, consumed: Series | None) -> None:
    """Consumed tokens on the top axis, read off the logged (step, consumed_tokens) pairs, at
    the bottom axis's step ticks: tokens per step change (a rollback that skips data jumps
    ahead), so round token ticks could fall on one step and print over each other. Left out
    unless both grow strictly (then each converts to the other)."""
    import numpy as np
    from matplotlib.ticker import EngFormatter, FixedLocator, FuncFormatter

    points = consumed.finite() if consumed is not None else []
    if points and points[0][0] > 0:
        points.insert(0, (0, 0.0))  # a run starts at no tokens (the first record is step 1)
    if len(points) < 2:
        return
    steps = np.array([p[0] for p in points], dtype=float)
    tokens = np.array([p[1] for p in points], dtype=float)
    if np.any(np.diff(steps) <= 0) or np.any(np.diff(tokens) <= 0):
        return
    top = ax.secondary_xaxis("top", functions=(lambda s: _linear(s, steps, tokens),
                                               lambda t: _linear(t, tokens, steps)))
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    top.xaxis.set_major_locator(FixedLocator(_linear(ticks, steps, tokens)))
    eng = EngFormatter()
    top.xaxis.set_major_formatter(FuncFormatter(lambda t, _: eng(float(f"{t:.3g}"))))
    top.set_xlabel("tokens consumed", fontsize=8)
    top.tick_params(labelsize=7)


def _curve(ax, curve: Curve, metrics: RunMetrics, color, gaps_named: list[bool],
           index: int) -> None:
    """One curve; ``index``: its place in the panel (counters on one panel often hold the
    same counts, so each later one is narrower and dashed over the earlier, both seen)."""
    import numpy as np

    series = metrics.series[curve.key]
    xs = np.array(series.steps, dtype=float)
    ys = np.array(series.values, dtype=float) * curve.scale
    if curve.kind == "events":
        ax.plot(xs, ys, "v", color="tab:red", markersize=6, label=curve.label)
        return
    if curve.kind == "counter":
        ax.step(xs, ys, where="post", color=color, linewidth=max(4.0 - 2 * index, 1.2),
                linestyle="-" if index == 0 else (0, (4, 2)), label=curve.label)
        ax.yaxis.get_major_locator().set_params(integer=True)
    elif curve.smooth > 1:
        ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8, label=f"{curve.label} (raw)")
        ax.plot(xs, smooth(list(ys), curve.smooth), color=color, linewidth=1.6,
                label=f"{curve.label} (mean of {curve.smooth} logged steps)")
    else:
        ax.plot(xs, ys, color=color, linewidth=1.4, markersize=3, label=curve.label,
                marker="o" if len(xs) <= MARKERS_UP_TO else None)
    errors = metrics.series.get(curve.error_key) if curve.error_key else None
    if errors is not None:
        by_step = dict(zip(errors.steps, errors.values, strict=True))
        err = np.array([by_step.get(int(s), math.nan) for s in xs]) * curve.scale
        ax.fill_between(xs, ys - err, ys + err, color=color, alpha=0.2, linewidth=0)
    gaps = xs[~np.isfinite(ys)]
    if len(gaps):  # a gap alone is easy to miss: a tick at the bottom names it
        ax.plot(gaps, np.full(len(gaps), 0.02), "|", color=color, markersize=12,
                markeredgewidth=1.5, transform=ax.get_xaxis_transform(),
                label=None if gaps_named else "non-finite value (null)")
        gaps_named.append(True)


def _plot(plt, fig, ax, plot: Plot, metrics: RunMetrics) -> None:
    curves = [c for c in plot.curves if c.key in metrics.series]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    norm = cmap = None
    if plot.by_depth:
        from matplotlib.colors import Normalize

        cmap = plt.get_cmap("viridis")
        norm = Normalize(0, max(len(curves) - 1, 1))
    finite = []
    gaps_named: list[bool] = []
    for i, curve in enumerate(curves):
        color = cmap(norm(i)) if plot.by_depth else colors[i % len(colors)]
        _curve(ax, curve, metrics, color, gaps_named, i)
        finite += [v * curve.scale for _, v in metrics.series[curve.key].finite()]
    if not finite:
        ax.text(0.5, 0.5, "no finite value logged", transform=ax.transAxes, ha="center",
                va="center", color="gray")
    if plot.threshold is not None:
        ax.axhline(plot.threshold[0], color="gray", linestyle="--", linewidth=1,
                   label=plot.threshold[1])
    body = body_range([[v * c.scale for v in metrics.series[c.key].values]
                       for c in curves if c.kind != "events"])
    if body is not None:
        finite = [v for v in finite if body[0] <= v <= body[1]]
    positive = [v for v in finite if v > 0]
    if plot.log_y and positive and max(positive) > LOG_FROM * min(positive):
        ax.set_yscale("log")
    else:  # values as they are, not as offsets from a "+1" in the corner
        ax.ticklabel_format(axis="y", useOffset=False)
    if body is not None:
        _clip(ax, body, curves, metrics, ax.get_yscale() == "log")
    if plot.by_depth and curves:
        from matplotlib.cm import ScalarMappable

        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.02)
        bar.set_label("block (0 = nearest the input)", fontsize=8)
        bar.ax.tick_params(labelsize=7)
        bar.locator = plt.MaxNLocator(integer=True)
        bar.update_ticks()
    handles, labels = ax.get_legend_handles_labels()
    shown = [(h, lab) for h, lab in zip(handles, labels, strict=True)
             if not (plot.by_depth and lab.startswith("block "))]
    if len(shown) > 1 or (shown and plot.threshold is not None):
        ax.legend(*zip(*shown, strict=True), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=8, frameon=False)
    if plot.title:
        ax.set_title(_wrapped(plot.title, 10, PANEL_INCHES[0] * 0.75), fontsize=10)
    ax.set_ylabel(plot.ylabel, fontsize=9)
    ax.set_xlabel("step", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def _clip(ax, body: tuple[float, float], curves: list[Curve], metrics: RunMetrics,
          log: bool) -> None:
    """The y axis over ``body`` alone; every value beyond it a marker on the edge it lies
    past, one legend entry per edge with the count and the extreme value."""
    low, high = body
    if log and low > 0:
        ax.set_ylim(low / 1.25, high * 1.25)
    else:
        pad = 0.05 * (high - low) or 0.05 * abs(high) or 1.0
        ax.set_ylim(low - pad, high + pad)
    for above, edge, marker in ((True, 1.0, "^"), (False, 0.0, "v")):
        def past(v: float, above=above) -> bool:
            return v > high if above else v < low

        for c in (c for c in curves if c.kind == "events"):  # its own marker, on the edge
            steps = [s for s, v in metrics.series[c.key].finite() if past(v * c.scale)]
            ax.plot(steps, [edge] * len(steps), "v", color="tab:red", markersize=6,
                    clip_on=False, transform=ax.get_xaxis_transform())
        beyond = [(s, v * c.scale) for c in curves if c.kind != "events"
                  for s, v in metrics.series[c.key].finite() if past(v * c.scale)]
        if not beyond:
            continue
        extreme = max(v for _, v in beyond) if above else min(v for _, v in beyond)
        ax.plot([s for s, _ in beyond], [edge] * len(beyond), marker, color="black",
                markersize=6, clip_on=False, transform=ax.get_xaxis_transform(),
                label=f"{len(beyond)} value(s) {'above' if above else 'below'} the axis, "
                      f"{'up' if above else 'down'} to {extreme:.4g}")


def _wrapped(title: str, size: int, inches: float) -> str:
    """``title`` in lines that fit ``inches`` at font ``size``."""
    return "\n".join(textwrap.wrap(title, int(inches * 72 / (CHAR_EM * size))))


def _marks(ax, marks: list[Mark]) -> None:
    """Each mark a line across the panel, with its label along the line (``_mark_label``)."""
    for mark in marks:
        ax.axvline(mark.step, color=mark.color, linestyle=mark.style, linewidth=1)
        label = _mark_label()(mark.step, MARK_TOP, mark.label, rotation=90, va="top",
                              ha="right", fontsize=MARK_FONT, color=mark.color, clip_on=False,
                              transform=ax.get_xaxis_transform(),
                              bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none",
                                    "pad": 1})
        label.set_in_layout(False)  # it fits itself to the panel the layout leaves
        ax.add_artist(label)


@functools.cache
def _mark_label() -> type:
    """The type of a mark's label: a text that fits itself inside its panel each time it is
    drawn, when the figure's layout has set the panel's size: wrapped into at most
    ``MARK_LINES`` lines no taller than the panel (the rest cut with "...": the page's summary
    holds every change whole), left of its line, or right of it where the line is too near
    the panel's left edge (a mark near the run's start). Inside the panel it is never cut by
    the figure's edge nor drawn over the tick labels."""
    from matplotlib.text import Text

    class MarkLabel(Text):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.whole = self.get_text()

        def draw(self, renderer) -> None:
            if self.get_visible():
                self._fit(renderer)
            super().draw(renderer)

        def _fit(self, renderer) -> None:
            panel = self.axes.get_window_extent(renderer)
            room = panel.height * (MARK_TOP - MARK_BOTTOM)
            self.set_horizontalalignment("right")
            width = len(self.whole)
            while True:  # the longest lines that fit, measured as drawn
                self.set_text("\n".join(textwrap.wrap(self.whole, width, max_lines=MARK_LINES,
                                                      placeholder=" ...")))
                height = self.get_window_extent(renderer).height
                if height <= room or width <= MARK_MIN_CHARS:
                    break
                width = max(MARK_MIN_CHARS, min(width - 1, int(width * room / height)))
            left = self.get_window_extent(renderer)
            if left.x0 < panel.x0:
                self.set_horizontalalignment("left")
                right = self.get_window_extent(renderer)
                if right.x1 > panel.x1 and right.x1 - panel.x1 > panel.x0 - left.x0:
                    self.set_horizontalalignment("right")  # neither fits: the lesser overflow

    return MarkLabel


def render(plt, figure: Figure, metrics: RunMetrics, marks: list[Mark], run_title: str,
           last_step: int):
    """``figure`` as a matplotlib figure, up to three panels per row (the caller closes it)."""
    count = len(figure.plots)
    columns = min(3, count)
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, squeeze=False, layout="constrained",
                             figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows + 0.4))
    for i, (ax, plot) in enumerate(zip(axes.flat, figure.plots, strict=False)):
        _plot(plt, fig, ax, plot, metrics)
        ax.set_xlim(0, max(last_step, 1))
        ax.xaxis.set_major_locator(  # whole steps
            plt.MaxNLocator(nbins=STEP_TICKS, integer=True))
        _marks(ax, marks)
        if i < columns:
            _tokens_axis(ax, metrics.series.get("consumed_tokens"))
    for ax in list(axes.flat)[count:]:  # the grid's empty places: removed, not just hidden
        ax.remove()
    fig.suptitle(_wrapped(f"{figure.title} | {run_title}", 11, PANEL_INCHES[0] * columns - 0.4),
                 fontsize=11)
    return fig


def draw(plt, figure: Figure, metrics: RunMetrics, marks: list[Mark], run_title: str,
         last_step: int, path: Path) -> None:
    """``figure`` as a PNG at ``path``."""
    fig = render(plt, figure, metrics, marks, run_title, last_step)
    try:
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
