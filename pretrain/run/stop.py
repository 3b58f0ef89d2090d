"""SIGTERM/SIGUSR1 (slurm preemption, torchrun shutdown) as a request to stop, not a kill.

Installed by ``python -m pretrain train`` before anything slow (imports, model build, data
indexing), so a signal during start-up is remembered too. Training stops at the next step
boundary and saves; a request during start-up stops at the next start-up boundary, with
nothing to save yet. No torch import here: it must be cheap to install first.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("pretrain")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Remembers the first stop signal; :attr:`signal_name` says which one."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @classmethod
    def install(cls) -> StopRequest:
        stop = cls()
        for sig in SIGNALS:
            signal.signal(sig, stop._handle)
        return stop

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, _frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            log.info("received %s: will stop at the next step boundary", self.signal_name)
