"""``python -m tests.leave_a_child PIDFILE``: forks a child that sleeps for a minute in this
process's group, writes its pid to PIDFILE, says so on stdout and stderr and exits 0,
leaving it behind, as megatron's
checkpoint writer outlives a SIGKILLed trainer (tests/test_zygote.py)."""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    with open(sys.argv[1], "w") as f:
        f.write(str(child))
    print(f"left {child}", flush=True)
    print("exiting", file=sys.stderr, flush=True)
