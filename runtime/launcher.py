"""The launcher's environment: what torchrun (or slurm's srun through it) tells a process, and
how to start a child process or a local rendezvous without it."""

from __future__ import annotations

import os
import socket

# What torchrun (and launchers like it) set for a process to join their group.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def standalone_env(environ=os.environ) -> dict[str, str]:
    """``environ`` without a launcher's variables: a child process started with it runs its
    own one-rank group (:func:`runtime.parallel.initialize`) instead of joining its parent's."""
    return {k: v for k, v in environ.items() if k not in LAUNCHER_VARS}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
