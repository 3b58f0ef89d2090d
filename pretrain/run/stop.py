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
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

log = logging.getLogger("pretrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED = 128 + signal.SIGINT
"""The exit status after Ctrl-C, saved or not."""
SAME_PRESS_S = 1.0
"""A SIGINT this soon after the first is the same press relayed (torchrun), not a second one."""
AGAIN_TEXT = (f"Ctrl-C again, {SAME_PRESS_S:g} s or more after this one, exits at once without "
              f"saving (a press within {SAME_PRESS_S:g} s is taken as this one)")
"""What the first Ctrl-C's line promises, worded from the rule :meth:`StopRequest._handle`
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
        stop = cls()
        for sig in SIGNALS:
            signal.signal(sig, stop._handle)
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

    def _handle(self, signum, _frame) -> None:
        if os.getpid() != self._pid:  # a forked checkpoint writer: it finishes or is killed
            return
        name = signal.Signals(signum).name
        if name == "SIGINT":
            now = time.monotonic()
            if self._first_interrupt is not None and now - self._first_interrupt \
                    >= SAME_PRESS_S:
                _exit_at_once()
            self._first_interrupt = self._first_interrupt or now
        if self.signal_name is None:
            self.signal_name = name
            then = f"; {AGAIN_TEXT}" if name == "SIGINT" else ""
            log.info("received %s: will stop at the next step boundary and save%s",
                     signal_text(name), then)


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
