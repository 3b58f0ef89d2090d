"""The slurm batch scripts on a real slurm (started here, on CPU, with gloo).

One cluster serves every test: two nodes on this machine (see tests/slurm_cluster.py). A
single-node job runs the tiny config to the end; the same job, warned by SIGUSR1 as before a
time limit, checkpoints, requeues itself and finishes with exactly the uninterrupted losses,
logging both starts to one W&B run (offline); a two-node job trains data-parallel across both
nodes with the single-process losses.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pretrain_fixtures import REPO, env, train_args, train_losses

pytestmark = pytest.mark.cluster

# Enough steps (20-100 ms each) that a warning sent after step 1 lands well before the end.
STEPS = 150
SLURM = REPO / "launch" / "slurm"


def _job_env(cluster, nproc: int = 1) -> dict:
    return {**env(), "SLURM_CONF": cluster.env["SLURM_CONF"], "PYTHON": sys.executable,
            "NPROC_PER_NODE": str(nproc)}


def _sbatch(cluster, script: str, name: str, log: Path, args: list[str], *options: str):
    """`sbatch --wait` as a background process (it returns when the job has ended for good,
    requeues included)."""
    cmd = ["sbatch", "--wait", f"--job-name={name}", f"--output={log}", *options,
           str(SLURM / script), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=_job_env(cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text = log.read_text() if log.exists() else "(no job output)"
        raise AssertionError(f"job did not end in {timeout} s:\n{text[-3000:]}") from None
    text = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, f"sbatch exited {proc.returncode}: {out}\n{text[-3000:]}"
    return text


def _args(data, run: Path, *extra: str) -> list[str]:
    return train_args(data, run, f"--run.steps={STEPS}", "--run.eval_interval=1000", *extra)


@pytest.fixture(scope="module")
def reference(cluster, data, tmp_path_factory):
    """The tiny config run to the end by single-node.sbatch, uninterrupted (1 rank)."""
    folder = tmp_path_factory.mktemp("slurm-reference")
    log = folder / "job.out"
    _finish(_sbatch(cluster, "single-node.sbatch", "reference", log, _args(data, folder / "run")),
            log)
    return folder


def test_single_node_job_runs_to_completion(reference):
    log = (reference / "job.out").read_text()
    assert "srun exited with status 0" in log
    assert sorted(train_losses(reference / "run")) == list(range(1, STEPS + 1))
    assert (reference / "run" / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_preempted_job_checkpoints_requeues_and_resumes_exactly(cluster, data, reference,
                                                                tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    proc = _sbatch(cluster, "single-node.sbatch", "preempted", log,
                   _args(data, run, "--logging.wandb_mode=offline"))
    deadline = time.time() + 180
    while not (run / "metrics.jsonl").is_file() or '"loss"' not in (
            run / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, "the job never reached step 1"
        time.sleep(0.1)
    # What slurm does at --signal=B:USR1@N before the time limit, delivered now.
    cluster.run("scancel", "--batch", "--signal=USR1", cluster.job_id("preempted"))
    text = _finish(proc, log)
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+)", text)
    assert stopped and int(stopped.group(1)) < STEPS, text[-3000:]
    assert "checkpoint saved (srun status 0); requeueing" in text, text[-3000:]
    assert "(restart 1)" in text, "the requeued job did not start again"
    at = int(stopped.group(1))
    assert f"resuming from {run / 'checkpoints'}/step_{at:08d} (step {at} of {STEPS})" in text
    assert "srun exited with status 0" in text.rstrip().splitlines()[-1]  # the rerun finished
    assert train_losses(run) == train_losses(reference / "run")  # exact, step by step
    # Both starts logged to one W&B run: two offline folders, one run id.
    runs = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and runs[0].name == runs[1].name, runs


def test_two_node_job_matches_single_process_losses(cluster, data, reference, tmp_path):
    """One rank on each node: data parallelism across the two nodes."""
    run, log = tmp_path / "run", tmp_path / "job.out"
    text = _finish(_sbatch(cluster, "multi-node.sbatch", "two-nodes", log, _args(data, run),
                           "--nodes=2"), log)
    assert "2 node(s), head n0" in text
    assert '"world_size": 2' in (run / "versions.json").read_text()
    single, both = train_losses(reference / "run"), train_losses(run)
    assert both.keys() == single.keys()
    for step, loss in single.items():
        assert both[step] == pytest.approx(loss, rel=1e-5), step
