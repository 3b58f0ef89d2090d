"""The spike guard (pretrain.train.guard): outlier steps skip their update without touching a
weight or the optimizer state, are counted and logged, decide the same after a resume, and
too many in a row stop the run or roll it back past the batches that caused them; a W&B run
keeps one step axis through rollbacks and resumes."""

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from model.builder import build_model, wrap_ddp
from pretrain.config import Config, GuardConfig, OptimConfig, RunConfig
from pretrain.optim import build_optimizer
from pretrain.train.guard import (
    SpikeGuard,
    Verdict,
    grad_norm_limit_into,
    short_window_warning,
)
from runtime.checkpoint_reader import common_state
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model
from tests.pretrain_fixtures import metrics, run_logged, train_args, train_losses
from tests.wandb_reader import read_run

SPIKY = ["--guard.spikes=true", "--guard.window=8", "--guard.warmup=4",
         "--data.valid_samples=0"]


def _guard(values, **overrides) -> SpikeGuard:
    guard = SpikeGuard(GuardConfig(spikes=True, window=6, warmup=3, sigma=2.0, **overrides))
    for loss, norm in values:
        guard.record(Verdict.UPDATE, loss, norm)
    return guard


def test_the_limit_is_the_windows_mean_plus_sigma_standard_deviations():
    values = [(5.0 - 0.1 * i, 1.0 + 0.05 * (i % 3)) for i in range(9)]
    guard = _guard(values)
    losses = np.array([v[0] for v in values[-6:]])  # the window keeps the newest 6
    norms = np.array([v[1] for v in values[-6:]])
    assert guard.loss_limit() == pytest.approx(losses.mean() + 2 * losses.std(ddof=1), rel=1e-12)
    assert guard.grad_norm_limit() == pytest.approx(norms.mean() + 2 * norms.std(ddof=1),
                                                    rel=1e-12)
    assert guard.judge_loss(guard.loss_limit() * 1.001, True) is Verdict.LOSS_SPIKE
    assert guard.judge_loss(losses.mean(), True) is Verdict.UPDATE
    assert guard.judge_loss(1.0, False) is Verdict.NONFINITE


def test_no_judging_during_warm_up_or_when_off():
    assert math.isinf(_guard([(5.0, 1.0), (4.0, 1.0)]).loss_limit())  # 2 < warmup 3
    off = SpikeGuard(GuardConfig(spikes=False, warmup=2))
    for loss in (5.0, 4.0, 3.0):
        off.record(Verdict.UPDATE, loss, 1.0)
    assert math.isinf(off.loss_limit()) and math.isinf(off.grad_norm_limit())
    assert off.judge_loss(1e9, True) is Verdict.UPDATE


def test_skipped_steps_stay_out_of_the_window_and_are_counted():
    guard = _guard([(5.0, 1.0), (4.9, 1.1), (4.8, 1.0)])
    limit = guard.loss_limit()
    guard.record(Verdict.LOSS_SPIKE, 500.0, None)
    guard.record(Verdict.NONFINITE, math.nan, None)
    assert guard.loss_limit() == limit
    assert (guard.skipped, guard.spikes, guard.exhausted()) == (2, 1, False)
    guard.record(Verdict.GRAD_SPIKE, 4.7, 90.0)
    assert guard.exhausted()  # max_skipped = 3 in a row
    assert guard.streak_text() == ("3 consecutive steps were skipped (1 with a NaN/Inf loss or "
                                   "gradient, 1 with a loss spike, 1 with a gradient-norm spike)")
    guard.record(Verdict.UPDATE, 4.7, 1.0)
    assert not guard.exhausted() and guard.skipped == 3


def test_the_state_survives_json_exactly():
    guard = _guard([(5.0 / 3, 1.0 / 7), (4.9 / 3, 1.1 / 7), (4.8 / 3, 1.3 / 7), (5.1 / 3, 0.9)])
    guard.record(Verdict.LOSS_SPIKE, 9.0, None)
    again = SpikeGuard(guard.config, json.loads(json.dumps(guard.state())))
    assert again.state() == guard.state()
    assert (again.loss_limit(), again.grad_norm_limit()) == (guard.loss_limit(),
                                                            guard.grad_norm_limit())


