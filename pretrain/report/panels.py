"""Which pictures a run's report holds, decided from the keys its metrics.jsonl has.

Kept apart from the drawing (``pretrain.report.plots``) so that what a report shows can be
decided, and tested, without matplotlib. Each :class:`Figure` is one PNG of one or more
:class:`Plot` panels over the step axis; a figure exists only when the run logged its data,
so a CPU run has no MFU, a run without ``diagnostics.interval`` no stream panels, a healthy
run no skipped-steps panel, a one-rank run (whose slowest rank is itself) no straggler panel.

Key families read here, besides the training record's own fields:
``val_loss`` (the default validation set) and ``val/<name>/loss`` (further sets);
``val_loss_at/<first>-<last>`` (the default set's loss by position in the sequence);
``diag/{x,y,h}_{rms,grad_norm}/block<NN>`` and ``diag/merge/*``
(``pretrain.train.diagnostics``); ``downstream/<task>/<metric>``, where a
``<metric>_stderr`` becomes the band around its metric and ``chance`` (a multiple-choice
task's guessing level) a dashed line; ``spike_loss`` of loss-spike events; ``moe_load/block<NN>``
and ``moe_*`` of a mixture-of-experts run (``pretrain.train.experts``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pretrain.report.expert_load import LOAD_KEY, imbalance_load
from pretrain.report.run_info import RunInfo
from pretrain.report.series import RunMetrics

VALIDATION = re.compile(r"^val/(.+)/loss$")
DOWNSTREAM = re.compile(r"^downstream/([^/]+)/(.+)$")
STREAM_STAT = re.compile(r"^diag/([a-z]+)_(rms|grad_norm)/block(\d+)$")
POSITION_LOSS = re.compile(r"^val_loss_at/(\d+)-(\d+)$")
CHANCE = "chance"  # downstream/<task>/chance: a reference level, not a score
STREAMS = {"x": "x stream (Post-Norm-like)", "y": "y stream (Pre-Norm-like)",
           "h": "residual stream"}


@dataclass(frozen=True)
class Curve:
    """One line of a panel: ``kind`` is ``line`` (a value per logged step), ``counter`` (a
    running count, drawn as steps) or ``events`` (markers only); ``scale`` multiplies the
    values (a fraction shown in %); ``error_key`` names a +- band; ``smooth`` > 1 draws the
    mean of that many points over the raw line, which is then faint."""

    key: str
    label: str
    kind: str = "line"
    scale: float = 1.0
    error_key: str | None = None
    smooth: int = 0


@dataclass(frozen=True)
class Plot:
    """One panel. ``by_depth``: one curve per block, coloured by depth with a colour bar
    instead of a legend (24 blocks make no readable legend). ``log_y``: a log axis where the
    values span enough to need one. ``threshold``: a horizontal reference line (value,
    label). An empty title leaves the figure's own."""

    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    log_y: bool = False
    by_depth: bool = False
    threshold: tuple[float, str] | None = None


@dataclass(frozen=True)
class Mark:
    """A vertical line across every panel at ``step``: a rollback, or settings changed."""

    step: int
    label: str
    color: str
    style: str


@dataclass(frozen=True)
class Figure:
    """One PNG, ``<name>.png``."""

    name: str
    title: str
    plots: tuple[Plot, ...]


def validation_sets(metrics: RunMetrics) -> list[tuple[str, str]]:
    """(name, key) of every validation set's loss: the default split first, named ""."""
    found = [("", "val_loss")] if metrics.has("val_loss") else []
    found += [(m.group(1), key) for key in metrics.keys("val/")
              if (m := VALIDATION.match(key))]
    return found


def _stderr_key(key: str) -> str:
    """lm-eval's error of ``acc`` is ``acc_stderr``, of ``exact_match/strict`` (a filter)
    ``exact_match_stderr/strict``."""
    metric, slash, where = key.partition("/")
    return f"{metric}_stderr{slash}{where}"


def downstream_tasks(metrics: RunMetrics) -> dict[str, list[Curve]]:
    """Per task, one curve per metric (its ``_stderr`` as the curve's band, not a curve)."""
    metrics_of: dict[str, dict[str, str]] = {}
    for key in metrics.keys("downstream/"):
        if m := DOWNSTREAM.match(key):
            metrics_of.setdefault(m.group(1), {})[m.group(2)] = key
    tasks = {}
    for task, named in sorted(metrics_of.items()):
        errors = {_stderr_key(metric) for metric in named} & set(named)
        tasks[task] = [Curve(key, metric, error_key=named.get(_stderr_key(metric)))
                       for metric, key in sorted(named.items()) if metric not in errors]
    return tasks


