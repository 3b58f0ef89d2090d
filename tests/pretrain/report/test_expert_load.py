"""A mixture-of-experts router's load, as plain arithmetic (pretrain.report.expert_load), and
the report's experts panel: only for a run that logged it, one line per MoE block in depth
order, the imbalance level from the run's config."""

from __future__ import annotations

import json

import pytest

from pretrain.report import panels
from pretrain.report.expert_load import BlockLoad, imbalance_load, load_fields
from pretrain.report.run_info import read_run_info
from pretrain.report.series import read_metrics


def test_loads_are_counts_over_their_mean_and_dropped_is_what_was_not_kept():
    even, skewed = BlockLoad(0, (8, 8, 8, 8), 32), BlockLoad(3, (20, 6, 2, 0), 32)
    assert (even.max_load, even.min_load, even.dropped) == (1.0, 1.0, 0)
    assert skewed.mean == 7.0 and skewed.dropped == 4
    assert skewed.max_load == pytest.approx(20 / 7) and skewed.min_load == 0.0
    assert load_fields([even, skewed], capacity=True) == {
        "moe_max_load": pytest.approx(20 / 7), "moe_min_load": 0.0,
        "moe_dropped": 4 / 64, "moe_load/block00": 1.0,
        "moe_load/block03": pytest.approx(20 / 7)}
    assert "moe_dropped" not in load_fields([even], capacity=False)
    assert load_fields([], capacity=True) == {}


def test_the_imbalance_level_is_halfway_to_every_token_on_the_same_experts():
    assert imbalance_load(4, 2) == 1.5  # most: 2
    assert imbalance_load(64, 8) == 4.5  # most: 8
    assert imbalance_load(8, 1) == 4.5
    assert imbalance_load(4, 4) == 1.0  # routing to every expert: never above


def _run(tmp_path, records, config: str = ""):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.toml").write_text(config)
    return read_metrics(run / "metrics.jsonl"), read_run_info(run)


def test_the_experts_panel_exists_only_for_a_run_with_experts(tmp_path):
    dense = [{"step": 1, "loss": 5.0}]
    assert "experts" not in [f.name for f in panels.figures(*_run(tmp_path, dense))]
    record = {"step": 1, "loss": 5.0, "moe_aux_loss": 1.01, "moe_max_load": 1.4,
              "moe_min_load": 0.6, "moe_load/block10": 1.2, "moe_load/block02": 1.4}
    figures = panels.figures(*_run(tmp_path, [record], "[model]\nnum_experts = 8\n"
                                                       "moe_router_topk = 2\n"))
    (figure,) = [f for f in figures if f.name == "experts"]
    assert [p.title for p in figure.plots] == [
        "busiest expert of each MoE block", "least-loaded expert (every MoE block)",
        "load-balancing loss (mean over MoE blocks)"]
    loads = figure.plots[0]
    assert [c.key for c in loads.curves] == ["moe_load/block02", "moe_load/block10"]
    assert loads.by_depth and loads.threshold == (2.5, "imbalance level")
    bare = panels.figures(*_run(tmp_path, [record]))  # no config: no level to draw
    assert [f for f in bare if f.name == "experts"][0].plots[0].threshold is None
