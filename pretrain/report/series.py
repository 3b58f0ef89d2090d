"""A run's metrics.jsonl read back as one curve per key, for ``python -m pretrain report``.

metrics.jsonl (``pretrain.report.metrics``) holds one JSON object per record, each with its
``step``. A step is logged more than once when it is trained again (after a crash, the steps
since the last checkpoint; after a rollback, those since the checkpoint rolled back to), and
the later record is the one that counts, so a curve keeps, for each key, the last value
logged at each step. Records of one step split over several lines (training, diagnostics,
validation) each add their own keys. A value written as null (a NaN/Inf loss) stays in the
curve as NaN, which a plot draws as a gap rather than joining its neighbours over it.

Only the standard library here: the report must start fast and without torch.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import DataError

log = logging.getLogger("pretrain")


@dataclass(frozen=True)
class Series:
    """One key's values by step, in step order; NaN where the value was null or non-finite."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    def finite(self) -> list[tuple[int, float]]:
        return [(s, v) for s, v in zip(self.steps, self.values, strict=True)
                if math.isfinite(v)]

    def last(self) -> tuple[int, float] | None:
        """The last finite (step, value), or None."""
        found = self.finite()
        return found[-1] if found else None


@dataclass(frozen=True)
class Rollback:
    """A rollback row: at ``step`` the run returned to the checkpoint of ``to_step``."""

    step: int
    to_step: int


@dataclass(frozen=True)
class SettingsChange:
    """A resume that changed settings from ``step`` on: {"section.key": [old, new]}."""

    step: int
    changes: dict[str, list]

    def text(self) -> str:
        return ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}"
                         for key, (old, new) in self.changes.items())


@dataclass
class RunMetrics:
    """Every key's curve, plus the events that are not curves (rollbacks, settings)."""

    series: dict[str, Series]
    rollbacks: list[Rollback] = field(default_factory=list)
    settings_changes: list[SettingsChange] = field(default_factory=list)

    def has(self, key: str) -> bool:
        return key in self.series

    def keys(self, prefix: str) -> list[str]:
        """The keys starting with ``prefix``, sorted."""
        return sorted(k for k in self.series if k.startswith(prefix))


def _number(value) -> float | None:
    """A record's value as a float (null: NaN); None for what is not a number (text)."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def read_records(path: Path, what: str):
    """(line number, object) of every non-blank line; any other line is a DataError naming
    the file, the line and the rule, except a last line without its newline that is not JSON:
    a write a crash cut short (the state a crashed run leaves, which is when a report is most
    wanted), left out with a warning."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{what} '{path}' cannot be read: {err}") from None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                log.warning("%s '%s': line %d was cut short (a crash during a write); left "
                            "out", what, path, number)
                return
            raise DataError(f"{what} '{path}' line {number} is not JSON ({err.msg}, column "
                            f"{err.colno}): {line[:60]!r}") from None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DataError(f"{what} '{path}' line {number} must be a JSON object with a "
                            f"step >= 0, got {line[:60]!r}")
        yield number, record


def read_metrics(path: Path) -> RunMetrics:
    """The curves and rollbacks of a metrics.jsonl (last record of each step wins, per key)."""
    by_key: dict[str, dict[int, float]] = {}
    rollbacks: list[Rollback] = []
    for _, record in read_records(path, "metrics file"):
        step = record["step"]
        for key, value in record.items():
            number = _number(value)
            if key != "step" and number is not None:
                by_key.setdefault(key, {})[step] = number
        to_step = record.get("rollback_to_step")
        if isinstance(to_step, int) and Rollback(step, to_step) not in rollbacks:
            rollbacks.append(Rollback(step, to_step))
    if not by_key:
        raise DataError(f"metrics file '{path}' holds no records")
    series = {}
    for key, values in by_key.items():
        steps = tuple(sorted(values))
        series[key] = Series(steps, tuple(values[s] for s in steps))
    return RunMetrics(series, rollbacks)


def read_settings_changes(path: Path) -> list[SettingsChange]:
    """settings_changes.jsonl's lines (none when the file does not exist)."""
    if not path.is_file():
        return []
    out = []
    for number, record in read_records(path, "settings file"):
        changes = record.get("changes")
        if not isinstance(changes, dict) or not all(
                isinstance(v, list) and len(v) == 2 for v in changes.values()):
            raise DataError(f"settings file '{path}' line {number}: changes must be "
                            f"{{\"section.key\": [old, new]}}, got {json.dumps(changes)[:60]}")
        out.append(SettingsChange(record["step"], changes))
    return out


def smooth(values: tuple[float, ...] | list[float], width: int) -> list[float]:
    """Mean of the last ``width`` finite values at each point (``width`` <= 1: unchanged);
    a non-finite value stays a gap and is left out of its neighbours' means."""
    if width <= 1:
        return list(values)
    out, window = [], []
    for value in values:
        if math.isfinite(value):
            window = [*window[-(width - 1):], value]
            out.append(sum(window) / len(window))
        else:
            out.append(math.nan)
    return out
