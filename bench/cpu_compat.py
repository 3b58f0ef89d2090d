"""What the CPU layer's device-rewriting torch function mode costs a small CPU training step.

``runtime.cpu_compat`` rewrites ``device="cuda"`` arguments through a torch function mode, so
every torch call pays a Python hop. This builds one small model (default: the CPU demo's,
``configs/demo-cpu.toml``: ``siamese``, 6 x 128, one micro-batch of 16 x 128 tokens) inside the
CPU layer and times forward+backward steps
alternately with the mode in force and with it popped for the step (the layer's other patches
stay: megatron needs them, the mode only adds the hop), one of each per round, and prints the
medians and the overhead: the median over rounds of each round's with/without ratio, which
holds up better than a ratio of medians when other jobs share the machine. ``--clock wall``
(default) times the step as a run sees it, with torch's threads; ``--clock cpu`` times the CPU
this thread spends, on one torch thread: the figure to take on a machine whose other jobs make
wall time meaningless (it leaves out what a second thread would save). On a machine with CUDA
the layer is inert and this prints one line.

    python -m bench.cpu_compat [--scheme siamese --layers 6 --hidden 128 --heads 4 --ffn 512
                                --seq 128 --batch 16 --repeats 30 --clock wall|cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
from torch.overrides import _pop_mode_temporarily

from bench.common import versions_line
from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from runtime import cpu_compat, parallel
from runtime.markdown import markdown_table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="siamese")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time, torch's threads; cpu: this thread's CPU time, "
                        "one torch thread")
    return p.parse_args(argv)


@contextlib.contextmanager
def without_mode():
    """The CPU layer's torch function mode popped for the block (its patches stay)."""
    with _pop_mode_temporarily() as mode:
        if type(mode).__module__ != cpu_compat.__name__:
            raise RuntimeError(f"the innermost torch function mode is {type(mode).__name__}, "
                               "not the CPU layer's")
        yield


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per forward+backward step, with and without the mode. Needs the CPU layer in
    force and megatron's parallel state."""
    if not cpu_compat.active():
        raise RuntimeError("bench.cpu_compat measures the CPU layer: run it inside "
                           "cpu_compat.enabled() on a machine without CUDA")
    cfg = ModelConfig(residual_scheme=args.scheme, num_layers=args.layers,
                      hidden_size=args.hidden, num_attention_heads=args.heads,
                      ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=args.seq)
    [model] = build_model(cfg, ParallelConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    def step() -> float:
        start = clock()
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        elapsed = clock() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    times: dict[str, list[float]] = {"with the mode": [], "without the mode": []}
    for round_ in range(args.warmup + args.repeats):
        with_mode = step()
        with without_mode():
            without = step()
        if round_ >= args.warmup:
            times["with the mode"].append(with_mode)
            times["without the mode"].append(without)
    return times


def report(times: dict[str, list[float]]) -> str:
    base = statistics.median(times["without the mode"])
    rows = [[name, f"{1e3 * statistics.median(t):.1f}", f"{statistics.median(t) / base:.3f}"]
            for name, t in times.items()]
    paired = [w / wo for w, wo in zip(times["with the mode"], times["without the mode"],
                                      strict=True)]
    overhead = statistics.median(paired) - 1
    extra = statistics.median(w - wo for w, wo in zip(times["with the mode"],
                                                       times["without the mode"], strict=True))
    return (markdown_table(["step", "median fwd+bwd ms", "/ without"], rows) + "\n\n"
            f"overhead of the mode: {100 * overhead:+.1f}% of a step, {1e3 * extra:+.1f} ms "
            f"(medians of the {len(paired)} rounds' ratios and differences; ratio quartiles "
            f"{', '.join(f'{100 * (q - 1):+.1f}%' for q in _quartiles(paired))})")


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with cpu_compat.enabled() as in_force:
        if not in_force:
            print("CUDA is available: the CPU layer is inert here, nothing to measure")
            return
        if args.clock == "cpu":
            torch.set_num_threads(1)
        parallel.initialize(ParallelConfig())
        try:
            times = measure(args)
        finally:
            parallel.destroy()
    print(f"device: CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads); {versions_line()}")
    print(f"{args.scheme}, {args.layers} layers x {args.hidden} hidden, {args.heads} heads, "
          f"MLP {args.ffn}, seq {args.seq}, batch {args.batch}, vocab {args.vocab}, fp32; "
          f"median of {args.repeats} alternating rounds after {args.warmup} warm-up; clock: "
          f"{'CPU time of this thread' if args.clock == 'cpu' else 'wall'}\n")
    print(report(times))


if __name__ == "__main__":
    main()
