"""Per-expert load where users of other frameworks look for it: the report's block x expert
heat map, read from a hand-written experts.jsonl (the whole run and its last logged steps,
the last line of each step winning, bad lines refused), and every expert's load in the W&B
row but not in metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.report import expert_map
from pretrain.report.expert_load import BlockLoad, expert_load_fields
from pretrain.report.metrics import MetricsLogger
from pretrain.report.run_report import write_report
from runtime.errors import DataError

PIL = pytest.importorskip("PIL.Image", reason="the image check reads the PNG with Pillow")
STEPS = 25  # more than the recent window, so the report draws both maps


def _line(step: int) -> dict:
    """Block 0 even throughout; in block 3 expert 3 gets nothing from step 6 on."""
    starved = [40, 40, 40, 0] if step > 5 else [30, 30, 30, 30]
    return {"step": step, "topk": 2, "tokens": 60, "received": {"0": [30, 30, 30, 30],
                                                                "3": starved}}


def _run(tmp_path: Path, lines: list) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "moe_load/block00": 1.0}) + "\n"
        for s in range(1, STEPS + 1)))
    (run / "experts.jsonl").write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return run


def test_the_maps_sum_each_window_and_the_last_line_of_a_step_wins(tmp_path):
    # step 3 first logged starved, then trained again (after a crash) even: the even one counts
    lines = [_line(1), _line(2), {**_line(3), "received": {"0": [120, 0, 0, 0],
                                                           "3": [120, 0, 0, 0]}}]
    lines += [_line(s) for s in range(3, STEPS + 1)]
    maps = expert_map.expert_maps(_run(tmp_path, lines))
    assert (maps.experts, maps.topk) == (4, 2)
    whole, recent = maps.maps
    assert whole.blocks == recent.blocks == (0, 3)
    assert whole.title == "the whole run, 25 logged steps (1-25)"
    assert recent.title == f"the last {expert_map.WINDOW} logged steps (6-25)"
    assert whole.loads[0] == recent.loads[0] == (1.0, 1.0, 1.0, 1.0)
    # block 3 over 1-25: 5 even steps (30 each), 20 starved ones (40, 40, 40, 0)
    total = [5 * 30 + 20 * 40] * 3 + [5 * 30]
    mean = sum(total) / 4
    assert whole.loads[1] == pytest.approx(tuple(v / mean for v in total))
    assert recent.loads[1] == pytest.approx((4 / 3, 4 / 3, 4 / 3, 0.0))
    assert "summed over the whole run, 25 logged steps (1-25) and over the last 20" \
        in maps.caption


def test_a_short_run_has_one_map_and_a_dense_run_none(tmp_path):
    maps = expert_map.expert_maps(_run(tmp_path, [_line(1), _line(2)]))
    assert [m.title for m in maps.maps] == ["the whole run, 2 logged steps (1-2)"]
    (tmp_path / "run" / "experts.jsonl").unlink()
    assert expert_map.expert_maps(tmp_path / "run") is None


def test_the_report_draws_the_heat_map_with_its_window_in_the_caption(tmp_path):
    run = _run(tmp_path, [_line(s) for s in range(1, STEPS + 1)])
    written = write_report(run)
    assert [p.name for p in written] == ["loss.png", "experts.png", "expert_load.png",
                                         "report.html"]
    with PIL.open(written[-2]) as image:
        assert image.format == "PNG" and image.width >= 600 and image.height >= 200
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    # a starved expert is deep blue: some pixel is far more blue than red
    assert any(b > r + 100 for _, (r, _g, b) in colours)
    html = written[-1].read_text()
    assert "Load of each expert" in html and "the last 20 logged steps (6-25)" in html


@pytest.mark.parametrize("line, said", [
    ({"step": 1, "topk": 2, "received": {"0": [1, -2]}}, "line 1 must hold a topk > 0"),
    ({"step": 1, "topk": 2, "received": {"0": [1, 2], "1": [1, 2, 3]}},
     "same number of experts, got [2, 3]"),
    ('{"step": 1, "topk"', "line 1 is not JSON"),
])
def test_a_bad_experts_file_is_one_line_and_writes_nothing(tmp_path, line, said):
    run = _run(tmp_path, [line, _line(2)])
    with pytest.raises(DataError, match="experts file") as caught:
        write_report(run)
    assert said in str(caught.value) and "\n" not in str(caught.value)
    assert not (run / "report").exists()


class _FakeRun:
    """What MetricsLogger calls of a wandb run."""

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, row: dict, step: int) -> None:
        self.rows.append((step, row))


def test_every_experts_load_goes_to_wandb_and_not_to_metrics_jsonl(tmp_path):
    loads = expert_load_fields([BlockLoad(0, (8, 8, 8, 8), 32),
                                BlockLoad(3, (20, 6, 2, 0), 32)])
    assert loads["moe_expert_load/block00/e00"] == 1.0
    assert loads["moe_expert_load/block03/e00"] == pytest.approx(20 / 7)
    assert loads["moe_expert_load/block03/e03"] == 0.0 and len(loads) == 8
    wide = expert_load_fields([BlockLoad(1, tuple(range(1, 129)), 0)])
    assert sorted(wide)[:2] == ["moe_expert_load/block01/e000", "moe_expert_load/block01/e001"]
    logger = MetricsLogger.__new__(MetricsLogger)  # the logging rank, W&B started
    logger.active, logger.path = True, tmp_path / "metrics.jsonl"
    logger.wandb_run, logger.wandb_high, logger._held_back = _FakeRun(), -1, None
    logger.log({"step": 1, "loss": 2.0, "moe_max_load": 20 / 7}, loads)
    ((step, row),) = logger.wandb_run.rows
    assert step == 1 and row == {"loss": 2.0, "moe_max_load": 20 / 7, **loads}
    assert json.loads(logger.path.read_text()) == {"step": 1, "loss": 2.0,
                                                   "moe_max_load": 20 / 7}
