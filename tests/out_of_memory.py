"""``python -m tests.out_of_memory N ARGS...``: ``python -m pretrain ARGS...`` whose step N (from
1) raises ``torch.OutOfMemoryError`` in its forward and backward, as a step that outgrows a
GPU does, to test what the training loop does then (pretrain.train.profiling) on any machine.
The hook lives here, in the tests, not in the training path."""

from __future__ import annotations

import sys

MESSAGE = "CUDA out of memory (injected by tests.out_of_memory)"


def main(step: int, argv: list[str]) -> int:
    import torch

    from pretrain.train import loop

    calls = 0
    forward_backward = loop.forward_backward

    def running_out(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == step:
            raise torch.OutOfMemoryError(MESSAGE)
        return forward_backward(*args, **kwargs)

    loop.forward_backward = running_out
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
