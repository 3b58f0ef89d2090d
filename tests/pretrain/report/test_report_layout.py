"""The report's pictures read as drawn: read back from matplotlib's own layout (every text's
box in the rendered figure), no title, axis label, tick label or legend entry runs off the
figure or over another, on a long run with the hard cases at once (a loss spike 250 times the
loss, a rollback that skips data ahead, two counters holding the same counts, downstream
scores with their chance level, a mixture of experts' router panels, a null, a long run
title), and the experts' heat map (64 experts in 12 blocks, and 4 in 2 with each cell's value);
the labels of marks (settings changed on resume, rollbacks) stay inside their panel; and one
spike does not set an axis (``pretrain.report.outliers``)."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from pretrain.report import expert_map, panels, plots
from pretrain.report.outliers import body_range
from pretrain.report.run_info import read_run_info
from pretrain.report.series import read_metrics, read_settings_changes

pytest.importorskip("matplotlib", reason="the report draws with matplotlib")

# A long run (logged every 500 steps of 4 Mi tokens) and a short one (every step of 4 Ki
# tokens, like the demo), each with a spike and a rollback that skips data ahead.
RUNS = {"long": (120_000, 500, 4 * 2**20), "short": (300, 1, 4096)}


def _loss(step: int) -> float:
    return 2.5 + 8 * math.exp(-step / 8000)


def _events(steps: int) -> tuple[int, int, int]:
    """(spike, rollback, back to) steps of a run of ``steps``."""
    return steps // 2, steps * 2 // 3, steps * 5 // 8


def _tokens(kind: str, step: int) -> int:
    """Consumed tokens at ``step``: the rollback skipped the data of the steps it undid, so
    they jump ahead after it."""
    steps, _, per_step = RUNS[kind]
    _, rollback, back_to = _events(steps)
    return (step + (rollback - back_to) * (step > back_to)) * per_step


def _records(kind: str) -> list[dict]:
    steps, every, _ = RUNS[kind]
    spike, rollback, back_to = _events(steps)
    rng = random.Random(0)
    records = []
    for step in range(every, steps + 1, every):
        skipped = 3 if step >= spike else 0
        tokens = _tokens(kind, step)
        records.append({
            "step": step, "consumed_tokens": tokens,
            "loss": 650.0 if step == spike else _loss(step * 400 // every) + rng.gauss(0, 0.05),
            "lr": 3e-4 * min(1.0, step / 2000), "skipped_steps": skipped,
            "skipped_spikes": skipped, "tokens_per_s": 9e5 + rng.gauss(0, 1e4),
            "mfu": 0.41, "slowest_ratio": 1.1 + rng.random() / 10,
            "moe_aux_loss": 1.0 + rng.random() / 50, "moe_z_loss": 2.0 - step / steps,
            "moe_max_load": 1.6, "moe_min_load": 0.3, "moe_dropped": 0.01 * rng.random(),
            **{f"moe_load/block{b:02d}": 1.2 + b / 50 for b in range(0, 24, 2)},
            "grad_norm": None if step == 6 * every else
            3e4 if step == spike else 0.4 + rng.random() / 5})
    records.append({"step": spike, "event": "loss_spike", "spike_loss": 650.0})
    records.append({"step": rollback, "rollback_to_step": back_to, "rollbacks": 1})
    for step in range(steps // 12, steps + 1, steps // 12):
        records.append({"step": step, "val_loss": _loss(step * 400 // every) + 0.1,
                        "val/wikipedia-english-held-out/loss": _loss(step * 400 // every) + 0.2,
                        "downstream/hellaswag/acc": 0.25 + step / steps / 10,
                        "downstream/hellaswag/acc_stderr": 0.01,
                        "downstream/hellaswag/chance": 0.25,
                        "downstream/arc_easy/acc": 0.25 + step / steps / 5,
                        "downstream/arc_easy/chance": 0.2507,
                        **{f"diag/{s}_{q}/block{b:02d}": 1.0 + b / 10
                           for s in "xy" for q in ("rms", "grad_norm") for b in range(24)},
                        "diag/merge/x_share": 0.5, "diag/merge/cosine": 0.9})
    return records


def _changes(steps: int) -> list[dict]:
    """A resume near the start that changed many settings, and the run extended at 3/4 of its
    steps (what --run.steps with --optim.override_schedule records)."""
    return [{"step": steps // 40, "changes": {
                "optim.clip_grad": [1.0, 0.5], "optim.beta2": [0.95, 0.98],
                "guard.spikes": [False, True], "guard.action": ["stop", "rollback"],
                "data.valid_sets": [[], ["wiki=data/wiki_text_document:256"]]}},
            {"step": steps * 3 // 4, "changes": {"optim.override_schedule": [False, True],
                                                 "run.steps": [steps * 3 // 4, steps]}}]


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("report") / request.param
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                               for r in _records(request.param)))
    (run / "settings_changes.jsonl").write_text("".join(
        json.dumps(c) + "\n" for c in _changes(RUNS[request.param][0])))
    (run / "config.toml").write_text(
        '[model]\nresidual_scheme = "siamese"\nnum_layers = 24\nhidden_size = 2048\n'
        'num_experts = 64\nmoe_router_topk = 8\n'
        '[logging]\nname = "siamese-1.3b-lr2e-3-350b-with-a-long-name"\n'
        '[run]\nstraggler_ratio = 1.5\n')
    (run / "versions.json").write_text(json.dumps({"git_commit": "0123456789abcdef",
                                                   "parameters": 1_300_000_000}))
    steps, every, _ = RUNS[request.param]
    experts, blocks = (64, range(0, 24, 2)) if request.param == "long" else (4, range(2))
    rng = random.Random(1)
    (run / "experts.jsonl").write_text("".join(json.dumps(
        {"step": step, "topk": 2, "received": {str(b): [rng.randint(0, 300) for _ in
                                                        range(experts)] for b in blocks}})
        + "\n" for step in range(every, steps + 1, every)))
    return run


def _texts(fig) -> list:
    """Every text a reader must read whole, with matplotlib's rendered box: the titles, axis
    labels, tick labels of the ticks in view (top axes and colour bars included) and legend
    entries. The labels of marks sit inside a panel over its data, by design, and are left
    out."""
    found = [fig._suptitle]
    axes = [a for ax in fig.axes for a in (ax, *ax.child_axes)]
    for ax in axes:
        found += [ax.title, ax._left_title, ax._right_title]
        for axis in (ax.xaxis, ax.yaxis):
            found.append(axis.label)
            low, high = sorted(axis.get_view_interval())
            slack = (high - low) * 1e-9
            found += [label for loc, label in zip(axis.get_majorticklocs(),
                                                  axis.get_majorticklabels(), strict=True)
                      if low - slack <= loc <= high + slack]
        if ax.get_legend() is not None:
            found += ax.get_legend().get_texts()
    return [t for t in found if t is not None and t.get_visible() and t.get_text().strip()]


@pytest.fixture(scope="module")
def drawn(run: Path):
    """(name, figure) of every figure of ``run``, rendered once for this module's tests, which
    only read them."""
    import matplotlib.pyplot as plt

    metrics = read_metrics(run / "metrics.jsonl")
    metrics.settings_changes = read_settings_changes(run / "settings_changes.jsonl")
    info = read_run_info(run)
    found = panels.figures(metrics, info)
    assert [f.name for f in found] == [
        "loss", "lr", "grad_norm", "throughput", "skipped", "stragglers", "diag_rms",
        "diag_grad_norm", "diag_merge", "experts", "downstream"]
    figures = []
    try:
        for figure in found:
            fig = plots.render(plt, figure, metrics, panels.marks(metrics), info.title(),
                               RUNS[run.name][0])
            fig.canvas.draw()
            figures.append((figure.name, fig))
        fig = expert_map.render(plt, expert_map.expert_maps(run), info.title(), plots.CHAR_EM)
        fig.canvas.draw()
        figures.append(("expert_load", fig))
        yield figures
    finally:
        for _, fig in figures:
            plt.close(fig)


def test_no_text_is_cut_or_drawn_over_another(drawn):
    for name, fig in drawn:
        renderer = fig.canvas.get_renderer()
        page = fig.bbox
        texts = _texts(fig)
        assert len(texts) > 10, name
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        for text, box in boxes:
            assert (box.x0 >= page.x0 - 0.5 and box.x1 <= page.x1 + 0.5
                    and box.y0 >= page.y0 - 0.5 and box.y1 <= page.y1 + 0.5), \
                f"{name}.png: {text!r} runs off the figure ({box.extents} in {page.extents})"
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
            overlap_x = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
            overlap_y = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
            assert overlap_x <= 0.5 or overlap_y <= 0.5, \
                f"{name}.png: {a!r} and {b!r} overlap"


def test_mark_labels_stay_inside_their_panel(run, drawn):
    """Every mark's label runs along its line inside its panel, so it is neither cut by the
    figure's edge nor drawn over the step axis's tick labels (both outside the panel): a
    resume near the run's start is labelled right of its line, the extension's two changes
    are shown whole, and a longer list is cut with "..." (the page's summary holds it)."""
    marks = panels.marks(read_settings_changes_into(run))
    extension = next(m.label for m in marks if "run.steps" in m.label)
    for name, fig in drawn:
        renderer = fig.canvas.get_renderer()
        for ax in (a for a in fig.axes if a.get_xlabel() == "step"):
            panel = ax.get_window_extent(renderer)
            labels = [t for t in ax.texts if t.get_rotation() == 90]
            assert len(labels) == len(marks), name
            for label in labels:
                box = label.get_window_extent(renderer)
                assert (box.x0 >= panel.x0 - 0.5 and box.x1 <= panel.x1 + 0.5
                        and box.y0 >= panel.y0 - 0.5 and box.y1 <= panel.y1 + 0.5), \
                    f"{name}.png: {label.get_text()!r} leaves its panel " \
                    f"({box.extents} in {panel.extents})"
            texts = [" ".join(t.get_text().split("\n")) for t in labels]
            assert extension in texts, (name, texts)
            assert any(t.startswith("resumed with optim.clip_grad") and t.endswith("...")
                       for t in texts), (name, texts)


def read_settings_changes_into(run: Path):
    metrics = read_metrics(run / "metrics.jsonl")
    metrics.settings_changes = read_settings_changes(run / "settings_changes.jsonl")
    return metrics


def test_a_spike_leaves_the_axis_to_the_curve_and_is_marked_on_its_edge(drawn):
    for name, fig in drawn:
        if name not in ("loss", "grad_norm"):
            continue
        (ax,) = [a for a in fig.axes if a.get_ylabel()]
        low, high = ax.get_ylim()
        if name == "loss":
            assert high < 15 and _loss(400) <= high and low < 2.6, (low, high)
        else:
            assert high < 1 and ax.get_yscale() == "linear", (low, high)
        labels = ax.get_legend_handles_labels()[1]
        spike = "650" if name == "loss" else "3e+04"
        assert f"1 value(s) above the axis, up to {spike}" in labels, labels


def test_counters_holding_the_same_counts_stay_both_visible(drawn):
    for name, fig in drawn:
        if name == "skipped":
            lines = [line for line in fig.axes[0].get_lines() if line.get_label()
                     .startswith("skipped")]
            assert len(lines) == 2
            assert lines[0].get_linewidth() > lines[1].get_linewidth()
            assert lines[1].get_linestyle() != "-"


def test_the_downstream_panels_show_the_chance_level(drawn):
    for name, fig in drawn:
        if name == "downstream":
            for ax, level in zip(fig.axes, (0.2507, 0.25), strict=False):
                labels = ax.get_legend_handles_labels()[1]
                assert "chance (a uniform guess)" in labels, labels
                chance = [line for line in ax.get_lines()
                          if line.get_label() == "chance (a uniform guess)"]
                assert chance[0].get_ydata()[0] == level


def test_the_top_axis_labels_the_tokens_at_the_step_ticks(run, drawn):
    for name, fig in drawn:
        if name == "loss":
            ax = fig.axes[0]
            (top,) = ax.child_axes
            steps = [t for t in ax.get_xticks() if 0 <= t <= RUNS[run.name][0]]
            tokens = top.xaxis.get_majorticklocs()
            assert len(steps) >= 4
            assert tokens == pytest.approx([_tokens(run.name, s) for s in steps], rel=1e-3)


# ---- the body of a curve -------------------------------------------------------------------

def test_an_isolated_spike_is_outside_the_body_and_the_decay_inside():
    curve = [_loss(s) for s in range(0, 50_000, 250)]
    curve[100] = 650.0
    low, high = body_range([curve])
    assert high == pytest.approx(_loss(0)) and low == pytest.approx(min(curve))
    assert body_range([curve, [5.0, 640.0, 5.0]]) is not None  # a second curve's spike too


def test_without_outliers_every_value_is_shown():
    smooth = [_loss(s) for s in range(0, 50_000, 250)]
    noisy = [v + random.Random(i).gauss(0, 0.1) for i, v in enumerate(smooth)]
    assert body_range([smooth]) is None and body_range([noisy]) is None
    assert body_range([[1.0, math.nan, 2.0]]) is None and body_range([[]]) is None
    # a value away from its neighbours that stretches the axis little is not clipped
    small = [1.0] * 20
    small[10] = 1.5
    assert body_range([small + [0.0, 2.0]]) is None
