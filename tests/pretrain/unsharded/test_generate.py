"""``python -m pretrain generate``: text from a checkpoint, greedy or seeded sampling."""

import json

import pytest
import torch

from model.builder import build_model
from pretrain.config import load_config
from pretrain.data.tokenizer import open_tokenizer
from pretrain.unsharded.generate import Sampling, continue_tokens, next_token
from runtime import weights
from runtime.errors import ConfigError
from tests.pretrain_fixtures import cli

PROMPT = "The return statement"


@pytest.fixture(scope="module")
def run(trained_run):
    return trained_run


def generate(run, *args: str, check: bool = True):
    done = cli("generate", "--checkpoint", str(run / "checkpoints"), "--prompt", PROMPT,
               "--prompt", "class", "--max-tokens=12", *args, check=check)
    return done if not check else [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def loaded(single_rank, run):
    """The run's model loaded in this process, for the sampling tests."""
    config = load_config(str(run / "config.toml"), [], training=False)
    [model] = build_model(config.model, type(config.parallel)(), seed=1)
    weights.load([model], str(sorted((run / "checkpoints").glob("step_*"))[-1]))
    model.eval()
    return model, config


def sample(loaded, sampling: Sampling) -> list[int]:
    model, config = loaded
    return continue_tokens(model, [5, 9, 40], sampling, config.model.vocab_size,
                           config.model.seq_length, None)


def test_generate_prints_one_line_per_prompt(run, loaded):
    first, second = generate(run)
    assert (first["prompt"], second["prompt"]) == (PROMPT, "class")
    assert first["tokens"] >= 1 and first["completion"].strip()
    if torch.cuda.is_available():  # the CLI runs on the CPU: near-ties may round otherwise
        return
    tok = open_tokenizer(loaded[1].data.tokenizer)
    greedy = continue_tokens(loaded[0], tok.encode(PROMPT), Sampling(max_tokens=12),
                             loaded[1].model.vocab_size, loaded[1].model.seq_length, tok.eod)
    # the prompt and its completion read as the whole text (its first space kept)
    assert PROMPT + first["completion"] == tok.decode(tok.encode(PROMPT) + greedy)


def test_greedy_is_top_k_one_and_sampling_is_seeded(loaded):
    greedy = sample(loaded, Sampling(max_tokens=16))
    assert sample(loaded, Sampling(max_tokens=16, temperature=1.5, top_k=1, seed=9)) == greedy
    hot = dict(max_tokens=16, temperature=1.5, top_p=0.98)
    a, b, c = (sample(loaded, Sampling(**hot, seed=s)) for s in (3, 3, 4))
    assert a == b
    assert a != c


def test_bad_sampling_is_one_line(run):
    done = generate(run, "--temperature=-1", check=False)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "--temperature (-1.0)" in line and ">= 0" in line, line


@pytest.mark.parametrize("sampling,words", [
    (Sampling(top_p=0.0), ["--top-p (0.0)", "(0, 1]"]),
    (Sampling(max_tokens=0), ["--max-tokens (0)", ">= 1"]),
    (Sampling(top_k=-2), ["--top-k (-2)", ">= 0"]),
])
def test_sampling_checks(sampling, words):
    with pytest.raises(ConfigError) as err:
        sampling.check()
    assert all(w in str(err.value) for w in words), err.value


@pytest.mark.slow
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
