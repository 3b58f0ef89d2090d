"""What context parallelism costs: the core attention of one layer at CP=1 and CP=2 on this
machine, and its communication on paper for the 1.3B context-extension presets on 64 H100s.

1. The SDPA core attention (``model.sdpa_attention``) forward + backward on [s/cp, b, heads,
   d] bf16 queries, keys and values, causal, for each ``--seqs`` length: at CP=1 in this
   process, at CP=2 on two gloo processes (each rank its two chunks against the gathered
   keys; rank 0's time). Median ms per rank, and the bytes autograd keeps for backward per
   token of a rank's share (the CPU's materialised lower-right causal masks left out, as
   CUDA's flash attention forms none: ``bench.saved_activations``). On the CPU the gloo
   all-gather goes through memory; on GPUs it is NVLink's.
2. On paper (``pretrain.report.dry_run.context_parallel_bytes``): the bytes each rank receives
   per step in the K/V all-gathers and gradient reduce-scatters of the long-context presets
   (``configs/paper/long``) at 64 GPUs, and the time they take at an assumed per-GPU NVLink
   bandwidth (``--nvlink-gbs``; a CP group of up to 8 ranks stays inside one node) next to
   the step's model FLOPs at an assumed sustained rate (``--tflops``).

    python -m bench.context_parallel [--seqs 2048,4096,8192 --rounds 5]
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.common import on_context_ranks, one_process, time_ms, versions_line
from runtime.markdown import markdown_table

PRESETS = ("configs/paper/long/siamese-32k.toml", "configs/paper/long/siamese-64k.toml")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2, help="K/V heads (grouped-query attention)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--world", type=int, default=64, help="GPUs of the paper table")
    p.add_argument("--nvlink-gbs", type=float, default=450.0,
                   help="assumed NVLink bandwidth per GPU and direction, GB/s (H100 SXM: 900 "
                        "GB/s both ways)")
    p.add_argument("--tflops", type=float, default=400.0,
                   help="assumed sustained bf16 TFLOP/s per GPU for the step's model FLOPs")
    return p.parse_args(argv)


def attention_cost(args, seq: int) -> dict:
    """This rank's median ms of forward + backward and saved bytes per token of its share, at
    the context-parallel size the process groups have."""
    from megatron.core.transformer.enums import AttnMaskType

    from bench.saved_activations import cpu_causal_masks, saved_bytes
    from model.config import ModelConfig, ParallelConfig
    from model.megatron_config import transformer_config
    from model.sdpa_attention import SDPAttention
    from runtime import context

    cp = context.size()
    model = ModelConfig(num_layers=1, hidden_size=args.heads * args.head_dim,
                        num_attention_heads=args.heads, num_query_groups=args.groups,
                        seq_length=seq)
    config = transformer_config(model, ParallelConfig(cp=cp), torch.bfloat16)
    core = SDPAttention(config, 1, AttnMaskType.causal, "self")
    local = seq // cp
    gen = torch.Generator().manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(local, args.batch, heads, args.head_dim, generator=gen,
                           dtype=torch.bfloat16).requires_grad_()

    q, k, v = tensor(args.heads), tensor(args.groups), tensor(args.groups)

    def step() -> None:
        core(q, k, v, None).float().sum().backward()

    ms = time_ms(step, args.rounds)

    class Attention(torch.nn.Module):  # saved_bytes' model contract
        def forward(self, *_args, **_kwargs):
            return core(q, k, v, None).float().sum()

    skip = cpu_causal_masks(argparse.Namespace(cp=cp), {"tokens": torch.empty(1, local)})
    kept = saved_bytes(Attention(), {"tokens": None, "position_ids": None, "labels": None},
                       skip)
    return {"ms": ms, "bytes_per_token": kept / (args.batch * local)}


def _seqs(args) -> list[int]:
    return [int(s) for s in args.seqs.split(",")]


def _costs(args) -> dict[int, dict]:
    return {seq: attention_cost(args, seq) for seq in _seqs(args)}


def measured(args) -> dict[int, dict[int, dict]]:
    """{cp: {seq: cost}} for CP=1 (this process, one thread, as each rank has) and CP=2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_process():
            one = _costs(args)
    finally:
        torch.set_num_threads(threads)
    return {1: one, 2: on_context_ranks(2, _costs, args)}


def on_paper(args) -> list[list[str]]:
    """The communication model's rows for the long-context presets at ``args.world`` GPUs."""
    from pretrain.config import load_config
    from pretrain.report.dry_run import context_parallel_bytes
    from pretrain.report.throughput import flops_per_token

    rows = []
    for preset in PRESETS:
        config = load_config(preset)
        p, d = config.parallel, config.data
        dp = args.world // p.replica
        received = context_parallel_bytes(config, dp)
        comm_s = received / (args.nvlink_gbs * 1e9)
        tokens = d.global_batch_size * config.seq_length / args.world  # per GPU per step
        compute_s = flops_per_token(config) * tokens / (args.tflops * 1e12)
        rows.append([os.path.basename(preset), f"{config.seq_length:,}", str(p.cp), str(dp),
                     f"{received / 2**30:.2f}", f"{comm_s * 1e3:,.0f}",
                     f"{compute_s * 1e3:,.0f}", f"{comm_s / compute_s:.1%}"])
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    costs = measured(args)
    print(versions_line())
    print(f"core attention, forward + backward: bf16, {args.heads} heads of {args.head_dim}, "
          f"{args.groups} K/V heads, batch {args.batch}, causal; median of {args.rounds}, "
          "one thread per rank; bytes kept per token of a rank's share\n")
    rows = []
    for seq in _seqs(args):
        one, two = costs[1][seq], costs[2][seq]
        rows.append([f"{seq:,}", f"{one['ms']:,.1f}", f"{two['ms']:,.1f}",
                     f"{two['ms'] / one['ms']:.2f}", f"{one['bytes_per_token']:,.0f}",
                     f"{two['bytes_per_token']:,.0f}"])
    print(markdown_table(["seq", "CP=1 ms", "CP=2 ms per rank", "CP=2 / CP=1",
                          "CP=1 B/token", "CP=2 B/token"], rows))
    print(f"\non paper, {args.world} GPUs: K/V all-gathers and reduce-scatters per rank and "
          f"step at {args.nvlink_gbs:.0f} GB/s, against the step's model FLOPs at "
          f"{args.tflops:.0f} TFLOP/s (not overlapped: an upper bound on what they add)\n")
    print(markdown_table(["preset", "seq", "cp", "dp", "GiB received", "comm ms", "compute ms",
                          "comm / compute"], on_paper(args)))


if __name__ == "__main__":
    main()