def stream_stats(metrics: RunMetrics) -> dict[str, dict[str, list[tuple[int, str]]]]:
    """{quantity: {stream: [(block, key), ...]}} of the per-block diagnostics."""
    found: dict[str, dict[str, list[tuple[int, str]]]] = {}
    for key in metrics.keys("diag/"):
        if m := STREAM_STAT.match(key):
            stream, quantity, block = m.group(1), m.group(2), int(m.group(3))
            found.setdefault(quantity, {}).setdefault(stream, []).append((block, key))
    for streams in found.values():
        for blocks in streams.values():
            blocks.sort()
    return found


def _loss(metrics: RunMetrics, smooth: int) -> Figure | None:
    curves = []
    if metrics.has("loss"):
        curves.append(Curve("loss", "train", smooth=smooth))
    curves += [Curve(key, f"validation: {name}" if name else "validation")
               for name, key in validation_sets(metrics)]
    if not curves:
        return None
    if metrics.has("spike_loss"):
        curves.append(Curve("spike_loss", "loss spike (diagnostics)", kind="events"))
    return Figure("loss", "Loss", (Plot("", "loss (nats per token)",
                                        tuple(curves)),))


def _loss_by_position(metrics: RunMetrics) -> Figure | None:
    """The validation loss over each span of positions in the sequence, one curve per span
    (``val_loss_at/<first>-<last>``, ``pretrain.train.evaluate``): later spans below earlier
    ones when the model uses its context, the usual long-context check."""
    spans = sorted((int(m[1]), int(m[2]), key) for key in metrics.series
                   if (m := POSITION_LOSS.match(key)))
    if not spans:
        return None
    curves = tuple(Curve(key, f"positions {first}-{last}") for first, last, key in spans)
    return Figure("loss_by_position", "Validation loss by position in the sequence",
                  (Plot("", "loss (nats per token)", curves),))


def _single(metrics: RunMetrics, key: str, name: str, title: str, ylabel: str,
            log_y: bool = False) -> Figure | None:
    if not metrics.has(key):
        return None
    return Figure(name, title, (Plot("", ylabel, (Curve(key, key),), log_y=log_y),))


def _learning_rates(metrics: RunMetrics) -> Figure | None:
    """AdamW's LR and, with Muon, its matrices' (one curve each)."""
    if not metrics.has("lr"):
        return None
    curves = [Curve("lr", "AdamW" if metrics.has("muon_lr") else "lr")]
    if metrics.has("muon_lr"):
        curves.append(Curve("muon_lr", "Muon"))
    return Figure("lr", "Learning rate", (Plot("", "learning rate", tuple(curves)),))


def _throughput(metrics: RunMetrics) -> Figure | None:
    plots = []
    if metrics.has("tokens_per_s"):
        plots.append(Plot("tokens per second", "tokens per second (whole job)",
                          (Curve("tokens_per_s", "tokens/s"),)))
    if metrics.has("mfu"):
        plots.append(Plot("model FLOPs utilisation", "MFU (%)", (Curve("mfu", "MFU", scale=100),)))
    elif metrics.has("tflops_per_gpu"):
        plots.append(Plot("model FLOPs per GPU", "TFLOP/s per GPU",
                          (Curve("tflops_per_gpu", "TFLOP/s per GPU"),)))
    return Figure("throughput", "Throughput", tuple(plots)) if plots else None


def _skipped(metrics: RunMetrics) -> Figure | None:
    """Skipped updates (running counts) and rollbacks: only when there was any."""
    keys = [k for k in ("skipped_steps", "skipped_spikes") if metrics.has(k)]
    counted = any(v > 0 for k in keys for _, v in metrics.series[k].finite())
    if not counted and not metrics.rollbacks:
        return None
    labels = {"skipped_steps": "skipped steps (every reason)",
              "skipped_spikes": "skipped as loss or gradient spikes"}
    curves = tuple(Curve(k, labels[k], kind="counter") for k in keys)
    return Figure("skipped", "Skipped steps and rollbacks",
                  (Plot("skipped updates since the run began (rollbacks: red lines)",
                        "skipped steps (running count)", curves),))


def _stragglers(metrics: RunMetrics, info: RunInfo) -> Figure | None:
    """The slowest rank's step time over the median; on one rank it is 1.0 by definition."""
    if not metrics.has("slowest_ratio") or all(
            v == 1.0 for _, v in metrics.series["slowest_ratio"].finite()):
        return None
    limit = info.config.get("run.straggler_ratio")
    threshold = (float(limit), "run.straggler_ratio (warning)") \
        if isinstance(limit, int | float) and math.isfinite(limit) else None
    return Figure("stragglers", "Stragglers", (Plot(
        "slowest rank", "slowest rank's step time / median",
        (Curve("slowest_ratio", "slowest / median"),), threshold=threshold),))


