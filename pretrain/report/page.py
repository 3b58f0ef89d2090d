"""The report's page: one self-contained HTML file with the figures and two small tables.

Self-contained (every image a base64 ``data:`` URI, no script, no external style) so the one
file can be mailed, attached to an issue or opened from a cluster's shared disk as it is.
The summary says how the run ended (final train loss, best loss of each validation set,
tokens, steps, median throughput, skipped steps, settings changed on resume); the config
table what was trained (``pretrain.report.run_info``).
"""

from __future__ import annotations

import base64
import html
import math
import statistics
from pathlib import Path

from pretrain.report.panels import downstream_tasks, validation_sets
from pretrain.report.run_info import RunInfo
from pretrain.report.series import RunMetrics

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1500px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
.tables { display: flex; flex-wrap: wrap; gap: 2em; align-items: flex-start; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: left; }
td.value { font-family: ui-monospace, monospace; }
figure { margin: 1.5em 0; } img { max-width: 100%; }
figcaption { color: #555; font-size: 0.9em; }
"""


def _number(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "non-finite"


def _count(value: float) -> str:
    """1234567 -> '1,234,567 (1.23M)'."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value:,.0f} ({value / size:.3g}{suffix})"
    return f"{value:,.0f}"


def summary(metrics: RunMetrics, info: RunInfo) -> list[tuple[str, str]]:
    """(label, value) rows of how the run went, from what it logged."""
    rows = []
    series = metrics.series
    if "loss" in series and (last := series["loss"].last()):
        after = "" if last[0] == series["loss"].steps[-1] else \
            f"; non-finite at step {series['loss'].steps[-1]}"
        rows.append(("final train loss", f"{_number(last[1])} at step {last[0]}{after}"))
    elif "loss" in series:
        rows.append(("final train loss", "non-finite at every logged step"))
    for name, key in validation_sets(metrics):
        finite = series[key].finite()
        if finite:
            step, best = min(finite, key=lambda p: p[1])
            rows.append((f"best validation loss ({name})" if name else "best validation loss",
                         f"{_number(best)} at step {step} (last {_number(finite[-1][1])} at "
                         f"step {finite[-1][0]})"))
    if "loss" in series:
        planned = info.config.get("run.steps")
        steps = f"{max(series['loss'].steps)}" + (f" of {planned}" if planned else "")
        rows.append(("steps logged", steps))
    if "consumed_tokens" in series and (last := series["consumed_tokens"].last()):
        rows.append(("tokens consumed", _count(last[1])))
    for key, label, scale, unit in (("tokens_per_s", "tokens/s (median)", 1, ""),
                                    ("mfu", "MFU (median)", 100, " %")):
        values = [v for _, v in series[key].finite()] if key in series else []
        if values:
            rows.append((label, f"{statistics.median(values) * scale:,.1f}{unit}"))
    skipped = series.get("skipped_steps")
    if skipped is not None and (last := skipped.last()):
        spikes = series.get("skipped_spikes")
        of = f" ({spikes.last()[1]:.0f} as spikes)" if spikes and spikes.last() else ""
        rows.append(("skipped steps", f"{last[1]:.0f}{of}"))
    for r in metrics.rollbacks:
        rows.append(("rollback", f"at step {r.step} to step {r.to_step}"))
    for change in metrics.settings_changes:
        rows.append((f"resumed at step {change.step} with", change.text()))
    for task, curves in downstream_tasks(metrics).items():
        for curve in curves:
            if last := series[curve.key].last():
                rows.append((f"{task} {curve.label}", f"{_number(last[1])} at step {last[0]}"))
    return rows


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    body = "\n".join(f"<tr><th>{html.escape(label)}</th>"
                     f"<td class=\"value\">{html.escape(value)}</td></tr>"
                     for label, value in rows)
    return f"<div><h2>{html.escape(title)}</h2>\n<table>\n{body}\n</table></div>"


def page(info: RunInfo, run_dir: Path, summary_rows: list[tuple[str, str]],
         images: list[tuple[str, Path]]) -> str:
    """The HTML of the report: title, the two tables, then each (caption, PNG) embedded."""
    figures = []
    for caption, path in images:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        figures.append(f"<figure><img src=\"data:image/png;base64,{data}\" "
                       f"alt=\"{html.escape(caption)}\">"
                       f"<figcaption>{html.escape(caption)} ({html.escape(path.name)})"
                       f"</figcaption></figure>")
    title = html.escape(info.title())
    return "\n".join([
        "<!DOCTYPE html>", "<html lang=\"en\">", "<head>", "<meta charset=\"utf-8\">",
        f"<title>{title}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
        f"<h1>{title}</h1>",
        f"<p>Run folder <code>{html.escape(str(run_dir))}</code>; curves from its "
        "metrics.jsonl (the last record of each step).</p>",
        "<div class=\"tables\">", _table("Summary", summary_rows),
        _table("Config", info.rows()), "</div>", *figures, "</body>", "</html>", ""])
