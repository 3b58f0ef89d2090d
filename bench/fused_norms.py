"""GPU benchmark of the fused SiameseNorm norm kernels against their unfused alternatives.

    python -m bench.fused_norms [--batch 2] [--hidden 2048] [--norm rmsnorm|layernorm]

Prints one table at the 1.3B shape (4096 x batch tokens, hidden 2048, bf16): for each op (a
plain norm; a sublayer's entry; the attention update fused with the MLP entry; the layer's
last update into the packed tensor; the final merge; Post-Norm's residual add and norm; the
Q/K/V head norms of the packed projection), forward and forward+backward, the time
of the Triton kernels, torch eager (the reference composition the model runs unfused),
torch.compile of that reference and, when Transformer Engine is installed, TE's norms called
one at a time. The plain norm also gets torch's own fused norm (``F.rms_norm`` /
``F.layer_norm`` on bf16 weights) and, when installed (``pip install liger-kernel``, a
benchmark-only dependency), Liger-Kernel's. Times are GPU times from
``triton.testing.do_bench`` (many launches, no synchronisation per launch), the median of
``--rounds`` medians. Bandwidth counts each activation the op must touch once: inputs read and
outputs written (for forward+backward also the output gradients read and the input gradients
written); norm weights are left out (a few KB). It is given next to a device-to-device copy
measured in the same run, the practical ceiling for ops like these.

``--backward-tiles 2048,4096,8192`` adds the Triton ops once more per value, with every
backward kernel's tile (rows x block values, ``kernels.triton_ops``) set to it: the table to
choose those constants from on a new GPU or hidden size.

Without CUDA it prints one line and exits 0, so it can sit in scripts run anywhere. Its
functions take the device, so ``bench.gpu_check`` rehearses them on the CPU at a tiny size
(Triton's interpreter, wall-clock times that mean nothing but that the code runs).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import int_list, time_ms, versions_line
from runtime.markdown import markdown_table

SEQ = 4096


@dataclass(frozen=True)
class Op:
    name: str
    inputs: float  # [tokens, hidden] activations read by the forward (a packed one counts 2)
    outputs: float  # [tokens, hidden] activations written by the forward
    norms: int

    def tensors_moved(self, backward: bool) -> float:
        """Forward: inputs + outputs. Backward adds the output gradients read and the input
        gradients written, so forward+backward moves twice as many."""
        return 2 * (self.inputs + self.outputs) if backward else self.inputs + self.outputs


OPS = [
    Op("plain norm N(x)", 1, 1, 1),
    Op("(a) entry u, Nin(u + Npre(y))", 2, 2, 3),
    Op("(a+b) update + entry", 3, 3, 3),
    Op("(b) last update -> packed", 3, 2, 0),
    Op("(c) merge Nf(Na(x) + Nb(y))", 2, 1, 3),
    Op("post-norm N(h + r)", 2, 1, 1),
    # the packed QKV projection at 32 heads / 8 K/V groups: (32 + 2 x 8) x 64 = 1.5 hidden
    Op("Q/K/V head norms", 1.5, 1.5, 3),
]
HEADS, GROUPS = 32, 8  # the 1.3B shape's attention


def op_module(op: Op, backend, config, hidden: int, device: str = "cuda"):
    """The module computing ``op`` as the model builds it with ``backend``, on ``device``
    (None for the packed update, which has no norm)."""
    from megatron.core.transformer.spec_utils import build_module

    from model.config import ModelConfig
    from model.layers.merge import StreamMergeNorm
    from model.layers.two_stream import SublayerNorms
    from model.spec import plain_norm

    # The model's norm as the spec builds it (LayerNorm without bias: the default).
    norm = plain_norm(ModelConfig(normalization=config.normalization.lower()), backend)

    def build_norm():
        return build_module(norm, config=config, hidden_size=hidden, eps=1e-5)

    if op in (OPS[0], OPS[5]):
        return build_norm().to(device)
    if op is OPS[6]:
        head_dim = hidden // HEADS
        return torch.nn.ModuleList(build_module(norm, config=config, hidden_size=head_dim,
                                                eps=1e-5) for _ in range(3)).to(device)
    if op in (OPS[1], OPS[2]):
        return SublayerNorms(build_norm, backend).to(device)
    if op is OPS[4]:
        return StreamMergeNorm(config, hidden, 1e-5, norm=norm, backend=backend).to(device)
    return None


def op_call(op: Op, backend, scale: float = 3.0) -> Callable:
    """``call(tensors, module) -> outputs`` of ``op``, as the model calls it."""
    from kernels.norms import residual_norm
    from model import streams
    from model.layers.two_stream import packed_update

    return {
        OPS[0].name: lambda t, m: [m(t[0])],
        OPS[1].name: lambda t, m: list(m.entry(*streams.unpack(t[0]))),
        OPS[2].name: lambda t, m: list(m.update_entry(*t, scale)),
        OPS[3].name: lambda t, m: [packed_update(backend)(*t, scale)],
        OPS[4].name: lambda t, m: [m(t[0])],
        OPS[5].name: lambda t, m: [residual_norm(m, t[0], t[1])],
        OPS[6].name: lambda t, m: _qkv_heads(t[0], m, backend),
    }[op.name]


def _qkv_heads(mixed: torch.Tensor, norms, backend) -> list[torch.Tensor]:
    """Q, K, V normalised per head, as QKVNormSelfAttention computes them with ``backend``:
    the fused op with triton, megatron's split and three norms otherwise."""
    from kernels.backend import NormBackend

    heads, dim = HEADS // GROUPS, mixed.shape[-1] // (HEADS // GROUPS + 2)
    if backend is NormBackend.TRITON:
        from kernels import triton_ops

        q_norm = norms[0]
        return list(triton_ops.qkv_norm(mixed, heads, dim, q_norm.eps, q_norm.is_rms, *norms))
    q, k, v = mixed.split([heads * dim, dim, dim], dim=-1)
    return [norms[0](q.reshape(*q.shape[:2], -1, dim)), norms[1](k), norms[2](v)]


