"""``python -m pretrain generate``: text from a checkpoint, greedy or seeded sampling."""

import json

import pytest
import torch

from model.builder import build_model
from pretrain.config import load_config
from pretrain.data.tokenizer import open_tokenizer
from pretrain.unsharded import generate as generate_module
from pretrain.unsharded.generate import Sampling, continue_tokens, next_token, prompt_generator
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


# Where two fp32 computations of the same logits may rank two tokens differently: the CLI's
# (run on the CPU, tests/pretrain_fixtures.py) and this process's (on the GPU where there is
# one). Other kernels sum in other orders and differ by about 1e-6 of the logits' size (a few
# units): a 1e-3 gap between the two best logits is a hundred times that.
NEAR_TIE = 1e-3


def greedy_margins(model, ids: list[int], start: int, vocab: int) -> list[float]:
    """For each token of ``ids`` from ``start`` on, the gap between the best and second-best
    logit at the step that chose it (all at once: the model is causal)."""
    where = next(model.parameters()).device
    context = torch.tensor([ids], device=where)
    positions = torch.arange(len(ids), device=where).unsqueeze(0)
    with torch.no_grad():
        logits = model(context, positions, None)[0, start - 1:-1, :vocab].float()
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def test_generate_prints_one_line_per_prompt(run, loaded):
    """The CLI's greedy text is this process's greedy decoding of the prompt. On a CPU the two
    compute alike; on a GPU they compute on different devices, so the texts must agree up to
    the first step whose two best logits are within NEAR_TIE (on this model: every step)."""
    first, second = generate(run)
    assert (first["prompt"], second["prompt"]) == (PROMPT, "class")
    assert first["tokens"] >= 1 and first["completion"].strip()
    model, config = loaded
    tok = open_tokenizer(config.data.tokenizer)
    ids = tok.encode(PROMPT)
    greedy = continue_tokens(model, ids, Sampling(max_tokens=12), config.model.vocab_size,
                             config.model.seq_length, tok.eod)
    assert len(ids) + len(greedy) <= config.model.seq_length  # one context holds every step
    margins = greedy_margins(model, ids + greedy, len(ids), config.model.vocab_size)
    if len(greedy) < 12:  # it stopped at the end-of-document token: that step's gap too
        margins += greedy_margins(model, ids + greedy + [tok.eod], len(ids) + len(greedy),
                                  config.model.vocab_size)
    print(f"\nsmallest gap between the two best logits: {min(margins):.2e}")
    check_greedy_text(PROMPT + first["completion"], tok, ids, greedy, margins,
                      same_arithmetic=not torch.cuda.is_available())


def check_greedy_text(text: str, tok, ids: list[int], greedy: list[int], margins: list[float],
                      same_arithmetic: bool) -> None:
    """``text`` (the CLI's prompt and completion) reads as ``ids`` + ``greedy`` decoded (its
    first space kept): wholly where both were computed alike or no step was a near tie, else
    up to the first near tie, after which the other computation may have chosen otherwise."""
    decided = next((i for i, gap in enumerate(margins) if gap < NEAR_TIE), len(margins))
    if same_arithmetic or decided == len(margins):
        assert text == tok.decode(ids + greedy)
    else:
        assert text.startswith(tok.decode(ids + greedy[:decided])), (decided, margins)


def test_greedy_is_top_k_one_and_sampling_is_seeded(loaded):
    greedy = sample(loaded, Sampling(max_tokens=16))
    assert sample(loaded, Sampling(max_tokens=16, temperature=1.5, top_k=1, seed=9)) == greedy
    hot = dict(max_tokens=16, temperature=1.5, top_p=0.98)
    a, b, c = (sample(loaded, Sampling(**hot, seed=s)) for s in (3, 3, 4))
    assert a == b
    assert a != c


def test_each_prompt_draws_from_its_own_stream(loaded, monkeypatch):
    """One command, one seed, the same prompt twice: two continuations (a shared seed's
    draws made prompts whose continuations met go on alike, token for token); the same
    command again: the same two. Through the command's own function, on the loaded model."""
    model, config = loaded
    tokenizer = open_tokenizer(config.data.tokenizer)
    monkeypatch.setattr(generate_module, "single_process", lambda config, command: None)
    monkeypatch.setattr(generate_module, "load_whole",
                        lambda config, path: (model, tokenizer, None))
    hot = Sampling(max_tokens=8, temperature=1.5, top_p=0.98, seed=3)
    first, second = generate_module.generate_from_checkpoint(config, "-", ["class"] * 2, hot)
    assert first["completion"] != second["completion"], (first, second)
    again = generate_module.generate_from_checkpoint(config, "-", ["class"] * 2, hot)
    assert again == [first, second]


def test_prompt_streams_differ_by_place_and_repeat_by_seed():
    draws = {(seed, index): torch.rand(8, generator=prompt_generator(seed, index)).tolist()
             for seed in (0, 1) for index in (0, 1)}
    assert len({tuple(d) for d in draws.values()}) == 4
    assert torch.rand(8, generator=prompt_generator(1, 0)).tolist() == draws[1, 0]


def test_bad_sampling_is_one_line(run):
    done = generate(run, "--temperature=-1", check=False)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "--temperature (-1.0)" in line and ">= 0" in line, line


@pytest.mark.parametrize("sampling,words", [
    (Sampling(top_p=0.0), ["--top-p (0.0)", "(0, 1]"]),
    (Sampling(max_tokens=0), ["--max-tokens (0)", ">= 1"]),
    (Sampling(top_k=-2), ["--top-k (-2)", ">= 0"]),
    (Sampling(seed=-1), ["--seed (-1)", ">= 0"]),  # the prompts' streams need a seed >= 0
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


def test_whole_model_commands_run_eager_whatever_the_training_config(run):
    """generate, lm-eval and export-hf build the blocks eager even where the run's config
    compiles them (the demo's does): their shapes change from call to call, which a block
    compiled for static shapes would compile again each time."""
    from pretrain.unsharded.whole_model import single_process

    config = load_config(str(run / "config.toml"), ["--kernels.compile=true"], training=False)
    assert config.kernels.compile
    single_process(config, "generate")
    assert not config.kernels.compile and not config.kernels.cuda_graphs
