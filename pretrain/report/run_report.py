"""``python -m pretrain report RUN_DIR``: a run's curves as PNGs and one HTML page, for people
without W&B (or without network on the cluster).

Reads ``RUN_DIR/metrics.jsonl`` (``pretrain.report.series``), ``settings_changes.jsonl``,
``config.toml`` and ``versions.json`` (``pretrain.report.run_info``: the config with every
resume's changes applied, so an extended run's planned steps are its last plan) and a mixture
of experts' ``experts.jsonl`` (``pretrain.report.expert_map``); decides the
figures from the keys the run logged (``pretrain.report.panels``), draws them
(``pretrain.report.plots``) and writes ``report.html`` with every image embedded
(``pretrain.report.page``). Everything is read and checked, and matplotlib imported, before
the output folder is created, so bad input (no such folder, no metrics.jsonl, a line that is
not JSON, an output folder that is not writable) is one ``error:`` line and nothing is
written. No torch and no process group: it runs anywhere the run folder is readable, also
while the run is still training.
"""

from __future__ import annotations

from pathlib import Path

from pretrain import paths
from pretrain.report import expert_map, page, panels, plots
from pretrain.report.run_info import read_run_info
from pretrain.report.series import read_metrics, read_settings_changes
from runtime.errors import ConfigError, DataError

HTML = "report.html"
EXPERT_MAP = "expert_load"


def write_report(run_dir: str | Path, output: str | Path | None = None,
                 smooth: int = 0) -> list[Path]:
    """Write the report of ``run_dir`` into ``output`` (default RUN_DIR/report): one PNG per
    figure and report.html. Returns the files written, the page last."""
    run_dir = paths.require_folder(run_dir, "run folder")
    if smooth < 0:
        raise ConfigError(f"--smooth ({smooth}) must be >= 0 (0 or 1: no smoothing)")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise DataError(f"run folder '{run_dir}' holds no metrics.jsonl (a run writes it from "
                        "its first logged step or validation)")
    out = paths.require_writable(output if output is not None else run_dir / "report",
                                 "report --output")
    metrics = read_metrics(metrics_path)
    metrics.settings_changes = read_settings_changes(run_dir / "settings_changes.jsonl")
    info = read_run_info(run_dir, metrics.settings_changes)
    figures = panels.figures(metrics, info, smooth)
    marks = panels.marks(metrics)
    maps = expert_map.expert_maps(run_dir)
    last_step = max(max(s.steps) for s in metrics.series.values())
    plt = plots.pyplot()  # before the folder exists: without matplotlib nothing is written
    out.mkdir(parents=True, exist_ok=True)
    images = []
    for figure in figures:
        path = out / f"{figure.name}.png"
        plots.draw(plt, figure, metrics, marks, info.title(), last_step, path)
        images.append((figure.title, path))
    if maps is not None:  # beside the experts' curves, which come from the same routers
        path = out / f"{EXPERT_MAP}.png"
        expert_map.draw(plt, maps, info.title(), path, plots.DPI, plots.CHAR_EM)
        names = [figure.name for figure in figures]
        after = names.index("experts") + 1 if "experts" in names else len(images)
        images.insert(after, (maps.caption, path))
    html_path = out / HTML
    html_path.write_text(page.page(info, run_dir, page.summary(metrics, info), images))
    return [path for _, path in images] + [html_path]
