"""Bytes one transformer layer moves outside the matmuls, forward and backward, for each residual
scheme, by op and by source line, with the difference to pre in passes over [tokens, hidden].

    python -m bench.traffic [--preset configs/paper/1.3b/pre-lr1e-3.toml] [--backend torch,triton]
        [--schemes pre,post,hybridnorm,siamese,siamese_hybrid] [--tokens 4x4096] [--top 12]

How it counts. The model is built on the meta device and its parameters replaced by fake
tensors (``FakeTensorMode``: shapes, dtypes and strides, no storage, no arithmetic), so the
preset's full shape runs on any CPU in about a second per model. One forward and backward of
the loss runs under a ``TorchDispatchMode`` that sees every aten op and counts the bytes of
its tensor inputs (read) and outputs (written), each tensor as the memory it spans (an expanded
dimension counts once); views (view, reshape as a view, expand, as_strided, permute, detach,
alias...) and allocations count 0; an in-place op reads its inputs and writes its result;
``copy_`` reads its source only. The matmuls (mm, bmm, addmm, baddbmm and SDPA's attention
kernels, forward and backward) are left out: their traffic is "inside the matmuls". The fused
Triton norm kernels never run: ``bench.triton_launches.kernels_replaced`` turns each launch into
a call to the counter, which counts the tensor arguments the kernel loads (read) and stores
(written) under that launch's constexprs (``bench.traffic_count.KERNEL_ROLES``; a pointer passed
only as a placeholder for an absent input counts nothing), and backward launches get the grid
an H100 would (``--sms`` SMs, each kernel's residency compiled and measured by
``bench.kernel_resources``), so the fp32 weight-gradient partials have their GPU size. Torch
ops around the kernels (partial sums, casts) are counted by the dispatch mode.

One layer is the difference between a model of ``--layers + 1`` layers and one of ``--layers``
(default 2 and 3): embedding, output layer, loss and the final norm or merge cancel, and the
layer counted is a middle one (not block 0, which starts SiameseNorm's streams). Each count is
attributed to the innermost source line under model/, kernels/ or megatron/ that issued it
(backward ops autograd runs in C++: the forward line whose backward they are, from anomaly
mode's record of it; autograd's sum of two gradients of one tensor: the line of the op whose
gradient it adds) and to the line of model/ that called it ("via"). A pass is one bf16
[tokens, hidden] tensor read or written (64 MiB at 4 x 4096 tokens, hidden 2048).

What it is not: a GPU's traffic through caches. It counts what each op reads and writes in
full, as eager torch issues the ops: megatron's fusions (SwiGLU, bias-dropout-add, RoPE) are
off, as on a CPU, so pre's absolute figure counts their unfused ops; the schemes' differences
come from their own norms and updates. Attention uses SDPA with native GQA, as on a GPU in
bf16 (no copies of K and V). Outside the matmuls and attention scores the bytes are linear in
tokens, plus parameter-sized terms (norm weights read, their gradients summed; h values each)
and, once a backward launch has more rows than 16 per program, its fixed number of fp32
partials; since fake tensors cost nothing, the preset's own shape is counted, never scaled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

if not torch.cuda.is_available():  # the triton backend needs the interpreter to be chosen on
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU; no kernel runs here either way

from bench.common import one_process, versions_line  # noqa: E402
from bench.traffic_count import TrafficMode  # noqa: E402
from runtime.markdown import markdown_table  # noqa: E402

SCHEMES = ("pre", "post", "hybridnorm", "siamese", "siamese_hybrid")
DETAIL = ("siamese", "siamese_hybrid")
PRESET = "configs/paper/1.3b/pre-lr1e-3.toml"
MIB = 2**20


def _fake_parameters(model: torch.nn.Module, device: torch.device) -> None:
    """Replace a meta-device model's parameters and buffers by fake tensors (the fake mode is
    active) of the same shapes, keeping each parameter's megatron attributes."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fake = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                      requires_grad=param.requires_grad)
            fake.__dict__.update(param.__dict__)
            setattr(module, name, fake)
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buf.shape, dtype=buf.dtype, device=device))


