"""``python -m tests.old_expert_layout ARGS...``: ``python -m pretrain ARGS...`` as versions
before :func:`model.moe.mark_experts` ran it: the routed experts' parameters marked by megatron
alone, so at parallel.ep 1 and parallel.etp = parallel.tp they are ordinary parameters of the
one optimizer, and its checkpoints hold the optimizer state of that earlier layout. The hook
lives here, in the tests, not in the model code."""

from __future__ import annotations

import sys

from model import moe


def main(argv: list[str]) -> int:
    moe.mark_experts = lambda chunks: None  # model.builder calls it through the module
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
