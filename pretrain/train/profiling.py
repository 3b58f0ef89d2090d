"""A torch.profiler trace of chosen training steps, and a CUDA memory snapshot when a step runs
out of memory (the ``[profiling]`` section).

Why: where a step's time goes (which kernels, which collectives wait, the host's gaps between
launches) and what filled a GPU when it ran out of memory are questions the metrics cannot
answer. Megatron-LM (``--profile-step-start``, ``--profile-ranks``,
``--record-memory-history``) and torchtitan (``[profiling]``) answer them with these torch
tools, so their users look for them here; one place owns both, entered from the loop around
each step (:meth:`StepProfiler.step`).

- **Trace**: steps ``first_step`` to ``first_step + steps - 1`` (the console's numbers) on
  each rank of ``profiling.ranks``, into one Chrome-trace file per rank,
  ``<run.dir>/profile/rank<R>-step<A>-<B>.pt.trace.json`` (the ``.pt.trace.json`` ending is
  the one TensorBoard's profiler plugin looks for; Perfetto opens any). Each step is a range
  named ``step N``. The step before the window, when this run takes it, is the profiler's
  warm-up (``torch.profiler.schedule``), so the profiler's own start is not billed to the
  first traced step. Steps outside the window run without a profiler. A resumed run whose
  start lies past the window's first step traces nothing and says so; a window cut short (a
  stop, an error) writes nothing.
- **Memory snapshot** (``profiling.memory_snapshot``, CUDA only): every rank records its
  caching allocator's history from the start (``torch.cuda.memory._record_memory_history``),
  and a step that raises ``torch.OutOfMemoryError`` dumps it
  (``torch.cuda.memory._dump_snapshot``) to ``<run.dir>/profile/rank<R>-oom-step<N>.pickle``;
  the error then goes on unchanged. Whatever happens, an out-of-memory step logs one warning
  saying where the snapshot is, or why there is none (not asked for: how to ask; the CPU has
  no such allocator).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from pretrain.config import ProfilingConfig
from runtime import device

log = logging.getLogger("pretrain")

FOLDER = "profile"
HISTORY_ENTRIES = 100_000
"""Allocator events the memory history keeps (the newest; torchtitan's default)."""
VIEWER = "https://ui.perfetto.dev"
MEMORY_VIEWER = "https://pytorch.org/memory_viz"


def trace_name(rank: int | str, first: int, last: int) -> str:
    """The trace file of ``rank`` for steps ``first``-``last``."""
    steps = f"{first}" if first == last else f"{first}-{last}"
    return f"rank{rank}-step{steps}.pt.trace.json"


def snapshot_name(rank: int, step: int) -> str:
    return f"rank{rank}-oom-step{step}.pickle"


class StepProfiler:
    """This rank's profiler: :meth:`step` wraps each training step, :meth:`close` ends it.
    ``start`` is the number of steps done before this run (a resume's checkpoint), ``say``
    prints a console line (on the logging rank)."""

    def __init__(self, p: ProfilingConfig, run_dir: Path, rank: int, start: int, cuda: bool,
                 say: Callable[[str], None]):
        self.rank, self.cuda, self.say = rank, cuda, say
        self.folder = Path(run_dir) / FOLDER
        self.first, self.last = p.first_step, p.first_step + p.steps - 1
        self.steps = (self.first, self.last)
        ahead = p.first_step > start  # the whole window is still to come
        self.window_ahead = p.first_step > 0 and ahead  # some rank traces it
        self.tracing_rank = self.window_ahead and rank in p.ranks
        self.warmup = 1 if self.first - 1 > start else 0
        self.options = dict(record_shapes=p.record_shapes, profile_memory=p.profile_memory,
                            with_stack=p.with_stack)
        self.profiler: profile | None = None
        self.ranks = sorted(set(p.ranks))
        if p.first_step and not ahead:
            say(f"profiling.first_step ({p.first_step}) lies before this start (after step "
                f"{start}): no trace")
        self.history = p.memory_snapshot and cuda
        if self.history:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        elif p.memory_snapshot:
            say("profiling.memory_snapshot: this run is on the CPU, where torch records no "
                "allocator history; no snapshot will be written")

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around step ``number`` (from 1): the profiler starts before its warm-up step and
        stops after the window's last step; an out-of-memory error is met here."""
        if self.tracing_rank and number == self.first - self.warmup:
            self._start()
        try:
            with record_function(f"step {number}") if self.profiler else contextlib.nullcontext():
                yield
        except BaseException as err:
            if isinstance(err, torch.OutOfMemoryError):
                self._out_of_memory(number)
            self.close()
            raise
        if self.profiler is not None:
            self.profiler.step()  # the schedule moves on: warm-up, record, write
            if number == self.last:
                self.profiler.__exit__(None, None, None)  # writes the trace (_write)
                self.profiler = None
        if self.window_ahead and number == self.last:
            self.tracing_rank = self.window_ahead = False  # once, even if a rollback repeats it
            them = "them" if len(self.ranks) > 1 else "it"
            self.say(f"traced {self.window()} on {self.where()} (open {them} in {VIEWER})")

    def window(self) -> str:
        return f"step {self.first}" if self.first == self.last else \
            f"steps {self.first}-{self.last}"

    def where(self) -> str:
        """The rank(s) that trace, and their file(s)."""
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}: {self.folder / trace_name(self.ranks[0], *self.steps)}"
        return (f"ranks {', '.join(map(str, self.ranks))}: "
                f"{self.folder / trace_name('<R>', *self.steps)}")

    def close(self) -> None:
        """Ends the profiler (a window cut short writes nothing) and the memory history."""
        if self.profiler is not None:
            self.profiler.on_trace_ready = None
            self.profiler.__exit__(None, None, None)
            self.profiler = None
            self.say(f"the trace of {self.window()} was cut short: not written")
        if self.history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.history = False

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # without a warm-up step the profiler records from its start (torch's schedule
        # would warn that it has no warm-up); with one, the schedule skips it
        steps = schedule(wait=0, warmup=1, active=self.last - self.first + 1, repeat=1) \
            if self.warmup else None
        self.profiler = profile(activities=activities, schedule=steps,
                                on_trace_ready=self._write, **self.options)
        self.profiler.__enter__()

    def _write(self, profiler: profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.folder / trace_name(self.rank, *self.steps)))

    def _out_of_memory(self, step: int) -> None:
        """One warning for an out-of-memory step: where its snapshot went, or why none."""
        if not self.cuda:
            log.warning("step %d ran out of memory on rank %d; no memory snapshot: torch "
                        "records allocator history only on a CUDA device", step, self.rank)
            return
        if not self.history:
            log.warning("step %d ran out of CUDA memory on rank %d; for a snapshot of what "
                        "filled it, run again with --profiling.memory_snapshot=true", step,
                        self.rank)
            return
        path = self.folder / snapshot_name(self.rank, step)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as err:  # the out-of-memory error is the one to report
            log.warning("step %d ran out of CUDA memory on rank %d; its memory snapshot could "
                        "not be written to %s: %s", step, self.rank, path, err)
            return
        log.warning("step %d ran out of CUDA memory on rank %d: memory snapshot in %s (open it "
                    "at %s)", step, self.rank, path, MEMORY_VIEWER)


def build(p: ProfilingConfig, run_dir: Path, rank: int, start: int,
          say: Callable[[str], None]) -> StepProfiler:
    """This rank's :class:`StepProfiler`; with nothing asked for it only watches for an
    out-of-memory step."""
    return StepProfiler(p, run_dir, rank, start, device.uses_cuda(), say)
