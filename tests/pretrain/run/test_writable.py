"""Read-only folders: a run folder, its W&B folder and a report's run folder mounted read-only
(a bind mount in a user and mount namespace: root is refused there too). The dry run and the
real start both fail in one line naming the folder, and nothing is written."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pretrain_fixtures import REPO, cli, env, train_args

pytestmark = pytest.mark.slow

READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    folder = tmp_path_factory.mktemp("probe")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            READ_ONLY, "sh", str(folder), "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.decode().strip()}")


def _with_read_only(folder: Path, *args: str, extra_env: dict | None = None):
    """``python -m pretrain ARGS`` while ``folder`` is mounted read-only."""
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", READ_ONLY, "sh",
         str(folder), sys.executable, "-m", "pretrain", *args],
        cwd=REPO, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=300)


def _one_line(done, *fragments: str) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "start"])
def test_a_read_only_run_folder(data, tmp_path, namespaces, dry_run):
    run = tmp_path / "run"
    run.mkdir()
    args = train_args(data, run, "--run.steps=3", *(["--dry-run"] if dry_run else []))
    _one_line(_with_read_only(run, *args),
              f"run.dir '{run}' is not writable: on a read-only file system")
    assert _files(run) == []


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "start"])
def test_a_read_only_wandb_folder(data, tmp_path, namespaces, dry_run):
    run = tmp_path / "run"
    (run / "wandb").mkdir(parents=True)
    args = train_args(data, run, "--run.steps=3", "--logging.wandb_mode=offline",
                      *(["--dry-run"] if dry_run else []))
    _one_line(_with_read_only(run / "wandb", *args),
              f"W&B's folder (run.dir) '{run / 'wandb'}' is not writable")
    assert _files(run) == ["wandb"]  # no config.toml, versions.json, data_cache, run id


def test_a_read_only_wandb_dir_from_the_environment(data, tmp_path, namespaces):
    run, elsewhere = tmp_path / "run", tmp_path / "wandb-dir"
    elsewhere.mkdir()
    _one_line(_with_read_only(elsewhere, *train_args(data, run, "--run.steps=3",
                                                     "--logging.wandb_mode=auto"),
                              extra_env={"WANDB_MODE": "offline", "WANDB_DIR": str(elsewhere)}),
              f"W&B's folder (WANDB_DIR) '{elsewhere / 'wandb'}' is not writable",
              f"(it would be created in '{elsewhere}')")
    assert not run.exists()


def test_report_on_a_read_only_run_folder(data, tmp_path, namespaces):
    run = tmp_path / "run"
    cli(*train_args(data, run, "--run.steps=3", "--data.valid_samples=0"))
    before = _files(run)
    _one_line(_with_read_only(run, "report", str(run)),
              f"report --output '{run / 'report'}' is not writable (it would be created in "
              f"'{run}'): on a read-only file system")
    assert _files(run) == before
