"""``generate``: text from a checkpoint, computed by the framework's own model (CPU or GPU).

The checkpoint of any parallel layout loads into one unsharded model in this one process
(megatron's checkpoint format reshards), so a model trained at TP=2 x PP=2 samples on a laptop.
Decoding is plain autoregressive: each new token re-reads the whole context (at most
``model.seq_length`` tokens, the most recent kept), without a KV cache; that is fine for the
short samples one reads to judge a run, and slow for long ones (an exported HF model with a
KV cache is the tool for those).

Greedy when ``temperature`` is 0; otherwise logits / temperature, then top-k, then top-p
(the smallest set of tokens whose probability reaches p), then a draw from the prompt's own
generator (:func:`prompt_generator`): seeded with ``seed`` and the prompt's place on the
command line, so the same command prints the same text, and two prompts draw independent
numbers. One generator shared by every prompt from the same seed did: prompts whose
continuations met (a small model's common phrase) then went on identically, token for token.
Batch samplers of other frameworks likewise give each sequence its own stream. Generation
stops after ``max_tokens`` or at the tokenizer's end-of-document token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.config import require
from pretrain.config import Config
from pretrain.data.tokenizer import Tokenizer
from pretrain.unsharded.whole_model import load_whole, single_process
from runtime import device


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (the command line's --max-tokens ... --seed)."""

    max_tokens: int = 64
    temperature: float = 0.0
    """0: greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities sum to p (1: all)."""
    seed: int = 0

    def check(self) -> None:
        require(self.max_tokens >= 1, f"--max-tokens ({self.max_tokens}) must be >= 1")
        require(self.temperature >= 0, f"--temperature ({self.temperature}) must be >= 0 "
                "(0: greedy)")
        require(self.top_k >= 0, f"--top-k ({self.top_k}) must be >= 0 (0: off)")
        require(0 < self.top_p <= 1, f"--top-p ({self.top_p}) must be in (0, 1]")
        require(self.seed >= 0, f"--seed ({self.seed}) must be >= 0")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the fp32 logits [vocab] of the last position."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(-1)
        # a token stays if the tokens ranked above it hold less than top_p
        dropped = probs.cumsum(-1) - probs >= sampling.top_p
        logits = logits.scatter(0, order[dropped], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def prompt_generator(seed: int, index: int) -> torch.Generator:
    """The generator of the ``index``-th prompt (from 0) of a command with ``--seed seed``: its
    own stream, seeded from both numbers by numpy's SeedSequence (which spreads nearby seeds
    apart), so prompts draw independently and the same seed and place repeat their draws."""
    state = np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


@torch.no_grad()
def continue_tokens(model, prompt: list[int], sampling: Sampling, vocab_size: int,
                    seq_length: int, stop_token: int | None, index: int = 0) -> list[int]:
    """The tokens ``model`` appends to ``prompt``, the ``index``-th prompt of its command
    (its draws: :func:`prompt_generator`; the padded vocabulary's extra entries are never
    chosen)."""
    generator = prompt_generator(sampling.seed, index)
    where = device.compute_device()
    ids = list(prompt)
    for _ in range(sampling.max_tokens):
        context = torch.tensor([ids[-seq_length:]], device=where)
        positions = torch.arange(context.shape[1], device=where).unsqueeze(0)
        logits = model(context, positions, None)[0, -1, :vocab_size].float().cpu()
        token = next_token(logits, sampling, generator)
        if token == stop_token:
            break
        ids.append(token)
    return ids[len(prompt):]


def completion(tokenizer: Tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``. Decoded with the prompt, then cut: decoding
    ``new`` alone would drop the space its first piece starts with (sentencepiece reads a
    leading "▁" as the dummy prefix of a text's start)."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode([*prompt, *new])
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)


def generate_from_checkpoint(config: Config, path: str, prompts: list[str],
                             sampling: Sampling) -> list[dict]:
    """One {"prompt", "completion", "tokens"} per prompt, from the checkpoint ``path`` of the
    config's model (checked before loading)."""
    sampling.check()
    single_process(config, "generate")
    model, tokenizer, _ = load_whole(config, path)
    results = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        require(len(ids) >= 1, "--prompt must not be empty")
        new = continue_tokens(model, ids, sampling, tokenizer.vocab_size,
                              config.model.seq_length, tokenizer.eod, index)
        results.append({"prompt": prompt, "completion": completion(tokenizer, ids, new),
                        "tokens": len(new)})
    return results
