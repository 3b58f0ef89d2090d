"""``python -m tests.stall_rank MODE N ARGS...``: ``python -m pretrain ARGS...`` with rank 1
stalled in its training steps, to test the hang watchdog (pretrain.train.watchdog) and the
straggler report (pretrain.train.stragglers) on real runs. MODE ``hang``: rank 1 sleeps for
ever in the N-th step this process trains (from 1), before its forward pass; the other ranks
then wait in that step's gradient all-reduce. In that step every rank first starts a daemon
child process that sleeps, as a checkpoint writer in flight would be. MODE ``slow``: rank 1
sleeps N seconds before every step's forward pass. The hooks live here, in the tests, not in
the training path."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time


def hang_forever() -> None:
    """The frame the hung rank's stack dump must show."""
    while True:
        time.sleep(3600)


def main(mode: str, n: str, argv: list[str]) -> int:
    from pretrain.train import loop

    forward_backward, calls = loop.forward_backward, [0]
    stalled = os.environ.get("RANK") == "1"

    def stalling_forward_backward(*args, **kwargs):
        calls[0] += 1
        if mode == "hang" and calls[0] == int(n):
            multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,),
                                                        daemon=True).start()
            if stalled:
                hang_forever()
        if stalled and mode == "slow":
            time.sleep(float(n))
        return forward_backward(*args, **kwargs)

    loop.forward_backward = stalling_forward_backward
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
