"""A failed save names its cause ("No space left on device" and where), though megatron-core's
writer keeps only the type of a worker's OSError: the cause is found in the exception chain
when it is there, else on the filesystem after the fact (pretrain.run.failure)."""

import errno
import os
import resource
import shutil

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.run import failure
from pretrain.run.failure import save_failure, size

NO_SPACE = os.strerror(errno.ENOSPC)


def wrapped(err: BaseException) -> CheckpointException:
    """As torch and megatron wrap a writer's error: rank -> (exception, traceback)."""
    try:
        raise RuntimeError("Worker failure") from err
    except RuntimeError as outer:
        return CheckpointException("save failed", {0: (outer, None)})


def megatron_019() -> CheckpointException:
    """What megatron-core 0.19's filesystem writer leaves of a worker's full disk."""
    lost = RuntimeError("An error is caught while starting worker 0, error: <class 'OSError'>")
    return wrapped(lost)


@pytest.fixture
def root(tmp_path):
    """A checkpoints folder whose last checkpoint holds 10,000 bytes, the biggest file 6,000."""
    step = tmp_path / "checkpoints" / "step_00000003"
    (step / "rng").mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x" * 6000)
    (step / "rng" / "rank0.pt").write_bytes(b"x" * 4000)
    return tmp_path / "checkpoints"


def free_space(monkeypatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(failure.shutil, "disk_usage",
                        lambda path: usage._replace(free=free))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_an_os_error_anywhere_in_the_chain_is_named_with_its_file(root, code):
    err = wrapped(OSError(code, os.strerror(code), str(root / ".step_6.tmp" / "x.distcp")))
    assert save_failure(err, root) == f"{os.strerror(code)}: '{root / '.step_6.tmp' / 'x.distcp'}'"


def test_an_os_error_without_a_file_names_the_checkpoints_folder(root):
    try:
        try:
            raise OSError(errno.ENOSPC, NO_SPACE)  # a write() reports no file name
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from None
    except RuntimeError as err:  # the OSError survives as the context only
        assert save_failure(err, root) == f"{NO_SPACE}: '{root}'"


def test_a_lost_cause_is_found_as_less_free_space_than_the_last_checkpoint_took(
        root, monkeypatch):
    free_space(monkeypatch, 5000)
    assert save_failure(megatron_019(), root) == (
        f"{NO_SPACE}: '{root}', 4.9 KiB free where the last checkpoint took 9.8 KiB")


def test_a_lost_cause_with_room_on_the_disk_keeps_the_error_and_says_the_free_space(
        root, monkeypatch):
    free_space(monkeypatch, 3 * 2**30)
    assert save_failure(megatron_019(), root) == (
        f"CheckpointException ranks:dict_keys([0]), 3.0 GiB free on '{root}'")


def test_a_lost_cause_is_found_as_a_file_size_limit(root, monkeypatch):
    monkeypatch.setattr(failure.resource, "getrlimit", lambda which: (
        (4096, 4096) if which == resource.RLIMIT_FSIZE else resource.getrlimit(which)))
    assert save_failure(megatron_019(), root) == (
        f"{os.strerror(errno.EFBIG)}: '{root}', files are limited to 4.0 KiB (RLIMIT_FSIZE, "
        "ulimit -f) and the last checkpoint has one of 5.9 KiB")


def test_the_first_save_of_a_run_has_nothing_to_compare_with(tmp_path, monkeypatch):
    free_space(monkeypatch, 10)
    root = tmp_path / "checkpoints"  # not even made yet: its parent's filesystem counts
    assert save_failure(megatron_019(), root).endswith(f", 10 bytes free on '{root}'")


def test_sizes_read_as_people_read_them():
    assert [size(n) for n in (0, 1023, 1536, 5 * 2**20, 2**50)] == [
        "0 bytes", "1023 bytes", "1.5 KiB", "5.0 MiB", "1024.0 TiB"]
