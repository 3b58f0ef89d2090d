"""Which steps update the weights: the spike guard and the count of skipped steps.

A step whose loss or gradient is NaN/Inf never updates the weights. With ``guard.spikes`` a
step whose loss or gradient norm is an outlier is skipped too: an outlier exceeds the mean of
the last ``guard.window`` *updated* steps by more than ``guard.sigma`` standard deviations
(OLMo-core's rule, 6 sigma over 128 steps by default). Skipped steps never enter the window,
so a spike cannot widen the band that judges the next one. The loss is judged before the
optimizer runs; the gradient norm inside megatron's step, through its own skip threshold
(``OptimizerConfig.grad_norm_skip_threshold``, set before every step), so a skipped step
changes no weight and no optimizer state and costs no extra pass over the gradients.

The loss and the norm a rank sees are the same on every rank (both are all-reduced), so every
rank makes the same decision without another collective. The window is part of every
checkpoint (:meth:`SpikeGuard.state`), so a resumed run decides exactly as the run it
continues would have.
"""

from __future__ import annotations

import math
from collections import deque
from enum import StrEnum

from pretrain.config import GuardConfig

# The shortest window and warm-up at which the rule at 6 sigma skipped no step of healthy runs
# (docs/run-folder.md, "Choosing the window"): gradient norms have natural excursions every
# few dozen steps, and a shorter window, which holds none, judges the next one an outlier.
MIN_WINDOW, MIN_WARMUP, MEASURED_SIGMA = 64, 32, 6.0


def short_window_warning(config: GuardConfig) -> str | None:
    """One line for a start whose spike rule would judge healthy steps outliers, else None."""
    short = config.window < MIN_WINDOW or config.warmup < MIN_WARMUP
    if not config.spikes or not short or config.sigma > MEASURED_SIGMA:
        return None
    return (f"guard.window ({config.window}) and guard.warmup ({config.warmup}) are below "
            f"{MIN_WINDOW} and {MIN_WARMUP} updated steps, which the spike rule at guard.sigma "
            f"{config.sigma:g} needs: shorter ones skipped natural gradient-norm excursions of "
            "healthy runs, and 3 in a row stop the run (docs/run-folder.md)")


class Verdict(StrEnum):
    UPDATE = "update"
    NONFINITE = "a NaN/Inf loss or gradient"
    LOSS_SPIKE = "a loss spike"
    GRAD_SPIKE = "a gradient-norm spike"


def _limit(values: deque, sigma: float, warmup: int) -> float:
    """mean + sigma x standard deviation of ``values``; inf until there are ``warmup``."""
    if len(values) < warmup:
        return math.inf
    mean = math.fsum(values) / len(values)
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean + sigma * math.sqrt(variance)


class SpikeGuard:
    """The rolling windows, the skip counters and the rollbacks of one run."""

    def __init__(self, config: GuardConfig, state: dict | None = None):
        self.config = config
        state = state or {}
        self.losses = deque(state.get("losses", ()), maxlen=config.window)
        self.grad_norms = deque(state.get("grad_norms", ()), maxlen=config.window)
        self.skipped = state.get("skipped", 0)
        """Steps skipped since the run began (every reason)."""
        self.spikes = state.get("spikes", 0)
        """Of those, the spikes."""
        self.in_a_row: list[str] = list(state.get("in_a_row", ()))
        """The reasons of the skipped steps since the last update."""
        self.rollbacks: list[dict] = list(state.get("rollbacks", ()))
        """Each rollback: the step it was made at, the step it returned to, and the sample
        range [first, end) it skipped."""

    def state(self) -> dict:
        """Everything a resumed run needs to decide as this one would (plain JSON values:
        Python writes floats to JSON exactly)."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "skipped": self.skipped, "spikes": self.spikes, "in_a_row": self.in_a_row,
                "rollbacks": self.rollbacks}

    def loss_limit(self) -> float:
        """The largest loss the next step may have and still update (inf: not judging)."""
        c = self.config
        return _limit(self.losses, c.sigma, c.warmup) if c.spikes else math.inf

    def grad_norm_limit(self) -> float:
        """The largest gradient norm the next step may have and still update."""
        c = self.config
        return _limit(self.grad_norms, c.sigma, c.warmup) if c.spikes else math.inf

    def judge_loss(self, loss: float, finite: bool) -> Verdict:
        """Whether a step with this (all-reduced) loss may go on to the optimizer."""
        if not finite:
            return Verdict.NONFINITE
        return Verdict.LOSS_SPIKE if loss > self.loss_limit() else Verdict.UPDATE

    def record(self, verdict: Verdict, loss: float, grad_norm: float | None) -> None:
        """Count the step's outcome; an updated step joins the windows."""
        if verdict is Verdict.UPDATE:
            self.in_a_row.clear()
            self.losses.append(loss)
            if grad_norm is not None:
                self.grad_norms.append(float(grad_norm))
            return
        self.skipped += 1
        self.spikes += verdict in (Verdict.LOSS_SPIKE, Verdict.GRAD_SPIKE)
        self.in_a_row.append(verdict.value)

    def exhausted(self) -> bool:
        """Too many skipped steps in a row: the run must stop or roll back."""
        return len(self.in_a_row) >= self.config.max_skipped

    def streak_text(self) -> str:
        """The skipped steps in a row, for the message that stops or rolls back the run."""
        n = len(self.in_a_row)
        if set(self.in_a_row) == {Verdict.NONFINITE.value}:
            return f"{n} consecutive steps had a NaN/Inf loss or gradient"
        counts = ", ".join(f"{self.in_a_row.count(v.value)} with {v.value}" for v in Verdict
                           if v.value in self.in_a_row)
        return f"{n} consecutive steps were skipped ({counts})"

    def roll_back(self, saved: dict | None, at_step: int, to_step: int, first: int,
                  end: int) -> None:
        """Return the windows to ``saved`` (the state in the checkpoint rolled back to) and
        remember the rollback: made at ``at_step``, back to ``to_step``, skipping samples
        [first, end). The counters keep what this run did; they never go back."""
        saved = saved or {}
        self.losses = deque(saved.get("losses", ()), maxlen=self.config.window)
        self.grad_norms = deque(saved.get("grad_norms", ()), maxlen=self.config.window)
        self.in_a_row.clear()
        self.rollbacks.append({"at_step": at_step, "to_step": to_step,
                               "skipped_samples": [first, end]})


def grad_norm_limit_into(optimizer, limit: float) -> None:
    """megatron's skip threshold for the next step, on every optimizer of a chain (each has
    its own config object in general)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.config.grad_norm_skip_threshold = limit
