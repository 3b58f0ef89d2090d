"""The fused Triton norm as a registered operator (``torch.library``), for compiled blocks.

Dynamo cannot see into an autograd Function whose forward launches a Triton kernel sized by
Python (launch arguments, the backward's occupancy-derived grid, weight-gradient partials):
it would try to trace that Python and break the graph. Registered as custom ops, with fake
implementations that give only shapes and dtypes, and their backward registered as a second
op, the norm enters a compiled block's graph as one opaque call each way: inductor fuses
around it, never into it. :func:`norm` and :func:`add_norm`, which the Triton-backed
``Norm`` modules bind, take the op inside a compiled region and ``triton_ops.NormFunction``
outside it; both compute with ``triton_ops.norm_forward`` / ``norm_backward``, so the two
paths run the same launches.

Absent tensors in the backward's results (no residual, no bias) come back as empty tensors,
since an operator returns tensors only; the autograd formula turns them into None.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import triton_ops


@torch.library.custom_op("siamesenorm::norm", mutates_args=())
def _norm(x: Tensor, residual: Tensor | None, alpha: float, weight: Tensor,
          bias: Tensor | None, eps: float, is_rms: bool) -> tuple[Tensor, Tensor]:
    return triton_ops.norm_forward(x, residual, alpha, weight, bias, eps, is_rms,
                                   zero_stats=True)


@_norm.register_fake
def _(x, residual, alpha, weight, bias, eps, is_rms):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((rows, 2), dtype=torch.float32)


@torch.library.custom_op("siamesenorm::norm_backward", mutates_args=())
def _norm_backward(grad: Tensor, x: Tensor, residual: Tensor | None, alpha: float,
                   weight: Tensor, stats: Tensor, has_bias: bool,
                   is_rms: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, dres, dw, db = triton_ops.norm_backward(grad, x, residual, alpha, weight, stats,
                                                has_bias, is_rms)
    # dw and db are rows of one sum tensor, and an op's outputs may not alias each other
    return (dx, grad.new_empty(0) if dres is None else dres, dw.clone(),
            grad.new_empty(0) if db is None else db.clone())


@_norm_backward.register_fake
def _(grad, x, residual, alpha, weight, stats, has_bias, is_rms):
    return (grad.new_empty(grad.shape),
            grad.new_empty(0) if residual is None else grad.new_empty(grad.shape),
            weight.new_empty(weight.shape),
            weight.new_empty(weight.shape) if has_bias else grad.new_empty(0))


def _setup(ctx, inputs, output):
    x, residual, alpha, weight, bias, _eps, is_rms = inputs
    ctx.save_for_backward(x, residual, weight, output[1])
    ctx.alpha, ctx.has_bias, ctx.is_rms = alpha, bias is not None, is_rms
    ctx.has_residual = residual is not None


def _backward(ctx, grad, _grad_stats):
    x, residual, weight, stats = ctx.saved_tensors
    dx, dres, dw, db = _norm_backward(grad.contiguous(), x, residual, ctx.alpha, weight, stats,
                                      ctx.has_bias, ctx.is_rms)
    return (dx, dres if ctx.has_residual else None, None, dw,
            db if ctx.has_bias else None, None, None)


_norm.register_autograd(_backward, setup_context=_setup)


def norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, is_rms: bool) -> Tensor:
    """``triton_ops.norm``, as the registered op inside a compiled region."""
    if torch.compiler.is_compiling():
        return _norm(x, None, 1.0, weight, None if is_rms else bias, eps, is_rms)[0]
    return triton_ops.norm(x, weight, bias, eps, is_rms)


def add_norm(h: Tensor, r: Tensor, alpha: float, weight: Tensor, bias: Tensor | None,
             eps: float, is_rms: bool) -> Tensor:
    """``triton_ops.add_norm``, as the registered op inside a compiled region."""
    if torch.compiler.is_compiling():
        return _norm(h, r, alpha, weight, None if is_rms else bias, eps, is_rms)[0]
    return triton_ops.add_norm(h, r, alpha, weight, bias, eps, is_rms)
