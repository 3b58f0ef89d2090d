"""The optimizer step alone, AdamW against Muon, on the CPU at a few widths.

For each width, one two-stream model (``--scheme``, ``--layers`` blocks, SwiGLU 4 x width)
with gradients from one forward and backward, then the time of ``optimizer.step()`` (median of
``--steps`` after 2 warm-up steps) with ``optim.name`` adamw and muon, as training builds them
(``pretrain.optim.build_optimizer``; one process, no distributed optimizer: nothing to shard).
Muon's step is torch's Newton-Schulz in bf16 on each block matrix (QKV as Q, K and V, fc1 as
its gate and up halves), AdamW's one fused update per parameter: on a CPU without bf16 matrix
units the first is far slower, which says nothing of a GPU.

    python -m bench.optimizer_step [--widths 128,256,512 --layers 4 --steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import one_process, random_batch, versions_line
from runtime.markdown import markdown_table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="siamese")
    p.add_argument("--widths", default="128,256,512")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    return p.parse_args(argv)


def measure(args, width: int, name: str) -> dict:
    """Parameters, Muon's share of them and the median optimizer step in ms."""
    from model import decay
    from model.builder import build_model, count_parameters, wrap_ddp
    from model.config import ModelConfig, ParallelConfig
    from pretrain.config import Config, DataConfig, OptimConfig, OptimName
    from pretrain.optim import build_optimizer
    from runtime.schedule import forward_backward

    model = ModelConfig(residual_scheme=args.scheme, num_layers=args.layers, hidden_size=width,
                        num_attention_heads=args.heads, ffn_hidden_size=4 * width,
                        vocab_size=args.vocab, seq_length=args.seq)
    config = Config(model=model, parallel=ParallelConfig(distributed_optimizer=False),
                    optim=OptimConfig(name=OptimName(name), warmup_steps=0),
                    data=DataConfig(micro_batch_size=args.batch, global_batch_size=args.batch))
    chunks = build_model(config.model, config.parallel, seed=0)
    muon = sum(p.numel() for c in chunks for p in c.parameters() if decay.muon_matrix(p))
    parameters = count_parameters(chunks)
    ddp = wrap_ddp(chunks, config.parallel)
    optimizer, _ = build_optimizer(config, ddp, torch.float32)
    forward_backward(ddp, iter([random_batch(args.vocab, args.batch, args.seq)]), 1, args.seq,
                     args.batch)
    times = []
    for step in range(args.steps + 2):
        began = time.perf_counter()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - began)
    return {"parameters": parameters, "muon": muon, "ms": 1e3 * statistics.median(times)}


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    with one_process():
        for width in map(int, args.widths.split(",")):
            adamw, muon = (measure(args, width, name) for name in ("adamw", "muon"))
            rows.append([f"{args.layers} x {width}", f"{adamw['parameters']:,}",
                         f"{muon['muon']:,}", f"{adamw['ms']:.1f}", f"{muon['ms']:.1f}",
                         f"{muon['ms'] / adamw['ms']:.1f}"])
    print(versions_line())
    print(f"{args.scheme}, SwiGLU 4 x width, fp32, {torch.get_num_threads()} threads; "
          f"optimizer.step() alone, median of {args.steps}\n")
    print(markdown_table(["blocks x width", "parameters", "Muon's", "AdamW ms", "Muon ms",
                          "Muon / AdamW"], rows, right_from=1))


if __name__ == "__main__":
    main()
