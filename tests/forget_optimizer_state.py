"""``python -m tests.forget_optimizer_state ARGS...``: ``python -m pretrain ARGS...`` whose resume
loses the optimizer's Adam state: the checkpoint loads as usual (model weights, fp32 main
weights, LR schedule, RNG, data position), then every parameter's ``exp_avg``, ``exp_avg_sq``
and ``step`` are zeroed, as a freshly built AdamW has them. A broken resume, for the negative
controls of the resume tests (tests/pretrain/test_gpu_e2e.py): the hook lives here, in the
tests, not in the resume path.

It prints ``forgot the Adam state of N parameters`` to stderr, so a test can tell that the
breakage really happened (a hook that matched nothing would leave a correct resume)."""

from __future__ import annotations

import sys

import torch

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def forget(optimizer) -> int:
    """Zero the Adam moments and step counts of megatron's ``optimizer`` (chained or not);
    returns how many parameters' state was zeroed. The main weights ("param" in the
    distributed optimizer's state, the fp32 copies in the param groups) are left alone."""
    count = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for state in torch_optimizer.state.values():
            found = [k for k in ADAM_KEYS if isinstance(state.get(k), torch.Tensor)]
            for key in found:
                state[key].zero_()
            count += bool(found)
    return count


def main(argv: list[str]) -> int:
    from pretrain.run import checkpoint

    load_state = checkpoint.load_state  # pretrain.run.checkpoint.load calls it by this name

    def load_then_forget(optimizer, state_dict):
        load_state(optimizer, state_dict)
        count = forget(optimizer)
        if count == 0:
            raise RuntimeError("tests.forget_optimizer_state found no Adam state to forget")
        print(f"forgot the Adam state of {count} parameters", file=sys.stderr, flush=True)

    checkpoint.load_state = load_then_forget
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
