"""Bytes each residual scheme keeps for backward per token and layer, counted tensor by tensor,
next to the dry run's estimate of them and as a ratio to pre.

Autograd's saved tensors are counted with ``torch.autograd.graph.saved_tensors_hooks`` during
one forward: every distinct storage once (a view keeps its whole storage alive), parameters
left out. A layer's share is the difference between a model with ``--layers + 1`` layers and
one with ``--layers``, so embedding, output layer and loss cancel; its share per token is
its growth from half of ``--seq`` to all of it, so what a layer keeps once whatever the
tokens (mHC's fp32 gate vectors) is apart (``once``) and the count per token is exact. This
is the part of
activation memory the code decides (what each kernel and module keeps), independent of the
allocator, and it runs the same computation on a CPU (Triton's interpreter, torch's fused CPU
attention) as on a GPU, so the memory targets of the residual schemes can be checked anywhere;
the GPU's peak memory (``bench.gpu_step``) adds backward's short-lived buffers on top.

    python -m bench.saved_activations [--hidden 256 --heads 4 --seq 128 --dtype bf16]
                                      [--normalization dyt]
"""

from __future__ import annotations

import argparse
import os
import weakref

import torch

if not torch.cuda.is_available():  # the Triton norms run in the interpreter; Triton reads
    os.environ.setdefault("TRITON_INTERPRET", "1")  # this when a kernel module is imported

from bench.common import (  # noqa: E402
    on_context_ranks,
    one_process,
    random_batch,
    versions_line,
)
from runtime.markdown import markdown_table  # noqa: E402

SCHEMES = ("pre", "post", "hybridnorm", "siamese", "siamese_hybrid")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--layers", type=int, default=1, help="the smaller model's layers")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: this many gloo processes share each sequence "
                        "(parallel.cp); bytes per token of a rank's share")
    p.add_argument("--norm-backend", default="triton")
    p.add_argument("--normalization", default="rmsnorm",
                   help="model.normalization (kernels.normalizations): what every norm is")
    p.add_argument("--experts", type=int, default=0,
                   help="mixture of experts in every block: routed experts (model.num_experts)")
    p.add_argument("--topk", type=int, default=2, help="with --experts: model.moe_router_topk")
    p.add_argument("--expert-ffn", type=int, default=None,
                   help="with --experts: each expert's width (model.moe_ffn_hidden_size)")
    p.add_argument("--shared-ffn", type=int, default=None,
                   help="with --experts: the shared expert's width "
                        "(model.moe_shared_expert_intermediate_size)")
    return p.parse_args(argv)


def saved_bytes(model, batch, skip=None) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward of ``model``
    (parameters excluded; ``skip``: a tensor's predicate for leaving it out too). A tensor
    saved by a part of the graph that forward then drops (a branch no output depends on) is
    freed, and its address can be reused by a later one, so storages are told apart only
    among the tensors still held when forward ends."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if skip is None or not skip(t):
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                     labels=batch["labels"])
    kept = {s.data_ptr(): s.nbytes() for s in (ref().untyped_storage() for ref in saved
                                               if ref() is not None)}
    del loss
    return sum(n for ptr, n in kept.items() if ptr not in params)


def experts(args) -> dict:
    """The model's mixture-of-experts fields from ``--experts`` and its companions."""
    if not args.experts:
        return {}
    return {"num_experts": args.experts, "moe_router_topk": args.topk,
            "moe_ffn_hidden_size": args.expert_ffn,
            "moe_shared_expert_intermediate_size": args.shared_ffn}


