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
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

# The exit statuses of `python -m pretrain` that come with their own explanation (4:
# pretrain.train.watchdog.HANG_EXIT, not imported: this script runs before any path is set).
EXPLAINED = (2, 3, 4)
# How a rank ends that torchrun stopped because another one failed.
STOPPED = -signal.SIGTERM
# The logger of torchrun's lines about its workers (which failed, which it stopped).
WORKER_LOG = "torch.distributed.elastic.multiprocessing.api"


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


@record
def main(argv: list[str] | None = None) -> int:
    held = HeldBack(logging.getLogger(WORKER_LOG))
    explained = None
    try:
        run(parse_args(argv))
    except ChildFailedError as failure:
        explained = explained_status(failure)
        if explained is None:
            raise
        lines = error_lines(failure)
        if lines and 0 not in lines:
            print(lines[min(lines)], file=sys.stderr)
    finally:
        held.release(show=explained is None)
    return explained or 0


if __name__ == "__main__":
    sys.exit(main())
