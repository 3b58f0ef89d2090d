"""Parameters and forward+backward time of every residual scheme, as ratios to ``pre``.

All schemes are built at one shape and timed side by side in one process, round-robin, so
machine drift affects every scheme alike. Prints one markdown table.

    python -m bench.schemes [--layers 8 --hidden 256 --heads 8 --seq 256 --batch 4 --repeats 20]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from model.builder import build_model, count_parameters
from model.config import ModelConfig, ParallelConfig
from model.schemes import ResidualScheme
from runtime import cpu_compat, parallel
from runtime.markdown import markdown_table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    with cpu_compat.enabled():
        measure(args)


def measure(args) -> None:
    parallel.initialize(ParallelConfig())
    shape = dict(num_layers=args.layers, hidden_size=args.hidden,
                 num_attention_heads=args.heads, vocab_size=args.vocab, seq_length=args.seq)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)
    models, times = {}, {}
    for scheme in ResidualScheme:
        torch.manual_seed(0)
        [models[scheme]] = build_model(ModelConfig(residual_scheme=scheme, **shape),
                                       ParallelConfig())
        times[scheme] = []

    def step(model) -> float:
        start = time.perf_counter()
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    for round_ in range(args.warmup + args.repeats):
        for scheme, model in models.items():
            elapsed = step(model)
            if round_ >= args.warmup:
                times[scheme].append(elapsed)

    base_params = count_parameters([models[ResidualScheme.PRE]])
    base_time = statistics.median(times[ResidualScheme.PRE])
    print(f"device: CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), torch {torch.__version__}")
    print(f"shape: {args.layers} layers x {args.hidden} hidden, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}; median of "
          f"{args.repeats} fwd+bwd steps after {args.warmup} warm-up, fp32\n")
    rows = []
    for scheme, model in models.items():
        n = count_parameters([model])
        t = statistics.median(times[scheme])
        rows.append([str(scheme), f"{n:,}", f"{n / base_params:.5f}", f"{1e3 * t:.1f}",
                     f"{t / base_time:.3f}"])
    print(markdown_table(["scheme", "parameters", "params / pre", "fwd+bwd ms", "time / pre"],
                         rows))
    parallel.destroy()


if __name__ == "__main__":
    main()
