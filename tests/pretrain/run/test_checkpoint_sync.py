"""A checkpoint is on the disk before anything names it: the RNG file and complete.json are
synced, then the folder holding them, and only then, after the rename, the checkpoints
folder (so a node crash or power loss after ``latest`` moved cannot leave a checkpoint whose
files are missing). A file system that cannot sync a folder is accepted."""

import errno
import os

import pytest

from pretrain.run import checkpoint


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync was called on, in order."""
    calls, real = [], os.fsync

    def fsync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_each_step_is_synced_before_the_next_names_it(single_rank, tmp_path, synced):
    root = tmp_path / "checkpoints"
    tmp = checkpoint.start(root, 5)
    checkpoint.save_rng_state(tmp)
    final = checkpoint.complete(root, 5, tmp, keep_last=2, record={}, failure=None)
    assert synced == [str(tmp / "rng" / "rank0.pt"), str(tmp / "complete.json"),
                      str(tmp / "rng"), str(tmp), str(root)]
    assert (final / "complete.json").exists() and (root / "latest").read_text() == final.name


def test_a_file_system_that_cannot_sync_folders_still_saves(single_rank, tmp_path,
                                                           monkeypatch):
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "checkpoints"
    tmp = checkpoint.start(root, 3)
    checkpoint.save_rng_state(tmp)
    final = checkpoint.complete(root, 3, tmp, keep_last=2, record={}, failure=None)
    assert (final / "rng" / "rank0.pt").exists()
