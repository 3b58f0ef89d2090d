"""A lock file with a heartbeat, for filesystems without ``flock`` (Lustre mounted without the
``flock`` option, some NFS set-ups), where :mod:`pretrain.run.lock` falls back to it.

Holding the lock is having created the file: ``os.open(O_CREAT | O_EXCL)`` either creates it
or fails, decided by the filesystem (the metadata server on Lustre, the server on NFS v3 and
later), so two starts cannot both create it. The file names its holder (host, PID, start time,
and the boot and PID namespace the PID belongs to), is flushed to the server at once, and
carries a heartbeat: a daemon thread touches it every ``HEARTBEAT_S`` seconds.

Nothing removes the file when its holder dies, so a start takes it over when the holder is
provably gone:

- on the same host (same boot and PID namespace): its PID no longer exists;
- anywhere: its heartbeat is older than ``STALE_S`` (20 heartbeats; generous, since hosts'
  clocks and NFS attribute caches disagree by seconds to a minute).

A takeover is exclusive. The taker first takes a *claim*: a lock file of the same kind named
after exactly that stale file (its inode and mtime), so only one start can hold it; then it
checks that the lock is still that file (a fresh heartbeat changes the mtime), removes it and
creates its own with ``O_EXCL``. Any other start loses the claim or the create, reads the
winner's fresh file and is refused. A claim left by a taker that died during its takeover (a
few milliseconds) is itself taken over by the same rules.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pretrain")

HEARTBEAT_S = 30.0
STALE_S = 600.0
ATTEMPTS = 40  # reads of a lock that another start is creating or taking over, 50 ms apart
READ_INTERVAL_S = 0.05
NOT_WRITTEN = "a process that has not written its name yet"
_HOLDER = re.compile(r"host (\S+), pid (\d+), since ")
_SPACE = re.compile(r"^space (.*)$", re.MULTILINE)


def holder_line() -> str:
    """How this process names itself in a lock file (and so in a second run's error)."""
    return (f"host {socket.gethostname()}, pid {os.getpid()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}")


def process_space() -> str:
    """Where a PID names one process: this boot and PID namespace ('' where /proc lacks them).
    Containers that share a host name but not their PIDs differ here."""
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        pass
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return " ".join(parts)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """What a lock file says and when its heartbeat last beat."""

    text: str  # its first line: "host H, pid P, since T" ('' while being written)
    host: str | None
    pid: int | None
    space: str | None
    inode: int
    mtime_ns: int

    def describe(self) -> str:
        return self.text or NOT_WRITTEN

    def stale(self, stale_s: float) -> str:
        """Why its holder is provably gone (a dead PID of this host, or a heartbeat older than
        ``stale_s``); '' while it may be alive."""
        silent_s = time.time() - self.mtime_ns / 1e9
        if silent_s > stale_s:
            return f"no heartbeat for {silent_s / 60:.0f} minutes"
        if (self.pid is not None and self.host == socket.gethostname()
                and self.space == process_space() and not pid_alive(self.pid)):
            return "its process has ended"
        return ""


def read_holder(path: Path) -> Holder | None:
    """The lock file's holder, read through one descriptor (its text and its times belong to
    the same file); None when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        stat = os.fstat(fd)
        text = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    first = text.strip().splitlines()[0] if text.strip() else ""
    named, space = _HOLDER.match(first), _SPACE.search(text)
    return Holder(first, named[1] if named else None, int(named[2]) if named else None,
                  space[1] if space else None, stat.st_ino, stat.st_mtime_ns)


class LockFile:
    """Held between :meth:`take` (or :meth:`hold`) and :meth:`release` (idempotent)."""

    def __init__(self, path: Path, heartbeat_s: float | None = HEARTBEAT_S,
                 stale_s: float = STALE_S) -> None:
        self.path = path
        self.heartbeat_s = heartbeat_s  # None: no heartbeat (claims last milliseconds)
        self.stale_s = stale_s
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def take(self) -> str:
        """'' when this process now holds the lock, else a description of the holder."""
        holder = None
        for _ in range(ATTEMPTS):
            if self.create():
                return ""
            holder = read_holder(self.path)
            if holder is None:
                continue  # released as we looked: create again
            gone = holder.stale(self.stale_s)
            if not gone:
                if holder.text:
                    return holder.describe()
                time.sleep(READ_INTERVAL_S)  # created a moment ago, its name not written yet
                continue
            if self.take_over(holder):
                log.info("took over %s from %s: %s", self.path, holder.describe(), gone)
                return ""
            time.sleep(READ_INTERVAL_S)  # another start is taking it over: read what it leaves
        return holder.describe() if holder else NOT_WRITTEN

    def create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        self.hold(fd)
        return True

    def hold(self, fd: int) -> None:
        """Hold the lock through ``fd``, a descriptor of the file this process just created."""
        try:
            os.write(fd, f"{holder_line()}\nspace {process_space()}\n".encode())
            os.fsync(fd)  # other NFS clients see the name now, not when the file is closed
        except OSError:  # a full disk: leave no nameless lock behind
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd = fd
        if self.heartbeat_s is not None:
            self._stop.clear()
            self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat",
                                          daemon=True)
            self._beat.start()

    def take_over(self, stale: Holder) -> bool:
        """Replace the lock file ``stale`` describes by this process's, if no other start does
        first (see the module docstring)."""
        claim = LockFile(self.path.with_name(
            f"{self.path.name}.takeover-{stale.inode}-{stale.mtime_ns}"), None, self.stale_s)
        if claim.take():
            return False
        try:
            now = read_holder(self.path)
            if now is not None and (now.inode, now.mtime_ns) != (stale.inode, stale.mtime_ns):
                return False  # replaced, or its holder beat after all
            self.path.unlink(missing_ok=True)
            return self.create()
        finally:
            claim.release()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self._fd)  # through the descriptor: never another start's file
            except OSError:  # a passing server error: the next beat tries again
                pass

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
