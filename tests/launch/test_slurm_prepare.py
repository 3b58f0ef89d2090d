"""launch/slurm/prepare-data.sbatch on a real slurm (tests/slurm_cluster.py): an array job
prepares the shards, one task each, and a second job merges them into the files a single
process writes from the same inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.data.prepare import prepare_data
from tests.pretrain_fixtures import REPO, env

pytestmark = pytest.mark.cluster

SHARDS = 3


def _sbatch(cluster, log: Path, args: list[str], *options: str) -> str:
    cmd = ["sbatch", "--wait", "--cpus-per-task=1", f"--output={log}", *options,
           str(REPO / "launch" / "slurm" / "prepare-data.sbatch"), *args]
    job_env = {**env(), "SLURM_CONF": cluster.env["SLURM_CONF"], "PYTHON": sys.executable}
    done = subprocess.run(cmd, cwd=REPO, env=job_env, capture_output=True, text=True,
                          timeout=300)
    logs = "".join(p.read_text() for p in sorted(log.parent.glob(log.name.replace("%a", "*"))))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{logs[-3000:]}"
    return logs


def test_an_array_job_prepares_the_shards_and_a_job_merges_them(cluster, data, tmp_path):
    lines = Path(data["corpus"]).read_text().splitlines(keepends=True)
    third = len(lines) // SHARDS
    for i in range(SHARDS):
        part = lines[i * third:(i + 1) * third if i < SHARDS - 1 else len(lines)]
        (tmp_path / f"in{i}.jsonl").write_text("".join(part))
    out = tmp_path / "merged"
    args = ["prepare-data", str(tmp_path / "in*.jsonl"), "--tokenizer", data["tokenizer"],
            "--output", str(out), "--shards", str(SHARDS)]
    _sbatch(cluster, tmp_path / "array-%a.out", args, f"--array=0-{SHARDS - 1}")
    shards = sorted(p.name for p in (tmp_path / "merged.shards").glob("*.bin"))
    assert shards == [f"shard-0000{i}.bin" for i in range(SHARDS)]
    _sbatch(cluster, tmp_path / "merge.out", args)
    inputs = [str(tmp_path / f"in{i}.jsonl") for i in range(SHARDS)]
    prepare_data(inputs, data["tokenizer"], str(tmp_path / "single"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == \
            (tmp_path / f"single{suffix}").read_bytes()