def gpu_grid(model_config, sms: int) -> Callable[[str, int, dict], int]:
    """The backward grid a GPU of ``sms`` SMs (sm_90) launches for each kernel of a model of
    this width, dtype bf16 and norm: each launch's programs per SM measured by
    ``bench.kernel_resources`` (compiled in a process without the interpreter), then the
    ops' one-wave rule (``kernels.occupancy.backward_programs``)."""
    from kernels.occupancy import backward_programs

    is_rms = model_config.normalization.lower() == "rmsnorm"
    norm = "rmsnorm" if is_rms else "layernorm+bias" if model_config.norm_bias else "layernorm"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "bench.kernel_resources", "--hidden",
         str(model_config.hidden_size), "--dtype", "bf16", "--norm", norm, "--json"],
        env=env, capture_output=True, text=True, check=True)
    resident = {(r["kernel"], r["num_warps"], tuple(sorted(r["constexprs"].items()))):
                r["programs_per_sm"] for r in json.loads(done.stdout.strip().splitlines()[-1])}

    def grid(kernel: str, n_rows: int, constexprs: dict) -> int:
        flags = {k: v for k, v in constexprs.items() if k not in ("num_warps", "num_stages")}
        key = (kernel, constexprs["num_warps"], tuple(sorted(flags.items())))
        if key not in resident:
            raise KeyError(f"{kernel} {flags}: a launch bench.triton_launches does not make")
        return backward_programs(n_rows, sms, resident[key])

    return grid


def count_model(model_config, backend: str, batch: int, seq: int, dtype: torch.dtype,
                grid: Callable | None) -> TrafficMode:
    """One forward and backward of the loss of ``model_config`` at batch x seq tokens, counted
    (see the module docstring). Needs megatron's parallel state (one rank)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.builder import build_model
    from model.config import ParallelConfig
    from model.sdpa_attention import SDPAttention
    from runtime import device as devices

    with torch.device("meta"):
        [model] = build_model(model_config, ParallelConfig(), dtype, backend, seed=0)
    mode, fake = TrafficMode(grid), FakeTensorMode(allow_non_fake_inputs=True)
    where = devices.compute_device()
    native_gqa, SDPAttention.native_gqa = SDPAttention.native_gqa, True
    try:
        with fake, warnings.catch_warnings(), mode.counting_kernels():
            warnings.simplefilter("ignore")  # anomaly mode announces itself
            _fake_parameters(model, where)
            tokens = torch.zeros(batch, seq, dtype=torch.long, device=where)
            positions = torch.arange(seq, device=where).unsqueeze(0).expand(batch, -1)
            with mode, torch.autograd.detect_anomaly(check_nan=False):
                loss = model(tokens, positions, None, labels=tokens)
                mode.phase = "backward"
                loss.sum().backward()
    finally:
        SDPAttention.native_gqa = native_gqa
    return mode


def layer_traffic(model_config, backend: str, batch: int, seq: int,
                  dtype: torch.dtype = torch.bfloat16, layers: int = 2,
                  grid: Callable | None = None) -> dict[tuple, int]:
    """Bytes one layer of ``model_config`` moves outside the matmuls, per (phase, op, line,
    via): a model of ``layers + 1`` layers minus one of ``layers``; backward partials at
    ``grid``'s size (:func:`gpu_grid`), else at this machine's."""
    counted = [count_model(dataclasses.replace(model_config, num_layers=n), backend, batch, seq,
                           dtype, grid).totals() for n in (layers, layers + 1)]
    diff = {k: counted[1].get(k, 0) - counted[0].get(k, 0) for k in counted[0] | counted[1]}
    return {k: v for k, v in diff.items() if v}


def by(traffic: dict[tuple, int], *fields: int) -> dict[tuple, list[int]]:
    """[forward, backward] bytes grouped by the key fields given (1 op, 2 line, 3 via)."""
    out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for key, value in traffic.items():
        out[tuple(key[f] for f in fields)][key[0] == "backward"] += value
    return out


def phase_totals(traffic: dict[tuple, int]) -> tuple[int, int]:
    fwd, bwd = by(traffic)[()] if traffic else (0, 0)
    return fwd, bwd


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=PRESET, help="config whose model shape and micro-batch "
                   "are used (its residual scheme is replaced by each of --schemes)")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--backend", default="torch,triton", help="norm backends, comma-separated")
    p.add_argument("--tokens", default=None, metavar="BxS",
                   help="micro-batch x sequence (default: the preset's)")
    p.add_argument("--top", type=int, default=12, help="rows of the per-op and per-line tables")
    p.add_argument("--detail", default=",".join(DETAIL),
                   help="schemes whose ops and lines are listed")
    p.add_argument("--layers", type=int, default=2, help="the smaller model's layers")
    p.add_argument("--sms", type=int, default=132,
                   help="SMs the backward grids are sized for (0: this machine's grid, no "
                        "compile)")
    return p.parse_args(argv)


def _shape(args, config) -> tuple[int, int]:
    if args.tokens is None:
        return config.data.micro_batch_size, config.seq_length
    batch, _, seq = args.tokens.partition("x")
    return int(batch), int(seq)


def _mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def scheme_table(results: dict[str, dict], pass_bytes: int) -> str:
    base = phase_totals(results["pre"]) if "pre" in results else None
    rows = []
    for scheme, traffic in results.items():
        fwd, bwd = phase_totals(traffic)
        diff = "" if base is None else f"{(fwd + bwd - sum(base)) / pass_bytes:+.1f}"
        rows.append([scheme, _mib(fwd), _mib(bwd), _mib(fwd + bwd),
                     f"{(fwd + bwd) / pass_bytes:,.1f}", diff])
    return markdown_table(["scheme", "forward MiB", "backward MiB", "total MiB", "passes",
                           "vs pre (passes)"], rows)


def _top(groups: dict[tuple, list[int]], top: int) -> Iterable[tuple[tuple, list[int]]]:
    return sorted(groups.items(), key=lambda kv: (-abs(sum(kv[1])), kv[0]))[:top]


def op_table(traffic: dict[tuple, int], pre: dict[tuple, int] | None, top: int,
             pass_bytes: int) -> str:
    ops, base = by(traffic, 1), by(pre or {}, 1)
    rows = [[op, _mib(f), _mib(b), f"{(f + b) / pass_bytes:.1f}",
             f"{(f + b - sum(base.get((op,), [0, 0]))) / pass_bytes:+.1f}"]
            for (op,), (f, b) in _top(ops, top)]
    return markdown_table(["op", "forward MiB", "backward MiB", "passes", "vs pre (passes)"],
                          rows)


def line_table(traffic: dict[tuple, int], pre: dict[tuple, int] | None, top: int,
               pass_bytes: int) -> str:
    """The lines whose bytes differ most from pre's same line (a line pre never runs counts
    in full), largest first, then the rest: the difference column sums to the layer's."""
    lines, base = by(traffic, 2), by(pre or {}, 2)
    vias: dict[str, set[str]] = defaultdict(set)
    for _, _, line, via in traffic:
        if via and via != line:
            vias[line].add(via)

    def diff(line: str) -> int:
        return sum(lines.get((line,), [0, 0])) - sum(base.get((line,), [0, 0]))

    ranked = sorted({k[0] for k in lines} | {k[0] for k in base},
                    key=lambda ln: (-diff(ln), -sum(lines.get((ln,), [0, 0])), ln))
    rows = [[f"`{line}`", "; ".join(f"`{v}`" for v in sorted(vias[line])),
             *(_mib(v) for v in lines.get((line,), [0, 0])),
             f"{sum(lines.get((line,), [0, 0])) / pass_bytes:.1f}",
             f"{diff(line) / pass_bytes:+.1f}"] for line in ranked[:top]]
    rest = ranked[top:]
    if rest:
        f, b = (sum(lines.get((ln,), [0, 0])[i] for ln in rest) for i in (0, 1))
        rows.append([f"{len(rest)} other lines", "", _mib(f), _mib(b),
                     f"{(f + b) / pass_bytes:.1f}",
                     f"{sum(diff(ln) for ln in rest) / pass_bytes:+.1f}"])
    return markdown_table(["source line", "via", "forward MiB", "backward MiB", "passes",
                           "vs pre (passes)"], rows, right_from=2)