def layer_bytes(args, scheme: str, overrides: dict | None = None) -> dict:
    """Bytes one layer of ``scheme`` keeps: per token, measured and estimated, and measured
    once whatever the tokens. ``overrides``: more model fields (a router's variants). Under
    context parallelism (``--cp``, inside its process groups) per token of this rank's
    share of the sequence."""
    from model.builder import build_model
    from model.config import ModelConfig, ParallelConfig
    from pretrain.report.dry_run import Fusions, estimated_layer_bytes
    from runtime import context, device

    dtype = DTYPES[args.dtype]
    lengths = (args.seq // 2, args.seq)
    batches = [context.split_batch(random_batch(args.vocab, args.batch, s,
                                                device.compute_device())) for s in lengths]
    kept = []  # [layers][length]
    for layers in (args.layers, args.layers + 1):
        config = ModelConfig(residual_scheme=scheme, num_layers=layers, hidden_size=args.hidden,
                             num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                             vocab_size=args.vocab, seq_length=args.seq,
                             **{"normalization": args.normalization, **experts(args),
                                **(overrides or {})})
        [model] = build_model(config, ParallelConfig(cp=args.cp), dtype, args.norm_backend,
                              seed=0)
        kept.append([saved_bytes(model, batch, cpu_causal_masks(args, batch))
                     for batch in batches])
    short, full = (more - fewer for fewer, more in zip(*kept, strict=True))
    local = [length // args.cp for length in lengths]
    per_token = (full - short) / (args.batch * (local[1] - local[0]))
    tc = model.config
    fusions = Fusions(activation=tc.bias_activation_fusion,
                      cross_entropy=tc.cross_entropy_loss_fusion, rope=tc.apply_rope_fusion)
    return {"scheme": scheme, "measured": per_token,
            "once": full - per_token * args.batch * local[1],
            "estimated": estimated_layer_bytes(config, dtype.itemsize, fusions, args.batch,
                                               cp=args.cp)}


def cpu_causal_masks(args, batch):
    """Under context parallelism on the CPU, what to leave out of the count: the lower-right
    causal masks [chunk, k chunk] (k >= 2) of a rank's later chunks against the keys before
    them, which the CPU's attention kernel materialises and CUDA's flash attention does not
    form (its causal rule is lower-right), so the count is the GPU's, as the estimate."""
    if args.cp == 1 or torch.cuda.is_available():
        return None
    chunk = batch["tokens"].shape[1] // 2

    def causal_mask(t: torch.Tensor) -> bool:
        return t.dim() == 2 and t.shape[0] == chunk and t.shape[1] % chunk == 0 \
            and t.shape[1] > chunk
    return causal_mask


def _layers_bytes(args, schemes: list[str]) -> list[dict]:
    return [layer_bytes(args, s) for s in schemes]


def count(args, schemes: list[str]) -> list[dict]:
    """Each scheme's :func:`layer_bytes` in this process, or on ``args.cp`` gloo processes
    (rank 0's share: every rank holds as much)."""
    if args.cp == 1:
        with one_process():
            return _layers_bytes(args, schemes)
    return on_context_ranks(args.cp, _layers_bytes, args, schemes)


def main(argv=None) -> None:
    args = parse_args(argv)
    results = count(args, args.schemes.split(","))
    base = next((r for r in results if r["scheme"] == "pre"), results[0])
    h = args.hidden
    print(versions_line())
    shape = [f"{args.hidden} hidden, {args.heads} heads, MLP {args.ffn}, seq {args.seq}",
             f"batch {args.batch}, {args.dtype}",
             f"{args.normalization} norms ({args.norm_backend} backend)"]
    if args.experts:
        shape.append(f"MoE in every block: {args.experts} experts of "
                     f"{args.expert_ffn or args.ffn}, top-{args.topk}, shared expert "
                     f"{args.shared_ffn or 'none'}")
    if args.cp > 1:
        shape.append(f"context parallelism {args.cp}: bytes per token of a rank's share")
    print(f"shape: {', '.join(shape)}; bytes per token and layer kept for backward (h = "
          "hidden size in values of the dtype); the last column is what a layer keeps once, "
          "whatever the tokens\n")
    width = DTYPES[args.dtype].itemsize
    rows = [[r["scheme"], f"{r['measured']:,.0f}", f"{r['measured'] / (width * h):.2f} h",
             f"{r['estimated']:,.0f}", f"{r['measured'] / base['measured']:.3f}",
             f"{r['once']:,.0f}"] for r in results]
    print(markdown_table(["scheme", "measured B", "measured", "dry-run estimate B",
                          "layer / pre", "once per layer B"], rows))


if __name__ == "__main__":
    main()
