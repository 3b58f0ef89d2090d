"""The GPU benchmarks run to their table at a tiny size (their numbers mean nothing here: this
checks that every row's code works on a GPU, so a GPU session does not spend its time on a
broken benchmark). Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.pretrain_fixtures import REPO, env

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def run(module: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env(gpu=True),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_fused_norms_prints_every_op_and_implementation():
    from bench.fused_norms import OPS

    out = run("bench.fused_norms", "--batch", "1", "--hidden", "256", "--rounds", "1",
              "--backward-tiles", "1024")
    for op in OPS:
        assert op.name in out
    assert "torch F.rms_norm" in out and "failed" not in out
    assert "triton, backward tile 1024" in out


def test_gpu_step_sweeps_and_reports():
    out = run("bench.gpu_step", "--layers", "1", "--hidden", "256", "--heads", "4",
              "--kv-heads", "2", "--ffn", "512", "--seq", "128", "--vocab", "512",
              "--micro-batches", "1,2", "--recomputes", "none,full", "--rounds", "1",
              "--steps", "2", "--warmup", "1", "--schemes", "pre,siamese_hybrid",
              "--profile", "1")
    rows = [line for line in out.splitlines() if line.startswith(("| pre", "| siamese"))]
    assert len(rows) == 8 and "best pre setting" in out
    assert out.count("GPU kernels per step") == 4 and "| all kernels |" in out


def test_saved_activations_on_the_gpu_path():
    out = run("bench.saved_activations", "--schemes", "pre,siamese")
    rows = [line for line in out.splitlines() if line.startswith(("| pre", "| siamese"))]
    assert len(rows) == 2
