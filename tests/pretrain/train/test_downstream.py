"""In-loop downstream evaluation (pretrain.train.downstream): the live, sharded model scores a
local lm-eval task (tests/fixtures/tasks) as the ``lm-eval`` command scores its checkpoint,
under any layout, without changing a single training loss."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.builder import build_model, wrap_ddp
from pretrain.config import Config, DataConfig, RunConfig
from pretrain.train.downstream import LiveLM, _sequence, chance_levels
from pretrain.unsharded.lm_eval import FrameworkLM
from tests.helpers import tiny_model
from tests.pretrain_fixtures import cli, metrics, train_args, train_losses, val_losses

TASKS = "tests/fixtures/tasks"
IN_LOOP = ["--eval.downstream_tasks=tiny_choice", f"--eval.include_path={TASKS}",
           "--eval.downstream_interval=2", "--run.steps=4"]
SCORES = ("downstream/tiny_choice/acc", "downstream/tiny_choice/acc_norm",
          "downstream/tiny_choice/brier_score")


def test_a_pair_becomes_a_right_padded_sequence_scored_on_its_continuation():
    tokens, labels, mask = _sequence([5, 6, 7], [8, 9], seq_length=6, pad=0)
    assert tokens == [5, 6, 7, 8, 0, 0]
    assert labels == [6, 7, 8, 9, 0, 0]
    assert mask == [0, 0, 1, 1, 0, 0]
    tokens, labels, mask = _sequence(list(range(1, 10)), [10, 11], seq_length=4, pad=0)
    assert (tokens, labels, mask) == ([7, 8, 9, 10], [8, 9, 10, 11], [0, 0, 1, 1])


def _task(name: str, kind: str, choices: list[int]) -> SimpleNamespace:
    return SimpleNamespace(OUTPUT_TYPE=kind, config=SimpleNamespace(task=name),
                           eval_docs=[{"n": n} for n in choices],
                           doc_to_choice=lambda doc: ["a choice"] * doc["n"])


def test_the_chance_level_is_a_uniform_guess_over_the_documents_scored():
    """The mean of 1/choices, over the first ``limit`` documents as lm-eval takes them; a
    group's members each; no level for a task that is not multiple-choice."""
    mixed = _task("mixed", "multiple_choice", [2, 4, 4])
    group = {"a group": [_task("pair", "multiple_choice", [2, 2]),
                         _task("perplexity", "loglikelihood_rolling", [1])]}
    assert chance_levels([mixed, group], None) == pytest.approx(
        {"mixed": (1 / 2 + 1 / 4 + 1 / 4) / 3, "pair": 0.5})
    assert chance_levels([mixed], 1) == {"mixed": 0.5}
    from lm_eval.tasks import TaskManager

    from pretrain.unsharded.lm_eval import load_tasks

    docs = [json.loads(line) for line in Path(TASKS, "tiny_choice.jsonl").read_text().splitlines()]
    tasks = load_tasks(TaskManager(include_path=TASKS), ["tiny_choice"])
    assert chance_levels(tasks, None) == pytest.approx(
        {"tiny_choice": sum(1 / len(d["choices"]) for d in docs) / len(docs)})


def test_the_live_model_scores_pairs_as_the_whole_model_does(single_rank):
    """Batched, padded and sharded-path scoring against the one-sequence-at-a-time scoring of
    the ``lm-eval`` command, on the same weights; a vocabulary smaller than the model's padded
    one keeps the padded rows out of both."""
    config = Config(model=tiny_model("siamese"), run=RunConfig(steps=4),
                    data=DataConfig(micro_batch_size=2, global_batch_size=4))
    chunks = wrap_ddp(build_model(config.model, config.parallel, seed=5), config.parallel)
    tokenizer = SimpleNamespace(vocab_size=config.model.vocab_size - 7, eod=0)
    generator = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(1, tokenizer.vocab_size, (n,), generator=generator).tolist()

    pairs = [(ids(c), ids(k)) for c, k in ((3, 1), (5, 2), (1, 3), (9, 1), (4, 4), (60, 2),
                                          (2, 1))]
    live = LiveLM(config, chunks, tokenizer).score_pairs(pairs)
    for chunk in chunks:
        chunk.eval()
    whole = FrameworkLM(chunks[0], tokenizer, tokenizer.vocab_size,
                        config.seq_length).score_pairs(pairs)
    assert [g for _, g in live] == [g for _, g in whole]
    assert [s for s, _ in live] == pytest.approx([s for s, _ in whole], abs=1e-5)
    assert len({round(s, 6) for s, _ in live}) > 1  # real scores, not a constant


