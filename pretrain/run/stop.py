"""SIGTERM/SIGUSR1 (slurm preemption, torchrun shutdown) and Ctrl-C as a request to stop.

Installed by ``python -m pretrain train`` before anything slow (imports, model build, data
indexing), so a signal during start-up is remembered too. Training stops at the next step
boundary and saves; a request during start-up stops at the next start-up boundary, with
nothing to save yet. No torch import here: it must be cheap to install first.

Ctrl-C (SIGINT) stops the same way, and the run then exits :data:`INTERRUPTED` (130, what a
shell expects of an interrupted command, so ``train && next`` does not go on). A second Ctrl-C
exits at once, without saving: the checkpoints already written stay (a save in flight is a
``.tmp`` folder the next start removes), and the process's children (a background checkpoint
writer) are killed first, since ``os._exit`` skips the exit handlers that would end them. A
terminal sends Ctrl-C to every process of the foreground group and torchrun relays it to its
ranks as well, so a rank may see one press twice: a SIGINT within :data:`SAME_PRESS_S` of the
first is that same press. A forked child (megatron's checkpoint writer) inherits the handler
and ignores the signals: its parent decides, and ends it if need be.

The presses are timed where they arrive, not in the Python handler: Python runs a handler only
when the main thread is back in the interpreter, which a long step, a collective or a save
delays by seconds on a busy machine; two presses a few seconds apart then reached the handler
together (and a Python handler runs once for signals that arrive together), and one press
relayed twice could reach it a second apart. :class:`ArrivalClock` reads the signal wakeup fd
(written by the C-level handler as each signal arrives) on a thread of its own, which needs
only the GIL, not the main thread, to stamp a press and to end the run.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time

log = logging.getLogger("pretrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED = 128 + signal.SIGINT
"""The exit status after Ctrl-C, saved or not."""
SAME_PRESS_S = 1.0
"""A SIGINT this soon after the first is the same press relayed (torchrun), not a second one."""
AGAIN_TEXT = (f"Ctrl-C again, {SAME_PRESS_S:g} s or more after this one, exits at once without "
              f"saving (a press within {SAME_PRESS_S:g} s is taken as this one)")
"""What the first Ctrl-C's line promises, worded from the rule :meth:`StopRequest.interrupted_at`
applies."""


def signal_text(name: str) -> str:
    return "Ctrl-C (SIGINT)" if name == "SIGINT" else name


class StopRequest:
    """Remembers the first stop signal; :attr:`signal_name` says which one."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_interrupt: float | None = None
        self._pid = os.getpid()

    @classmethod
    def install(cls) -> StopRequest:
        """Handle :data:`SIGNALS` from now on (from the main thread, as any handler)."""
        stop = cls()
        for sig in SIGNALS:
            signal.signal(sig, stop._handle)
        ArrivalClock.start().listener = stop
        return stop

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def exit_status(self) -> int:
        """The CLI's exit status after a stop: 130 after Ctrl-C, 0 after SIGTERM/SIGUSR1."""
        return INTERRUPTED if self.signal_name == "SIGINT" else 0

    def stopped_text(self, step: int) -> str:
        """The line a run prints once its stop checkpoint is written."""
        return (f"stopped by {signal_text(self.signal_name or 'signal')} after step {step}; "
                "checkpoint saved; run the same command to resume")

    def interrupted_at(self, arrival: float) -> None:
        """A SIGINT that arrived at ``arrival`` (``time.monotonic()``): a second press, one
        :data:`SAME_PRESS_S` or more after the first, exits at once. Called by the clock's
        thread, in the order the signals arrived."""
        if self._first_interrupt is None:
            self._first_interrupt = arrival
        elif arrival - self._first_interrupt >= SAME_PRESS_S:
            _exit_at_once()

    def _handle(self, signum, _frame) -> None:
        if os.getpid() != self._pid:  # a forked checkpoint writer: it finishes or is killed
            return
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            then = f"; {AGAIN_TEXT}" if name == "SIGINT" else ""
            log.info("received %s: will stop at the next step boundary and save%s",
                     signal_text(name), then)


class ArrivalClock:
    """Stamps each SIGINT as it arrives and hands it to :attr:`listener`, on a daemon thread.

    Python's C-level handler writes each signal's number to the wakeup fd as the signal arrives
    (:func:`signal.set_wakeup_fd`; one byte per signal, none merged); the thread blocks on the
    other end of that pipe. One clock per process: the fd is the process's only one (nothing a
    run imports sets another), and a forked child drops it (:func:`_forget_in_child`), so that
    its signals are not taken for the parent's.
    """

    _running: ArrivalClock | None = None

    def __init__(self) -> None:
        self.listener: StopRequest | None = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # as set_wakeup_fd requires
        self._pid = os.getpid()
        threading.Thread(target=self._watch, name="ctrl-c-clock", daemon=True).start()

    @classmethod
    def start(cls) -> ArrivalClock:
        """The process's clock, started on first use; (re)takes the wakeup fd."""
        clock = cls._running
        if clock is None or clock._pid != os.getpid():
            if clock is None:  # once per process, and inherited by its forks
                os.register_at_fork(after_in_child=_forget_in_child)
            clock = cls._running = cls()
        signal.set_wakeup_fd(clock._write, warn_on_full_buffer=False)
        return clock

    def _watch(self) -> None:
        while True:
            arrived = os.read(self._read, 64)
            now = time.monotonic()
            for signum in arrived:
                listener = self.listener
                if signum == signal.SIGINT and listener is not None:
                    listener.interrupted_at(now)


def _forget_in_child() -> None:
    """In a forked child: no clock (its thread is not there) and no wakeup fd."""
    if ArrivalClock._running is not None:
        ArrivalClock._running = None
        with contextlib.suppress(ValueError):  # forked from a thread other than the main one
            signal.set_wakeup_fd(-1)



def kill_children() -> None:
    """SIGKILL this process's multiprocessing children (a background checkpoint writer) before
    an ``os._exit``, which skips the exit handler that ends them: one left running with parent
    1 would go on writing into the run folder. Nothing here waits."""
    for child in multiprocessing.active_children():
        child.kill()


def _exit_at_once() -> None:
    """The second Ctrl-C: one line (rank 0 only), no traceback, no clean-up that could hang,
    no child left behind."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"error: interrupted again by Ctrl-C: exited at once without saving; "
                    b"the checkpoints already written are kept\n")
    kill_children()
    os._exit(INTERRUPTED)
