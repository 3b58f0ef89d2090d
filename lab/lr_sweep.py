"""Stability lab: a grid of equal-budget training runs (scheme x peak LR x warm-up x depth).

Why: the paper's central claim is about stability, i.e. which residual schemes still train,
and how well, as the peak learning rate rises or the warm-up disappears. Checking that needs
many identical runs that differ in one knob, on the same data and token budget.

    python -m lab.lr_sweep --preset configs/sweep/cpu.toml [--jobs 2] [--out DIR]
                             [--list] [--report-only] [--section.key=value ...]

A preset (TOML) names a base training config, overrides shared by every cell (``[train]``,
dotted keys), and one or more ``[[grid]]`` tables; each grid is the cross product of its
``schemes`` (or ``"all"``: every registered scheme), ``lrs``, ``warmup`` (steps) and ``layers``
lists, and the sweep runs the union of the grids (a cell named twice runs once). Extra
``--section.key=value`` arguments reach every cell. Before the first cell starts, every cell's
config, tokenizer and data are checked as its trainer would check them: a mistake is one
``error:`` line naming the cell, exit 2, and no cell runs. Each cell is one ``python -m
pretrain train`` process in ``<out>/cells/<name>``; a cell that finished has a ``result.json``
and is skipped when the sweep runs again, so an interrupted sweep resumes. A run the trainer
aborts for repeated NaN/Inf steps (exit 3), or whose final validation loss is not finite or no
better than at step 0, is recorded as ``diverged``; one that ends above the preset's
``collapse_loss`` is reported as ``collapsed``; any other failure is ``failed`` and retried on
the next run. With ``data = "demo"`` the demo's corpus, tokenizer and dataset are prepared once
if missing. The report (``results.csv``, ``table.md``, ``val_loss_vs_lr.png``,
``loss_curves.png``) is rewritten after every cell.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.report import write_report
from model.schemes import ResidualScheme
from pretrain.config import Config, load_config
from pretrain.report import console
from pretrain.train.diagnostics import LossSpikeDetector
from runtime.errors import ConfigError, UserError, error_lines
from runtime.launcher import standalone_env

REPO = Path(__file__).resolve().parent.parent
DEMO_DATA = "runs/demo-data"


@dataclass(frozen=True)
class Cell:
    grid: str
    scheme: str
    lr: float
    warmup: int
    layers: int

    @property
    def name(self) -> str:
        return f"{self.scheme}-L{self.layers}-lr{self.lr:g}-wu{self.warmup}"

    def overrides(self, min_lr_ratio: float) -> list[str]:
        return [f"--model.residual_scheme={self.scheme}", f"--model.num_layers={self.layers}",
                f"--optim.lr={self.lr!r}", f"--optim.min_lr={self.lr * min_lr_ratio!r}",
                f"--optim.warmup_steps={self.warmup}"]


def _flatten(table: dict, prefix: str = "") -> list[str]:
    """``{"model": {"hidden_size": 64}}`` -> ``["--model.hidden_size=64"]``."""
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"--{prefix}{key}={json.dumps(value)}")
    return out


SETTINGS = {"base_config": "configs/demo-cpu.toml", "out": "runs/sweep", "jobs": 1,
            "threads": 1, "data": "", "min_lr_ratio": 0.1, "keep_checkpoints": False,
            "spike_factor": 1.5, "spike_window": 20, "collapse_loss": 0.0}
GRID_KEYS = ("schemes", "lrs", "warmup", "layers")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _number(value, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integer else isinstance(value, int | float)


def _check_settings(where: str, settings: dict) -> None:
    for key, value in settings.items():
        _check(key in SETTINGS, f"{where} [sweep]: unknown key {key!r}; known keys: "
                                f"{', '.join(SETTINGS)}")
        default = SETTINGS[key]
        kind = type(default) if not isinstance(default, float) else (int, float)
        _check(isinstance(value, kind) and not (isinstance(value, bool)
                                                 and not isinstance(default, bool)),
               f"{where} [sweep] {key} ({value!r}) must be a {type(default).__name__}")
    _check(settings["jobs"] >= 1, f"{where} [sweep] jobs ({settings['jobs']}) must be >= 1")
    _check(settings["threads"] >= 1,
           f"{where} [sweep] threads ({settings['threads']}) must be >= 1")
    _check(settings["data"] in ("", "demo"),
           f"{where} [sweep] data ({settings['data']!r}) must be \"demo\" or \"\" (the base "
           f"config's data)")
    _check(0 <= settings["min_lr_ratio"] <= 1,
           f"{where} [sweep] min_lr_ratio ({settings['min_lr_ratio']}) must be in [0, 1]")


def _grid_cells(where: str, grid: dict) -> list[Cell]:
    """The cross product of one [[grid]] table, each list checked."""
    name = grid.get("name", "grid")
    label = f"{where} [[grid]] {name!r}"
    unknown = sorted(set(grid) - {"name", *GRID_KEYS})
    _check(not unknown, f"{label}: unknown key {unknown[0] if unknown else ''!r}; "
                        f"known keys: name, {', '.join(GRID_KEYS)}")
    _check(isinstance(name, str) and name, f"{label}: name must be a non-empty string")
    schemes = [s.value for s in ResidualScheme]
    if grid.get("schemes") == "all":  # every registered scheme, so a new one joins the sweep
        grid = {**grid, "schemes": schemes}
    for key in GRID_KEYS:
        _check(key in grid, f"{label}: missing {key} (a list)")
        _check(isinstance(grid[key], list) and grid[key],
               f"{label}: {key} ({grid[key]!r}) must be a non-empty list"
               + (' or "all"' if key == "schemes" else ""))
    for scheme in grid["schemes"]:
        _check(scheme in schemes,
               f"{label}: unknown scheme {scheme!r}; known schemes: {', '.join(schemes)}")
    for lr in grid["lrs"]:
        _check(_number(lr, False) and 0 < lr < 1, f"{label}: lrs entry {lr!r} must be in (0, 1)")
    for warmup in grid["warmup"]:
        _check(_number(warmup, True) and warmup >= 0,
               f"{label}: warmup entry {warmup!r} must be an integer >= 0 (steps)")
    for layers in grid["layers"]:
        _check(_number(layers, True) and layers >= 1,
               f"{label}: layers entry {layers!r} must be an integer >= 1")
    return [Cell(name, scheme, float(lr), warmup, layers) for scheme, lr, warmup, layers
            in itertools.product(*(grid[k] for k in GRID_KEYS))]


def load_preset(path: Path) -> tuple[dict, list[str], list[Cell]]:
    """(sweep settings, overrides for every cell, cells in preset order); a mistake in the
    preset is one :class:`ConfigError` line naming the file, the table and the value."""
    _check(path.is_file(), f"sweep preset '{path}' does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"sweep preset '{path}' is not valid TOML: {err}") from None
    unknown = sorted(set(raw) - {"sweep", "train", "grid"})
    _check(not unknown, f"{path}: unknown table [{unknown[0] if unknown else ''}]; a preset "
                        f"has [sweep], [train] and [[grid]] tables")
    settings = {**SETTINGS, **raw.get("sweep", {})}
    _check_settings(str(path), settings)
    _check(isinstance(raw.get("grid", []), list), f"{path}: grid must be [[grid]] tables")
    cells: dict[str, Cell] = {}
    for grid in raw.get("grid", []):
        for cell in _grid_cells(str(path), grid):
            cells.setdefault(cell.name, cell)  # a cell named by two grids runs once
    _check(bool(cells), f"{path}: no [[grid]] table, so no cell to run")
    return settings, _flatten(raw.get("train", {})), list(cells.values())


def demo_data_overrides() -> list[str]:
    """The overrides that point a cell at the demo's corpus (see :func:`prepare_demo_data`)."""
    data = REPO / DEMO_DATA
    return [f'--data.prefixes=["{data / "kjv_text_document"}"]',
            f"--data.tokenizer={data / 'kjv.model'}"]


