"""The launcher's environment: what torchrun (or slurm's srun through it) tells a process, how
to start a child process or a local rendezvous without it, and how a rank reports a mistake
once for the whole launch."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from runtime.errors import error_lines

# What torchrun (and launchers like it) set for one process of their group: to join it, and
# where to report its failure.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")


def standalone_env(environ=os.environ) -> dict[str, str]:
    """``environ`` without a launcher's variables: a child process started with it runs its
    own one-rank group (:func:`runtime.parallel.initialize`) instead of joining its parent's."""
    return {k: v for k, v in environ.items() if k not in LAUNCHER_VARS}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_rank() -> int:
    """This process's global rank as its launcher numbered it (0 without one): known before
    any process group exists, when every rank runs the same start-up checks."""
    return int(os.environ.get("RANK", "0"))


def report_error(message: str) -> None:
    """``error: MESSAGE`` on stderr once per launch, not once per rank: every rank meets the
    same mistake (each reads the same config, data and checkpoint). Under torchrun each rank
    writes it to the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``), where
    torchrun's failure report shows it, and only rank 0 prints it; ``launch/torchrun_main.py``
    prints it where rank 0 did not (a mistake only another rank met). A process without such
    a file prints it. A message of several lines (several config errors) is one ``error:``
    line each."""
    line = error_lines(message)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's own format (torch.distributed.elastic's ErrorHandler)
        stamp = str(int(time.time()))
        with open(error_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": stamp}}}, f)
    if launch_rank() == 0 or not error_file:
        print(line, file=sys.stderr)
