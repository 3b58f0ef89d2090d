"""The report's block x expert heat map of a mixture-of-experts run: which experts starve.

metrics.jsonl keeps per block only its busiest expert (``moe_load/block<NN>``), which shows a
router piling tokens onto a few experts but not which experts it leaves idle. The raw counts
are in ``experts.jsonl`` (``pretrain.train.experts``): here they are summed over a window of
logged steps per block and expert, and each cell coloured by its load, the tokens the expert
received over the mean per expert of its block (``pretrain.report.expert_load``): 1 is an even
share, 0 an expert that received nothing, E/k every token.

Two windows, side by side: the whole run and its last :data:`WINDOW` logged steps (one map
when the run logged no more than that). The early steps' transient, when routers are still
random, weighs on the first; the second says where the routers stand now. A step logged twice
(trained again after a crash or a rollback) counts once, by its last line, as in
metrics.jsonl. Standard library only, but for :func:`draw`, which receives pyplot.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from pretrain.report.expert_load import FILE
from pretrain.report.series import read_records
from runtime.errors import DataError

WINDOW = 20
"""Logged steps in the recent window."""
ANNOTATE_UP_TO = 16
"""Cells carry their value when a block has at most this many experts (beyond, unreadable)."""


@dataclass(frozen=True)
class LoadMap:
    """One window's loads, a row per MoE block (global index), a column per expert."""

    title: str
    blocks: tuple[int, ...]
    loads: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class ExpertMaps:
    """The figure: its maps (whole run first) and what they share."""

    experts: int
    topk: int
    maps: tuple[LoadMap, ...]

    @property
    def caption(self) -> str:
        windows = " and over ".join(m.title for m in self.maps)
        return (f"Load of each expert: tokens received over the mean per expert of its block, "
                f"summed over {windows} (1: an even share; 0: starved; {self.experts}/"
                f"{self.topk} = {self.experts / self.topk:g}: every token)")


def _counts(path: Path) -> tuple[dict[int, dict[int, list[int]]], int]:
    """({step: {block: received}}, top-k) of experts.jsonl, the last line of each step."""
    by_step: dict[int, dict[int, list[int]]] = {}
    topk = 0
    for number, record in read_records(path, "experts file"):
        received, k = record.get("received"), record.get("topk")
        rows = received.items() if isinstance(received, dict) else ()
        if not (isinstance(k, int) and k > 0 and rows and all(
                key.isdigit() and isinstance(v, list) and v and all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v)
                for key, v in rows)):
            raise DataError(f"experts file '{path}' line {number} must hold a topk > 0 and "
                            f"\"received\": {{\"<block>\": [tokens per expert, ...]}}, got "
                            f"{str(record)[:80]!r}")
        widths = {len(v) for _, v in rows}
        if len(widths) != 1:
            raise DataError(f"experts file '{path}' line {number}: every block must count the "
                            f"same number of experts, got {sorted(widths)}")
        by_step[record["step"]] = {int(key): v for key, v in rows}
        topk = k
    return by_step, topk


def _window(by_step: dict[int, dict[int, list[int]]], steps: list[int], title: str) -> LoadMap:
    totals: dict[int, list[int]] = {}
    for step in steps:
        for block, received in by_step[step].items():
            row = totals.setdefault(block, [0] * len(received))
            totals[block] = [a + b for a, b in zip(row, received, strict=True)]
    blocks = tuple(sorted(totals))
    loads = []
    for block in blocks:
        mean = sum(totals[block]) / len(totals[block])
        loads.append(tuple(v / mean if mean else float("nan") for v in totals[block]))
    return LoadMap(title, blocks, tuple(loads))


def _span(steps: list[int]) -> str:
    count = f"{len(steps)} logged step{'s' if len(steps) != 1 else ''}"
    return f"{count} ({steps[0]}-{steps[-1]})" if len(steps) > 1 else f"{count} ({steps[0]})"


def expert_maps(run_dir: Path) -> ExpertMaps | None:
    """The heat maps of ``run_dir``'s experts.jsonl; None without the file (a dense run)."""
    path = run_dir / FILE
    if not path.is_file():
        return None
    by_step, topk = _counts(path)
    if not by_step:
        return None
    experts = {len(v) for lines in by_step.values() for v in lines.values()}
    if len(experts) != 1:
        raise DataError(f"experts file '{path}': every line must count the same number of "
                        f"experts, got {sorted(experts)}")
    steps = sorted(by_step)
    maps = [_window(by_step, steps, f"the whole run, {_span(steps)}")]
    if len(steps) > WINDOW:
        recent = steps[-WINDOW:]
        maps.append(_window(by_step, recent, f"the last {_span(recent)}"))
    return ExpertMaps(experts.pop(), topk, tuple(maps))


def render(plt, maps: ExpertMaps, run_title: str, char_em: float):
    """``maps`` as a matplotlib figure (the caller closes it): a heat map per window on one
    colour scale, blue below an even share (white), red above it; the title wrapped to the
    figure's width at ``char_em`` (the mean character width in em)."""
    from matplotlib.colors import TwoSlopeNorm

    experts, blocks = maps.experts, max(len(m.blocks) for m in maps.maps)
    finite = [v for m in maps.maps for row in m.loads for v in row if v == v]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max([2.0, *finite]))
    width = min(max(4.5, 0.4 * experts + 1.8), 12.0) * len(maps.maps) + 1.2
    height = min(max(3.4, 0.32 * blocks + 1.6), 14.0)
    fig, axes = plt.subplots(1, len(maps.maps), squeeze=False, layout="constrained",
                             figsize=(width, height))
    image = None
    for ax, load_map in zip(axes.flat, maps.maps, strict=True):
        image = ax.imshow(load_map.loads, cmap="RdBu_r", norm=norm, aspect="auto",
                          interpolation="nearest")
        ax.set_xticks(range(0, experts, max(1, experts // 16)))
        ax.set_yticks(range(len(load_map.blocks)), [str(b) for b in load_map.blocks])
        ax.set_xlabel("expert", fontsize=9)
        ax.set_ylabel("block (0 = nearest the input)", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_title(load_map.title, fontsize=10)
        if experts <= ANNOTATE_UP_TO:
            for r, row in enumerate(load_map.loads):
                for e, value in enumerate(row):
                    ax.text(e, r, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if value == value and abs(value - 1) > 0.6
                            else "black")
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), pad=0.02)
    bar.set_label("load (received / mean)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    title = f"Mixture of experts: load per block and expert | {run_title}"
    fig.suptitle("\n".join(textwrap.wrap(title, int((width - 0.4) * 72 / (char_em * 11)))),
                 fontsize=11)
    return fig


def draw(plt, maps: ExpertMaps, run_title: str, path: Path, dpi: int, char_em: float) -> None:
    """``maps`` as one PNG at ``path`` (:func:`render`)."""
    fig = render(plt, maps, run_title, char_em)
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
