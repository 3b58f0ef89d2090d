"""The learning-rate sweep's machinery: preset checks, run statuses, the report, and a real
two-cell sweep that resumes (skipping the finished cell) and writes its CSV and plots."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lab import lr_sweep, report
from model.schemes import ResidualScheme
from runtime.errors import ConfigError
from tests.helpers import children_on_cpu
from tests.pretrain_fixtures import make_corpus

PNG = b"\x89PNG\r\n\x1a\n"


def _preset(path: Path, grid: str, train: str = "", sweep: str = "") -> Path:
    path.write_text(f"[sweep]\nout = \"{path.parent / 'out'}\"\n{sweep}\n"
                    f"[train]\nrun.steps = 4\n{train}\n[[grid]]\n{grid}\n")
    return path


GRID = 'schemes = ["pre"]\nlrs = [1e-3]\nwarmup = [1]\nlayers = [2]\n'


@pytest.mark.parametrize("grid, train, sweep, message", [
    (GRID.replace('"pre"', '"prenorm"'), "", "", "unknown scheme 'prenorm'; known schemes: pre,"),
    (GRID.replace("[1e-3]", "[]"), "", "", "lrs ([]) must be a non-empty list"),
    (GRID.replace("[1e-3]", "[-1e-3]"), "", "", "lrs entry -0.001 must be in (0, 1)"),
    (GRID.replace("[1]", "[1.5]"), "", "", "warmup entry 1.5 must be an integer >= 0"),
    (GRID.replace("[2]", "[0]"), "", "", "layers entry 0 must be an integer >= 1"),
    (GRID.replace("layers", "depth"), "", "", "unknown key 'depth'"),
    (GRID.replace("[1]", "[8]"), "", "",
     "cell pre-L2-lr0.001-wu8: optim.warmup_steps (8) must be >= 0 and < run.steps (4)"),
    (GRID, "model.hiden_size = 3", "",
     "cell pre-L2-lr0.001-wu1: unknown config key model.hiden_size"),
    (GRID, "", "jobz = 2", "[sweep]: unknown key 'jobz'"),
    (GRID, "", "jobs = 0", "[sweep] jobs (0) must be >= 1"),
], ids=["scheme", "empty", "lr", "warmup", "layers", "grid-key", "warmup-vs-steps", "train-key",
        "sweep-key", "jobs"])
def test_preset_mistakes_are_one_line_errors(tmp_path, capsys, grid, train, sweep, message):
    preset = _preset(tmp_path / "p.toml", grid, train, sweep)
    assert lr_sweep.main(["--preset", str(preset), "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_command_line_mistakes(tmp_path, capsys):
    assert lr_sweep.main(["--preset", str(tmp_path / "none.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    preset = _preset(tmp_path / "p.toml", GRID)
    assert lr_sweep.main(["--preset", str(preset), "--jobs", "0"]) == 2
    assert "--jobs (0) must be >= 1" in capsys.readouterr().err
    assert lr_sweep.main(["--preset", str(preset), "model.num_layers=3"]) == 2
    assert "is not a --section.key=value override" in capsys.readouterr().err


def test_tokenizer_and_data_are_checked_before_any_cell_runs(tmp_path, capsys):
    """A tokenizer (or data) every cell would refuse is one line naming the first cell, exit
    2, before any cell starts: no cell folder, no process (this test is not slow, so a
    launched cell would fail it, see tests/tiers.py)."""
    missing = tmp_path / "missing.model"
    preset = _preset(tmp_path / "p.toml", GRID.replace('["pre"]', '["pre", "siamese"]'),
                     f'data.tokenizer = "{missing}"')
    assert lr_sweep.main(["--preset", str(preset)]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"error: cell pre-L2-lr0.001-wu1: tokenizer '{missing}' does not exist"], err
    assert not (tmp_path / "out").exists() and "to run" not in out


def test_a_failed_cell_shows_its_error_not_a_loss(tmp_path, capsys, monkeypatch):
    """A cell whose trainer failed never trained to a final loss: its console line gives the
    trainer's error line and its log, and no "nan"."""
    preset = _preset(tmp_path / "p.toml", GRID)
    sweep = lr_sweep.Sweep(preset, tmp_path / "out", None, [])
    monkeypatch.setattr(lr_sweep.Sweep, "check_inputs", lambda self, cells: None,
                        raising=False)  # the tokenizer is not the point here

    def trainer(command, stdout, **kwargs):  # a trainer that fails at start-up
        stdout.write("error: data.prefixes: something the checks did not see\n")
        return subprocess.CompletedProcess(command, 2)

    monkeypatch.setattr(lr_sweep.subprocess, "run", trainer)
    assert sweep.run() == 1
    out = capsys.readouterr().out
    log = tmp_path / "out" / "cells" / "pre-L2-lr0.001-wu1" / "train.log"
    assert (f"pre-L2-lr0.001-wu1: failed (error: data.prefixes: something the checks did not "
            f"see; see {log})") in out, out
    assert "nan" not in out.lower()


