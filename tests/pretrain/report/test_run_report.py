"""``python -m pretrain report RUN_DIR``: a run's curves read back right (the last record of
each step, nulls as gaps, every validation set, downstream task and stream statistic found by
its key), pictures only for the data a run has, and bad input as one line that writes nothing."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import re
import sys
import warnings
from pathlib import Path

import pytest

from pretrain.report import panels
from pretrain.report.run_info import read_run_info
from pretrain.report.run_report import write_report
from pretrain.report.series import read_metrics, read_settings_changes, smooth
from runtime.errors import ConfigError, DataError
from tests.pretrain_fixtures import cli, train_args

PIL = pytest.importorskip("PIL.Image", reason="the image checks read PNGs with Pillow")


def _write(folder: Path, records: list, name: str = "metrics.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def _metrics(tmp_path: Path, records: list):
    return read_metrics(_write(tmp_path / "run", records))


def _train(step: int, loss, **extra) -> dict:
    return {"step": step, "consumed_tokens": 256 * step, "loss": loss, "lr": 1e-3,
            "grad_norm": 0.5, "skipped_steps": 0, "skipped_spikes": 0, "tokens_per_s": 900.0,
            **extra}


def _figure(figures: list[panels.Figure], name: str) -> panels.Figure:
    return next(f for f in figures if f.name == name)


# ---- reading metrics.jsonl -----------------------------------------------------------------

def test_the_last_record_of_each_step_wins_per_key(tmp_path):
    """A step trained again (after a crash or rollback) is logged again: the later value
    counts; records of one step on several lines each add their keys."""
    m = _metrics(tmp_path, [
        _train(1, 5.0), _train(2, 4.0), {"step": 2, "val_loss": 4.5},
        _train(3, 3.9), {"step": 3, "rollback_to_step": 1, "rollbacks": 1},
        _train(2, 4.2), {"step": 2, "diag/merge/cosine": 0.5}, _train(3, 3.5),
    ])
    assert m.series["loss"].steps == (1, 2, 3)
    assert m.series["loss"].values == (5.0, 4.2, 3.5)
    assert m.series["val_loss"].steps == (2,) and m.series["val_loss"].values == (4.5,)
    assert m.series["diag/merge/cosine"].values == (0.5,)
    assert [(r.step, r.to_step) for r in m.rollbacks] == [(3, 1)]


def test_nulls_become_gaps_not_joined_values(tmp_path):
    m = _metrics(tmp_path, [_train(1, 5.0), _train(2, None, grad_norm=None), _train(3, 4.0),
                            {"step": 3, "event": "loss_spike", "spike_loss": 9.0}])
    loss = m.series["loss"]
    assert loss.steps == (1, 2, 3) and math.isnan(loss.values[1])
    assert loss.finite() == [(1, 5.0), (3, 4.0)] and loss.last() == (3, 4.0)
    assert math.isnan(m.series["grad_norm"].values[1])
    assert "event" not in m.series  # text is not a curve
    smoothed = smooth(loss.values, 2)
    assert smoothed[0] == 5.0 and math.isnan(smoothed[1]) and smoothed[2] == 4.5
    assert smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    assert smooth([1.0, 3.0], 0) == [1.0, 3.0]


def test_the_summary_says_when_the_last_train_loss_is_not_finite(tmp_path):
    from pretrain.report.page import summary

    info = read_run_info(tmp_path / "run")
    rows = dict(summary(_metrics(tmp_path, [_train(1, 5.0), _train(2, None)]), info))
    assert rows["final train loss"] == "5.0000 at step 1; non-finite at step 2"
    rows = dict(summary(_metrics(tmp_path, [_train(1, None)]), info))
    assert rows["final train loss"] == "non-finite at every logged step"


def test_settings_changes_and_rollbacks_become_marks(tmp_path):
    m = _metrics(tmp_path, [_train(1, 5.0), {"step": 7, "rollback_to_step": 4}])
    path = _write(tmp_path / "run", [{"step": 5, "changes": {"optim.clip_grad": [1.0, 0.1]}}],
                  "settings_changes.jsonl")
    m.settings_changes = read_settings_changes(path)
    marks = panels.marks(m)
    assert [(k.step, k.label) for k in marks] == [
        (7, "rollback at step 7 to step 4"), (5, "resumed with optim.clip_grad 1.0 -> 0.1")]
    assert read_settings_changes(tmp_path / "none.jsonl") == []


def test_an_extended_run_reports_the_plan_it_ended_with(tmp_path):
    """A run of 40 steps resumed with --run.steps=50 --optim.override_schedule=true:
    config.toml holds the first start's plan, settings_changes.jsonl the extension; the
    report counts the steps against the last plan and shows what it replaced."""
    run = tmp_path / "run"
    _write(run, [_train(step, 5.0 - step / 100) for step in range(1, 51)])
    _write(run, [{"step": 40, "changes": {"optim.override_schedule": [False, True],
                                          "run.steps": [40, 50]}}], "settings_changes.jsonl")
    (run / "config.toml").write_text("[optim]\noverride_schedule = false\n[run]\nsteps = 40\n")
    html = write_report(run)[-1].read_text()
    rows = dict(re.findall(r"<tr><th>(.*?)</th><td class=\"value\">(.*?)</td></tr>", html))
    assert rows["steps logged"] == "50 of 50"
    assert rows["steps planned"] == "50 (40 until step 40)"
    assert rows["resumed at step 40 with"] == \
        "optim.override_schedule false -&gt; true, run.steps 40 -&gt; 50"
    # extended twice, and a setting config.toml left out (unset) set by a resume
    _write(run, [{"step": 40, "changes": {"run.steps": [40, 50]}},
                 {"step": 50, "changes": {"run.steps": [50, 60], "parallel.vp": [None, 2]}}],
           "settings_changes.jsonl")
    info = read_run_info(run, read_settings_changes(run / "settings_changes.jsonl"))
    assert info.config["run.steps"] == 60 and info.config["parallel.vp"] == 2
    assert dict(info.rows())["steps planned"] == "60 (40 until step 40, 50 until step 50)"


# ---- which panels --------------------------------------------------------------------------

def test_validation_sets_are_found_by_key_pattern(tmp_path):
    m = _metrics(tmp_path, [_train(1, 5.0), {"step": 1, "val_loss": 5.1, "val_ppl": 160.0},
                            {"step": 1, "val/wiki/loss": 5.2, "val/wiki/ppl": 181.0,
                             "val/code/loss": 5.3}])
    assert panels.validation_sets(m) == [("", "val_loss"), ("code", "val/code/loss"),
                                         ("wiki", "val/wiki/loss")]
    (plot,) = _figure(panels.figures(m, read_run_info(tmp_path / "run")), "loss").plots
    assert [(c.key, c.label) for c in plot.curves] == [
        ("loss", "train"), ("val_loss", "validation"), ("val/code/loss", "validation: code"),
        ("val/wiki/loss", "validation: wiki")]


def test_downstream_scores_are_grouped_per_task_with_their_error(tmp_path):
    m = _metrics(tmp_path, [{"step": 10, "downstream/hellaswag/acc": 0.3,
                             "downstream/hellaswag/acc_stderr": 0.01,
                             "downstream/hellaswag/acc_norm": 0.31,
                             "downstream/arc_easy/acc": 0.4,
                             "downstream/gsm8k/exact_match/strict-match": 0.02,
                             "downstream/gsm8k/exact_match_stderr/strict-match": 0.004}])
    tasks = panels.downstream_tasks(m)
    assert list(tasks) == ["arc_easy", "gsm8k", "hellaswag"]
    assert [(c.label, c.error_key) for c in tasks["hellaswag"]] == [
        ("acc", "downstream/hellaswag/acc_stderr"), ("acc_norm", None)]
    assert [(c.label, c.error_key) for c in tasks["gsm8k"]] == [
        ("exact_match/strict-match", "downstream/gsm8k/exact_match_stderr/strict-match")]
    figure = _figure(panels.figures(m, read_run_info(tmp_path / "run")), "downstream")
    assert [p.title for p in figure.plots] == ["arc_easy", "gsm8k", "hellaswag"]


def test_stream_diagnostics_are_one_figure_per_quantity_one_line_per_block(tmp_path):
    record = {"step": 2}
    for block in (0, 20, 100):  # numeric order, not the keys' text order (block100 < block20)
        for stream in ("x", "y"):
            record[f"diag/{stream}_rms/block{block:02d}"] = 1.0
            record[f"diag/{stream}_grad_norm/block{block:02d}"] = 0.1
    record.update({"diag/merge/x_share": 0.5, "diag/merge/cosine": 0.9,
                   "diag/merge/x_rms": 1.0, "diag/merge/y_rms": 1.0})
    m = _metrics(tmp_path, [record])
    figures = panels.figures(m, read_run_info(tmp_path / "run"))
    assert [f.name for f in figures] == ["diag_rms", "diag_grad_norm", "diag_merge"]
    rms = _figure(figures, "diag_rms")
    assert [p.title for p in rms.plots] == ["x stream (Post-Norm-like)",
                                            "y stream (Pre-Norm-like)"]
    assert [c.key for c in rms.plots[1].curves] == [
        "diag/y_rms/block00", "diag/y_rms/block20", "diag/y_rms/block100"]
    assert all(p.by_depth and p.log_y for p in rms.plots)
    assert len(_figure(figures, "diag_merge").plots) == 2


def test_panels_exist_only_for_the_data_a_run_has(tmp_path):
    def names(records):
        return [f.name for f in panels.figures(_metrics(tmp_path, records),
                                               read_run_info(tmp_path / "run"))]

    # a healthy one-rank CPU run: no MFU, no skipped steps, its own slowest rank
    plain = [_train(1, 5.0, slowest_ratio=1.0), _train(2, 4.0, slowest_ratio=1.0)]
    assert names(plain) == ["loss", "lr", "grad_norm", "throughput"]
    with_mfu = panels.figures(_metrics(tmp_path, [_train(1, 5.0, mfu=0.4)]),
                              read_run_info(tmp_path / "run"))
    assert [p.ylabel for p in _figure(with_mfu, "throughput").plots] == [
        "tokens per second (whole job)", "MFU (%)"]
    assert "skipped" in names([_train(1, 5.0), _train(2, None, skipped_steps=1)])
    assert "skipped" in names([_train(1, 5.0), {"step": 1, "rollback_to_step": 0}])
    assert "stragglers" in names([_train(1, 5.0), _train(2, 4.0, slowest_ratio=1.3)])
    assert names([{"step": 0, "val_loss": 6.0}]) == ["loss"]


def test_the_title_names_run_scheme_size_and_commit(tmp_path):
    run = tmp_path / "run"
    _write(run, [_train(1, 5.0)])
    (run / "config.toml").write_text('[model]\nresidual_scheme = "siamese"\nnum_layers = 12\n'
                                     'hidden_size = 768\n[logging]\nname = ""\n')
    (run / "versions.json").write_text(json.dumps({"git_commit": "0123456789abcdef",
                                                   "parameters": 124_000_000}))
    info = read_run_info(run)
    assert info.title() == "run: siamese, 12 x 768 (124,000,000 parameters), commit 0123456"
    assert ("blocks", "12") in info.rows() and ("parameters", "124,000,000") in info.rows()
    assert read_run_info(tmp_path / "bare").title() == "bare"  # no config, no versions


# ---- the pictures and the page --------------------------------------------------------------

def _check_png(path: Path) -> None:
    from PIL import ImageStat

    with PIL.open(path) as image:
        image.load()
        assert image.format == "PNG"
        assert image.width >= 500 and image.height >= 300, (path.name, image.size)
        spread = ImageStat.Stat(image.convert("L")).var[0]
    assert spread > 0, f"{path.name} is blank"


def _check_page(html: str, pictures: list[Path], run_name: str) -> None:
    for picture in pictures:
        data = base64.b64encode(picture.read_bytes()).decode()
        assert f"data:image/png;base64,{data}\"" in html, picture.name
    assert f"<h1>{run_name}" in html and "<title>" in html
    assert "src=\"http" not in html and "<script" not in html  # self-contained


def test_a_report_of_everything_a_run_can_log(tmp_path):
    """Synthetic: the panels a short CPU run does not have (validation sets, MFU, skipped
    steps and a rollback, stragglers, downstream scores, a settings change, a null)."""
    run = tmp_path / "big"
    records = []
    for step in range(1, 21):
        records.append(_train(step, None if step == 7 else 6.0 - step / 10, mfu=0.4,
                              skipped_steps=int(step >= 7), slowest_ratio=1.1 + step / 100))
    records += [{"step": 10, "val_loss": 5.2, "val/wiki/loss": 5.4},
                {"step": 20, "val_loss": 4.4, "val/wiki/loss": 4.6},
                {"step": 12, "rollback_to_step": 10, "rollbacks": 1},
                {"step": 20, "downstream/hellaswag/acc": 0.3,
                 "downstream/hellaswag/acc_stderr": 0.02, "downstream/arc_easy/acc": 0.4}]
    _write(run, records)
    _write(run, [{"step": 5, "changes": {"optim.lr": [1e-3, 2e-3]}}], "settings_changes.jsonl")
    written = write_report(run, smooth=3)
    assert [p.name for p in written] == [
        "loss.png", "lr.png", "grad_norm.png", "throughput.png", "skipped.png",
        "stragglers.png", "downstream.png", "report.html"]
    assert all(p.parent == run / "report" for p in written)
    for png in written[:-1]:
        _check_png(png)
    html = written[-1].read_text()
    _check_page(html, written[:-1], "big")
    for text in ("best validation loss (wiki)", "4.6000 at step 20", "optim.lr 0.001 -&gt; 0.002",
                 "at step 12 to step 10", "MFU (median)", "40.0 %"):
        assert text in html, text


@pytest.mark.slow
def test_report_of_a_real_run(data, tmp_path):
    """A tiny run trained through the CLI with diagnostics, then `python -m pretrain report`."""
    run = tmp_path / "tiny"
    cli(*train_args(data, run, "--run.steps=6", "--run.eval_interval=3",
                    "--diagnostics.interval=2"))
    done = cli("report", str(run), "--smooth", "2")
    out = run / "report"
    assert done.stdout.strip() == str(out / "report.html")
    pictures = sorted(out.glob("*.png"))
    assert sorted(p.stem for p in pictures) == sorted(
        ["loss", "loss_by_position", "lr", "grad_norm", "throughput", "diag_rms",
         "diag_grad_norm", "diag_merge"])
    for png in pictures:
        _check_png(png)
    html = (out / "report.html").read_text()
    _check_page(html, pictures, "tiny: siamese, 2 x 64")
    assert "final train loss" in html and "best validation loss" in html
    other = tmp_path / "elsewhere"
    cli("report", str(run), "--output", str(other))
    assert (other / "report.html").is_file()


# ---- bad input ------------------------------------------------------------------------------

@contextlib.contextmanager
def _console_restored():
    """main() sets the process's logging and warning filters up; put them back."""
    root, ours = logging.getLogger(), logging.getLogger("pretrain")
    saved = root.handlers[:], root.level, ours.level, logging.getLogger("megatron").level
    try:
        with warnings.catch_warnings():
            yield
    finally:
        root.handlers[:], _, _, _ = saved
        root.setLevel(saved[1])
        ours.setLevel(saved[2])
        logging.getLogger("megatron").setLevel(saved[3])


