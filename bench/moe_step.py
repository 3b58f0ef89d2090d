"""A tiny mixture-of-experts step on the CPU, against the dense model of the same active size.

For each scheme, three models of one width: dense (MLP width ``--ffn``), MoE (``--experts``
experts of width ``--ffn / --topk``, top-``--topk``: per token the same active MLP parameters
as the dense one), and each one's step time (forward, backward and optimizer, median of
``--steps``) and the bytes one layer keeps for backward per token (``bench.saved_activations``'s
count: the difference between a model of ``--layers + 1`` and one of ``--layers`` layers).
What the MoE column costs over the dense one is routing, dispatch and one matrix product per
expert instead of one for all; what siamese costs over pre is the paper's comparison (the
paper's 15B MoE: -0.5% speed, +2% activation memory; a CPU says nothing about a GPU's speed).

    python -m bench.moe_step [--schemes pre,siamese --experts 8 --topk 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import one_process, random_batch, versions_line
from bench.saved_activations import saved_bytes
from runtime.markdown import markdown_table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="pre,siamese")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512, help="the dense MLP's width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    args = p.parse_args(argv)
    if args.ffn % args.topk:
        p.error(f"--topk ({args.topk}) must divide --ffn ({args.ffn})")
    return args


def model_config(args, scheme: str, experts: int, layers: int):
    from model.config import ModelConfig

    moe = {"num_experts": experts, "moe_router_topk": args.topk,
           "moe_ffn_hidden_size": args.ffn // args.topk} if experts else {}
    return ModelConfig(residual_scheme=scheme, num_layers=layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                       vocab_size=args.vocab, seq_length=args.seq, **moe)


def measure(args, scheme: str, experts: int) -> dict:
    """Step ms, saved bytes per token and layer, and parameters of one model."""
    from model.builder import build_model, count_parameters, wrap_ddp
    from model.config import ParallelConfig
    from pretrain.config import Config, DataConfig, OptimConfig
    from pretrain.optim import build_optimizer
    from runtime.schedule import forward_backward

    batch = random_batch(args.vocab, args.batch, args.seq)
    kept = []
    for layers in (args.layers, args.layers + 1):
        [model] = build_model(model_config(args, scheme, experts, layers), ParallelConfig(),
                              seed=0)
        kept.append(saved_bytes(model, batch))
    config = Config(model=model_config(args, scheme, experts, args.layers),
                    parallel=ParallelConfig(distributed_optimizer=False),
                    optim=OptimConfig(warmup_steps=0),
                    data=DataConfig(micro_batch_size=args.batch,
                                    global_batch_size=args.batch))
    chunks = build_model(config.model, config.parallel, seed=0)
    parameters = count_parameters(chunks)
    ddp = wrap_ddp(chunks, config.parallel)
    optimizer, _ = build_optimizer(config, ddp, torch.float32)
    times = []
    for step in range(args.steps + 2):
        began = time.perf_counter()
        forward_backward(ddp, iter([batch]), 1, args.seq, args.batch)
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - began)
    return {"step_ms": 1e3 * statistics.median(times), "parameters": parameters,
            "layer_bytes": (kept[1] - kept[0]) / (args.batch * args.seq)}


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    with one_process():
        for scheme in args.schemes.split(","):
            dense, moe = measure(args, scheme, 0), measure(args, scheme, args.experts)
            rows.append((scheme, dense, moe))
    pre = next((moe for scheme, _, moe in rows if scheme == "pre"), None)
    print(versions_line())
    print(f"{args.layers} layers x {args.hidden}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}, fp32, {torch.get_num_threads()} threads; dense MLP {args.ffn}, MoE "
          f"{args.experts} experts of {args.ffn // args.topk}, top-{args.topk} (the same "
          f"active MLP); median of {args.steps} steps\n")
    table = []
    for scheme, dense, moe in rows:
        table.append([
            scheme, f"{dense['parameters']:,}", f"{moe['parameters']:,}",
            f"{dense['step_ms']:.1f}", f"{moe['step_ms']:.1f}",
            f"{moe['step_ms'] / dense['step_ms']:.2f}",
            f"{moe['step_ms'] / pre['step_ms']:.3f}" if pre else "n/a",
            f"{dense['layer_bytes']:,.0f}", f"{moe['layer_bytes']:,.0f}",
            f"{moe['layer_bytes'] / pre['layer_bytes']:.3f}" if pre else "n/a"])
    print(markdown_table(["scheme", "dense params", "MoE params", "dense step ms",
                          "MoE step ms", "MoE / dense", "MoE step / pre MoE",
                          "dense B/token/layer", "MoE B/token/layer", "MoE B / pre MoE"],
                         table, right_from=1))


if __name__ == "__main__":
    main()
