"""Compiled runs where the run folder's filesystem has no flock (Lustre without it, some NFS
set-ups): inductor's compile cache, which locks its files, moves to a node-local folder and
says so in one line; where that has none either, the run is refused before it starts. The
CLI test makes flock fail under the run folder alone, as tests/pretrain/run/test_run_lock.py
makes it fail for the run lock."""

import errno
import fcntl
import os
import shutil
from pathlib import Path

import pytest

from model import compiled
from runtime.errors import ConfigError

SHIM = Path(__file__).resolve().parents[1] / "shims" / "no_flock"


@pytest.fixture
def restore_cache_variables():
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _refuse_under(monkeypatch, folder: Path) -> None:
    real = fcntl.flock

    def refusing(fd, operation):
        number = fd if isinstance(fd, int) else fd.fileno()
        if os.path.realpath(f"/proc/self/fd/{number}").startswith(str(folder)):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", refusing)


def test_the_cache_stays_where_flock_works(tmp_path, restore_cache_variables):
    assert compiled.use_cache(tmp_path / "cache") == tmp_path / "cache"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")


def test_without_flock_the_cache_moves_to_a_local_folder_in_one_line(
        tmp_path, monkeypatch, caplog, restore_cache_variables):
    lustre, local = tmp_path / "lustre", tmp_path / "local"
    local.mkdir()
    monkeypatch.setenv("TMPDIR", str(local))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    _refuse_under(monkeypatch, lustre)
    with caplog.at_level("INFO", logger="pretrain"):
        path = compiled.use_cache(lustre / "compile_cache")
    assert path == local / f"pretrain-compile-cache-{os.getuid()}"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
    assert caplog.messages == [
        f"kernels.compile_cache: flock is not supported on {lustre / 'compile_cache'} "
        f"({os.strerror(errno.ENOLCK)}), which inductor's cache needs; compiling with the "
        f"cache in {path} instead"]
    assert os.listdir(lustre / "compile_cache") == []  # the probe leaves nothing behind


def test_without_flock_anywhere_the_run_is_refused_naming_the_setting(
        tmp_path, monkeypatch, restore_cache_variables):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    _refuse_under(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match=r"^kernels.compile_cache \('.*'\): the compile cache "
                       r"needs file locks, and flock fails there \(No locks available\) and "
                       r"in '.*'; set kernels.compile_cache to a folder on a filesystem with "
                       r"flock, or kernels.compile=false$"):
        compiled.use_cache(tmp_path / "cache")


@pytest.mark.slow  # starts a process; inductor generates and builds C++ (~20 s)
def test_a_run_folder_without_flock_trains_compiled(data, tmp_path):
    """Everything under the folder refuses flock: the run lock falls back to its lock file,
    the data (copied there without its record) is scanned and recorded without the record's
    lock, and the compiled blocks' cache moves to TMPDIR."""
    from tests.pretrain_fixtures import REPO, cli, train_args, train_losses

    lustre, local = tmp_path / "lustre", tmp_path / "local"
    lustre.mkdir()
    local.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(data["prefix"] + suffix, lustre / ("topics" + suffix))
    moved = {**data, "prefix": str(lustre / "topics")}
    run = lustre / "run"
    # one block, one graph to build (what is tested is where its cache goes)
    done = cli(*train_args(moved, run, "--run.steps=3", "--model.num_layers=1",
                           "--kernels.compile=true"),
               extra_env={"PYTHONPATH": f"{SHIM}{os.pathsep}{REPO}",
                          "NO_FLOCK_UNDER": str(lustre), "TMPDIR": str(local)}, timeout=600)
    output = done.stdout + done.stderr
    assert f"flock is not supported on {run} (No locks available); using a lock file" \
        in output, output[-3000:]
    assert (f"kernels.compile_cache: flock is not supported on {run / 'compile_cache'} (No "
            f"locks available), which inductor's cache needs; compiling with the cache in "
            f"{local / f'pretrain-compile-cache-{os.getuid()}'} instead") in output
    assert sorted(train_losses(run)) == [1, 2, 3]
    assert (lustre / "topics.record.json").is_file()
    assert any((local / f"pretrain-compile-cache-{os.getuid()}").iterdir())