def test_one_lr_panel_compares_schemes_side_by_side():
    """With one LR the panel's x axis is the schemes, each marker on its own labelled tick
    (a log LR axis put every scheme at one tick and nudged failed runs to the panel's
    edges)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"scheme": s, "lr": 2e-2, "layers": 12, "warmup": 15, "status": status,
             "final_val_loss": loss}
            for s, status, loss in [("pre", "ok", 5.1), ("post", "collapsed", 6.0),
                                    ("siamese", "ok", 5.4), ("hybridnorm", "diverged", math.nan)]]
    fig, ax = plt.subplots()
    report.draw_slice(ax, "lr", rows)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["pre", "post", "siamese", "hybridnorm"]
    assert "lr 0.02" in ax.get_xlabel()
    marks = {float(x) for line in ax.get_lines() for x in line.get_xdata()}
    assert marks == set(ax.get_xticks()) == {0, 1, 2, 3}
    plt.close(fig)


def _write_metrics(folder: Path, losses: list[float], val: dict[int, float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "val_loss": v} for s, v in val.items()]
    rows += [{"step": i + 1, "loss": x, "grad_norm": 1.0, "tokens_per_s": 10.0}
             for i, x in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("rc, losses, val, status", [
    (0, [5.0, 4.0, 3.0, 2.5], {0: 5.5, 4: 3.0}, "ok"),
    (0, [5.0, 6.0, 7.0, 8.0], {0: 5.5, 4: 8.0}, "diverged"),  # no better than at the start
    (0, [5.0, 4.0, 3.0, 2.5], {0: 5.5, 4: float("nan")}, "diverged"),
    (3, [5.0, float("nan")], {0: 5.5}, "diverged"),  # the trainer's NaN/Inf abort
    (1, [5.0], {0: 5.5}, "failed"),  # anything else: retried on the next run
])
def test_run_status(tmp_path, rc, losses, val, status):
    _write_metrics(tmp_path, losses, val)
    result = lr_sweep.summarize_run(tmp_path, rc, 4)
    assert result["status"] == status
    if status == "ok":
        assert result["final_val_loss"] == 3.0 and result["val_loss_step0"] == 5.5


def test_collapsed_runs_are_marked_in_the_report():
    ok = {"status": "ok", "final_val_loss": 6.0}
    assert lr_sweep.mark_collapsed(ok, 5.9)["status"] == "collapsed"
    assert lr_sweep.mark_collapsed(ok, 0.0)["status"] == "ok"  # 0: no threshold
    assert lr_sweep.mark_collapsed({**ok, "final_val_loss": 4.0}, 5.9)["status"] == "ok"
    assert lr_sweep.mark_collapsed({**ok, "status": "failed"}, 5.9)["status"] == "failed"
    row = {"scheme": "post", "lr": 0.02, "layers": 12, "warmup": 15, "status": "collapsed",
           "final_val_loss": 6.0}
    assert "| post | collapsed (6.000) |" in report.markdown_tables([row])


def test_loss_spikes_are_counted(tmp_path):
    _write_metrics(tmp_path, [4.0] * 6 + [9.0] + [4.0] * 3, {0: 5.0, 10: 4.0})
    assert lr_sweep.summarize_run(tmp_path, 0, 10)["loss_spikes"] == 1


def test_report_without_matplotlib(tmp_path, monkeypatch, capsys):
    rows = [{"name": "pre-L2-lr0.001-wu1", "grid": "g", "scheme": "pre", "layers": 2,
             "lr": 1e-3, "warmup": 1, "status": "diverged", "final_val_loss": math.nan}]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    report.write_report(tmp_path, rows, {})
    assert "plots need matplotlib" in capsys.readouterr().err
    assert (tmp_path / "results.csv").is_file() and "| pre | diverged |" in (
        tmp_path / "table.md").read_text()
    assert not (tmp_path / "val_loss_vs_lr.png").exists()


@pytest.mark.slow
def test_two_cell_sweep_resumes_and_reports(tmp_path, capsys):
    """One cell, then a grid of two: the finished cell is skipped (its folder untouched),
    the other runs, and the CSV, table and both plots cover both; a third run with other
    settings refuses to mix them into the same table. The cells train on the CPU on any
    machine: this tests the sweep's machinery, not the device."""
    with children_on_cpu():
        _two_cell_sweep(tmp_path, capsys)


