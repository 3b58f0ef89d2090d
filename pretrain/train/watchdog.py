"""The hang watchdog: a rank that stops making progress writes its stacks and exits.

A hung collective (a dead peer, a NCCL or gloo deadlock, a stuck file system) blocks every
rank without an error, and the job burns its allocation until slurm's time limit. Each rank
therefore runs a daemon thread holding a deadline that every completed step pushes forward.
When the deadline passes, the thread writes the Python stacks of all the rank's threads
(``faulthandler.dump_traceback``) to ``<run.dir>/hangs/rank<r>-<time>.txt``, logs one line
saying where, waits a little and ends the process (and its children, such as a checkpoint
writer) with :data:`HANG_EXIT`, so that the launcher sees a failure it can restart from the
latest checkpoint. Nothing is saved: checkpoints are written atomically, so the previous one
stays intact.

How long a step may take (:func:`step_budget`): ``run.hang_timeout`` (default 30 min) for the
first :data:`WARMUP_STEPS` steps this process takes (compilation, allocator and data warm-up),
for start-up and for every validation and checkpoint save (:meth:`Watchdog.long`); after that
:data:`STEP_FACTOR` x the median of the recent step times, at least :data:`STEP_FLOOR_S`,
never above ``run.hang_timeout``. A healthy step is close to the median and far below 5 min
unless steps are that long (then 10 x the median), so the rule cannot end a healthy run; a
hang is caught after 5 min instead of 30 once the run is warm.

A rank blocked in a collective still fires: torch releases the GIL while it waits in one (as
``time.sleep`` does), so the thread runs. The dump and the exit are not instant (see
:func:`linger`): the ranks waiting on the hung one completed their last step within about one
step of it, so they reach their own deadlines a step later at most; a rank that exited at once
would turn their wait into a connection error without a dump. Should the interpreter itself be
stuck (a C call that never releases the GIL), the thread cannot run: faulthandler's C-level
timer, re-armed by the thread, then writes the stacks to stderr and exits 1 a little later.

The main thread may give up before the thread exits (a peer's exit turns its wait into an
error): :meth:`Watchdog.stop`, in the training teardown, then waits for the thread's exit.
NCCL's own timeout (10 min by default) can end a rank stuck in a NCCL collective before the
30 min of run.hang_timeout; once warm, the step budget (5 min) comes first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from pretrain.run.stop import kill_children

log = logging.getLogger("pretrain")

HANG_EXIT = 4
"""The exit status of a rank the watchdog ended (2: bad input, 3: an aborted run)."""
WARMUP_STEPS = 10
"""Steps this process takes under run.hang_timeout before the step budget is measured."""
STEP_FACTOR = 10.0
"""A warm step's budget is this many times the median recent step time..."""
STEP_FLOOR_S = 300.0
"""...and at least this many seconds."""
WINDOW = 100
"""Recent step times the median is taken over."""
POLL_S = 1.0
"""The thread wakes at least this often, to follow a deadline that moved."""
BACKSTOP_S = 5.0
"""faulthandler's C timer fires this long after the thread should have exited."""


def step_budget(recent: Sequence[float], hang_timeout: float) -> float:
    """Seconds the next step may take, given the durations of the recent ones (seconds)."""
    if len(recent) < WARMUP_STEPS:
        return hang_timeout
    return min(hang_timeout, max(STEP_FLOOR_S, STEP_FACTOR * statistics.median(recent)))


def linger(budget: float) -> float:
    """How long a rank that fired waits before it exits, so that the ranks blocked with it
    reach their own deadlines and dump too before its exit breaks their wait: a tenth of its
    budget, which once warm is at least one step (unless run.hang_timeout is under 10 steps)."""
    return budget / STEP_FACTOR


