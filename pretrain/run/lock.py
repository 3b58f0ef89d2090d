"""One run per folder: an exclusive lock on ``<run.dir>/run.lock`` for the life of a run.

Rank 0 of a job takes the lock; the other ranks of the job share it by agreeing on rank 0's
result. The file names the holder (host, PID, start time) for the error a second run gets.

Where the filesystem provides ``flock`` (local disks, most NFS and Lustre mounts), the lock is
an ``flock`` on the file, released by the kernel when the process dies, so a SIGKILLed run
never blocks the next start. On a normal exit the file is removed while still locked; a run
that locks a file that was meanwhile removed (and maybe re-created by a third run) notices by
its inode and retries.

Where ``flock`` fails as unsupported (Lustre mounted without ``flock``, some NFS set-ups:
ENOLCK, EOPNOTSUPP, ENOSYS or EINVAL), the same file becomes a lock file with a heartbeat
(:mod:`pretrain.run.lock_file`): held by creating it exclusively, taken over only once its
holder is provably gone (a dead PID on this host, or a heartbeat older than 10 minutes).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

from pretrain.run.lock_file import ATTEMPTS, NOT_WRITTEN, READ_INTERVAL_S, LockFile, holder_line
from runtime import flock
from runtime.errors import ConfigError
from runtime.parallel import any_rank

log = logging.getLogger("pretrain")

LOCK_FILE = "run.lock"


class RunLock:
    """Held by rank 0 between :meth:`acquire` and :meth:`release` (idempotent)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        self._file: LockFile | None = None

    def acquire(self) -> None:
        """Take the lock on rank 0; every rank raises the same ConfigError when it is held."""
        holder = self.take() if dist.get_rank() == 0 else ""
        if any_rank(bool(holder)):
            where = f": {holder}" if dist.get_rank() == 0 else ""
            raise ConfigError(f"run.dir '{self.path.parent}' is in use by another run"
                              f"{where}; wait for it, or stop it, or choose another run.dir")

    def take(self) -> str:
        """This process takes the lock: '' when it holds it, else a description of the
        holder (what :meth:`acquire` decides with, on rank 0)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd, created = _open(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = _holder_text(fd)
                os.close(fd)
                return text
            except OSError as err:
                if not flock.unsupported(err):
                    os.close(fd)
                    raise
                return self._fall_back(fd, created, err)
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed it as we opened it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"{holder_line()}\n".encode())
        self._fd = fd
        return ""

    def _fall_back(self, fd: int, created: bool, err: OSError) -> str:
        """The lock file with a heartbeat; a file this process just created is already its."""
        log.info("flock is not supported on %s (%s); using a lock file with a heartbeat",
                 self.path.parent, err.strerror)
        self._file = LockFile(self.path)
        if created:
            self._file.hold(fd)
            return ""
        os.close(fd)
        return self._file.take()

    def release(self) -> None:
        if self._file is not None:
            self._file.release()
            self._file = None
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # removed while locked: see the module docstring
        os.close(self._fd)
        self._fd = None


def _open(path: Path) -> tuple[int, bool]:
    """A descriptor of the lock file, and whether this call created it."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_RDWR), False
        except FileNotFoundError:
            continue  # removed between the two calls


def _holder_text(fd: int) -> str:
    """What the holder of the flock on ``fd`` wrote. It writes its name right after taking the
    lock, so a file still empty is read again, READ_INTERVAL_S apart, up to ATTEMPTS times."""
    for _ in range(ATTEMPTS):
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(READ_INTERVAL_S)
    return NOT_WRITTEN


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