def _two_cell_sweep(tmp_path, capsys):
    data = make_corpus(tmp_path / "corpus")
    train = "\n".join([
        "model.hidden_size = 32", "model.num_attention_heads = 2", "model.ffn_hidden_size = 64",
        "model.seq_length = 32", "model.vocab_size = 512", "data.micro_batch_size = 4",
        "data.global_batch_size = 4", "data.valid_samples = 4", "run.eval_interval = 100",
        "run.save_interval = 0", "diagnostics.interval = 2", "kernels.compile = false",
        f"data.prefixes = [\"{data['prefix']}\"]", f"data.tokenizer = \"{data['tokenizer']}\""])
    first = _preset(tmp_path / "one.toml", GRID, train)
    both = _preset(tmp_path / "two.toml", GRID.replace('["pre"]', '["pre", "siamese"]'), train)
    assert lr_sweep.main(["--preset", str(first)]) == 0
    out = tmp_path / "out"
    pre = out / "cells" / "pre-L2-lr0.001-wu1"
    log = (pre / "train.log").read_text()
    assert lr_sweep.main(["--preset", str(both), "--jobs", "2"]) == 0
    assert "2 cells, 1 finished, 1 to run" in capsys.readouterr().out
    assert (pre / "train.log").read_text() == log  # not run again
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["scheme"], r["status"]) for r in rows] == [("pre", "ok"), ("siamese", "ok")]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent, check=False).stdout.strip()
    for row in rows:  # every row says which code and which seed made it
        assert row["seed"] == "1234" and row["commit"] == (head or "unknown"), row
    for row in rows:
        assert float(row["final_val_loss"]) < float(row["val_loss_step0"])
    siamese = rows[1]
    assert 0 < float(siamese["merge_x_share"]) < 1 and math.isnan(float(rows[0]["merge_x_share"]))
    for png in ("val_loss_vs_lr.png", "loss_curves.png"):
        head = (out / png).read_bytes()
        assert head[:8] == PNG
        width = int.from_bytes(head[16:20], "big")  # the IHDR chunk's width
        assert width >= 600, (png, width)  # one panel, legend beside it: still readable
    assert "| pre | " in (out / "table.md").read_text()
    assert not (pre / "checkpoints").exists()  # finished cells keep no checkpoint
    assert lr_sweep.main(["--preset", str(both), "--optim.weight_decay=0.0"]) == 2
    assert "was trained with other settings" in capsys.readouterr().err
    # One status vocabulary: with a collapse threshold below every final loss (a run that
    # ends above it "learned nothing"), --list, the CSV and the table all say "collapsed".
    strict = _preset(tmp_path / "strict.toml", GRID.replace('["pre"]', '["pre", "siamese"]'),
                     train, "collapse_loss = 0.001")
    assert lr_sweep.main(["--preset", str(strict), "--list"]) == 0
    listed = capsys.readouterr().out
    assert listed.count("collapsed") == 2, listed
    assert lr_sweep.main(["--preset", str(strict), "--report-only"]) == 0
    assert {r["status"] for r in csv.DictReader((out / "results.csv").open())} == {"collapsed"}
    assert "| collapsed" in (out / "table.md").read_text()
    assert lr_sweep.main(["--preset", str(strict), "--only", "nomatch-*"]) == 2
    assert "--only nomatch-* matches no cell" in capsys.readouterr().err


def test_schemes_all_is_every_registered_scheme(tmp_path):
    """A grid may name ``schemes = "all"``: the registry's schemes, in its order, so a scheme
    registered later joins every such sweep without an edit to the preset."""
    preset = _preset(tmp_path / "p.toml", GRID.replace('["pre"]', '"all"'))
    _, _, cells = lr_sweep.load_preset(preset)
    assert [c.scheme for c in cells] == [s.value for s in ResidualScheme]
    wrong = _preset(tmp_path / "q.toml", GRID.replace('["pre"]', '"every"'))
    with pytest.raises(ConfigError, match=r"schemes \('every'\) must be a non-empty list or "):
        lr_sweep.load_preset(wrong)


def test_only_runs_the_matching_cells(tmp_path, capsys):
    """--only NAME_GLOB picks the cells to run by name; the rest are not run (finished ones
    still appear in the report)."""
    preset = _preset(tmp_path / "p.toml", GRID.replace('["pre"]', '["pre", "siamese"]'))
    sweep = lr_sweep.Sweep(preset, tmp_path / "out", None, [], ["siamese-*"])
    assert [c.name for c in sweep.cells if sweep.selected(c)] == ["siamese-L2-lr0.001-wu1"]
    assert [c.name for c in sweep.cells if not sweep.selected(c)] == ["pre-L2-lr0.001-wu1"]


def test_every_registered_scheme_has_its_own_colour():
    colours = report.scheme_colors()
    assert set(colours) == {s.value for s in ResidualScheme}
    assert len(set(colours.values())) == len(colours), colours
