"""Context parallelism through the real CLI: two ranks sharing every sequence (parallel.cp 2)
take the one-process losses and validation losses, with documents crossing the split too; so
does CP=2 x TP=2 with sequence parallelism on four ranks. A CP=2 checkpoint resumes in one
process and one process's resumes at CP=2, each carrying on with the uninterrupted losses
(a checkpoint holds no trace of the sequence split); a SIGKILL in the middle of a CP=2 save
costs nothing (the resumed run repeats every loss bit for bit); ``eval`` of a CP=2 checkpoint
in one process gives the run's validation loss, and ``generate`` the one-process run's text.
A context extension starts at CP=2 from the one-process run's shorter weights with a larger
RoPE base, and its resume keeps both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.pretrain_fixtures import (
    cli,
    killed_in_save_then_resumed,
    metrics,
    train_args,
    train_losses,
    val_losses,
)

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
COMMON = [f"--run.steps={STEPS}", f"--run.save_interval={EVERY}", f"--run.eval_interval={EVERY}"]
SAVED = [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
# fp32 on gloo: only the order of sums differs (the attention's softmax over gathered keys,
# the loss's sum over the two ranks); measured 0 to 3e-8 apart.
REL = 1e-6
DOCUMENTS = ["--data.document_attention=true", "--data.reset_position_ids=true"]


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    """The run in one process, saving every 3 steps."""
    run = tmp_path_factory.mktemp("cp") / "run"
    cli(*train_args(data, run, *COMMON))
    return run


def assert_same_losses(run: Path, reference: Path, name: str, first: int = 1) -> None:
    losses, expected = train_losses(run), train_losses(reference)
    assert sorted(losses) == list(range(first, STEPS + 1)), (name, losses)
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=REL), (name, step)


def resumed_from(source: Path, run: Path) -> Path:
    """A run folder ``run`` holding ``source``'s checkpoint of step 3 alone."""
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / SAVED[0], run / "checkpoints" / SAVED[0])
    return run


def test_two_ranks_share_each_sequence_and_take_one_process_losses(data, single, tmp_path):
    """CP=2: the training and validation losses of one process; its step-3 checkpoint
    resumes in one process, and one process's at CP=2, with the uninterrupted losses; eval
    of its last checkpoint in one process is its last validation loss."""
    cp2 = tmp_path / "cp2"
    done = cli(*train_args(data, cp2, *COMMON, "--parallel.cp=2"), nproc=2)
    assert "layout: world 2 = tp 1 x cp 2 x pp 1 x dp 1" in done.stderr
    assert done.stderr.count("layout: world") == 1  # the logging rank alone speaks
    assert_same_losses(cp2, single, "cp2")
    assert val_losses(cp2) == pytest.approx(val_losses(single), rel=REL)
    # the loss by position: each rank's chunks counted where they lie in the sequence
    by_position = [{k: v for k, v in record.items() if k.startswith("val_loss_at/")}
                   for record in (metrics(cp2)[-1], metrics(single)[-1])]
    assert len(by_position[0]) == 8 and by_position[0].keys() == by_position[1].keys()
    for key, value in by_position[0].items():
        assert value == pytest.approx(by_position[1][key], rel=REL), key
    one = resumed_from(cp2, tmp_path / "cp2-then-one")
    cli(*train_args(data, one, *COMMON))
    assert_same_losses(one, single, "cp2 -> one process", first=EVERY + 1)
    back = resumed_from(single, tmp_path / "one-then-cp2")
    cli(*train_args(data, back, *COMMON, "--parallel.cp=2"), nproc=2)
    assert_same_losses(back, single, "one process -> cp2", first=EVERY + 1)
    evaluated = cli("eval", "--config", str(cp2 / "config.toml"), "--parallel.cp=1",
                    "--checkpoint", str(cp2 / "checkpoints"))
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["val_loss"] == pytest.approx(val_losses(cp2)[-1], rel=REL)
    sampled = cli("generate", "--checkpoint", str(cp2 / "checkpoints"), "--prompt", "The",
                  "--max-tokens", "4")  # one process, greedy: the one-process run's text
    reference = cli("generate", "--checkpoint", str(single / "checkpoints"), "--prompt",
                    "The", "--max-tokens", "4")
    assert sampled.stdout.strip() and sampled.stdout == reference.stdout


def test_documents_crossing_the_split_take_one_process_losses(data, tmp_path):
    """Document attention with positions restarting per document: the attention of each
    rank's queries keeps to their documents across the other rank's chunks."""
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    args = [*COMMON, "--run.save_interval=0", *DOCUMENTS]
    cli(*train_args(data, one, *args))
    cli(*train_args(data, cp2, *args, "--parallel.cp=2"), nproc=2)
    assert_same_losses(cp2, one, "cp2 with documents")


def test_cp2_by_tp2_with_sequence_parallelism_takes_one_process_losses(data, single,
                                                                       tmp_path):
    """The documented torchrun command's layout (docs/parallelism.md#context-parallelism):
    four ranks, each sequence over two context ranks, each share over two TP ranks."""
    run = tmp_path / "cp2-tp2"
    cli(*train_args(data, run, *COMMON, "--parallel.cp=2", "--parallel.tp=2",
                    "--parallel.sequence_parallel=true"), nproc=4)
    assert_same_losses(run, single, "cp2 x tp2")


def test_sigkill_during_a_cp2_save_resumes_every_loss_exactly(data, tmp_path):
    """Both ranks killed after megatron wrote step 6's tensors, before the checkpoint was
    complete: the run resumes from step 3 at CP=2 and repeats an uninterrupted CP=2 run's
    losses bit for bit."""
    args = [*COMMON, "--parallel.cp=2"]
    whole = tmp_path / "whole"
    cli(*train_args(data, whole, *args), nproc=2)
    run = tmp_path / "run"
    killed_in_save_then_resumed(train_args(data, run, *args), STEPS, run, SAVED[0],
                                tmp_path / "killed.log", nproc=2)
    assert train_losses(run) == train_losses(whole)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == SAVED


def test_a_context_extension_starts_from_shorter_weights(data, single, tmp_path):
    """run.init_from takes the 32-token run's weights into a 64-token model with RoPE base
    40,000 at CP=2 (the recipe of docs/long-context.md); another model field is still refused
    by name, and the extension's own resume may not change its length or base."""
    longer = ["--model.seq_length=64", "--model.rotary_base=40000", "--parallel.cp=2",
              f"--run.init_from={single / 'checkpoints'}", "--run.steps=3",
              "--run.save_interval=3", "--run.eval_interval=3"]
    run = tmp_path / "extended"
    done = cli(*train_args(data, run, *longer), nproc=2)
    assert f"from the weights of {single / 'checkpoints'}" in done.stderr
    assert sorted(train_losses(run)) == [1, 2, 3]
    assert [k for k in metrics(run)[-1] if k.startswith("val_loss_at/")][-1] == \
        "val_loss_at/56-63"
    wider = cli(*train_args(data, tmp_path / "wider", *longer, "--model.ffn_hidden_size=256"),
                nproc=2, check=False)
    assert wider.returncode != 0 and "model.ffn_hidden_size (128 in the checkpoint, 256 " \
        "here)" in wider.stderr, wider.stderr[-2000:]
    other_base = cli(*train_args(data, run, *longer, "--model.rotary_base=80000",
                                 "--run.steps=6"), nproc=2, check=False)
    assert other_base.returncode != 0 and "model.rotary_base (40000 in the checkpoint, " \
        "80000 here)" in other_base.stderr, other_base.stderr[-2000:]
