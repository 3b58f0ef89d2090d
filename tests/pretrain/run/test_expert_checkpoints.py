"""Checkpoints of a mixture-of-experts run through the real CLI: an expert-parallel run follows
the one-process losses from the same seed, its checkpoint resumes under another layout (megatron
numbers experts globally in it, so EP=2's halves load as TP=2's whole experts) or is refused in
one line where megatron cannot convert its optimizer state, a SIGKILL in the middle of a save
costs nothing, and a background save holds what a foreground one holds.

The model: the CLI tests' tiny one with 4 experts (top-2) and a shared expert in both blocks,
the balancing and z losses on, sigmoid scores with DeepSeek-V3's expert bias."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys

import pytest

from tests.pretrain.run.test_async_checkpoint import assert_same_checkpoints
from tests.pretrain_fixtures import cli, in_session, train_args, train_losses

pytestmark = pytest.mark.slow

EXPERTS = ["--model.num_experts=4", "--model.moe_router_topk=2",
           "--model.moe_shared_expert_intermediate_size=64", "--model.moe_z_loss_coeff=1e-3",
           # the loss-free balance's per-expert bias: state a checkpoint must carry, moved
           # after each step by the load of the whole global batch
           "--model.moe_router_score_function=sigmoid",
           "--model.moe_router_enable_expert_bias=true"]
STEPS, EVERY = 6, 3
COMMON = [*EXPERTS, f"--run.steps={STEPS}", f"--run.save_interval={EVERY}",
          "--run.eval_interval=100", "--data.valid_samples=0"]
SAVED = [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    """The run in one process, saving every 3 steps."""
    run = tmp_path_factory.mktemp("experts") / "run"
    cli(*train_args(data, run, *COMMON))
    return run


def test_expert_parallel_run_matches_one_process_and_its_checkpoint_reshards(data, single,
                                                                              tmp_path):
    """EP=2 (two ranks, each holding two experts and half the batch) from the same seed takes
    the one-process losses. Its step-3 checkpoint (weights, the distributed optimizer's
    state) resumes under TP=2 with sequence parallelism and whole experts (parallel.etp 1:
    the experts keep an optimizer of their own, now reduced over both ranks), repeating
    EP=2's losses of steps 4-6. Resumed in one process, where megatron would keep the experts
    with the other parameters in one optimizer, it is refused in one line before anything
    starts (megatron cannot convert the optimizer state; the weights alone load anywhere)."""
    ep2 = tmp_path / "ep2"
    cli(*train_args(data, ep2, *COMMON, "--parallel.ep=2"), nproc=2)
    reference, losses = train_losses(single), train_losses(ep2)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), ("ep2", step)
    runs = {}
    for name in ("tp2-etp1", "one-process"):
        runs[name] = tmp_path / name
        (runs[name] / "checkpoints").mkdir(parents=True)
        shutil.copytree(ep2 / "checkpoints" / SAVED[0], runs[name] / "checkpoints" / SAVED[0])
    cli(*train_args(data, runs["tp2-etp1"], *COMMON, "--parallel.tp=2",
                    "--parallel.sequence_parallel=true", "--parallel.etp=1"), nproc=2)
    resumed = train_losses(runs["tp2-etp1"])
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses[step], rel=1e-5), ("tp2-etp1", step)
    done = cli(*train_args(data, runs["one-process"], *COMMON), check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert done.stderr.strip().endswith(errors[0]) and "Traceback" not in done.stderr
    for fragment in ("routed experts' optimizer state in an optimizer of their own "
                     "(parallel.ep 2, parallel.etp 1, parallel.tp 1)",
                     "this start keeps it with the other parameters' (parallel.ep 1",
                     "resume with parallel.ep > 1 or parallel.etp other than parallel.tp",
                     "--run.init_from"):
        assert fragment in errors[0], (fragment, errors[0])
    assert sorted(p.name for p in (runs["one-process"] / "checkpoints").iterdir()) == SAVED[:1]


def test_a_run_with_experts_resumed_as_dense_is_refused_by_name(data, single, tmp_path):
    """The model's identity holds ``model.num_experts``: leaving the experts out of a resume
    is one line naming the field (the reverse: tests/pretrain/test_pretrain_errors.py)."""
    run = tmp_path / "run"
    shutil.copytree(single / "checkpoints", run / "checkpoints")
    done = cli(*train_args(data, run, *COMMON[len(EXPERTS):]), check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert "holds another model: model.num_experts (4 in the checkpoint, 0 here)" in errors[0]


def test_sigkill_during_a_save_resumes_every_loss_exactly(data, single, tmp_path):
    """Killed after megatron wrote step 6's tensors, before the checkpoint was complete: the
    run resumes from step 3 and repeats the uninterrupted run's losses bit for bit (the
    routers' expert biases, the experts and their optimizer state all restored)."""
    run = tmp_path / "run"
    args = train_args(data, run, *COMMON)
    # Its own session: megatron's checkpoint writer may outlive the killed trainer.
    proc = in_session([sys.executable, "-m", "tests.kill_in_save", str(STEPS), *args],
                      tmp_path / "killed.log")
    code = proc.wait(timeout=240)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    assert (run / "checkpoints" / "latest").read_text() == SAVED[0]
    cli(*args)
    assert train_losses(run) == train_losses(single)  # exact, step by step
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == SAVED


def test_a_background_save_holds_the_foreground_checkpoint(data, single, tmp_path):
    """run.async_save: the checkpoints written while training went on hold, tensor for
    tensor, what the foreground saves of the same steps hold."""
    run = tmp_path / "run"
    cli(*train_args(data, run, *COMMON, "--run.async_save=true"))
    assert train_losses(run) == train_losses(single)
    assert_same_checkpoints(single, run, SAVED)
