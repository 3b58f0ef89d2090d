"""lm-eval's three request types, each answer against a direct computation, request by request.

The direct side runs the model once per predicted token on exactly the tokens that token may
see (its prefix, cut to the window the docs promise: the most recent ``model.seq_length``
tokens), and reads the last position's log-probabilities; the framework's side scores a whole
window in one forward pass and gathers. Weights are scaled up so the model's predictions are
far from uniform: a scorer that reads the wrong position, the wrong token or the wrong window
then misses by far more than the bound (fp32 sums of ~20 terms, the same weights on both
sides: 1e-4 absolute).
"""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows

from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from pretrain.data.tokenizer import open_tokenizer, train_tokenizer
from pretrain.unsharded.lm_eval import FrameworkLM

SEQ = 16
TOLERANCE = 1e-4
TEXT = ("The for statement is used to iterate over the elements of a sequence (such as a "
        "string, tuple or list) or other iterable object, and the else clause runs when the "
        "loop ends without a break.")


@pytest.fixture(scope="module")
def lm(single_rank, tmp_path_factory):
    import pydoc_data.topics

    folder = tmp_path_factory.mktemp("lm-eval-requests")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n"
                              for t in pydoc_data.topics.topics.values()))
    tok = open_tokenizer(train_tokenizer([str(corpus)], str(folder / "tok"), 400))
    return make_lm(tok, seed=3)


def make_lm(tok, seed: int) -> FrameworkLM:
    config = ModelConfig(residual_scheme="siamese", num_layers=2, hidden_size=32,
                         num_attention_heads=4, ffn_hidden_size=64, vocab_size=tok.vocab_size,
                         seq_length=SEQ)
    [model] = build_model(config, ParallelConfig(), norm_backend="torch", seed=seed)
    with torch.no_grad():  # peaked predictions: every token's log-probability differs
        for param in model.parameters():
            param.mul_(3.0)
    model.eval()
    return FrameworkLM(model, tok, tok.vocab_size, SEQ)


def direct_log_prob(lm: FrameworkLM, seen: list[int], token: int) -> float:
    """log p(token | seen), the model run on ``seen`` alone."""
    inputs = torch.tensor([seen])
    with torch.no_grad():
        logits = lm.model(inputs, torch.arange(len(seen))[None], None)
    return float(logits[0, -1, :lm.vocab_size].float().log_softmax(-1)[token])


def direct_argmax(lm: FrameworkLM, seen: list[int]) -> int:
    inputs = torch.tensor([seen])
    with torch.no_grad():
        logits = lm.model(inputs, torch.arange(len(seen))[None], None)
    return int(logits[0, -1, :lm.vocab_size].argmax())


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.mark.parametrize("context_words", [3, 30], ids=["fits", "window-truncated"])
def test_loglikelihood_per_request(lm, context_words):
    """Each (context, continuation) sums the continuation's token log-probabilities; a pair
    longer than the window keeps its most recent seq_length + 1 tokens."""
    words = TEXT.split()
    context, continuation = " ".join(words[:context_words]), " " + words[context_words]
    (score, greedy), = lm.loglikelihood([request("loglikelihood", context, continuation)])
    whole = lm.tok_encode(context + continuation)
    head = lm.tok_encode(context)
    cont = whole[len(head):]
    window = whole[-(SEQ + 1):]
    if context_words == 30:
        assert len(whole) > SEQ + 1  # the case truncates
    first = len(window) - len(cont)
    expected = sum(direct_log_prob(lm, window[:i], window[i])
                   for i in range(first, len(window)))
    assert score == pytest.approx(expected, abs=TOLERANCE)
    assert greedy == all(direct_argmax(lm, window[:i]) == window[i]
                         for i in range(first, len(window)))


@pytest.mark.parametrize("words", [3, 60], ids=["one-window", "rolling-windows"])
def test_loglikelihood_rolling_scores_every_token_once(lm, words):
    """A text's rolling log-likelihood: every token scored once, the first after the
    end-of-text token, within lm-eval's windows (the library's own window function)."""
    text = " ".join(TEXT.split()[:words])
    (total,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    tokens = lm.tok_encode(text)
    expected, scored = 0.0, []
    for inputs, predicted in get_rolling_token_windows(tokens, lm.eot_token_id, SEQ, 1):
        # inputs[j] predicts inputs[j + 1] (the last input predicts the last predicted token)
        sequence = [*inputs, predicted[-1]]
        start = len(sequence) - len(predicted)
        expected += sum(direct_log_prob(lm, sequence[:i], sequence[i])
                        for i in range(start, len(sequence)))
        scored += predicted
    assert scored == tokens
    if words == 3:  # one window: each token after the end-of-text token and all before it
        assert len(tokens) <= SEQ
        assert expected == pytest.approx(sum(
            direct_log_prob(lm, [lm.eot_token_id, *tokens[:i]], tokens[i])
            for i in range(len(tokens))), abs=TOLERANCE)
    assert total == pytest.approx(expected, abs=TOLERANCE)


def greedy(lm: FrameworkLM, ids: list[int], count: int) -> list[int]:
    new = []
    for _ in range(count):
        token = direct_argmax(lm, [*ids, *new][-SEQ:])
        if token == lm.eot_token_id:
            break
        new.append(token)
    return new


def test_generate_until_is_greedy_and_stops_at_the_stop_string(lm):
    """The greedy continuation as text (its first space kept: a prompt is chosen whose
    continuation starts a new word), cut at the first stop string."""
    prompts = [" ".join(TEXT.split()[:n]) for n in range(1, 12)]
    found = ((candidate, p) for candidate in (make_lm(lm.tok, seed) for seed in range(50))
             for p in prompts
             if lm.tok.processor.id_to_piece(greedy(candidate, lm.tok_encode(p), 1)[0])
             .startswith("\u2581"))
    lm, prompt = next(found)
    ids = lm.tok_encode(prompt)
    new = greedy(lm, ids, 8)
    text = lm.tok.decode([*ids, *new])[len(prompt):]
    assert text.startswith(" ")
    (free,) = lm.generate_until([request("generate_until", prompt, {"max_gen_toks": 8,
                                                                      "until": []})])
    assert free == text
    assert len(text) > 2
    stop = text[len(text) // 2:len(text) // 2 + 2]
    (stopped,) = lm.generate_until([request("generate_until", prompt, {"max_gen_toks": 8,
                                                                         "until": [stop]})])
    assert stopped == text.split(stop)[0]
