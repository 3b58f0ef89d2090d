"""What checking token ids costs: per micro-batch where they are read, or per start as a
content hash of every ``.idx``.

Table 1: the host-side id check every micro-batch passes (``pretrain.data.batch_ids.
check_batch``: the smallest and largest id of its tokens and labels) against a forward+backward
of the CPU demo's model (``configs/demo-cpu.toml``: ``siamese``, 6 x 128, vocabulary 2,048) on
a micro-batch of the same shape, at each ``--shapes`` entry (micro-batch x sequence length).

Table 2: what a content hash of the ``.idx`` in the record would cost every start: sha256 and
blake2b throughput over ``--hash-mb`` MB in memory (the hash alone, no disk), the
fingerprint a start computes now (``pretrain.data.record.fingerprint``: at most 2 MiB read),
and the ``.idx`` of a ``--tokens`` corpus at several mean document lengths (megatron's layout:
12 bytes per sequence, 8 per document, one sequence per document as prepare-data writes) with
the time each hash would take over it.

    python -m bench.batch_id_check [--shapes 16x128,8x4096 --repeats 3 --hash-mb 256
                                    --clock wall|cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.common import one_process, random_batch, versions_line
from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from pretrain.data import record
from pretrain.data.batch_ids import check_batch
from runtime.markdown import markdown_table

VOCAB = 2048
# Mean tokens per document of the .idx sizes in table 2.
DOCUMENT_TOKENS = (250, 1000, 4000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16x128,8x4096",
                   help="micro-batch x sequence length, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="forward+backward steps per shape")
    p.add_argument("--checks", type=int, default=200, help="id checks timed per shape")
    p.add_argument("--hash-mb", type=int, default=256, help="MB hashed per algorithm")
    p.add_argument("--tokens", type=float, default=100e9, help="corpus size for table 2")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time, torch's threads; cpu: this thread's CPU time, one "
                        "torch thread (for a machine other jobs share)")
    return p.parse_args(argv)


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in shape.split("x")) for shape in text.split(",") if shape]


def check_seconds(batch: dict[str, torch.Tensor], checks: int, clock) -> float:
    """Median seconds of one id check of ``batch`` (ids in range: the path every batch
    takes)."""
    dataset = SimpleNamespace(config=SimpleNamespace(tokenizer=SimpleNamespace(
        vocab_size=VOCAB)))
    samples = list(range(batch["tokens"].shape[0]))
    times = []
    for _ in range(checks):
        start = clock()
        check_batch(batch, dataset, samples)
        times.append(clock() - start)
    return statistics.median(times)


def step_seconds(model, batch: dict[str, torch.Tensor], repeats: int, clock) -> float:
    """Median seconds of a forward+backward of the demo model on ``batch``, after one
    warm-up."""
    times = []
    for _ in range(repeats + 1):
        start = clock()
        model(batch["tokens"], batch["position_ids"], None,
              labels=batch["labels"]).float().mean().backward()
        times.append(clock() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def check_table(args: argparse.Namespace) -> str:
    cfg = ModelConfig(residual_scheme="siamese", num_layers=6, hidden_size=128,
                      num_attention_heads=4, ffn_hidden_size=512, vocab_size=VOCAB,
                      seq_length=max(seq for _, seq in _shapes(args.shapes)))
    [model] = build_model(cfg, ParallelConfig(), seed=0)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for micro, seq in _shapes(args.shapes):
        batch = random_batch(VOCAB, micro, seq)
        check = check_seconds(batch, args.checks, clock)
        step = step_seconds(model, batch, args.repeats, clock)
        rows.append([f"{micro} x {seq}", f"{1e6 * check:.0f}", f"{1e3 * step:,.0f}",
                     f"{check / step:.1e}"])
    return markdown_table(["micro-batch", "id check us", "fwd+bwd ms", "check / step"], rows)


def hash_rate(name: str, data: memoryview) -> float:
    """Bytes per second of ``name`` over ``data`` (the better of two passes)."""
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        hashlib.new(name, data).digest()
        best = min(best, time.perf_counter() - start)
    return len(data) / best


def fingerprint_seconds() -> float:
    """Seconds of record.fingerprint on a 64 MB .idx in the page cache (it reads 2 MiB)."""
    with tempfile.TemporaryDirectory() as folder:
        prefix = str(Path(folder) / "d")
        Path(prefix + ".bin").write_bytes(b"")
        Path(prefix + ".idx").write_bytes(np.random.default_rng(0).bytes(64 << 20))
        record.fingerprint(prefix)
        start = time.perf_counter()
        for _ in range(10):
            record.fingerprint(prefix)
        return (time.perf_counter() - start) / 10


def hash_table(args: argparse.Namespace) -> str:
    data = memoryview(np.random.default_rng(0).bytes(args.hash_mb << 20))
    rates = {name: hash_rate(name, data) for name in ("sha256", "blake2b")}
    lines = [f"hash throughput over {args.hash_mb} MB in memory: "
             + ", ".join(f"{name} {rate / 1e6:,.0f} MB/s" for name, rate in rates.items())
             + f"; record.fingerprint (2 MiB of the .idx): {1e3 * fingerprint_seconds():.1f} ms",
             ""]
    rows = []
    for per_document in DOCUMENT_TOKENS:
        documents = int(args.tokens / per_document)
        size = 34 + documents * 12 + (documents + 1) * 8
        rows.append([f"{per_document:,}", f"{documents / 1e6:,.0f}M", f"{size / 1e9:.2f}",
                     *(f"{size / rate:.1f}" for rate in rates.values())])
    table = markdown_table(["mean document tokens", "documents", ".idx GB", "sha256 s",
                            "blake2b s"], rows)
    return "\n".join(lines) + "\n" + table


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    with one_process():
        checks = check_table(args)
    print(f"device: CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads); {versions_line()}\n")
    print(f"id check per micro-batch vs forward+backward of the demo model (siamese 6 x 128, "
          f"vocabulary {VOCAB}, fp32), medians; clock: "
          f"{'CPU time of this thread' if args.clock == 'cpu' else 'wall'}\n")
    print(checks + "\n")
    print(f".idx of a {args.tokens / 1e9:g}B-token corpus, one sequence per document\n")
    print(hash_table(args))


if __name__ == "__main__":
    main()
