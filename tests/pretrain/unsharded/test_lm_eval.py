"""``lm-eval``: a local lm-evaluation-harness task (YAML over a JSONL file) scored by the
framework's model gives the accuracy of a direct log-likelihood computation, for a dense
checkpoint and one with experts (written at EP=2)."""

import json

import pytest
import torch

from model.builder import build_model
from pretrain.config import load_config
from pretrain.data.tokenizer import open_tokenizer
from runtime import weights
from tests.pretrain_fixtures import REPO, cli
from tests.wandb_reader import read_run

# The local task the in-loop tests use too: a YAML over a JSONL file (paths from the repo root).
TASKS = REPO / "tests" / "fixtures" / "tasks"
QUESTIONS = [(d["question"], d["choices"], d["answer"]) for d in map(
    json.loads, (TASKS / "tiny_choice.jsonl").read_text().splitlines())]
TASK = (TASKS / "tiny_choice.yaml").read_text()
# A task over a Hub dataset that no machine has cached: without network it cannot be built.
# (its metric spelled out in full: lm-eval prints a notice for each metric without them)
HUB_TASK = TASK.replace("task: tiny_choice", "task: hub_choice").replace(
    "dataset_path: json\ndataset_kwargs:\n  data_files:\n"
    "    test: tests/fixtures/tasks/tiny_choice.jsonl\n",
    "dataset_path: siamesenorm-tests/not-on-this-machine\n").split("metric_list:")[0] + (
    "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
UNREACHABLE = ("error: lm-eval task hub_choice needs its data from the Hugging Face Hub, which "
               "could not be reached (")


@pytest.fixture(scope="module", params=["dense", "experts"])
def setup(request):
    """The session's tiny siamese run, or its run with experts."""
    run = request.getfixturevalue("trained_run" if request.param == "dense" else "moe_run")
    return run, TASKS


def direct_accuracy(run) -> float:
    """Pick each question's most likely choice, from the model's logits directly (lm-eval's
    tokenisation: the continuation is " choice", split off the encoded whole)."""
    config = load_config(str(run / "config.toml"), [], training=False)
    tok = open_tokenizer(config.data.tokenizer)
    [model] = build_model(config.model, type(config.parallel)(), seed=1)
    weights.load([model], str(sorted((run / "checkpoints").glob("step_*"))[-1]))
    model.eval()
    right = 0
    for question, choices, answer in QUESTIONS:
        scores = []
        for choice in choices:
            context = tok.encode(question)
            continuation = tok.encode(question + " " + choice)[len(context):]
            tokens = torch.tensor([context + continuation])
            with torch.no_grad():
                logits = model(tokens[:, :-1], torch.arange(tokens.shape[1] - 1)[None], None)
            log_probs = logits[0, -len(continuation):, :tok.vocab_size].log_softmax(-1)
            scores.append(log_probs.gather(-1, torch.tensor(continuation)[:, None]).sum())
        right += int(torch.stack(scores).argmax()) == answer
    return right / len(QUESTIONS)


@pytest.mark.slow  # its runs are trained by the CLI
def test_local_task_accuracy_equals_direct_loglikelihood(single_rank, setup):
    run, tasks = setup
    step = int(sorted((run / "checkpoints").glob("step_*"))[-1].name.removeprefix("step_"))
    done = cli("lm-eval", "--checkpoint", str(run / "checkpoints"), "--tasks", "tiny_choice",
               "--include-path", str(tasks), "--logging.wandb_mode=offline")
    result = json.loads(done.stdout.splitlines()[-1])
    accuracy = result["results"]["tiny_choice"]["acc,none"]
    assert accuracy == pytest.approx(direct_accuracy(run), abs=1e-9)
    logged = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert logged[-1]["tasks"] == ["tiny_choice"]
    # and in the run's W&B run, against the checkpoint's step (6 or 3 steps trained)
    [wandb_file] = (run / "wandb").glob("offline-run-*/run-*.wandb")
    _, history = read_run(wandb_file)
    [row] = [row for row in history if "lm_eval/tiny_choice/acc" in row]
    assert row["lm_eval/tiny_choice/acc"] == pytest.approx(accuracy, abs=1e-12)
    assert row["lm_eval/step"] == step in (6, 3)


def test_task_without_network_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    """A task whose data must be downloaded, with the Hub unreachable (its client offline,
    as without network), is one DataError naming the task and --include-path, raised before
    the checkpoint is even looked at."""
    import huggingface_hub.constants

    from pretrain.unsharded import lm_eval
    from runtime.errors import DataError

    (tmp_path / "hub_choice.yaml").write_text(HUB_TASK)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def load_whole(*_args):
        raise AssertionError("the model was loaded before the tasks")

    monkeypatch.setattr(lm_eval, "load_whole", load_whole)
    config = load_config(str(REPO / "configs" / "demo-cpu.toml"), [], training=False)
    with pytest.raises(DataError) as err:
        lm_eval.run_lm_eval(config, str(tmp_path / "no-checkpoint"), ["hub_choice"],
                            str(tmp_path), None, 1)
    assert f"error: {err.value}".startswith(UNREACHABLE), err.value
    assert "--include-path DIR" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_task_without_network_from_the_command_line(trained_run, tmp_path):
    """The same through the CLI, from a real checkpoint, with the Hub offline: exit 2 and
    one line on stderr (it used to be a ConnectionError traceback, exit 1)."""
    (tmp_path / "hub_choice.yaml").write_text(HUB_TASK)
    done = cli("lm-eval", "--checkpoint", str(trained_run / "checkpoints"), "--tasks",
               "hub_choice", "--include-path", str(tmp_path), check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = done.stderr.splitlines()
    assert line.startswith(UNREACHABLE), line