class Watchdog:
    """This rank's deadline and the thread that enforces it (nothing at all when
    ``hang_timeout`` is 0). The training loop calls :meth:`step_done` after every step and
    wraps validation and saves in :meth:`long`; :meth:`stop` ends it."""

    def __init__(self, hang_timeout: float, folder: Path, rank: int):
        self.hang_timeout, self.folder, self.rank = hang_timeout, folder, rank
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._last: float | None = None  # when the last step ended (None: not a step's start)
        # (deadline, budget, what the rank is doing), replaced whole so the thread reads one
        self._state = (time.monotonic() + hang_timeout, hang_timeout, "start-up")
        self._stopped, self._fired = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if hang_timeout > 0:
            # armed here too: the thread may not run before the main thread holds the GIL
            _arm_backstop(hang_timeout + linger(hang_timeout) + BACKSTOP_S)
            self._thread = threading.Thread(target=self._watch, name="pretrain-watchdog",
                                            daemon=True)
            self._thread.start()

    def step_done(self, step: int) -> None:
        """Step ``step`` (1-based) completed: the next one gets :func:`step_budget`."""
        if self._thread is None:
            return
        now = time.monotonic()
        if self._last is not None:
            self._recent.append(now - self._last)
        self._last = now
        self._set(now, f"step {step + 1}")

    @contextlib.contextmanager
    def long(self, what: str) -> Iterator[None]:
        """A phase that may legitimately take long (validation, a save): run.hang_timeout for
        it, then the step budget again from its end; its time is no step time."""
        if self._thread is None:
            yield
            return
        self._state = (time.monotonic() + self.hang_timeout, self.hang_timeout, what)
        try:
            yield
        finally:
            self._last = time.monotonic()
            self._set(self._last, f"the step after {what}")

    def stop(self) -> None:
        """End the thread (the teardown). After it fired, wait for its exit instead."""
        if self._thread is None:
            return
        if self._fired.is_set():
            self._thread.join()  # the thread ends the process
        self._stopped.set()
        self._thread.join()
        faulthandler.cancel_dump_traceback_later()

    def _set(self, now: float, what: str) -> None:
        budget = step_budget(self._recent, self.hang_timeout)
        self._state = (now + budget, budget, what)

    def _watch(self) -> None:
        armed = None
        while True:
            deadline, budget, what = self._state
            now = time.monotonic()
            if now >= deadline:
                self._fire(budget, what)
            if deadline != armed:
                _arm_backstop(deadline - now + linger(budget) + BACKSTOP_S)
                armed = deadline
            if self._stopped.wait(min(deadline - now, POLL_S)):
                return

    def _fire(self, budget: float, what: str) -> None:
        """Write the stacks, say where, let the peers fire too, and exit :data:`HANG_EXIT`."""
        self._fired.set()
        wait = linger(budget)
        _arm_backstop(wait + BACKSTOP_S)  # should the dump itself hang (a dead file system)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.folder / f"rank{self.rank}-{stamp}.txt"
        header = (f"rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}): {what} "
                  f"made no progress within {budget:.0f} s (run.hang_timeout "
                  f"{self.hang_timeout:.0f} s); {stamp}; stacks of every thread, most recent "
                  "call first:\n")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as out:
                out.write(header)
                out.flush()
                faulthandler.dump_traceback(out, all_threads=True)
            where = str(path)
        except OSError as err:
            sys.__stderr__.write(header)
            sys.__stderr__.flush()
            faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
            where = f"stderr ({path}: {err.strerror})"
        log.error("rank %d: %s made no progress within %.0f s (run.hang_timeout %.0f s); "
                  "stacks written to %s; exiting with status %d in %.1f s", self.rank, what,
                  budget, self.hang_timeout, where, HANG_EXIT, wait)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        time.sleep(wait)
        # os._exit skips multiprocessing's exit handler, which ends the children (the
        # checkpoint writer megatron forks): one left behind could still write into the run
        # folder after the job was restarted.
        kill_children()
        os._exit(HANG_EXIT)


def _arm_backstop(seconds: float) -> None:
    """faulthandler's C timer: stacks to stderr and exit 1 after ``seconds``, even if no
    Python thread can run any more."""
    if sys.__stderr__ is not None:
        faulthandler.dump_traceback_later(max(seconds, 0.001), exit=True, file=sys.__stderr__)
