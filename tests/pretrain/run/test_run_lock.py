"""One run per folder where the filesystem has no ``flock`` (Lustre without it, some NFS
set-ups): flock is made to fail as it does there (ENOLCK), and the run lock falls back to a
lock file with a heartbeat. A second holder is refused naming the first; a lock whose holder
is provably gone (a dead PID here, a heartbeat older than the limit anywhere) is taken over;
a takeover has one winner however starts interleave; release removes the file. With flock
or without, a start reading a holder that has not yet written its name reads it again."""

import errno
import fcntl
import logging
import os
import socket
import threading
import time

import pytest

from pretrain.run import lock as run_lock
from pretrain.run import lock_file
from pretrain.run.lock import RunLock
from pretrain.run.lock_file import STALE_S, LockFile, process_space, read_holder
from runtime.errors import ConfigError

DEAD_PID = 2**31 - 1  # above any kernel's pid_max: no such process
HOST = socket.gethostname()


@pytest.fixture
def no_flock(monkeypatch):
    def unsupported(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", unsupported)


def left_behind(path, host: str, pid: int, age_s: float = 0.0, space: str | None = None):
    """A lock file as a run on ``host`` writes it, last beating ``age_s`` seconds ago."""
    path.write_text(f"host {host}, pid {pid}, since 2026-01-01 00:00:00\n"
                    f"space {process_space() if space is None else space}\n")
    beat = time.time() - age_s
    os.utime(path, (beat, beat))


def ours(text: str) -> bool:
    return text.startswith(f"host {HOST}, pid {os.getpid()}, since ")


def test_a_second_holder_is_refused_naming_the_first_and_release_removes_it(
        tmp_path, no_flock, caplog):
    first = RunLock(tmp_path)
    with caplog.at_level(logging.INFO, logger="pretrain"):
        assert first.take() == ""
    assert (f"flock is not supported on {tmp_path} ({os.strerror(errno.ENOLCK)}); using a "
            "lock file with a heartbeat") in caplog.messages
    assert ours((tmp_path / "run.lock").read_text())
    second = RunLock(tmp_path)
    assert ours(second.take())
    first.release()
    assert not (tmp_path / "run.lock").exists()
    assert second.take() == ""
    second.release()
    assert not (tmp_path / "run.lock").exists()


def test_a_second_run_gets_the_one_line_error_naming_the_holder(
        tmp_path, no_flock, single_rank):
    first = RunLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(ConfigError, match=(
                rf"^run.dir '{tmp_path}' is in use by another run: host {HOST}, "
                rf"pid {os.getpid()}, since [^;]+; wait for it")):
            RunLock(tmp_path).acquire()
    finally:
        first.release()


def test_flock_errors_other_than_unsupported_still_raise(tmp_path, monkeypatch):
    def broken(fd, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(OSError, match="Input/output error"):
        RunLock(tmp_path).take()


def test_a_lock_left_by_a_dead_pid_on_this_host_is_taken_over(tmp_path, no_flock, caplog):
    left_behind(tmp_path / "run.lock", HOST, DEAD_PID)  # its heartbeat still fresh
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.INFO, logger="pretrain"):
        assert lock.take() == ""
    assert (f"took over {tmp_path / 'run.lock'} from host {HOST}, pid {DEAD_PID}, since "
            "2026-01-01 00:00:00: its process has ended") in caplog.messages
    assert ours((tmp_path / "run.lock").read_text())
    lock.release()
    assert sorted(os.listdir(tmp_path)) == []  # no claim or old lock left behind


def test_a_dead_pid_of_another_pid_namespace_is_no_proof(tmp_path, no_flock):
    """Containers can share a host name but not their PIDs: only the heartbeat decides."""
    left_behind(tmp_path / "run.lock", HOST, DEAD_PID, space="other-boot pid:[1]")
    assert RunLock(tmp_path).take().startswith(f"host {HOST}, pid {DEAD_PID}, since ")


def test_another_hosts_lock_is_refused_while_it_beats_and_taken_over_when_stale(
        tmp_path, no_flock, caplog):
    path = tmp_path / "run.lock"
    left_behind(path, "node-b", 4242, age_s=STALE_S / 2)
    assert RunLock(tmp_path).take() == "host node-b, pid 4242, since 2026-01-01 00:00:00"
    left_behind(path, "node-b", 4242, age_s=STALE_S + 60)
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.INFO, logger="pretrain"):
        assert lock.take() == ""
    assert caplog.messages[-1].endswith(": no heartbeat for 11 minutes")
    assert ours(path.read_text())
    lock.release()


