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

from bench.common import one_process, random_batch, versions_line  # noqa: E402
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


def saved_bytes(model, batch) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward of ``model``
    (parameters excluded). A tensor saved by a part of the graph that forward then drops (a
    branch no output depends on) is freed, and its address can be reused by a later one, so
    storages are told apart only among the tensors still held when forward ends."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
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
    once whatever the tokens. ``overrides``: more model fields (a router's variants)."""
    from model.builder import build_model
    from model.config import ModelConfig, ParallelConfig
    from pretrain.report.dry_run import Fusions, estimated_layer_bytes
    from runtime import device

    dtype = DTYPES[args.dtype]
    lengths = (args.seq // 2, args.seq)
    batches = [random_batch(args.vocab, args.batch, s, device.compute_device()) for s in lengths]
    kept = []  # [layers][length]
    for layers in (args.layers, args.layers + 1):
        config = ModelConfig(residual_scheme=scheme, num_layers=layers, hidden_size=args.hidden,
                             num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                             vocab_size=args.vocab, seq_length=args.seq,
                             **{"normalization": args.normalization, **experts(args),
                                **(overrides or {})})
        [model] = build_model(config, ParallelConfig(), dtype, args.norm_backend, seed=0)
        kept.append([saved_bytes(model, batch) for batch in batches])
    short, full = (more - fewer for fewer, more in zip(*kept, strict=True))
    per_token = (full - short) / (args.batch * (lengths[1] - lengths[0]))
    tc = model.config
    fusions = Fusions(activation=tc.bias_activation_fusion,
                      cross_entropy=tc.cross_entropy_loss_fusion, rope=tc.apply_rope_fusion)
    return {"scheme": scheme, "measured": per_token,
            "once": full - per_token * args.batch * args.seq,
            "estimated": estimated_layer_bytes(config, dtype.itemsize, fusions, args.batch)}


def main(argv=None) -> None:
    args = parse_args(argv)
    with one_process():
        results = [layer_bytes(args, s) for s in args.schemes.split(",")]
    base = next((r for r in results if r["scheme"] == "pre"), results[0])
    h = args.hidden
    print(versions_line())
    print(f"shape: {args.hidden} hidden, {args.heads} heads, MLP {args.ffn}, seq {args.seq}, "
          f"batch {args.batch}, {args.dtype}, {args.normalization} norms "
          f"({args.norm_backend} backend)"
          + (f", MoE in every block: {args.experts} experts of {args.expert_ffn or args.ffn}, "
             f"top-{args.topk}, shared expert {args.shared_ffn or 'none'}" if args.experts else "")
          + "; bytes per token and "
          "layer kept for backward (h = hidden size in values of the dtype); the last column "
          "is what a layer keeps once, whatever the tokens\n")
    width = DTYPES[args.dtype].itemsize
    rows = [[r["scheme"], f"{r['measured']:,.0f}", f"{r['measured'] / (width * h):.2f} h",
             f"{r['estimated']:,.0f}", f"{r['measured'] / base['measured']:.3f}",
             f"{r['once']:,.0f}"] for r in results]
    print(markdown_table(["scheme", "measured B", "measured", "dry-run estimate B",
                          "layer / pre", "once per layer B"], rows))


if __name__ == "__main__":
    main()
