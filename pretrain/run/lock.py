"""One run per folder: an exclusive lock on ``<run.dir>/run.lock`` for the life of a run.

Rank 0 of a job takes the lock (``flock``, released by the kernel when the process dies, so a
SIGKILLed run never blocks the next start); the other ranks of the job share it by agreeing on
rank 0's result. The file names the holder (host, PID, start time) for the error a second run
gets. On a normal exit the file is removed while still locked; a run that locks a file that
was meanwhile removed (and maybe re-created by a third run) notices by its inode and retries.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from runtime.errors import ConfigError
from runtime.parallel import any_rank

LOCK_FILE = "run.lock"


class RunLock:
    """Held by rank 0 between :meth:`acquire` and :meth:`release` (idempotent)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock on rank 0; every rank raises the same ConfigError when it is held."""
        holder = self._take() if dist.get_rank() == 0 else ""
        if any_rank(bool(holder)):
            where = f": {holder}" if dist.get_rank() == 0 else ""
            raise ConfigError(f"run.dir '{self.path.parent}' is in use by another run"
                              f"{where}; wait for it, or stop it, or choose another run.dir")

    def _take(self) -> str:
        """'' when locked, else a description of the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.read(fd, 4096).decode(errors="replace").strip()
                os.close(fd)
                return text or "a process that has not written its name yet"
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed it as we opened it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        return ""

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # removed while locked: see the module docstring
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
