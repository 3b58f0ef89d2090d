"""``python -m tests.late_rank SECONDS ARGS...``: ``python -m pretrain ARGS...`` with rank 0
reaching its config SECONDS after the others (its console and stop handler in place, as on a
rank still importing on a busy machine). The ranks then meet the same config mistake at
different times, which is how a launch under torchrun ends when one rank is behind
(launch/torchrun_main.py). The hook lives here, in the tests, not in the launch path."""

from __future__ import annotations

import os
import sys
import time


def main(delay: float, argv: list[str]) -> int:
    from pretrain import config

    load_config = config.load_config

    def late_load_config(*args, **kwargs):
        if os.environ.get("RANK") == "0":
            time.sleep(delay)
        return load_config(*args, **kwargs)

    config.load_config = late_load_config
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]), sys.argv[2:]))
