"""``python -m pretrain generate``: text from a checkpoint, greedy or seeded sampling."""

import json

import pytest
import torch

from pretrain.generate import Sampling, next_token
from tests.pretrain_fixtures import cli, train_args

PROMPT = "The return statement"


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """A tiny model trained for a few steps on the test corpus."""
    folder = tmp_path_factory.mktemp("generate") / "run"
    cli(*train_args(data, folder, "--run.steps=20", "--run.eval_interval=100"))
    return folder


def generate(run, *args: str, check: bool = True):
    done = cli("generate", "--checkpoint", str(run / "checkpoints"), "--prompt", PROMPT,
               "--max-tokens=12", *args, check=check)
    return done if not check else [json.loads(line) for line in done.stdout.splitlines()]


def test_greedy_generation_is_text_and_repeatable(run):
    [first] = generate(run)
    assert first["prompt"] == PROMPT and first["tokens"] >= 1
    assert first["completion"].strip()
    assert generate(run) == [first]
    # top-k 1 at any temperature is greedy
    assert generate(run, "--temperature=1.5", "--top-k=1", "--seed=9") == [first]


def test_sampling_is_seeded(run):
    hot = ("--temperature=1.5", "--top-p=0.98")
    a, b, c = (generate(run, *hot, f"--seed={s}") for s in (3, 3, 4))
    assert a == b
    assert a != c


def test_several_prompts_one_line_each(run):
    done = cli("generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "a",
               "--prompt", "class", "--max-tokens=3")
    assert [json.loads(line)["prompt"] for line in done.stdout.splitlines()] == ["a", "class"]


@pytest.mark.parametrize("args,words", [
    (("--temperature=-1",), ["--temperature (-1.0)", ">= 0"]),
    (("--top-p=0",), ["--top-p (0.0)", "(0, 1]"]),
    (("--max-tokens=0",), ["--max-tokens (0)", ">= 1"]),
])
def test_bad_sampling_is_one_line(run, args, words):
    done = generate(run, *args, check=False)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert all(w in line for w in words), line


def test_missing_checkpoint_is_one_line(tmp_path):
    done = cli("generate", "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x",
               check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


def test_top_k_and_top_p_restrict_the_draw():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    top2 = {next_token(logits, Sampling(temperature=2.0, top_k=2), gen) for _ in range(300)}
    assert top2 == {0, 1}
    # p = 0.5: token 0 alone holds 0.64 of the mass at temperature 1
    nucleus = {next_token(logits, Sampling(temperature=1.0, top_p=0.5), gen) for _ in range(300)}
    assert nucleus == {0}
    everything = {next_token(logits, Sampling(temperature=3.0), gen) for _ in range(600)}
    assert everything == {0, 1, 2, 3, 4}