def run(args, print_fn: Callable[[str], None] = print) -> dict[str, dict[str, dict]]:
    from pretrain.config import load_config

    config = load_config(args.preset, training=False)
    batch, seq = _shape(args, config)
    model = dataclasses.replace(config.model, attention_backend="sdpa",
                                transformer_impl="local", megatron_fusions="off")
    pass_bytes = batch * seq * model.hidden_size * 2
    schemes = args.schemes.split(",")
    print_fn(versions_line())
    print_fn(f"preset {args.preset}: hidden {model.hidden_size}, {model.num_attention_heads} "
             f"heads / {model.num_query_groups} K/V groups, MLP {model.ffn_hidden_size} "
             f"({model.activation}), {model.normalization}, {batch} x {seq} tokens, bf16; one "
             f"layer = {args.layers + 1} layers minus {args.layers}; 1 pass = "
             f"{pass_bytes / MIB:,.0f} MiB")
    out = {}
    grid = gpu_grid(model, args.sms) if args.sms and "triton" in args.backend else None
    for backend in args.backend.split(","):
        results = {s: layer_traffic(dataclasses.replace(model, residual_scheme=s), backend,
                                    batch, seq, layers=args.layers, grid=grid)
                   for s in schemes}
        out[backend] = results
        print_fn(f"\nnorms: {backend}\n")
        print_fn(scheme_table(results, pass_bytes))
        for scheme in [s for s in args.detail.split(",") if s in results]:
            print_fn(f"\n{scheme}, {backend}: by op\n")
            print_fn(op_table(results[scheme], results.get("pre"), args.top, pass_bytes))
            print_fn(f"\n{scheme}, {backend}: by source line, most bytes over pre's first "
                     "(backward: the forward line whose backward autograd runs, or the "
                     "backward function's own line)\n")
            print_fn(line_table(results[scheme], results.get("pre"), args.top, pass_bytes))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    with one_process():
        run(args)


if __name__ == "__main__":
    main()