BAD = {
    "no such folder": (lambda run: [], ["run folder", "does not exist"]),
    "no metrics": (lambda run: (run.mkdir(), (run / "config.toml").write_text("")),
                   ["holds no metrics.jsonl"]),
    "corrupt line": (lambda run: _write(run, [_train(1, 5.0), '{"step": 2, "loss": 4.',
                                              _train(3, 4.0)]),
                     ["metrics.jsonl' line 2 is not JSON"]),
    "line without a step": (lambda run: _write(run, [_train(1, 5.0), {"loss": 4.0}]),
                            ["metrics.jsonl' line 2 must be a JSON object with a step"]),
    "empty metrics": (lambda run: _write(run, []), ["metrics.jsonl' holds no records"]),
    "corrupt settings": (lambda run: (_write(run, [_train(1, 5.0)]), _write(
        run, ["not json"], "settings_changes.jsonl")), ["settings_changes.jsonl' line 1"]),
    "corrupt versions": (lambda run: (_write(run, [_train(1, 5.0)]), _write(
        run, ['{"git_commit": '], "versions.json")), ["versions.json' cannot be read as JSON"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys):
    from pretrain.__main__ import main

    run = tmp_path / "run"
    prepare, fragments = BAD[case]
    prepare(run)
    before = sorted(tmp_path.rglob("*"))
    with _console_restored():
        code = main(["report", str(run)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert str(run) in lines[0] and all(f in lines[0] for f in fragments), lines[0]
    assert sorted(tmp_path.rglob("*")) == before


def test_a_negative_smoothing_and_an_output_under_a_file_are_refused(tmp_path):
    run = tmp_path / "run"
    _write(run, [_train(1, 5.0)])
    with pytest.raises(Exception, match=r"--smooth \(-1\) must be >= 0"):
        write_report(run, smooth=-1)
    (tmp_path / "file").write_text("")
    with pytest.raises(Exception, match="'.*file' is a file"):
        write_report(run, output=tmp_path / "file" / "report")
    assert not (run / "report").exists()


def test_without_matplotlib_the_error_names_the_extra_and_nothing_is_written(tmp_path,
                                                                           monkeypatch):
    run = tmp_path / "run"
    _write(run, [_train(1, 5.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(ConfigError, match=r"matplotlib, which is not installed: pip install "
                                          r"'matplotlib>=3.8' \(the project's `sweep` extra\)"):
        write_report(run)
    assert not (run / "report").exists()


def test_a_last_line_cut_short_by_a_crash_is_left_out(tmp_path, caplog):
    path = _write(tmp_path, [_train(1, 5.0), _train(2, 4.0)])
    path.write_text(path.read_text() + '{"step": 3, "lo')  # no newline: the write was cut
    assert read_metrics(path).series["loss"].steps == (1, 2)
    assert "line 3 was cut short" in caplog.text
    path.write_text(path.read_text() + "\n")  # a complete line that is not JSON is refused
    with pytest.raises(DataError, match=r"line 3 is not JSON"):
        read_metrics(path)


def test_a_corrupt_line_names_its_number(tmp_path):
    path = _write(tmp_path, [_train(1, 5.0), _train(2, 4.0), "[1, 2]"])
    with pytest.raises(DataError, match=r"line 3 must be a JSON object with a step >= 0"):
        read_metrics(path)