def op_inputs(op: Op, tokens: int, hidden: int, dtype: torch.dtype,
              device: str = "cuda") -> list[torch.Tensor]:
    def make(width):
        return torch.randn(tokens, 1, width, device=device, dtype=dtype).requires_grad_()

    if op.name in (OPS[1].name, OPS[4].name):
        return [make(2 * hidden)]  # the packed [s, b, 2h] tensor layers exchange
    if op is OPS[6]:  # the packed QKV projection, [s, b, groups, (heads/groups + 2) dim]
        dim = hidden // HEADS
        return [make(GROUPS * (HEADS // GROUPS + 2) * dim).view(tokens, 1, GROUPS, -1)
                .detach().requires_grad_()]
    return [make(hidden) for _ in range(int(op.inputs))]


def copy_bandwidth(rounds: int, nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rounds)
    return 2 * src.numel() / ms / 1e6


def passes(call: Callable, tensors: list[torch.Tensor], module) -> dict[str, Callable]:
    """The forward alone, and forward+backward (gradients returned, not accumulated)."""
    params = list(module.parameters()) if module is not None else []

    def fwd_bwd():
        outs = call(tensors, module)
        grads = [torch.ones_like(o) for o in outs]
        return torch.autograd.grad(outs, tensors + params, grads)

    def fwd():
        with torch.no_grad():
            return call(tensors, module)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def implementations(te_available: bool) -> dict[str, tuple]:
    """name -> (norm backend the op's module is built with, torch.compile'd?)."""
    from kernels.backend import NormBackend

    impls = {"triton (fused)": (NormBackend.TRITON, False),
             "torch eager": (NormBackend.TORCH, False),
             "torch.compile": (NormBackend.TORCH, True)}
    if te_available:  # TE's norms, composed: TE has no two-stream fusion
        impls["TE norms, separate"] = (NormBackend.TE, False)
    return impls


def plain_norm_alternatives(norm: str, hidden: int, device: str = "cuda",
                            dtype: torch.dtype = torch.bfloat16
                            ) -> dict[str, Callable[[], torch.nn.Module]]:
    """Other implementations of the plain norm alone: torch's own fused norm, and
    Liger-Kernel's when it is installed (builders of modules on ``device``)."""
    rms = norm == "rmsnorm"

    def torch_norm():
        module = (torch.nn.RMSNorm(hidden, eps=1e-5) if rms
                  else torch.nn.LayerNorm(hidden, eps=1e-5, bias=False))
        return module.to(device, dtype)

    found = {"torch F.rms_norm" if rms else "torch F.layer_norm": torch_norm}
    try:
        from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm
    except ImportError:
        return found
    found["Liger-Kernel"] = lambda: (LigerRMSNorm(hidden, eps=1e-5) if rms else
                                     LigerLayerNorm(hidden, eps=1e-5)).to(device, dtype)
    return found


@contextlib.contextmanager
def backward_tile(tile: int | None):
    """Every Triton backward kernel launched with ``tile`` values per tile (None: as built)."""
    from kernels import triton_ops

    names = ("NORM_BACKWARD_TILE", "ENTRY_BACKWARD_TILE", "QKV_BACKWARD_TILE")
    saved = {n: getattr(triton_ops, n) for n in names}
    if tile is not None:
        for name in names:
            setattr(triton_ops, name, tile)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(triton_ops, name, value)


def norm_config(args, dtype: torch.dtype = torch.bfloat16):
    """The megatron config the ops' modules are built from."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
                             normalization="RMSNorm" if args.norm == "rmsnorm" else "LayerNorm",
                             params_dtype=dtype)


def measure_op(op: Op, args, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               te_available: bool = False,
               keep: Callable[[str], bool] = lambda impl: True,
               compile_backend: str = "inductor") -> list[dict]:
    """Rows of one op: every implementation ``keep`` accepts, forward and forward+backward;
    the torch.compile row with ``compile_backend``."""
    from kernels.backend import NormBackend

    config = norm_config(args, dtype)
    tokens = args.seq * args.batch
    cases = []  # (implementation, module, call, backward tile)
    for impl, (backend, compiled) in implementations(te_available).items():
        if op.norms == 0 and impl.startswith("TE"):
            continue  # no norm in this op: TE has nothing to run
        call = op_call(op, backend)
        cases.append((impl, op_module(op, backend, config, args.hidden, device),
                      torch.compile(call, backend=compile_backend) if compiled else call,
                      None))
        if backend is NormBackend.TRITON:
            cases += [(f"triton, backward tile {tile}", cases[-1][1], call, tile)
                      for tile in args.backward_tiles]
    if op is OPS[0]:
        cases += [(impl, build(), op_call(op, None), None) for impl, build in
                  plain_norm_alternatives(args.norm, args.hidden, device, dtype).items()]
    results = []
    for impl, module, call, tile in (case for case in cases if keep(case[0])):
        tensors = op_inputs(op, tokens, args.hidden, dtype, device)
        for pass_name, fn in passes(call, tensors, module).items():
            if tile is not None and pass_name == "fwd":
                continue  # the tile is the backward's
            row = {"op": op.name, "impl": impl, "pass": pass_name, "ms": None,
                   "bytes": op.tensors_moved(pass_name != "fwd") * tokens * args.hidden
                   * dtype.itemsize}
            try:
                with backward_tile(tile):
                    row["ms"] = time_ms(fn, args.rounds)
            except Exception as err:  # e.g. torch.compile unavailable: report, go on
                row["error"] = type(err).__name__
            results.append(row)
    return results


def measure(args) -> tuple[list[dict], float]:
    from kernels.backend import NormBackend, unavailable_reason

    te_available = unavailable_reason(NormBackend.TE) is None
    copy_gbs = copy_bandwidth(args.rounds)
    results = [row for op in OPS for row in measure_op(op, args, te_available=te_available)]
    return results, copy_gbs


def table_rows(results: list[dict], copy_gbs: float) -> list[list[str]]:
    """One row per (op, pass, implementation): time, bandwidth, fraction of copy bandwidth,
    and the time relative to torch eager for the same op and pass."""
    eager = {(r["op"], r["pass"]): r["ms"] for r in results if r["impl"] == "torch eager"}
    rows = []
    for r in results:
        if r["ms"] is None:
            rows.append([r["op"], r["pass"], r["impl"], f"failed ({r.get('error', '?')})",
                         "", "", ""])
            continue
        gbs = r["bytes"] / r["ms"] / 1e6
        base = eager.get((r["op"], r["pass"]))
        speedup = f"{base / r['ms']:.2f}x" if base else ""
        rows.append([r["op"], r["pass"], r["impl"], f"{r['ms']:.3f}", f"{gbs:,.0f}",
                     f"{gbs / copy_gbs:.2f}", speedup])
    return rows


def report(results: list[dict], copy_gbs: float, header: str) -> str:
    columns = ["op", "pass", "implementation", "ms", "GB/s", "/ copy BW", "speed-up vs eager"]
    return header + "\n\n" + markdown_table(columns, table_rows(results, copy_gbs),
                                            right_from=3)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="sequences of 4096 tokens")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--norm", choices=["rmsnorm", "layernorm"], default="rmsnorm")
    parser.add_argument("--rounds", type=int, default=3,
                        help="do_bench medians to take the median of")
    parser.add_argument("--backward-tiles", type=int_list, default=[],
                        help="comma-separated backward tiles (values) to time the Triton ops at")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.fused_norms: needs a CUDA GPU (none found here); nothing measured")
        return 0
    results, copy_gbs = measure(args)
    header = (f"{torch.cuda.get_device_name()}; {versions_line()}; "
              f"{args.seq * args.batch} tokens x {args.hidden}, bf16, {args.norm}; device copy "
              f"{copy_gbs:,.0f} GB/s; GPU time by triton.testing.do_bench, median of "
              f"{args.rounds} rounds")
    print(report(results, copy_gbs, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
