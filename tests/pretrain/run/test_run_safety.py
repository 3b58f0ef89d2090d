"""Nothing lost, nothing silent: one run per folder, clean stops during start-up, failed saves,
non-finite weights, a damaged data cache, and a resume on changed data, through the real CLI."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.run import checkpoint
from pretrain.train.loop import weights_finite
from tests.pretrain_fixtures import (
    REPO,
    cli,
    env,
    metrics,
    popen,
    signal_during_start_up,
    train_args,
    wait_for,
)


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """A 3-step run with its checkpoint at step 3."""
    run = tmp_path_factory.mktemp("finished") / "run"
    cli(*train_args(data, run, "--run.steps=3"))
    return run


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-2000:]
    return errors[0]


def test_a_second_run_on_a_folder_is_refused_and_a_killed_run_does_not_block(data, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=100000", "--data.valid_samples=0",
                      "--run.save_interval=0")
    first = popen(args)
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file(), "the first run to train")
        second = cli(*args, check=False)
        assert second.returncode == 2
        line = _error_line(second.stderr)
        assert f"run.dir '{run}' is in use by another run" in line, line
        assert f"pid {first.pid}" in line, line
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
    assert (run / "run.lock").is_file()  # left behind by SIGKILL, and no obstacle:
    cli(*train_args(data, run, "--run.steps=3", "--data.valid_samples=0"))
    assert not (run / "run.lock").exists()  # a run that ends removes its lock
    assert (run / "checkpoints" / "step_00000003" / "complete.json").is_file()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_start_up_stops_cleanly_and_writes_nothing(data, tmp_path, sig):
    """Sent as soon as the CLI catches it, i.e. while torch and megatron are still loading:
    the run stops before its first step, exit 0, and the run folder is never created."""
    run = tmp_path / "run"
    proc = signal_during_start_up(train_args(data, run, "--run.steps=50"), sig)
    out, err = proc.stdout_text, proc.stderr_text
    assert proc.returncode == 0, err[-2000:]
    assert f"stopped by {sig.name} during start-up, before step 1; nothing to save" in err
    assert json.loads(out.strip().splitlines()[-1]) == {"stopped_at": 0}
    assert not run.exists()


def _limit_file_size(size: int):
    def apply() -> None:  # in the child: writes past `size` bytes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def _assert_previous_checkpoint_kept(root: Path, stderr: str, code: int, cause: str) -> None:
    """One error line naming the cause (``os.strerror`` of it) and the checkpoints folder,
    and no other line about it (megatron's writer logs its own)."""
    assert code == 2, stderr[-2000:]
    assert "encountered an error" not in stderr, stderr[-2000:]
    line = _error_line(stderr)
    assert "saving checkpoint step 6" in line and "failed" in line, line
    assert f"({cause}: '{root / 'checkpoints'}'" in line, line
    assert "the latest checkpoint is" in line and "step_00000003" in line, line


def test_a_save_that_cannot_be_written_keeps_the_previous_checkpoint(data, finished, tmp_path):
    """Files capped at 64 KB (RLIMIT_FSIZE; the checkpoint's shard is larger) make the save
    at step 6 fail as a full disk does: one error line, no partial folder, step 3 latest."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    done = subprocess.run(
        [sys.executable, "-m", "pretrain", *train_args(
            data, run, "--run.steps=6", "--optim.override_schedule=true",
            f"--data.cache_dir={tmp_path / 'cache'}")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_file_size(64 * 1024))
    _assert_previous_checkpoint_kept(run, done.stderr, done.returncode, "File too large")
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]
    assert (root / "latest").read_text() == "step_00000003"
    assert checkpoint.resolve(root) == root / "step_00000003"


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(data, finished, tmp_path):
    """The run folder on a tmpfs with room for the first checkpoint only (a user and mount
    namespace, so no privileges are needed)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs tmpfs {tmp_path}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no tmpfs in a user namespace here: {probe.stderr.decode().strip()}")
    used = sum(-(-p.stat().st_size // 4096) * 4096 + 4096 for p in finished.rglob("*"))
    step = next((finished / "checkpoints").glob("step_*"))
    checkpoint_size = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    args = train_args(data, disk / "run", "--run.steps=6",
                      "--optim.override_schedule=true", f"--data.cache_dir={tmp_path / 'cache'}")
    script = (f'mount -t tmpfs -o size={used + checkpoint_size // 2} tmpfs "$1" && '
              f'cp -r "$2" "$1/run" && shift 2 && "$@"; echo "exit=$?" >&2; '
              f'ls "{disk}/run/checkpoints" >&2')
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh",
         str(disk), str(finished), sys.executable, "-m", "pretrain", *args],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    stderr, _, listing = done.stderr.rpartition("exit=")
    code, *names = listing.split()
    _assert_previous_checkpoint_kept(disk / "run", stderr, int(code),
                                     "No space left on device")
    assert sorted(names) == ["latest", "step_00000003"], listing


def test_weights_finite_sees_one_bad_value(single_rank, device):
    """The check that runs before every save (a failing one aborts the run, exit 3, with no
    checkpoint written). No finite learning rate gets a run there: updates larger than fp32
    are refused by config validation and steps with non-finite gradients are skipped."""
    chunks = [torch.nn.Linear(4, 4).to(device), torch.nn.Linear(4, 2).to(device)]
    assert weights_finite(chunks)
    with torch.no_grad():
        chunks[1].bias[1] = float("inf")
    assert not weights_finite(chunks)


def test_a_truncated_data_cache_file_is_rebuilt(data, finished, tmp_path):
    """megatron writes its index cache in place: a start killed mid-write leaves a short
    .npy that it would trust. The next start rebuilds it, and evaluates the same samples."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    command = ["eval", "--checkpoint", str(run / "checkpoints"), f"--run.dir={run}"]
    before = cli(*command)
    index = next((run / "data_cache").glob("*-GPTDataset-valid-sample_index.npy"))
    index.write_bytes(index.read_bytes()[:100])
    after = cli(*command)
    assert "is damaged (an interrupted write); rebuilding" in after.stderr
    assert json.loads(after.stdout) == json.loads(before.stdout)


def test_a_resume_on_a_larger_batch_continues_from_the_data_position(data, finished, tmp_path):
    """With run.allow_data_change, steps 4-5 draw 16 sequences each from sample 24 on:
    consumed tokens keep growing from where the checkpoint left them."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    done = cli(*train_args(data, run, "--run.steps=5",
                           "--data.global_batch_size=16", "--run.allow_data_change=true",
                           "--optim.override_schedule=true"))
    assert "data changed on resume" in done.stderr and "data.global_batch_size (8" in done.stderr
    tokens = {r["step"]: r["consumed_tokens"] for r in metrics(run) if "consumed_tokens" in r}
    seq = 32
    assert tokens == {1: 8 * seq, 2: 16 * seq, 3: 24 * seq, 4: 40 * seq, 5: 56 * seq}
    record = json.loads((run / "checkpoints" / "step_00000005" / "complete.json").read_text())
    assert record["position"] == {"step": 5, "samples": 56, "tokens": 56 * seq}
    assert record["data"]["global_batch_size"] == 16


def test_the_newest_complete_checkpoint_wins_over_a_stale_latest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "complete.json").write_text("{}")
    (root / ".step_00000004.tmp").mkdir()  # a save that never finished
    (root / "latest").write_text("step_00000002")
    assert checkpoint.resolve(root) == root / "step_00000003"
    assert checkpoint.resolve(root / "step_00000001") == root / "step_00000001"
    assert os.listdir(root / ".step_00000004.tmp") == []
