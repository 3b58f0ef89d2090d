"""``python -m launch.finished PRETRAIN_ARGS``: exit 0 if that training run is complete.

The slurm job script asks this after a preemption warning, to requeue only a run that still
has steps to go. Complete means the run folder's newest complete checkpoint is at
``run.steps`` (training always saves at its last step). The arguments are those of
``python -m pretrain train`` (config file and overrides), so the run folder is resolved
exactly as training resolves it. Exit 1: not complete; exit 2: the arguments are wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pretrain.arguments import parse
from runtime.errors import UserError, error_lines


def last_step(checkpoints: Path) -> int:
    """Step of the newest complete checkpoint under ``checkpoints`` (0 when there is none)."""
    from pretrain.run.checkpoint import COMPLETE, resolve

    found = resolve(checkpoints)
    return json.loads((found / COMPLETE).read_text())["step"] if found else 0


def main(argv: list[str]) -> int:
    from pretrain.config import load_config

    try:
        args, overrides = parse(argv)
        config = load_config(args.config, overrides)
    except UserError as err:
        print(error_lines(str(err)), file=sys.stderr)
        return 2
    step = last_step(Path(config.run.dir) / "checkpoints")
    print(f"{config.run.dir}: step {step} of {config.run.steps}")
    return 0 if step >= config.run.steps else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