def test_a_window_too_short_for_the_rule_is_named_at_start():
    """The issue's settings (warm-up 10, window 20; 20, 40) skipped healthy steps; the
    defaults, spikes off, or a wider band are not warned about."""
    for warmup, window in ((10, 20), (20, 40), (20, 128), (64, 63)):
        text = short_window_warning(GuardConfig(spikes=True, warmup=warmup, window=window))
        assert text.startswith(f"guard.window ({window}) and guard.warmup ({warmup}) are below "
                               "64 and 32 updated steps, which the spike rule at guard.sigma 6 "
                               "needs") and "\n" not in text
    assert short_window_warning(GuardConfig(spikes=True)) is None  # 64 / 128
    assert short_window_warning(GuardConfig(spikes=True, warmup=32, window=64)) is None
    assert short_window_warning(GuardConfig(spikes=False, warmup=10, window=20)) is None
    assert short_window_warning(GuardConfig(spikes=True, warmup=10, window=20,
                                            sigma=8.0)) is None


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed-optimizer", "plain"])
def test_a_gradient_norm_spike_changes_no_weight_and_no_optimizer_state(single_rank,
                                                                       distributed):
    """The limit goes to megatron's own skip threshold: above it the step returns the norm and
    leaves every weight and every Adam moment as they were; below it the update happens."""
    config = Config(model=tiny_model("siamese"), run=RunConfig(steps=8),
                    optim=OptimConfig(warmup_steps=0))
    config.parallel.distributed_optimizer = distributed
    chunks = wrap_ddp(build_model(config.model, config.parallel, seed=3), config.parallel)
    optimizer, _ = build_optimizer(config, chunks, torch.float32)

    def state():
        weights = [p.detach().clone() for p in chunks[0].parameters()]
        moments = [v.clone() for opt in optimizer.chained_optimizers
                   for s in opt.optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v)]
        return weights, moments

    def step(limit):
        optimizer.zero_grad()
        forward_backward(chunks, batches(2, seed=1), 2, SEQ, MBS)
        grad_norm_limit_into(optimizer, limit)
        return optimizer.step()

    step(math.inf)  # Adam moments exist from here on
    before = state()
    ok, norm, _ = step(1e-6)
    assert not ok and norm > 1e-6
    after = state()
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1],
                                                 strict=True))
    ok, _, _ = step(math.inf)
    assert ok and not torch.equal(before[0][0], state()[0][0])


@pytest.mark.slow
def test_a_compiled_run_rolls_back_as_an_eager_one(data, tmp_path):
    """Compiled blocks (aot_eager: inductor's capture without its code generation) through a
    rollback: the checkpoint's weights are loaded into the parameters the compiled blocks
    read, so every step's loss, the retrained ones included, matches eager's within 1e-5
    relative (the bound of the compiled CLI test, tests/model/test_compiled_blocks.py)."""
    common = [*SPIKY, "--run.steps=10", "--run.save_interval=4", "--run.keep_last=5",
              "--guard.max_skipped=2", "--guard.action=rollback",
              "--guard.rollback_skip_batches=2"]
    compiled = ["--kernels.compile=true", "--kernels.compile_backend=aot_eager"]
    losses = {}
    for name, extra in (("eager", []), ("compiled", compiled)):
        done = _inject("7:loss,8:loss", train_args(data, tmp_path / name, *common, *extra),
                       tmp_path / f"{name}.log")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "rolled back to step_00000004" in done.stderr, done.stderr[-3000:]
        losses[name] = [(r["step"], r["loss"]) for r in metrics(tmp_path / name) if "loss" in r]
    assert [s for s, _ in losses["compiled"]] == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10]
    for (step, ours), (eager_step, eager) in zip(losses["compiled"], losses["eager"],
                                                 strict=True):
        assert step == eager_step and ours == pytest.approx(eager, rel=1e-5), step


class Done(NamedTuple):
    returncode: int
    stderr: str


def _inject(spec: str, args: list[str], log: Path) -> Done:
    """The CLI with spikes injected (tests/inject_spikes.py), its output in ``log`` (the
    helper process megatron's checkpoint writer leaves behind a SIGKILLed run reaped with
    it: :func:`run_logged`)."""
    return Done(run_logged("tests.inject_spikes", [spec, *args], log), log.read_text())


def _saved_schedule(checkpoint: Path) -> dict:
    """The LR scheduler's state a checkpoint holds (megatron's non-tensor items)."""
    return common_state(checkpoint)["scheduler"]


def _skipped(run) -> dict[int, int]:
    return {r["step"]: r["skipped_spikes"] for r in metrics(run) if "loss" in r}


