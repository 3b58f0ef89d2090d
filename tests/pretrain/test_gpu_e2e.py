"""The CLI on a GPU, end to end: bf16 training on real text with diagnostics, checkpoints,
SIGTERM and resume (bit-identical with ``run.deterministic``, within bf16 noise without it,
and a negative control: a resume that forgets the optimizer state leaves that bound), and
``eval`` reproducing the final validation loss. Skipped without CUDA.

The other CLI tests (tests/pretrain/test_pretrain.py) pin their children to the CPU, where
every run is exact; these are their GPU counterparts, one process on one GPU.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pretrain_fixtures import (
    REPO,
    cli,
    env,
    metrics,
    signal_during_start_up,
    train_losses,
    val_losses,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 40
# A small siamese model that still runs real GPU kernels: bf16 (params_dtype auto on a GPU),
# SDPA attention, the fused Triton norms (norm_backend auto on a GPU); eager (the demo's
# config compiles its blocks: the GPU check's `compiled` part times that on a GPU).
MODEL = [
    "--kernels.compile=false",
    "--model.residual_scheme=siamese", "--model.num_layers=4", "--model.hidden_size=256",
    "--model.num_attention_heads=4", "--model.num_query_groups=2",
    "--model.ffn_hidden_size=704", "--model.seq_length=128", "--model.vocab_size=512",
    "--data.micro_batch_size=8", "--data.global_batch_size=16",
    "--optim.lr=2e-3", "--optim.warmup_steps=5", f"--run.steps={STEPS}",
    "--data.valid_samples=16", "--run.eval_interval=20", "--run.save_interval=20",
    "--run.log_interval=1", "--diagnostics.interval=10", "--logging.wandb_mode=disabled",
]
DETERMINISTIC = "--run.deterministic=true"


def _args(data: dict, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(REPO / "configs" / "demo-cpu.toml"), *MODEL,
            f"--data.prefixes=[\"{data['prefix']}\"]", f"--data.tokenizer={data['tokenizer']}",
            f"--run.dir={run}", *extra]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted deterministic run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    cli(*_args(data, run, DETERMINISTIC), gpu=True)
    return run


def _stop_and_resume(data, run: Path, *extra: str,
                     resume_with: str = "pretrain") -> tuple[int, str]:
    """Start a run, SIGTERM it once step 5 is logged, check it saved and exited cleanly,
    resume it to the end with ``python -m RESUME_WITH`` (the CLI, or a test module that wraps
    it with a fault); returns the step it stopped at and the resume's stderr."""
    args = _args(data, run, *extra)
    log = run.parent / "stopped.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO,
                                env=env(gpu=True), stdout=out, stderr=out)
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").is_file()
                   and any(r.get("step", 0) >= 5 and "loss" in r for r in metrics(run))):
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.time() < deadline, "the run never reached step 5"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    stopped_at = int((run / "checkpoints" / "latest").read_text().split("_")[1])
    # at least two steps after the resume: a lost optimizer state shows from the second on
    assert 5 <= stopped_at < STEPS - 1, f"stopped at {stopped_at}: too late to test resume"
    done = subprocess.run([sys.executable, "-m", resume_with, *args], cwd=REPO,
                          env=env(gpu=True), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return stopped_at, done.stderr


def test_gpu_run_learns_and_logs_gpu_metrics_and_diagnostics(reference):
    records = metrics(reference)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    first, last = val_losses(reference)[0], val_losses(reference)[-1]
    assert last < first - 1.0, (first, last)
    for record in steps:
        assert record["tflops_per_gpu"] > 0 and record["peak_memory_gb"] > 0
        assert all(math.isfinite(record[k]) for k in ("loss", "grad_norm", "tokens_per_s"))
    device = json.loads((reference / "versions.json").read_text())["device"]
    if any(name in device for name in ("H100", "H200", "A100", "B200")):
        assert 0 < steps[-1]["mfu"] < 1, device
    diag = [r for r in records if "diag/merge/x_share" in r]
    assert [r["step"] for r in diag] == [10, 20, 30, 40]
    assert all(0 < r["diag/merge/x_share"] < 1 and r["diag/y_rms/block03"] > 0 for r in diag)
    assert (reference / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_gpu_deterministic_resume_is_bit_identical(data, reference, tmp_path):
    run = tmp_path / "run"
    _stop_and_resume(data, run, DETERMINISTIC)
    assert train_losses(run) == train_losses(reference)  # exact, step by step
    assert val_losses(run)[-1] == val_losses(reference)[-1]


# How far a resume without run.deterministic may drift from the deterministic reference: the
# largest relative loss difference over the 40 steps. One H100 run drifted 1.3e-4 (other SDPA
# backward and cuBLAS reduction orders, amplified by 35 steps of training). A resume that zeroed
# the Adam state (tests/forget_optimizer_state.py) drifted 0.14 when stopped at step 6 and 0.10
# at step 21, in fp32 CPU runs of this configuration (where a good resume drifts 0): the steps
# right after the reset move the weights by the full learning rate in every coordinate. 3e-3
# sits 20x above the one and 30x below the other; the negative control below shows this
# test's own broken resume, on the GPU, exceeding it.
RESUME_BOUND = 3e-3


def worst_relative_difference(got: dict[int, float], want: dict[int, float]) -> float:
    """The largest |got - want| / want over the steps of two runs' training losses."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in want)


def test_gpu_resume_without_determinism_stays_within_bf16_noise(data, reference, tmp_path):
    """Without run.deterministic, kernels such as SDPA's backward and cuBLAS's reductions
    vary from run to run, so a resumed run matches the deterministic reference only to bf16
    noise (RESUME_BOUND); a resume that lost the optimizer state would not (the control
    below)."""
    run = tmp_path / "run"
    _stop_and_resume(data, run)
    worst = worst_relative_difference(train_losses(run), train_losses(reference))
    print(f"\nmax relative loss difference over {STEPS} steps: {worst:.2e}")
    assert worst <= RESUME_BOUND, worst


def test_gpu_resume_that_forgets_the_optimizer_state_exceeds_the_bound(data, reference,
                                                                        tmp_path):
    """Negative control of the test above: the same stop and non-deterministic resume, but the
    resume zeroes Adam's moments and step counts after loading the checkpoint (weights, main
    weights, schedule, RNG and data position intact). The first step after the resume uses the
    restored weights and still matches; the run then drifts past RESUME_BOUND."""
    run = tmp_path / "run"
    stopped_at, stderr = _stop_and_resume(data, run, resume_with="tests.forget_optimizer_state")
    assert "forgot the Adam state of" in stderr, stderr[-2000:]
    got, want = train_losses(run), train_losses(reference)
    first = abs(got[stopped_at + 1] - want[stopped_at + 1]) / want[stopped_at + 1]
    worst = worst_relative_difference(got, want)
    print(f"\nstopped at {stopped_at}; first resumed step {first:.2e}, worst {worst:.2e}")
    assert first <= RESUME_BOUND, first
    assert worst > RESUME_BOUND, worst


def test_gpu_eval_reproduces_the_final_validation_loss(reference):
    done = cli("eval", "--config", str(reference / "config.toml"),
               "--checkpoint", str(reference / "checkpoints"), gpu=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["checkpoint"].endswith(f"step_{STEPS:08d}")
    assert result["val_loss"] == pytest.approx(val_losses(reference)[-1], rel=1e-6)


def test_gpu_signal_during_start_up_stops_cleanly(data, tmp_path):
    """The start-up stop is agreed over NCCL once the process group exists."""
    run = tmp_path / "run"
    proc = signal_during_start_up(_args(data, run), signal.SIGTERM, gpu=True)
    assert proc.returncode == 0, proc.stderr_text[-2000:]
    assert "stopped by SIGTERM during start-up" in proc.stderr_text
    assert json.loads(proc.stdout_text.strip().splitlines()[-1]) == {"stopped_at": 0}
    assert not run.exists()
