"""``python -m tests.kill_in_save STEP ARGS...``: ``python -m pretrain ARGS...``, SIGKILLed in the
middle of step STEP's checkpoint save (after megatron wrote the tensors, before the checkpoint
is complete), to test that a crash during a save loses nothing. The hook lives here, in the
tests, not in the save path."""

from __future__ import annotations

import os
import signal
import sys

from megatron.core import dist_checkpointing


def main(step: int, argv: list[str]) -> int:
    save = dist_checkpointing.save

    def save_then_die(state, directory, *args, **kwargs):
        result = save(state, directory, *args, **kwargs)
        if os.path.basename(directory) == f".step_{step:08d}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die  # pretrain.run.checkpoint calls it through the module
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