@pytest.mark.slow
def test_spikes_are_skipped_and_a_resumed_run_decides_the_same(data, tmp_path):
    """A loss spike at step 8 and a gradient spike at step 11 are skipped, logged and counted.
    Killed at step 9 and resumed from step 6, the run takes the same decisions and losses:
    the window comes back with the checkpoint (a resume that started an empty window would
    still be warming up at step 8 and take the spike)."""
    common = [*SPIKY, "--run.steps=14", "--run.save_interval=6"]
    reference = tmp_path / "reference"
    done = _inject("8:loss,11:grad", train_args(data, reference, *common),
                   tmp_path / "reference.log")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 8: a loss spike (loss " in done.stderr
    assert "step 11: a gradient-norm spike (gradient norm " in done.stderr
    counts = _skipped(reference)
    assert [counts[s] for s in (7, 8, 10, 11, 14)] == [0, 1, 1, 2, 2]
    lrs = {r["step"]: r["lr"] for r in metrics(reference) if "lr" in r}
    assert lrs[9] == lrs[8]  # a skipped step does not advance the LR schedule either

    run = tmp_path / "run"
    killed = _inject("8:loss,9:kill", train_args(data, run, *common), tmp_path / "killed.log")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _inject("2:loss,5:grad", train_args(data, run, *common),  # steps 8, 11 again
                      tmp_path / "resumed.log")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train_losses(run) == train_losses(reference)
    assert _skipped(run) == counts


@pytest.mark.slow
def test_too_many_spikes_in_a_row_stop_the_run(data, tmp_path):
    run = tmp_path / "run"
    done = _inject("6:loss,7:grad", train_args(data, run, *SPIKY, "--run.steps=10",
                                               "--guard.max_skipped=2"), tmp_path / "log")
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: 2 consecutive steps were skipped (1 with a loss spike, 1 with a gradient-norm "
        "spike) (guard.max_skipped = 2); no checkpoint was written yet")


@pytest.mark.slow
def test_a_rollback_skips_the_batches_after_the_checkpoint_and_wandb_keeps_one_axis(
        data, tmp_path):
    """Spikes at steps 7 and 8 roll the run back to its step-4 checkpoint with the 2 batches
    after it skipped; the run then ends normally at step 10, 2 batches further into its data,
    and its W&B run holds each step once, in order. Nothing is counted twice on the way: the
    LR schedule of steps 5-10 and the scheduler's saved state are those of a run that never
    skipped (the scheduler once restarted at step 8 + 4), the guard's window is the
    checkpoint's plus the steps trained since, the data position moved by the skipped
    batches only."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    common = [*SPIKY, "--run.steps=10", "--run.save_interval=4", "--run.keep_last=5",
              "--guard.max_skipped=2", "--guard.action=rollback",
              "--guard.rollback_skip_batches=2"]
    args = train_args(data, run, *common, "--logging.wandb_mode=offline")
    done = _inject("7:loss,8:loss", args, tmp_path / "log")
    assert done.returncode == 0, done.stderr[-3000:]
    plain = _inject("99:loss", train_args(data, reference, *common), tmp_path / "plain.log")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert ("2 consecutive steps were skipped (2 with a loss spike) (guard.max_skipped = 2): "
            "rolled back to step_00000004 and skipping its next 2 batches (samples 32-47)"
            in done.stderr), done.stderr[-3000:]
    events = [r for r in metrics(run) if "rollback_to_step" in r]
    assert events == [{"step": 8, "rollback_to_step": 4, "rollback_first_skipped_sample": 32,
                       "rollback_skipped_samples": 16, "rollbacks": 1}]
    record = json.loads((run / "checkpoints" / "step_00000010" / "complete.json").read_text())
    assert record["position"] == {"step": 10, "samples": 96, "tokens": 96 * 32}
    assert record["guard"]["rollbacks"] == [{"at_step": 8, "to_step": 4,
                                             "skipped_samples": [32, 48]}]
    assert record["guard"]["skipped"] == 2 and record["guard"]["in_a_row"] == []
    at_4 = json.loads((run / "checkpoints" / "step_00000004" / "complete.json").read_text())
    retrained = [r["loss"] for r in metrics(run) if "loss" in r][-6:]  # steps 5-10, again
    assert record["guard"]["losses"] == (at_4["guard"]["losses"] + retrained)[-8:]
    lrs = [(r["step"], r["lr"]) for r in metrics(run) if "lr" in r]
    expected = {r["step"]: r["lr"] for r in metrics(reference) if "lr" in r}
    assert lrs[8:] == [(s, expected[s]) for s in range(5, 11)]  # after the rollback
    for name in ("step_00000008", "step_00000010"):
        ours, theirs = (_saved_schedule(r / "checkpoints" / name) for r in (run, reference))
        assert ours == theirs and ours["num_steps"] == int(name[5:])
    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10]
    (file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    _, history = read_run(file)
    logged = [row["_step"] for row in history if "loss" in row]
    assert logged == list(range(1, 11))  # each step once, in order
    assert [row["_step"] for row in history if "rollbacks" in row] == [8]
    # W&B would drop the retrained steps too, with one warning per record; they never reach it
    assert "less than the current step" not in done.stderr
    assert "W&B already holds steps up to 8: the steps trained again from 5 on go to " \
           "metrics.jsonl only until step 9" in done.stderr