def _scores(run) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in SCORES} for r in metrics(run)
            if "downstream/tiny_choice/acc" in r}


def _assert_same_scores(run, reference) -> None:
    """Scored at steps 2 and 4 as ``reference`` was: accuracies equal, Brier within 1e-5."""
    ours, theirs = _scores(run), _scores(reference)
    assert sorted(ours) == [2, 4]
    for step in ours:
        for key in SCORES[:2]:
            assert ours[step][key] == theirs[step][key], (step, key)
        assert ours[step][SCORES[2]] == pytest.approx(theirs[step][SCORES[2]], abs=1e-5)


@pytest.fixture(scope="module")
def scored(data, tmp_path_factory):
    """A single-process run scored in the loop at steps 2 and 4, and the same run without."""
    root = tmp_path_factory.mktemp("downstream")
    cli(*train_args(data, root / "plain", "--run.steps=4"))
    done = cli(*train_args(data, root / "scored", *IN_LOOP))
    return root / "plain", root / "scored", done.stderr


@pytest.mark.slow
def test_scores_are_logged_and_training_is_untouched(scored):
    plain, run, stderr = scored
    assert sorted(_scores(run)) == [2, 4]
    assert [r.get("downstream/tiny_choice/chance") for r in metrics(run)
            if "downstream/tiny_choice/acc" in r] == pytest.approx([1 / 3] * 2)  # 3 choices
    assert "downstream at step 2: tiny_choice/acc " in stderr
    assert "Tokenizing inputs" not in stderr  # lm-eval's bars stay off a training console
    assert train_losses(run) == train_losses(plain)  # every step, exactly
    assert val_losses(run) == val_losses(plain)
    assert all(r["downstream_seconds"] > 0 for r in metrics(run) if "downstream_seconds" in r)


@pytest.mark.slow
def test_the_last_scores_equal_the_lm_eval_command_on_the_last_checkpoint(scored):
    _, run, _ = scored
    done = cli("lm-eval", "--checkpoint", str(run / "checkpoints" / "step_00000004"),
               "--tasks", "tiny_choice", "--include-path", TASKS,
               "--logging.wandb_mode=disabled")
    results = json.loads(done.stdout.splitlines()[-1])["results"]["tiny_choice"]
    last = _scores(run)[4]
    assert last["downstream/tiny_choice/acc"] == results["acc,none"]
    assert last["downstream/tiny_choice/acc_norm"] == results["acc_norm,none"]
    assert last["downstream/tiny_choice/brier_score"] == pytest.approx(
        results["brier_score,none"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--parallel.tp=2", "--parallel.pp=2"])
def test_tensor_and_pipeline_parallel_runs_score_as_one_process(data, scored, tmp_path, layout):
    _, single, _ = scored
    run = tmp_path / "run"
    cli(*train_args(data, run, *IN_LOOP, layout), nproc=2)
    _assert_same_scores(run, single)


@pytest.mark.slow
def test_a_compiled_run_scores_as_an_eager_one(data, scored, tmp_path):
    """Compiled blocks (aot_eager) score the tasks in the loop through the same compiled
    forward as training's: accuracies equal eager's, the Brier score within 1e-5."""
    _, single, _ = scored
    run = tmp_path / "run"
    done = cli(*train_args(data, run, *IN_LOOP, "--kernels.compile=true",
                           "--kernels.compile_backend=aot_eager"))
    assert "0 graph breaks" in done.stderr, done.stderr[-3000:]
    _assert_same_scores(run, single)
