"""Checkpoints of a mixture-of-experts run through the real CLI: an expert-parallel run follows
the one-process losses from the same seed, its checkpoint resumes under any other layout
(pipeline stages without experts included) and carries on with the uninterrupted run's
losses (megatron numbers experts globally in it, so EP=2's halves load as TP=2's whole experts
or as one process's four, and the experts' optimizer state is laid out alike at every layout:
``model.moe.mark_experts``), a checkpoint of the earlier layout is refused in one line whose
advice trains, a SIGKILL in the middle of a save costs nothing, and a background save holds
what a foreground one holds.

The model: the CLI tests' tiny one with 4 experts (top-2) and a shared expert in both blocks,
the balancing and z losses on, sigmoid scores with DeepSeek-V3's expert bias."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from model.config import ModelConfig
from pretrain.report.expert_load import balancing_advice
from tests.pretrain.run.test_async_checkpoint import assert_same_checkpoints
from tests.pretrain_fixtures import (
    cli,
    killed_in_save_then_resumed,
    run_logged,
    train_args,
    train_losses,
)

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


def resumed_from(source: Path, run: Path, step: int = EVERY) -> Path:
    """A run folder ``run`` holding ``source``'s checkpoint of ``step`` alone."""
    (run / "checkpoints").mkdir(parents=True)
    name = f"step_{step:08d}"
    shutil.copytree(source / "checkpoints" / name, run / "checkpoints" / name)
    return run


def assert_carries_on(run: Path, uninterrupted: dict[int, float], name: str) -> None:
    """``run`` resumed at step 3 took the uninterrupted run's losses of steps 4-6."""
    resumed = train_losses(run)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1)), (name, resumed)
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), (name, step)


def test_expert_parallel_run_matches_one_process_and_its_checkpoint_reshards(data, single,
                                                                              tmp_path):
    """EP=2 (two ranks, each holding two experts and half the batch) from the same seed takes
    the one-process losses. Its step-3 checkpoint (weights, the distributed optimizer's
    state) resumes under TP=2 with sequence parallelism and whole experts (parallel.etp 1:
    each expert on both ranks, its gradient reduced over both) and in one process (EP=1:
    every expert on the one rank), each repeating the uninterrupted losses of steps 4-6."""
    ep2 = tmp_path / "ep2"
    cli(*train_args(data, ep2, *COMMON, "--parallel.ep=2"), nproc=2)
    reference, losses = train_losses(single), train_losses(ep2)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), ("ep2", step)
    tp2 = resumed_from(ep2, tmp_path / "tp2-etp1")
    cli(*train_args(data, tp2, *COMMON, "--parallel.tp=2", "--parallel.sequence_parallel=true",
                    "--parallel.etp=1"), nproc=2)
    assert_carries_on(tp2, losses, "tp2-etp1")
    one = resumed_from(ep2, tmp_path / "one-process")
    cli(*train_args(data, one, *COMMON))
    assert_carries_on(one, reference, "ep2 -> ep1")
    assert sorted(p.name for p in (one / "checkpoints").glob("step_*")) == SAVED


def test_a_one_process_checkpoint_resumes_expert_parallel(data, single, tmp_path):
    """The reverse: the one-process run's step-3 checkpoint resumes under EP=2, each rank
    taking half of the experts and of their optimizer state, with the uninterrupted
    losses."""
    run = resumed_from(single, tmp_path / "ep2")
    cli(*train_args(data, run, *COMMON, "--parallel.ep=2"), nproc=2)
    assert_carries_on(run, train_losses(single), "ep1 -> ep2")


# Eight experts over four ranks, micro-batches of 2 so that four data-parallel ranks share the
# batch of 8 (every layout then balances the same micro-batches).
EIGHT = [*COMMON, "--model.num_experts=8", "--data.micro_batch_size=2"]


def one_process_and_layout(data, tmp_path: Path, fields: list[str],
                           layout: str) -> tuple[Path, Path, dict[int, float]]:
    """A run of ``fields`` in one process and one under ``layout`` on two ranks, which takes
    its losses: both run folders and the one-process losses."""
    single, sharded = tmp_path / "single", tmp_path / layout.removeprefix("--parallel.")
    cli(*train_args(data, single, *fields))
    cli(*train_args(data, sharded, *fields, layout), nproc=2)
    reference = train_losses(single)
    assert sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in train_losses(sharded).items():
        assert loss == pytest.approx(reference[step], rel=1e-5), (layout, step)
    return single, sharded, reference


def test_an_expert_parallel_checkpoint_resumes_on_four_ranks(data, tmp_path):
    """EP=2's step-3 checkpoint of eight experts resumes under EP=4 (four ranks of two
    experts) with the one-process run's losses of steps 4-6."""
    _, ep2, reference = one_process_and_layout(data, tmp_path, EIGHT, "--parallel.ep=2")
    ep4 = tmp_path / "ep4"
    cli(*train_args(data, resumed_from(ep2, ep4), *EIGHT, "--parallel.ep=4"), nproc=4)
    assert_carries_on(ep4, reference, "ep2 -> ep4")