def test_a_heartbeat_keeps_the_lock_fresh(tmp_path):
    path = tmp_path / "run.lock"
    lock = LockFile(path, heartbeat_s=0.05)
    assert lock.take() == ""
    old = time.time() - STALE_S - 60
    os.utime(path, (old, old))
    deadline = time.monotonic() + 10
    while read_holder(path).stale(STALE_S):
        assert time.monotonic() < deadline, "the heartbeat never touched the lock file"
        time.sleep(0.05)
    lock.release()
    assert not path.exists()


def test_release_leaves_a_lock_that_another_start_took_over(tmp_path):
    path = tmp_path / "run.lock"
    lock = LockFile(path, heartbeat_s=None)
    assert lock.take() == ""
    path.unlink()
    left_behind(path, "node-b", 4242)
    lock.release()
    assert path.read_text().startswith("host node-b")


def stale_lock(tmp_path):
    path = tmp_path / "run.lock"
    left_behind(path, "node-b", 4242, age_s=STALE_S + 60)
    return path, read_holder(path)


def test_a_stale_lock_taken_over_is_not_taken_over_again(tmp_path):
    path, stale = stale_lock(tmp_path)
    first, second = LockFile(path, None), LockFile(path, None)
    assert first.take_over(stale)
    assert not second.take_over(stale)  # it judged the same file stale, too late
    assert ours(second.take())
    first.release()


def test_a_takeover_cannot_slip_between_another_takers_check_and_its_create(
        tmp_path, monkeypatch):
    """``second`` checks that the lock is still the stale file; before it removes it,
    ``first`` tries its own takeover of the same file. Only one of them may win."""
    path, stale = stale_lock(tmp_path)
    first, second = LockFile(path, None), LockFile(path, None)
    read, tried = lock_file.read_holder, []

    def check_then_let_first_try(where):
        found = read(where)
        if where == path and not tried:
            tried.append(None)
            tried[0] = first.take_over(stale)
        return found

    monkeypatch.setattr(lock_file, "read_holder", check_then_let_first_try)
    won = [second.take_over(stale), *tried]
    assert won.count(True) == 1, won
    assert ours(path.read_text())
    first.release()
    second.release()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_lock_created_but_not_yet_named_is_read_again_for_its_name(tmp_path, monkeypatch):
    """Between a start's create and its write the file is empty: another start reading it
    then waits for the name (the race of the test below, made certain) instead of refusing
    with no name; a file that stays empty is still refused, as not written yet."""
    path = tmp_path / "run.lock"
    path.touch()
    named = threading.Timer(0.2, left_behind, (path, HOST, os.getpid()))
    named.start()
    try:
        assert LockFile(path, None).take() == f"host {HOST}, pid {os.getpid()}, since " \
                                               "2026-01-01 00:00:00"
    finally:
        named.join()
    path.write_text("")
    monkeypatch.setattr(lock_file, "ATTEMPTS", 3)  # 150 ms of reads, not 2 s
    assert LockFile(path, None).take() == lock_file.NOT_WRITTEN


def test_a_flock_holder_not_yet_named_is_read_again_for_its_name(tmp_path, monkeypatch):
    """With flock, the holder locks the file, then writes its name: a second start between
    the two waits for the name; a holder that never writes one is refused as not written."""
    path = tmp_path / "run.lock"
    path.touch()
    with path.open("r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        named = threading.Timer(0.2, left_behind, (path, HOST, 4242))
        named.start()
        try:
            assert RunLock(tmp_path).take().startswith(f"host {HOST}, pid 4242, since ")
        finally:
            named.join()
        path.write_text("")
        monkeypatch.setattr(run_lock, "ATTEMPTS", 3)  # 150 ms of reads, not 2 s
        assert RunLock(tmp_path).take() == lock_file.NOT_WRITTEN


def test_many_starts_racing_for_one_stale_lock_have_one_winner(tmp_path):
    path, _ = stale_lock(tmp_path)
    starts = [LockFile(path, None) for _ in range(8)]
    results, go = [None] * len(starts), threading.Barrier(len(starts))

    def start(index):
        go.wait()
        results[index] = starts[index].take()

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(starts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count("") == 1, results
    assert all(ours(text) for text in results if text)  # the winner is named
    for lock in starts:
        lock.release()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_claim_left_by_a_taker_that_died_is_taken_over(tmp_path):
    path, stale = stale_lock(tmp_path)
    left_behind(tmp_path / f"run.lock.takeover-{stale.inode}-{stale.mtime_ns}", HOST, DEAD_PID)
    lock = LockFile(path, None)
    assert lock.take() == ""
    lock.release()
    assert sorted(os.listdir(tmp_path)) == []
