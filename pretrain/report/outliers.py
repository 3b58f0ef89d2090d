"""The body of a curve's values, so that one spike does not set a panel's axis.

A loss spike of 650 on a curve that trains from 11 down to 2.5 would make that curve a flat
line at the bottom of its panel. An outlier is told from the real shape of a curve by being
isolated: it sits far from the median of its neighbours (a smooth decay, a warm-up or a
schedule's drop sits on that median and is never an outlier, however steep), where far is
many times the curve's own step-to-step noise. The axis is clipped to the rest only when the
outliers would stretch it several times over; what lies beyond is then marked at the edge
(``pretrain.report.plots``), never silently dropped. Only the standard library: it is
decided, and tested, without matplotlib.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Neighbours on each side whose median a value is compared with: a spike must last fewer
# than this many logged points to count as one.
RADIUS = 4
# How many median deviations from its neighbours make a value an outlier.
SPREAD = 10.0
# Clip only when the outliers would make the axis this many times taller than the body.
STRETCH = 3.0


def _deviations(values: list[float]) -> list[float]:
    """Each value minus the median of the window centred on it (narrower near the ends)."""
    out = []
    for i, value in enumerate(values):
        radius = min(RADIUS, i, len(values) - 1 - i)
        out.append(value - statistics.median(values[i - radius:i + radius + 1]))
    return out


def body_range(curves: Sequence[Sequence[float]]) -> tuple[float, float] | None:
    """(low, high) of the values of ``curves`` (each in step order, NaN for a gap) without
    their isolated outliers, or None when the outliers stretch the axis too little to matter
    (then every value is shown as it is)."""
    body: list[float] = []
    every: list[float] = []
    for curve in curves:
        values = [v for v in curve if math.isfinite(v)]
        if not values:
            continue
        every += values
        deviations = _deviations(values)
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (0, 0, 0)
        noise = statistics.median(abs(d) for d in deviations)
        limit = SPREAD * noise + 0.5 * (q3 - q1)
        body += [v for v, d in zip(values, deviations, strict=True) if abs(d) <= limit]
    if not body or len(body) == len(every):
        return None
    low, high = min(body), max(body)
    if max(every) - min(every) <= STRETCH * (high - low):
        return None
    return low, high