def _streams(metrics: RunMetrics) -> list[Figure]:
    out = []
    stats = stream_stats(metrics)
    for quantity, title, ylabel in (
            ("rms", "Stream RMS per block", "RMS of the block's output stream"),
            ("grad_norm", "Gradient reaching each stream",
             "L2 norm of d(loss)/d(block output)")):
        streams = stats.get(quantity)
        if not streams:
            continue
        plots = tuple(Plot(STREAMS.get(stream, f"{stream} stream"), ylabel,
                           tuple(Curve(key, f"block {block}") for block, key in blocks),
                           log_y=True, by_depth=True)
                      for stream, blocks in sorted(streams.items()))
        out.append(Figure(f"diag_{quantity}", title, plots))
    share = [Curve(k, label) for k, label in (("diag/merge/x_share",
                                                "x share |Na(x)| / (|Na(x)| + |Nb(y)|)"),
                                               ("diag/merge/cosine", "cosine(Na(x), Nb(y))"))
             if metrics.has(k)]
    rms = [Curve(k, label) for k, label in (("diag/merge/x_rms", "RMS of Na(x)"),
                                             ("diag/merge/y_rms", "RMS of Nb(y)"))
           if metrics.has(k)]
    plots = [Plot("x share and agreement in the final merge", "share / cosine", tuple(share))
             ] if share else []
    plots += [Plot("merge inputs", "RMS", tuple(rms))] if rms else []
    if plots:
        out.append(Figure("diag_merge", "Final merge Nfinal(Na(x) + Nb(y))", tuple(plots)))
    return out


def _downstream(metrics: RunMetrics) -> Figure | None:
    tasks = downstream_tasks(metrics)
    if not tasks:
        return None
    plots = []
    for task, curves in tasks.items():
        chance = metrics.series.get(f"downstream/{task}/{CHANCE}")
        level = chance.last() if chance is not None else None
        plots.append(Plot(task, "score", tuple(c for c in curves if c.label != CHANCE),
                          threshold=(level[1], "chance (a uniform guess)") if level else None))
    return Figure("downstream", "Downstream scores", tuple(plots))


def _imbalance_level(info: RunInfo) -> tuple[float, str] | None:
    """The max load above which the training loop calls a router imbalanced, from the run's
    experts and top-k; None when its config does not say them."""
    experts, topk = info.config.get("model.num_experts"), info.config.get("model.moe_router_topk")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (experts, topk)):
        return None
    return imbalance_load(experts, topk), "imbalance level"


def _experts(metrics: RunMetrics, info: RunInfo) -> Figure | None:
    """A mixture-of-experts run's routers: each MoE block's busiest expert against the level
    above which it counts as imbalanced (``pretrain.report.expert_load``), the least-loaded
    expert, the share dropped by a capacity factor, and the balancing and z losses."""
    blocks = sorted((int(m.group(1)), key) for key in metrics.keys("moe_load/")
                    if (m := LOAD_KEY.match(key)))
    plots = []
    if blocks:
        plots.append(Plot("busiest expert of each MoE block", "max / mean tokens per expert",
                          tuple(Curve(key, f"block {block}") for block, key in blocks),
                          by_depth=True, threshold=_imbalance_level(info)))
    for key, title, ylabel, curve, scale in (
            ("moe_min_load", "least-loaded expert (every MoE block)",
             "min / mean tokens per expert", "lowest of any block", 1.0),
            ("moe_dropped", "dropped by the capacity factor", "routed assignments dropped (%)",
             "dropped", 100.0),
            ("moe_aux_loss", "load-balancing loss (mean over MoE blocks)",
             "loss without its coefficient", "balancing loss", 1.0),
            ("moe_z_loss", "router z-loss (mean over MoE blocks)",
             "loss without its coefficient", "z-loss", 1.0)):
        if metrics.has(key):
            plots.append(Plot(title, ylabel, (Curve(key, curve, scale=scale),)))
    return Figure("experts", "Mixture of experts: router load and losses", tuple(plots)) \
        if plots else None


def marks(metrics: RunMetrics) -> list[Mark]:
    """Rollbacks (red, dotted: where the run returned to) and settings changed on resume
    (grey, dashed: from which step the new values apply)."""
    out = [Mark(r.step, f"rollback at step {r.step} to step {r.to_step}", "tab:red", ":")
           for r in metrics.rollbacks]
    out += [Mark(c.step, f"resumed with {c.text()}", "dimgray", "--")
            for c in metrics.settings_changes]
    return out


def figures(metrics: RunMetrics, info: RunInfo, smooth: int = 0) -> list[Figure]:
    """The report's figures, in the order the page shows them."""
    found = [
        _loss(metrics, smooth),
        _loss_by_position(metrics),
        _learning_rates(metrics),
        _single(metrics, "grad_norm", "grad_norm", "Gradient norm",
                "gradient L2 norm (before clipping)", log_y=True),
        _throughput(metrics),
        _skipped(metrics),
        _stragglers(metrics, info),
        *_streams(metrics),
        _experts(metrics, info),
        _downstream(metrics),
    ]
    return [f for f in found if f is not None]
