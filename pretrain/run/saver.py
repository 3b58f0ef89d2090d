"""A run's checkpoint saves, in the foreground or, with ``run.async_save``, in the background.

In the background a save returns once its state is off the training path, and the write runs
on while training goes on. It is megatron-core's async save: ``dist_checkpointing.save(...,
async_sharded_save=True)`` plans the write on every rank (the collectives, the non-tensor state
serialised), and its ``AsyncCallsQueue`` forks a writer process per rank (megatron's
``TemporalAsyncCaller``; ``async_strategy="mcore"``, since the "nvrx" one needs
nvidia-resiliency-ext). What that writer writes is the state at the fork: megatron's preload
first copies GPU tensors to host memory, and host tensors (on a CPU run all of them, which the
preload leaves in place) are the forked process's copy-on-write pages, which the training
process's later in-place updates of weights and optimizer state never reach (tested: a
background checkpoint equals a foreground one of the same step). megatron's persistent
worker would not do here: it shares host tensors with the worker instead of copying them.

A checkpoint counts once complete, as in the foreground: when every rank's writer has ended,
megatron's finalisation (the tensor index) and then :func:`pretrain.run.checkpoint.complete`
(complete.json last, the rename, ``latest``, ``run.keep_last``) run on every rank. The ranks
ask whether the writers have ended once per step while a write is in flight (:meth:`Saver.poll`,
one all-reduce), so a checkpoint completes about when its write ends; the next save and the
end of the run wait for it. A write that failed on any rank ends in the same CheckpointError a
foreground save raises, naming the step; the previous checkpoint stays the latest. A process
killed while a write is in flight leaves only ``.step_N.tmp`` behind, as in the foreground,
which the next start removes. The writer reports to its own save's file
(:mod:`runtime.write_results`), not to megatron's Manager process; an exit at once (a second
Ctrl-C, the hang watchdog) kills it first (:func:`pretrain.run.stop.kill_children`); a SIGKILL
of the training process leaves it to finish its write and exit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from pretrain.run import checkpoint
from runtime import weights
from runtime.errors import CheckpointError
from runtime.parallel import any_rank
from runtime.write_results import reported_in_a_file

log = logging.getLogger("pretrain")


class InFlight(NamedTuple):
    """A background save whose write has not been confirmed on every rank yet."""

    step: int
    tmp: Path
    record: dict
    """complete.json's content, taken when the save began."""


class Saver:
    """Every checkpoint of one run goes through here, on every rank, in the same order."""

    def __init__(self, root: Path, keep_last: int, background: bool):
        self.root, self.keep_last, self.background = root, keep_last, background
        self.calls = AsyncCallsQueue()  # a forked writer per save (see the module docstring)
        self.in_flight: InFlight | None = None

    def save(self, step: int, chunks, optimizer, scheduler, record: dict) -> None:
        """A checkpoint of the state after ``step``, described by ``record``. The save before
        it is completed first. In the background this returns once the writers are forked;
        the RNG files, which are small, are written at once."""
        self.wait()
        if not self.background:
            checkpoint.save(self.root, step, chunks, optimizer, scheduler, self.keep_last,
                            record)
            return
        tmp = checkpoint.start(self.root, step)
        self.in_flight = InFlight(step, tmp, record)
        failure = None
        try:
            with reported_in_a_file():  # the forked writer reports to this save's file
                request = dist_checkpointing.save(
                    checkpoint.saved_state(chunks, optimizer, scheduler, step), str(tmp),
                    async_sharded_save=True, async_strategy="mcore")
            self.calls.schedule_async_request(request)
            checkpoint.save_rng_state(tmp)
        except weights.LOAD_ERRORS as err:
            failure = err
        if any_rank(failure is not None):
            self._end_writers()
            self.in_flight = None
            checkpoint.abandon(self.root, step, tmp, failure)

    def poll(self) -> None:
        """Once per step on every rank: complete the save in flight if every rank's writer
        has ended (one all-reduce while a write is in flight, nothing otherwise)."""
        if self.in_flight is not None:
            self._complete(blocking=False)

    def wait(self) -> None:
        """Every rank: complete the save in flight, if any, waiting for its write; raises its
        CheckpointError if the write failed on some rank."""
        if self.in_flight is not None:
            self._complete(blocking=True)

    def latest_text(self) -> str:
        """Which checkpoint a stopping run resumes from, for its error message, true once the
        save in flight is complete (every rank calls it, on a stop they agreed on); a save
        that failed is named in it."""
        try:
            self.wait()
        except CheckpointError as err:
            return str(err)
        return checkpoint.latest_text(self.root)

    def close(self) -> None:
        """On a way out the ranks may not share (an exception): this rank's writer is waited
        for, without a collective, and a save it could not complete is reported, not left
        behind in silence."""
        if self.in_flight is None:
            return
        step, tmp, _ = self.in_flight
        self.in_flight = None
        self._end_writers()
        log.warning("the checkpoint of step %d was not completed: the run stopped while it was "
                    "being written (its files stay in %s); %s", step, tmp,
                    checkpoint.latest_text(self.root))

    def _complete(self, blocking: bool) -> None:
        failure = None
        try:
            if not self.calls.maybe_finalize_async_calls(blocking=blocking):
                return  # some rank's writer is still at work
        except weights.LOAD_ERRORS as err:  # megatron raises a failed write on every rank
            failure = err
        step, tmp, record = self.in_flight
        self.in_flight = None
        checkpoint.complete(self.root, step, tmp, self.keep_last, record, failure)

    def _end_writers(self) -> None:
        """Wait for this rank's writers (no collective) and forget their requests. What they
        reported stays in their own save's queue (runtime.write_results), never read as the
        next save's, which would give it another checkpoint's tensor index."""
        for call in self.calls.async_calls:
            call.async_caller.close()
        self.calls.async_calls.clear()
