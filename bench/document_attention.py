"""What document attention costs (data.document_attention): the attention alone and a whole
training step, with and without it.

1. Attention, forward + backward, [b, heads, s, d] in fp32 with documents of ``--doc-length``
   tokens on average: SDPA causal over the whole sequence (no documents), SDPA with the exact
   same-document causal mask (what the model runs without CUDA), and one causal SDPA call per
   document (the alternative with no mask: less arithmetic, many small calls).
2. A siamese model's training step (forward, backward, through megatron's schedule) at the
   demo shape (6 x 128, seq 128, micro-batch 16) and at seq 2048, with the setting off and
   on: median ms and the bytes autograd keeps for backward (bench.saved_activations' count).

On a GPU the model's path is flex attention (block mask from the ids); its cost there is not
measured yet. Prints markdown tables.

    python -m bench.document_attention [--rounds 5 --doc-length 256]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

if not torch.cuda.is_available():  # the Triton norms run in the interpreter otherwise; Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")  # reads this when a kernel module loads

import torch.nn.functional as F  # noqa: E402

from bench.common import random_batch, time_ms, versions_line  # noqa: E402
from bench.saved_activations import saved_bytes  # noqa: E402
from runtime.markdown import markdown_table  # noqa: E402

SHAPES = {"demo (6 x 128, seq 128, mb 16)": dict(num_layers=6, hidden_size=128, seq=128,
                                                 batch=16),
          "seq 2048 (6 x 128, mb 1)": dict(num_layers=6, hidden_size=128, seq=2048, batch=1)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--doc-length", type=int, default=256,
                   help="mean document length in tokens (lengths drawn uniformly in [1, 2x])")
    p.add_argument("--seqs", default="512,2048", help="sequence lengths of the attention table")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    return p.parse_args(argv)


def document_lengths(seq: int, mean: int, seed: int) -> list[int]:
    """Lengths of the documents packed into one sequence of ``seq`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], seq
    while left > 0:
        n = min(left, int(torch.randint(1, 2 * mean + 1, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return lengths


def attention_row(args, seq: int) -> list[str]:
    """One row of the attention table: forward + backward ms of each way, for ``seq``."""
    from model.documents import keep_mask

    per_row = [document_lengths(seq, args.doc_length, seed) for seed in range(args.batch)]
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                       for lengths in per_row])
    mask = keep_mask(ids[:, None, None, :].int(), seq, seq)
    q, k, v = (torch.randn(args.batch, args.heads, seq, args.head_dim, requires_grad=True)
               for _ in range(3))

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def masked():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    def per_document():
        total = 0
        for row, lengths in enumerate(per_row):
            start = 0
            for n in lengths:
                part = (slice(row, row + 1), slice(None), slice(start, start + n))
                total = total + F.scaled_dot_product_attention(
                    q[part], k[part], v[part], is_causal=True).sum()
                start += n
        total.backward()

    times = interleaved({"causal": causal, "mask": masked, "per document": per_document},
                        args.rounds)
    docs = sum(map(len, per_row)) / len(per_row)
    return [str(seq), f"{docs:.1f}", *(f"{t:.2f}" for t in times.values()),
            f"{times['mask'] / times['causal']:.2f}",
            f"{times['per document'] / times['causal']:.2f}"]


def packed(batch: dict, seq: int, mean: int, eod: int) -> dict:
    """``batch`` with an EOD ending documents of ``mean`` tokens on average, and their ids as
    the attention mask (model.documents)."""
    from model.documents import attention_mask, document_ids

    tokens = batch["tokens"].clone()
    for row in range(tokens.shape[0]):
        at = 0
        for n in document_lengths(seq, mean, row):
            at += n
            tokens[row, at - 1] = eod
    return {**batch, "tokens": tokens, "attention_mask": attention_mask(document_ids(tokens, eod))}


def step(args, shape: dict, documents: bool):
    """A siamese model's training step at ``shape``: (a call running one, MiB kept for
    backward)."""
    from model.builder import build_model, wrap_ddp
    from model.config import ModelConfig, ParallelConfig
    from runtime.schedule import forward_backward

    vocab, seq, batch = 2048, shape["seq"], shape["batch"]
    data = random_batch(vocab, batch, seq)
    if documents:
        data = packed(data, seq, args.doc_length, vocab - 1)
    torch.manual_seed(0)
    model = ModelConfig(residual_scheme="siamese", num_layers=shape["num_layers"],
                        hidden_size=shape["hidden_size"], num_attention_heads=4,
                        ffn_hidden_size=4 * shape["hidden_size"], vocab_size=vocab,
                        seq_length=seq, attention_backend="sdpa")
    chunks = wrap_ddp(build_model(model, ParallelConfig(), norm_backend="torch",
                                  positions_per_token=documents), ParallelConfig())
    return (lambda: forward_backward(chunks, [data], 1, seq, batch),
            saved_bytes(chunks[0].module, data) / 2**20)


def interleaved(calls: dict, rounds: int) -> dict[str, float]:
    """Median ms of each call, timed in turn round after round (after two warm-up calls
    each), so drift on a shared machine hits all alike."""
    for call in calls.values():
        call(), call()
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(time_ms(call, 1, warm=False))
    return {name: statistics.median(values) for name, values in samples.items()}


def step_rows(args) -> list[list[str]]:
    """Off and on built side by side and timed in alternation (:func:`interleaved`)."""
    from model.config import ParallelConfig
    from runtime import cpu_compat, parallel

    rows = []
    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig(), seed=0)
        for label, shape in SHAPES.items():
            (off, off_mib), (on, on_mib) = step(args, shape, False), step(args, shape, True)
            times = interleaved({"off": off, "on": on}, args.rounds)
            off_ms, on_ms = times["off"], times["on"]
            rows.append([label, f"{off_ms:.1f}", f"{off_mib:.1f}", f"{on_ms:.1f}",
                         f"{on_mib:.1f}", f"{on_ms / off_ms:.2f}", f"{on_mib / off_mib:.2f}"])
        parallel.destroy()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{versions_line()}; documents of {args.doc_length} tokens on average\n")
    print(markdown_table(
        ["seq", "documents", "causal ms", "mask ms", "per-document ms", "mask / causal",
         "per-document / causal"], [attention_row(args, int(s)) for s in args.seqs.split(",")]))
    print()
    print(markdown_table(
        ["shape", "off ms", "off MiB kept", "on ms", "on MiB kept", "time on/off",
         "memory on/off"], step_rows(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