def test_a_checkpoint_of_the_earlier_layout_is_refused_and_its_advice_trains(data, single,
                                                                             tmp_path):
    """A checkpoint written at EP=1 by versions that kept the experts' optimizer state with
    the rest (tests/old_expert_layout.py) is refused in one line naming it before anything
    starts (megatron would fail deep in the load); the advice, a new run from its weights
    with --run.init_from, trains from them."""
    old = tmp_path / "old"
    log = tmp_path / "old.log"
    code = run_logged("tests.old_expert_layout", train_args(data, old, *COMMON), log)
    assert code == 0, log.read_text()[-2000:]
    assert train_losses(old) == pytest.approx(train_losses(single), rel=1e-5)
    run = resumed_from(old, tmp_path / "resumed")
    done = cli(*train_args(data, run, *COMMON), check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert done.stderr.strip().endswith(errors[0]) and "Traceback" not in done.stderr
    checkpoint = run / "checkpoints" / SAVED[0]
    assert f"checkpoint '{checkpoint}' holds the routed experts' optimizer state with the " \
           "other parameters'" in errors[0], errors[0]
    advice = f"--run.init_from={checkpoint}"
    assert advice in errors[0], errors[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == SAVED[:1]
    new = tmp_path / "new"
    cli(*train_args(data, new, *COMMON, advice))
    losses = train_losses(new)
    assert sorted(losses) == list(range(1, STEPS + 1))
    # its first step starts from the old run's trained weights, not from the seed's
    assert losses[1] < train_losses(single)[1] - 0.05, (losses, train_losses(single))


def test_a_run_with_experts_resumed_as_dense_is_refused_by_name(data, single, tmp_path):
    """The model's identity holds ``model.num_experts``: leaving the experts out of a resume
    is one line naming the field (the reverse: tests/pretrain/test_pretrain_errors.py)."""
    run = tmp_path / "run"
    shutil.copytree(single / "checkpoints", run / "checkpoints")
    done = cli(*train_args(data, run, *COMMON[len(EXPERTS):]), check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert "holds another model: model.num_experts (4 in the checkpoint, 0 here)" in errors[0]


def test_a_resume_takes_the_routers_advice_and_records_it(data, single, tmp_path):
    """The advice of a router said to be imbalanced (pretrain.report.expert_load), a stronger
    balancing loss, with a stronger z-loss beside it: both weigh a loss and shape no tensor,
    so the step-3 checkpoint resumes with them, trains on to step 6, and the change is
    recorded with the run's other settings changes."""
    advice = balancing_advice(ModelConfig.moe_aux_loss_coeff)
    run = resumed_from(single, tmp_path / "stronger")
    done = cli(*train_args(data, run, *COMMON, advice, "--model.moe_z_loss_coeff=2e-3"))
    assert "holds another model" not in done.stderr
    assert sorted(train_losses(run)) == list(range(EVERY + 1, STEPS + 1))
    (line,) = [json.loads(x) for x in (run / "settings_changes.jsonl").read_text().splitlines()]
    assert line["step"] == EVERY
    assert {k: v for k, v in line["changes"].items() if k.startswith("model.")} == {
        "model.moe_aux_loss_coeff": [1e-2, 2e-2], "model.moe_z_loss_coeff": [1e-3, 2e-3]}


def test_sigkill_during_a_save_resumes_every_loss_exactly(data, single, tmp_path):
    """Killed after megatron wrote step 6's tensors, before the checkpoint was complete: the
    run resumes from step 3 and repeats the uninterrupted run's losses bit for bit (the
    routers' expert biases, the experts and their optimizer state all restored)."""
    run = tmp_path / "run"
    args = train_args(data, run, *COMMON)
    killed_in_save_then_resumed(args, STEPS, run, SAVED[0], tmp_path / "killed.log")
    assert train_losses(run) == train_losses(single)  # exact, step by step
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == SAVED


def test_a_background_save_holds_the_foreground_checkpoint(data, single, tmp_path):
    """run.async_save: the checkpoints written while training went on hold, tensor for
    tensor, what the foreground saves of the same steps hold."""
    run = tmp_path / "run"
    cli(*train_args(data, run, *COMMON, "--run.async_save=true"))
    assert train_losses(run) == train_losses(single)
    assert_same_checkpoints(single, run, SAVED)


# Four blocks, experts in the first two only: under parallel.pp 2 megatron still chains an
# experts' optimizer on the second stage, holding no parameter.
FIRST_HALF = [*COMMON, "--model.num_layers=4", "--model.moe_layer_freq=[1,1,0,0]"]


def test_a_pipeline_stage_without_experts_saves_and_reshards(data, tmp_path):
    """PP=2 with experts in the first stage only takes the one-process losses and saves (the
    empty experts' optimizer left out: ``pretrain.optim.sharded_optimizer_state``; megatron's
    own save fails on that rank while the other waits in it for good); its step-3 checkpoint
    resumes at PP=2 and in one process (the dense optimizer's keys are ``chained_0.`` on
    both stages, as in one process), and one process's resumes at PP=2, each with the
    uninterrupted one-process losses of steps 4-6. (A first stage without experts is refused
    at load time: tests/model/test_config_errors.py.)"""
    single, pp2, reference = one_process_and_layout(data, tmp_path, FIRST_HALF,
                                                    "--parallel.pp=2")
    again = resumed_from(pp2, tmp_path / "pp2-again")
    cli(*train_args(data, again, *FIRST_HALF, "--parallel.pp=2"), nproc=2)
    assert_carries_on(again, reference, "pp2 -> pp2")
    one = resumed_from(pp2, tmp_path / "pp1")
    cli(*train_args(data, one, *FIRST_HALF))
    assert_carries_on(one, reference, "pp2 -> pp1")
    split = resumed_from(single, tmp_path / "pp1-pp2")
    cli(*train_args(data, split, *FIRST_HALF, "--parallel.pp=2"), nproc=2)
    assert_carries_on(split, reference, "pp1 -> pp2")