def prepare_demo_data(python: str) -> None:
    """The demo's corpus, tokenizer and dataset (as scripts/demo.sh), each made only if
    missing, so the CPU preset needs no step before its one command."""
    data = REPO / DEMO_DATA
    data.mkdir(parents=True, exist_ok=True)
    steps = [
        (data / "kjv.jsonl", [python, "scripts/demo_corpus.py", str(data / "kjv.jsonl")]),
        (data / "kjv.model", [python, "-m", "pretrain", "train-tokenizer", str(data / "kjv.jsonl"),
                              "--output", str(data / "kjv"), "--vocab-size", "2048"]),
        (data / "kjv_text_document.idx",
         [python, "-m", "pretrain", "prepare-data", str(data / "kjv.jsonl"), "--tokenizer",
          str(data / "kjv.model"), "--output", str(data / "kjv_text_document"), "--workers", "2"]),
    ]
    for output, command in steps:
        if not output.exists():
            print(f"preparing {output.name} ...", flush=True)
            subprocess.run(command, cwd=REPO, check=True)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(run_dir: Path, returncode: int, steps: int, spike_factor: float = 1.5,
                  spike_window: int = 20) -> dict:
    """Status and figures of one finished training process (the last record of a step wins:
    a resumed run logs the steps after its checkpoint again)."""
    rows = _metrics(run_dir)
    train = {r["step"]: r for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    losses = [train[s]["loss"] for s in sorted(train)]
    detector = LossSpikeDetector(spike_factor, spike_window)
    spikes = sum(detector.update(i, loss) is not None for i, loss in enumerate(losses))
    norms = [train[s]["grad_norm"] for s in train if train[s].get("grad_norm") is not None]
    final_val = val.get(steps, float("nan")) if returncode == 0 else float("nan")
    tail = [x for x in losses[-10:] if math.isfinite(x)]
    merge = [r for r in rows if "diag/merge/x_share" in r]  # SiameseNorm with diagnostics on
    if returncode == 3:
        status = "diverged"
    elif returncode != 0:
        status = "failed"
    elif not math.isfinite(final_val) or (0 in val and final_val >= val[0]):
        status = "diverged"
    else:
        status = "ok"
    return {
        "status": status, "returncode": returncode, "final_val_loss": final_val,
        "val_loss_step0": val.get(0, float("nan")),
        "final_train_loss": sum(tail) / len(tail) if tail else float("nan"),
        "max_grad_norm": max((g for g in norms if math.isfinite(g)), default=float("nan")),
        "skipped_steps": max((r.get("skipped_steps", 0) for r in train.values()), default=0),
        "loss_spikes": spikes, "steps_logged": len(train),
        "merge_x_share": merge[-1]["diag/merge/x_share"] if merge else float("nan"),
        "merge_cosine": merge[-1]["diag/merge/cosine"] if merge else float("nan"),
        "tokens_per_s": _median([r["tokens_per_s"] for r in train.values()
                                 if "tokens_per_s" in r]),
    }


def provenance(run_dir: Path) -> dict:
    """The seed and the commit a cell trained with, from its run folder (empty if absent), so
    a results file says which code made each row."""
    found = {}
    config, versions = run_dir / "config.toml", run_dir / "versions.json"
    if config.is_file():
        found["seed"] = tomllib.loads(config.read_text()).get("run", {}).get("seed", "")
    if versions.is_file():
        found["commit"] = json.loads(versions.read_text()).get("git_commit", "")
    return found


def mark_collapsed(result: dict, collapse_loss: float) -> dict:
    """A run that finished but whose final validation loss is still above ``collapse_loss``
    (a preset's choice, e.g. just under its data's unigram entropy) learned no more than token
    frequencies: the failure of Post-Norm-like schemes at a high LR, which produces no NaN.
    Applied when the report is written, so a finished sweep can be re-judged."""
    if (collapse_loss > 0 and result["status"] == "ok"
            and result["final_val_loss"] >= collapse_loss):
        return {**result, "status": "collapsed"}
    return result


def preflight_inputs(config: Config) -> str:
    """What :func:`pretrain.build.preflight` reads: the tokenizer and data settings, the
    model's vocabulary and the samples a run draws (its length and sequence length). A
    sweep's cells differ in none of them (scheme, depth, LR, warm-up and folder aside)."""
    return repr((config.data, config.model.vocab_size, config.seq_length, config.run.steps))


def last_error(log: Path, returncode: int) -> str:
    """The last ``error:`` line a failed trainer wrote to its log, else its exit status."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [line for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else f"exit status {returncode}"


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


class Sweep:
    def __init__(self, preset: Path, out: Path | None, jobs: int | None, extra: list[str],
                 only: list[str] = ()):
        self.settings, self.common, self.cells = load_preset(preset)
        self.out = out or REPO / self.settings["out"]
        self.jobs = jobs if jobs is not None else self.settings["jobs"]
        self.only = list(only)  # --only NAME_GLOB patterns; empty: every cell
        _check(self.jobs >= 1, f"--jobs ({self.jobs}) must be >= 1")
        self.extra = extra
        self.python = sys.executable
        self.data_overrides = demo_data_overrides() if self.settings["data"] == "demo" else []

    def cell_dir(self, cell: Cell) -> Path:
        return self.out / "cells" / cell.name

    def training_args(self, cell: Cell) -> list[str]:
        """What makes a cell the run it is (not where its data or folder lie): a finished
        cell counts only if it was trained with exactly these."""
        return [self.settings["base_config"], *self.common,
                *cell.overrides(self.settings["min_lr_ratio"]), *self.extra]

    def result(self, cell: Cell) -> dict | None:
        """The finished cell's result; a cell trained with other settings is an error, so
        that one table never mixes budgets."""
        path = self.cell_dir(cell) / "result.json"
        if not path.is_file():
            return None
        result = json.loads(path.read_text())
        _check(result.get("args") == self.training_args(cell),
               f"cell {cell.name} in {self.out} was trained with other settings than this "
               f"sweep's; use another --out, or delete {self.cell_dir(cell)}")
        return {**result, **provenance(self.cell_dir(cell))}

    def overrides(self, cell: Cell) -> list[str]:
        """The cell's command-line overrides of the base config (later ones win)."""
        return [*self.common, *self.data_overrides,
                *cell.overrides(self.settings["min_lr_ratio"]),
                f"--run.dir={self.cell_dir(cell)}", *self.extra]

    def command(self, cell: Cell) -> list[str]:
        return [self.python, "-m", "pretrain", "train",
                "--config", str(REPO / self.settings["base_config"]), *self.overrides(cell)]

    def config(self, cell: Cell) -> Config:
        """The cell's training config, as its trainer will load it; a mistake is one line
        naming the cell."""
        try:
            return load_config(str(REPO / self.settings["base_config"]), self.overrides(cell))
        except UserError as err:
            raise type(err)(f"cell {cell.name}: {err}") from None

    def check(self) -> None:
        """Resolve every cell's training config before anything runs, so that a preset
        whose [train] keys, grid values or overrides the trainer would refuse fails now, in
        one line naming the cell, not after the first cells have trained."""
        for cell in self.cells:
            self.config(cell)

    def check_inputs(self, cells: list[Cell]) -> None:
        """The rest of each cell's start-up check (:func:`pretrain.build.preflight`: the
        tokenizer against the model's vocabulary, the data, its validation split) before the
        first cell is launched: a mistake there fails every cell, and would otherwise be
        found once per cell, each time in its own train.log. Checked from the repository
        root, where the cells run (relative paths mean the same); cells that read the same
        inputs are checked once, as the check reads every token of the data."""
        from pretrain.build import preflight  # megatron: after console.setup() (main)

        checked = set()
        with contextlib.chdir(REPO):
            for cell in cells:
                config = self.config(cell)
                inputs = preflight_inputs(config)
                if inputs in checked:
                    continue
                try:
                    preflight(config)
                except UserError as err:
                    raise type(err)(f"cell {cell.name}: {err}") from None
                checked.add(inputs)

    def run_cell(self, cell: Cell) -> dict:
        folder = self.cell_dir(cell)
        if folder.exists() and not (folder / "checkpoints" / "latest").is_file():
            shutil.rmtree(folder)  # an attempt that saved nothing starts clean
        folder.mkdir(parents=True, exist_ok=True)
        # Each cell is a one-process run of its own: a launcher's variables in this
        # environment (a sweep started under torchrun) must not make it join that group.
        env = standalone_env()
        path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.update(OMP_NUM_THREADS=str(self.settings["threads"]), PYTHONPATH=path)
        began = time.perf_counter()
        with (folder / "train.log").open("a") as log:
            done = subprocess.run(self.command(cell), cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        steps = self._steps(folder)
        result = {"name": cell.name, **asdict(cell),
                  **summarize_run(folder, done.returncode, steps,
                                 self.settings["spike_factor"], self.settings["spike_window"]),
                  "wall_s": round(time.perf_counter() - began, 1),
                  "args": self.training_args(cell)}
        if result["status"] != "failed":
            (folder / "result.json").write_text(json.dumps(result, indent=1))
            if not self.settings["keep_checkpoints"]:
                shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        return result

    @staticmethod
    def _steps(folder: Path) -> int:
        config = folder / "config.toml"
        if not config.is_file():
            return -1
        return tomllib.loads(config.read_text())["run"]["steps"]

    def report(self) -> None:
        done = [(c, self.result(c)) for c in self.cells]
        done = [(c, r) for c, r in done if r is not None]
        rows = [self.judged(r) for _, r in done]
        write_report(self.out, rows, {r["name"]: _metrics(self.cell_dir(c)) for c, r in done})

    def judged(self, result: dict) -> dict:
        """A cell's result with the preset's collapse rule applied: the one status vocabulary
        of the console, the CSV, the table and the plots."""
        return mark_collapsed(result, self.settings["collapse_loss"])

    def selected(self, cell: Cell) -> bool:
        return not self.only or any(fnmatch.fnmatchcase(cell.name, p) for p in self.only)

    def progress(self, cell: Cell, result: dict) -> str:
        """A finished cell's console line: its final validation loss where it has one; a
        failed cell (which never trained to the end) has none, so its line shows the error
        its trainer gave and where its log is."""
        log = self.cell_dir(cell) / "train.log"
        loss = result["final_val_loss"]
        if result["status"] == "failed":
            outcome = f"failed ({last_error(log, result['returncode'])}; see {log})"
        elif math.isfinite(loss):
            outcome = f"{result['status']} val_loss {loss:.4f}"
        else:
            outcome = f"{result['status']} (no finite final validation loss)"
        return f"{cell.name}: {outcome} ({result['wall_s']:.0f}s)"

    def run(self) -> int:
        self.check()
        todo = [c for c in self.cells if self.result(c) is None and self.selected(c)]
        if todo and self.settings["data"] == "demo":
            prepare_demo_data(self.python)
        self.check_inputs(todo)
        print(f"{len(self.cells)} cells, {len(self.cells) - len(todo)} finished, "
              f"{len(todo)} to run with {self.jobs} job(s); output in {self.out}", flush=True)
        failed = 0
        began = time.perf_counter()

        def one(cell: Cell) -> dict:
            result = self.judged(self.run_cell(cell))
            print(f"[{time.perf_counter() - began:7.0f}s] {self.progress(cell, result)}",
                  flush=True)
            return result

        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            for result in pool.map(one, todo):
                failed += result["status"] == "failed"
                self.report()
        self.report()
        print(f"done in {time.perf_counter() - began:.0f}s; report in {self.out}", flush=True)
        if failed:
            print(f"{failed} cell(s) failed (see their train.log); run again to retry them",
                  file=sys.stderr)
        return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user mistake
        raise ConfigError(f"command line: {message}")


def main(argv: list[str] | None = None) -> int:
    """Mistakes in the command line, the preset or a cell's config, tokenizer or data print
    one ``error:`` line and exit 2 before any cell runs; a sweep with failed cells exits 1."""
    console.setup()  # before megatron is imported (its notices)
    try:
        return _main(argv)
    except UserError as err:
        print(error_lines(str(err)), file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = _Parser(prog="python -m lab.lr_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, type=Path, help="configs/sweep/*.toml")
    parser.add_argument("--out", type=Path, help="output folder (default: the preset's)")
    parser.add_argument("--jobs", type=int, help="cells run at once (default: the preset's)")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument("--only", action="append", metavar="NAME_GLOB", default=[],
                        help="run only the cells whose name matches (e.g. 'siamese-*'); "
                             "repeatable; the report still covers every finished cell")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the CSV, table and plots from finished cells")
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if not a.startswith("--") or "=" not in a]
    if bad:
        raise ConfigError(f"command line: {bad[0]!r} is not a --section.key=value override")
    sweep = Sweep(args.preset, args.out, args.jobs, extra, args.only)
    if args.only and not any(sweep.selected(c) for c in sweep.cells):
        raise ConfigError(f"--only {' '.join(args.only)} matches no cell; --list shows them")
    if args.list:
        sweep.check()
        for cell in sweep.cells:
            done = sweep.result(cell)
            status = sweep.judged(done)["status"] if done else "-"
            print(f"{cell.grid:10s} {cell.name:40s} {status}")
        return 0
    if args.report_only:
        sweep.report()
        return 0
    return sweep.run()


if __name__ == "__main__":
    sys.exit(main())
