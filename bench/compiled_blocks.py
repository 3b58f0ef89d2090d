"""Step time of a small model eager against compiled blocks (``kernels.compile``), with what
compiling took, on the CPU.

For each scheme it builds the model twice from one seed (default: the CPU demo's shape,
``configs/demo-cpu.toml``: 6 x 128, one micro-batch of 16 x 128 tokens, fp32), compiles the
second one's blocks (``model/compiled.py``, inductor unless ``--backend``), and times
forward+backward steps of the two alternately, one of each per round, after the compiled
model's first step (which compiles, and whose seconds are reported). Also printed: the
micro-batches after which compiling has paid for itself (compile seconds / seconds saved per
micro-batch; "never" when compiled is not faster). Inductor's cache goes to a fresh
temporary folder unless ``--cache``, so the compile time is a first start's.

    python -m bench.compiled_blocks [--schemes pre,siamese,siamese_hybrid,hc --layers 6
        --hidden 128 --heads 4 --ffn 512 --seq 128 --batch 16 --repeats 10 --backend inductor]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from bench.common import one_process, versions_line
from model import compiled
from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from runtime.markdown import markdown_table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="pre,siamese,siamese_hybrid,hc")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=0, help="0: 4 x hidden")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--cache", default="", help="inductor's cache folder (default: a new one)")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, scheme: str) -> list[str]:
    """One table row: eager and compiled median step ms, speed-up, compile s, break-even."""
    cfg = ModelConfig(residual_scheme=scheme, num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.heads, ffn_hidden_size=args.ffn or 4 * args.hidden,
                      vocab_size=args.vocab, seq_length=args.seq)
    [eager] = build_model(cfg, ParallelConfig(), seed=0)
    [fast] = build_model(cfg, ParallelConfig(), seed=0)
    compiled.compile_blocks([fast], args.backend)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)

    def step(model) -> float:
        start = time.perf_counter()
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    before = compiled.compile_seconds()
    first = step(fast)
    compile_s = compiled.compile_seconds() - before
    step(eager)
    times = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        times["eager"].append(step(eager))
        times["compiled"].append(step(fast))
    e, c = (statistics.median(times[k]) for k in ("eager", "compiled"))
    even = f"{compile_s / (e - c):.0f}" if c < e else "never"
    return [scheme, f"{1e3 * e:.1f}", f"{1e3 * c:.1f}", f"{e / c:.2f}", f"{compile_s:.1f}",
            f"{first:.1f}", even]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as fresh:
        compiled.use_cache(args.cache or fresh)
        with one_process():
            rows = [measure(args, s) for s in args.schemes.split(",")]
    print(f"device: CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads); {versions_line()}")
    print(f"{args.layers} layers x {args.hidden} hidden, {args.heads} heads, MLP "
          f"{args.ffn or 4 * args.hidden}, seq {args.seq}, batch {args.batch}, vocab "
          f"{args.vocab}, fp32; backend {args.backend}; median of {args.repeats} alternating "
          "rounds after the first step\n")
    print(markdown_table(["scheme", "eager ms", "compiled ms", "speed-up", "compile s",
                          "first step s", "micro-batches to pay back"], rows))


if __name__ == "__main__":
    main()
