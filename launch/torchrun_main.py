"""torchrun as launch/torchrun.sh runs it: ``python launch/torchrun_main.py TORCHRUN_ARGS``.

This is torchrun (``torch.distributed.run``) except for how a launch ends that ``python -m
pretrain`` has already explained. Its ranks exit 2 on a user's mistake, after one ``error:``
line (rank 0 prints it, every rank writes it to its torchrun error file: see
:func:`runtime.launcher.report_error`), 3 on an aborted run and 4 on a hang (after a line
saying where the rank wrote its stacks); torchrun would add a report of the failed ranks, a
traceback of its own, and exit 1. When every failed rank exited with the same one of those
statuses (ranks that torchrun itself stopped with SIGTERM after the first failure aside),
the launch exits with it and adds nothing: no report, and none of torchrun's lines about which
worker failed and which it stopped. Where rank 0 wrote no ``error:`` line (a mistake only
another rank met), the lowest failed rank's line is printed. Any other failure keeps
torchrun's report and exit status.

The ranks of a launch meet the same mistake (they read the same config) but not at the same
instant, and torchrun stops every rank still running as soon as one has failed: a rank a little
behind then printed ``received SIGTERM: will stop ...`` before its own ``error:`` line. So once
a rank has exited with one of those statuses, the ranks still running get :data:`SETTLE_S` to
end by themselves before torchrun stops them (:func:`let_ranks_settle`).

Ctrl-C: torchrun would answer the first by sending its ranks SIGTERM, and a second by
raising a traceback while it still waits for them. Here torchrun leaves SIGINT alone (it is
taken out of its ``--signals-to-handle``) and each SIGINT it gets is relayed to the ranks as it is
(they run in sessions of their own, so the terminal's reaches only torchrun): the first makes
every rank save and exit 130, a second makes them exit at once (pretrain.run.stop), and the
launch exits 130 with the ranks, without a report. A signal torchrun still handles (SIGTERM)
ends the launch with one line and 128 + the signal, once torchrun has waited for its ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time

import psutil
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

# The exit statuses of `python -m pretrain` that come with their own explanation (4:
# pretrain.train.watchdog.HANG_EXIT; 130: Ctrl-C, pretrain.run.stop.INTERRUPTED; not
# imported: this script runs before any path is set).
EXPLAINED = (2, 3, 4, 130)
# How a rank ends that torchrun stopped because another one failed.
STOPPED = -signal.SIGTERM
# The logger of torchrun's lines about its workers (which failed, which it stopped).
WORKER_LOG = "torch.distributed.elastic.multiprocessing.api"
SETTLE_S = 10.0
"""How long this node's ranks still running get to end by themselves once one has exited with
an explained status, before torchrun stops them. The ranks that meet the same config mistake
end within a second or two of each other; one held in a collective by a mistake only another
rank met is stopped this much later than torchrun alone would stop it."""


def explained_status(failure: ChildFailedError) -> int | None:
    """The status every failed rank exited with (the stopped ones aside), if it is one of
    :data:`EXPLAINED`."""
    statuses = {f.exitcode for f in failure.failures.values()} - {STOPPED}
    return statuses.pop() if len(statuses) == 1 and statuses <= set(EXPLAINED) else None


def error_lines(failure: ChildFailedError) -> dict[int, str]:
    """The ``error:`` line each failed rank wrote to its error file, by global rank."""
    lines = {}
    for rank, failed in failure.failures.items():
        message = failed.message
        message = message.get("message") if isinstance(message, dict) else message
        if isinstance(message, str) and message.startswith("error: "):
            lines[rank] = message
    return lines


class HeldBack(logging.Filter):
    """Keeps a logger's records from its handlers until :meth:`release` (or drops them)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.records = logger, []
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def release(self, show: bool) -> None:
        self.logger.removeFilter(self)
        for held in self.records if show else ():
            self.logger.handle(held)


def let_ranks_settle(context: type = SubprocessContext) -> None:
    """Make torchrun's poll of its ranks (``context._poll``, which stops every running rank as
    soon as one has failed) report them as still running while the ranks that exited did so
    with an :data:`EXPLAINED` status and others still run, for up to :data:`SETTLE_S` from the
    first such exit. Any other failure is polled, and so stops the others, at once."""
    poll = getattr(context, "_poll", None)
    if poll is None or getattr(poll, "settles", False):  # another torch, or already in place
        return  # (a torch without it stops the others at once, as plain torchrun does)

    def settling_poll(self):
        exits = [handler.proc.poll() for handler in self.subprocess_handlers.values()]
        failed = {code for code in exits if code not in (None, 0)}
        if failed and None in exits and failed <= set(EXPLAINED):
            until = self.__dict__.setdefault("settle_until", time.monotonic() + SETTLE_S)
            if time.monotonic() < until:
                return None
        return poll(self)

    settling_poll.settles = True
    context._poll = settling_poll


def relay_interrupt(_signum, _frame) -> None:
    """SIGINT to every rank (torchrun's children), as the rank's own Ctrl-C."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            os.kill(child.pid, signal.SIGINT)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",")
                                      if name.strip() != "SIGINT")
    signal.signal(signal.SIGINT, relay_interrupt)
    let_ranks_settle()
    held = HeldBack(logging.getLogger(WORKER_LOG))
    explained = None
    try:
        run(args)
    except ChildFailedError as failure:
        explained = explained_status(failure)
        if explained is None:
            raise
        lines = error_lines(failure)
        if lines and 0 not in lines:
            print(lines[min(lines)], file=sys.stderr)
    except SignalException as stopped:  # torchrun asked its ranks to stop and waited for them
        explained = 128 + stopped.sigval
        print(f"launch stopped by {stopped.sigval.name}: its ranks were asked to stop",
              file=sys.stderr)
    finally:
        held.release(show=explained is None)
    return explained or 0


if __name__ == "__main__":
    sys.exit(main())
