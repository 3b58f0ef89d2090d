"""Every Triton kernel launch the fused ops make, recorded without running it and compiled
for a GPU this machine may not have.

The ops in ``kernels.triton_ops`` run forward and backward on small CPU tensors while each
kernel is replaced by a recorder, so nothing launches; a recorded launch (argument dtypes,
constexprs, num_warps) is then compiled by Triton's real compiler down to a cubin for
``sm_ARCH`` (ptxas ships with Triton; no driver or device is needed). The launches depend on
the hidden size (BLOCK, ROWS and num_warps follow from it), the dtype and the norm, never on
the row count, so two-row tensors give every launch a model of that width makes. Must run
without TRITON_INTERPRET (the interpreter has no compiler).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_kernels, triton_ops
from model import streams

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
KERNELS = ("norm_fwd", "norm_bwd", "entry_fwd", "entry_bwd", "dual_update_fwd",
           "dual_update_bwd", "qkv_norm_fwd", "qkv_norm_bwd")


class Case(NamedTuple):
    """One model's kind of launch: its dtype, its norm (RMSNorm, or LayerNorm with or without
    bias) and its hidden size."""

    dtype: torch.dtype
    is_rms: bool
    has_bias: bool
    hidden: int

    @property
    def norm(self) -> str:
        return "rmsnorm" if self.is_rms else "layernorm+bias" if self.has_bias else "layernorm"


NORMS = ((True, False), (False, True), (False, False))
# The 1.3B model's width (one row per forward tile) in both dtypes and every norm, and a small
# model's (several rows per tile, forward and backward).
DEFAULT_CASES = [*(Case(dtype, rms, bias, 2048) for dtype in (torch.bfloat16, torch.float32)
                   for rms, bias in NORMS),
                 *(Case(torch.bfloat16, rms, bias, 256) for rms, bias in NORMS[:2])]


class _Recorder:
    """Stands in for one @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` calls
    ``on_launch(name, args, kwargs)`` instead of launching it."""

    def __init__(self, name: str, on_launch: Callable[[str, tuple, dict], None]):
        self.name, self.on_launch = name, on_launch

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.on_launch(self.name, args, kwargs)


@contextlib.contextmanager
def kernels_replaced(on_launch: Callable[[str, tuple, dict], None]) -> Iterator[None]:
    """Inside, every kernel of :data:`KERNELS` is a recorder: a launch calls
    ``on_launch(kernel name, positional args, constexprs and num_warps)`` and computes
    nothing, so the ops run on tensors of any size (or fake ones) without a GPU."""
    originals = {n: getattr(triton_kernels, n) for n in KERNELS}
    for name in KERNELS:
        setattr(triton_kernels, name, _Recorder(name, on_launch))
    try:
        yield
    finally:
        for name, kernel in originals.items():
            setattr(triton_kernels, name, kernel)


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record_launches(cases: list[Case] | None = None) -> list:
    """Run each fused op, forward and backward, as the model calls it, for each of ``cases``
    (default :data:`DEFAULT_CASES`), and return the kernel launches they make as
    (kernel, args, constexprs and num_warps, case)."""
    launches: list = []
    with kernels_replaced(lambda *launch: launches.append(launch)):
        for case in cases or DEFAULT_CASES:
            start = len(launches)
            _run_ops(case.dtype, case.is_rms, case.has_bias, case.hidden)
            launches[start:] = [(*launch, case) for launch in launches[start:]]
    return launches


def _run_ops(dtype: torch.dtype, is_rms: bool, has_bias: bool, hidden: int) -> None:
    def t(*shape):
        return torch.ones(*shape, dtype=dtype, requires_grad=True)

    x, y, r, packed = t(2, hidden), t(2, hidden), t(2, hidden), t(2, 2 * hidden)
    w = [t(hidden) for _ in range(3)]
    b = [t(hidden) for _ in range(3)] if has_bias else [None] * 3
    params = [w[0], b[0], w[1], b[1], w[2], b[2]]
    entry, Entry, eps = triton_ops.EntryFunction.apply, triton_ops.Entry, 1e-5
    outputs = [
        triton_ops.norm(x, w[0], b[0], eps, is_rms),
        triton_ops.add_norm(x, r, 2.5, w[0], b[0], eps, is_rms),  # Post-Norm, DeepNorm
        # siamese entry from the packed input and block 0's (each with and without the input
        # norm), update+entry, the attention entry storing no u and the MLP entry computing
        # it, siamese_hybrid's gated entry (packed, block 0) and the merge
        *entry(Entry(eps, is_rms, pass_y=True), streams.unpack, packed, None, None, None, None,
               *params),
        *entry(Entry(eps, is_rms, pass_y=True), streams.unpack, packed, None, None, None, None,
               *params[:4], None, None),
        *entry(Entry(eps, is_rms), None, None, x, y, None, None, *params),
        *entry(Entry(eps, is_rms), None, None, x, y, None, None, *params[:4], None, None),
        *entry(Entry(eps, is_rms), None, None, x, y, r, 3.0, *params),
        *entry(Entry(eps, is_rms, store_a=False, pass_x=True, pass_y=True), streams.unpack,
               packed, None, None, None, None, *params),
        *entry(Entry(eps, is_rms, u_from_x=True), None, None, x, y, r, 3.0, *params,
               w[2], b[2]),
        *entry(Entry(eps, is_rms, store_a=False, gate=True, pass_x=True, pass_y=True),
               streams.unpack, packed, None, None, None, None, w[0], None, *params[2:4], None,
               None),
        *entry(Entry(eps, is_rms, store_a=False, gate=True), None, None, x, y, None, None,
               w[0], None, *params[2:4], None, None),
        entry(Entry(eps, is_rms, store_a=False), streams.unpack, packed, None, None, None, None,
              *params)[3],
    ]
    # QKV-norm attention at the 1.3B shape: 32 heads / 8 K/V groups, head_dim 64
    mixed = t(2, 1, 8, (4 + 2) * 64)
    head_norms = [torch.nn.Module() for _ in range(3)]
    for i, n in enumerate(head_norms):
        n.weight, n.bias = t(64), b[i] if b[i] is None else t(64)
    outputs += triton_ops.qkv_norm(mixed, 4, 64, eps, is_rms, *head_norms)
    if is_rms:  # the dual update has no norm
        outputs.append(triton_ops.dual_update(x, y, r, 3.0, streams.empty(x), streams.unpack))
    torch.autograd.backward([o for o in outputs if o is not None],
                            [torch.ones_like(o) for o in outputs if o is not None])


def _divisibility(args: tuple) -> dict:
    """The alignment hints Triton's JIT gives a launch: 16-byte aligned pointers (torch's
    allocations and the packed halves at hidden sizes that are multiples of 8) and integers
    that are multiples of 16. Without them the compiler cannot prove that a row's values are
    contiguous and aligned, and emits scalar loads where the GPU run vectorises."""
    return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args)
            if isinstance(a, torch.Tensor)
            or (isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0)}


def compile_launch(name: str, args: tuple, kwargs: dict, arch: int):
    kernel = getattr(triton_kernels, name)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    names = kernel.arg_names
    if set(names[len(args):]) != set(kwargs):
        raise TypeError(f"{name}: constexprs {sorted(kwargs)} != {names[len(args):]}")
    signature = {n: arg_type(v) for n, v in zip(names[:len(args)], args, strict=True)}
    signature.update(dict.fromkeys(names[len(args):], "constexpr"))
    source = ASTSource(kernel, signature, constexprs=dict(kwargs), attrs=_divisibility(args))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
