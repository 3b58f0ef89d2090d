"""``python -m tests.inject_spikes SPEC ARGS...``: ``python -m pretrain ARGS...`` with spikes
injected into chosen steps, to test the spike guard (pretrain.train.guard) on real runs. SPEC
is a comma-separated list of ``N:loss``, ``N:grad`` or ``N:kill``, N counting the steps this
process trains from 1 (so a step trained again after a rollback or a resume is a new N):
``loss`` multiplies the step's all-reduced loss by 100 as the guard sees it, ``grad`` every
gradient by 1000 before the optimizer, ``kill`` SIGKILLs the process before that step's
update. The hooks live here, in the tests, not in the training path."""

from __future__ import annotations

import os
import signal
import sys

LOSS_FACTOR, GRAD_FACTOR = 100.0, 1000.0


def main(spec: str, argv: list[str]) -> int:
    from pretrain.train import loop

    wanted = {(int(n), kind) for n, _, kind in (item.partition(":") for item in spec.split(","))}
    calls = {"forward_backward": 0, "step_status": 0}
    forward_backward, step_status = loop.forward_backward, loop.step_status

    def spiking_forward_backward(chunks, *args, **kwargs):
        losses = forward_backward(chunks, *args, **kwargs)
        calls["forward_backward"] += 1
        if (calls["forward_backward"], "grad") in wanted:
            for chunk in chunks:
                for buffer in chunk.buffers:
                    buffer.grad_data.mul_(GRAD_FACTOR)
        return losses

    def spiking_step_status(*args, **kwargs):
        status = step_status(*args, **kwargs)
        calls["step_status"] += 1
        if (calls["step_status"], "kill") in wanted:
            os.kill(os.getpid(), signal.SIGKILL)
        if (calls["step_status"], "loss") in wanted:
            return status._replace(loss=status.loss * LOSS_FACTOR)
        return status

    loop.forward_backward, loop.step_status = spiking_forward_backward, spiking_step_status
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
