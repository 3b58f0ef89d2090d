"""Which rank is the slowest: every rank's step time, gathered at each log interval.

A slow rank does not show in its own wall time per step: every step ends in collectives (the
gradient reduction, the step's status) where the other ranks wait for it, so each rank's step
takes as long as the slowest rank's. What differs is the time before the first such wait.
Each rank therefore times its steps from their start to the moment it enters the gradient
synchronisation (megatron's ``finalize_model_grads_func``, called once per step after the
last backward): its data, forward and backward. Across data-parallel replicas that is each
rank's own work; inside a tensor- or pipeline-parallel group the ranks also wait for each
other during the step (its collectives, the pipeline's hand-offs), so there a slow rank slows
its group and the rank named may be another of the group. On a GPU the interval is timed
with CUDA events on the compute stream (the device's time, gaps a slow host leaves
included), on the CPU with the host's clock.

At every log interval each rank contributes the mean of its step times since the previous one
(one all-reduce of one float per rank). The record gets ``step_time_max`` (seconds: the
slowest rank's mean), ``step_time_median`` (over the ranks), ``slowest_rank`` (global rank)
and ``slowest_ratio`` (max / median, 1.0 on one rank); the logging rank warns when the ratio
exceeds run.straggler_ratio. The first step a process takes is not timed: it carries one-time
set-up (lazy allocations, first kernel launches) that differs between ranks and would name a
straggler that is none; a record with no timed step (the first, with run.log_interval = 1)
has none of these fields.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

from runtime import device

log = logging.getLogger("pretrain")


def slowest(times: Sequence[float]) -> dict:
    """The record fields of per-rank step times (seconds, by global rank)."""
    median = statistics.median(times)
    rank = max(range(len(times)), key=times.__getitem__)
    return {"step_time_max": times[rank], "step_time_median": median, "slowest_rank": rank,
            "slowest_ratio": times[rank] / median if median > 0 else 1.0}


def gather(seconds: float) -> list[float]:
    """Every rank's ``seconds``, by global rank: one all-reduce that every rank must join."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.float64,
                         device=device.compute_device())
    values[dist.get_rank()] = seconds
    dist.all_reduce(values)
    return values.tolist()


class StepClock:
    """This rank's step times up to its gradient synchronisation: :meth:`begin` at a step's
    start; the end is marked by the model's ``finalize_model_grads_func``, wrapped for the
    life of the model (evaluation, forward only, never calls it)."""

    def __init__(self, chunks: list):
        self._cuda = device.uses_cuda()
        self._config = get_model_config(chunks[0])  # what the schedule reads; shared by chunks
        self._finalize = self._config.finalize_model_grads_func
        self._config.finalize_model_grads_func = self._synchronising
        self._start = None
        self._steps: list = []  # (start, end) marks of the steps since the last take()
        self._untimed = 1  # the first step: one-time set-up

    def begin(self) -> None:
        if self._untimed:
            self._untimed -= 1
            return
        self._start = self._mark()

    def _synchronising(self, *args, **kwargs):
        if self._start is not None:
            self._steps.append((self._start, self._mark()))
            self._start = None
        return self._finalize(*args, **kwargs)

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> float | None:
        """The mean time per step (seconds) since the last call; None with no timed step."""
        steps, self._steps = self._steps, []
        if self._cuda:
            for _, end in steps:
                end.synchronize()
            times = [start.elapsed_time(end) / 1000 for start, end in steps]
        else:
            times = [end - start for start, end in steps]
        return sum(times) / len(times) if times else None


class Stragglers:
    """The clock and the per-interval comparison of the ranks (:meth:`measure`, collective)."""

    def __init__(self, chunks: list, ratio: float, warn: bool):
        self.clock = StepClock(chunks)
        self.ratio, self.warn = ratio, warn

    def step_begins(self) -> None:
        self.clock.begin()

    def measure(self, step: int) -> dict:
        """The record fields for the steps since the last call; warns on a straggler. Every
        rank calls it at the same steps (the log interval), and every rank timed the same
        steps, so all of them gather or none does."""
        seconds = self.clock.take()
        if seconds is None:
            return {}
        fields = slowest(gather(seconds))
        if self.warn and fields["slowest_ratio"] > self.ratio:
            log.warning("step %d: rank %d is a straggler: %.3f s per step against a median "
                        "of %.3f s over the ranks (%.2fx > run.straggler_ratio %g)", step,
                        fields["slowest_rank"], fields["step_time_max"],
                        fields["step_time_median"], fields["slowest_ratio"], self.ratio)
        return fields
