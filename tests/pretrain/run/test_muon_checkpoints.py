"""Muon runs through the real CLI, with the template's distributed optimizer: two
data-parallel ranks, and TP=2 x DP=2 on four, take the one-process losses (each data-parallel
rank stepping the whole matrices it owns and keeping their momentum only); the two ranks'
checkpoint resumes in one process and under TP=2 (each rank then holding half of every matrix
and of its momentum), the one-process checkpoint resumes on two ranks, each carrying on with
the uninterrupted run's losses; a SIGKILL in the middle of a save costs nothing (the resumed
run repeats every loss bit for bit), and a bf16 run on two ranks resumes bit for bit too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.pretrain_fixtures import (
    cli,
    killed_in_save_then_resumed,
    train_args,
    train_losses,
)

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
COMMON = ["--optim.name=muon", f"--run.steps={STEPS}", f"--run.save_interval={EVERY}",
          "--run.eval_interval=100", "--data.valid_samples=0"]
SAVED = [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
# Muon orthogonalises in bf16 (torch's Newton-Schulz): a gradient summed in another order
# over two ranks can round an entry of the update the other way, so layouts agree to 1e-5
# of the loss, not bit for bit (tests/runtime/test_muon_parity.py holds the weights to 1e-5).
REL = 1e-5


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    """The run in one process, saving every 3 steps."""
    run = tmp_path_factory.mktemp("muon") / "run"
    cli(*train_args(data, run, *COMMON))
    return run


def resumed_from(source: Path, run: Path) -> Path:
    """A run folder ``run`` holding ``source``'s checkpoint of step 3 alone."""
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / SAVED[0], run / "checkpoints" / SAVED[0])
    return run


def assert_carries_on(run: Path, uninterrupted: dict[int, float], name: str) -> None:
    resumed = train_losses(run)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1)), (name, resumed)
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=REL), (name, step)


def test_two_ranks_take_one_process_losses_and_their_checkpoint_reshards(data, single,
                                                                         tmp_path):
    dp2 = tmp_path / "dp2"
    cli(*train_args(data, dp2, *COMMON), nproc=2)
    reference, losses = train_losses(single), train_losses(dp2)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=REL), ("dp2", step)
    one = resumed_from(dp2, tmp_path / "one-process")
    cli(*train_args(data, one, *COMMON))
    assert_carries_on(one, reference, "dp2 -> one process")
    tp2 = resumed_from(dp2, tmp_path / "tp2")
    cli(*train_args(data, tp2, *COMMON, "--parallel.tp=2"), nproc=2)
    assert_carries_on(tp2, reference, "dp2 -> tp2")


def test_tp2_by_dp2_takes_one_process_losses(data, single, tmp_path):
    """The documented torchrun command's layout (docs/training.md#muon): four ranks, TP=2 x
    DP=2 under the distributed optimizer, each pair of TP peers stepping the whole matrices
    its data-parallel rank owns."""
    run = tmp_path / "tp2-dp2"
    cli(*train_args(data, run, *COMMON, "--parallel.tp=2"), nproc=4)
    reference, losses = train_losses(single), train_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=REL), ("tp2 x dp2", step)


def test_a_one_process_checkpoint_resumes_on_two_ranks(data, single, tmp_path):
    run = resumed_from(single, tmp_path / "dp2")
    cli(*train_args(data, run, *COMMON), nproc=2)
    assert_carries_on(run, train_losses(single), "one process -> dp2")


def test_sigkill_during_a_save_resumes_every_loss_exactly(data, single, tmp_path):
    """Killed after megatron wrote step 6's tensors, before the checkpoint was complete: the
    run resumes from step 3 and repeats the uninterrupted losses bit for bit (the momenta
    and the AdamW moments restored)."""
    run = tmp_path / "run"
    args = train_args(data, run, *COMMON)
    killed_in_save_then_resumed(args, STEPS, run, SAVED[0], tmp_path / "killed.log")
    assert train_losses(run) == train_losses(single)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == SAVED


def test_a_bf16_run_on_two_ranks_resumes_exactly(data, tmp_path):
    """bf16 weights, fp32 main copies (megatron's mixed-precision wrapper inside the
    layer-wise optimizer): two ranks' step-3 checkpoint, resumed on two ranks, repeats the
    uninterrupted steps 4-6 bit for bit."""
    bf16 = [*COMMON, "--run.params_dtype=bf16"]
    whole = tmp_path / "whole"
    cli(*train_args(data, whole, *bf16), nproc=2)
    run = resumed_from(whole, tmp_path / "resumed")
    cli(*train_args(data, run, *bf16), nproc=2)
    uninterrupted = train_losses(whole)
    assert train_losses(run) == {s: uninterrupted[s] for s in range(EVERY + 1, STEPS + 1)}
