"""The fused Triton norm and the per-head Q/K/V norms as registered operators
(``torch.library``), for compiled blocks (the two-stream kernels: ``stream_library``).

Dynamo cannot see into an autograd Function whose forward launches a Triton kernel sized by
Python (launch arguments, the backward's occupancy-derived grid, weight-gradient partials):
it would try to trace that Python and break the graph. Registered as custom ops, with fake
implementations that give only shapes and dtypes, and their backward registered as a second
op, the norm enters a compiled block's graph as one opaque call each way: inductor fuses
around it, never into it. :func:`norm` and :func:`add_norm`, which the Triton-backed
``Norm`` modules bind, take the op inside a compiled region and ``triton_ops.NormFunction``
outside it; both compute with ``triton_ops.norm_forward`` / ``norm_backward``, so the two
paths run the same launches. :func:`qkv_norm` does the same for QKV-norm attention's heads.

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


@torch.library.custom_op("siamesenorm::qkv_norm", mutates_args=())
def _qkv_norm(mixed: Tensor, heads: int, dim: int, eps: float, is_rms: bool, wq: Tensor,
              bq: Tensor | None, wk: Tensor, bk: Tensor | None, wv: Tensor,
              bv: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, k, v, _, stats = triton_ops.qkv_norm_forward(mixed, heads, dim, eps, is_rms, wq, bq,
                                                    wk, bk, wv, bv, zero_stats=True)
    return q, k, v, stats


@_qkv_norm.register_fake
def _(mixed, heads, dim, eps, is_rms, wq, bq, wk, bk, wv, bv):
    lead, groups = mixed.shape[:-2], mixed.shape[-2]
    rows = mixed.numel() // ((heads + 2) * dim)
    return (mixed.new_empty((*lead, groups * heads, dim)), mixed.new_empty((*lead, groups, dim)),
            mixed.new_empty((*lead, groups, dim)),
            mixed.new_empty((rows, heads + 2, 2), dtype=torch.float32))


@torch.library.custom_op("siamesenorm::qkv_norm_backward", mutates_args=())
def _qkv_norm_backward(gq: Tensor, gk: Tensor, gv: Tensor, mixed: Tensor, wq: Tensor,
                       wk: Tensor, wv: Tensor, stats: Tensor, heads: int, dim: int,
                       is_rms: bool, has_bias: bool) -> list[Tensor]:
    """[d mixed, dwq, dbq, dwk, dbk, dwv, dbv], the biases' empty without a bias."""
    rows = mixed.reshape(-1, (heads + 2) * dim).contiguous()
    drows, *grads = triton_ops.qkv_norm_backward(gq, gk, gv, rows, wq, wk, wv, stats, heads,
                                                 dim, is_rms, has_bias)
    return [drows.view(mixed.shape),
            *(gq.new_empty(0) if g is None else g.clone() for g in grads)]


@_qkv_norm_backward.register_fake
def _(gq, gk, gv, mixed, wq, wk, wv, stats, heads, dim, is_rms, has_bias):
    def bias(w):
        return w.new_empty(w.shape) if has_bias else gq.new_empty(0)

    return [mixed.new_empty(mixed.shape), wq.new_empty(wq.shape), bias(wq),
            wk.new_empty(wk.shape), bias(wk), wv.new_empty(wv.shape), bias(wv)]


def _qkv_setup(ctx, inputs, output):
    mixed, heads, dim, _eps, is_rms, wq, bq, wk, _bk, wv, _bv = inputs
    ctx.save_for_backward(mixed, wq, wk, wv, output[3])
    ctx.heads, ctx.dim, ctx.is_rms, ctx.has_bias = heads, dim, is_rms, bq is not None


def _qkv_grads(ctx, gq, gk, gv, _grad_stats):
    mixed, wq, wk, wv, stats = ctx.saved_tensors
    dmixed, dwq, dbq, dwk, dbk, dwv, dbv = _qkv_norm_backward(
        gq, gk, gv, mixed, wq, wk, wv, stats, ctx.heads, ctx.dim, ctx.is_rms, ctx.has_bias)
    if not ctx.has_bias:
        dbq = dbk = dbv = None
    return dmixed, None, None, None, None, dwq, dbq, dwk, dbk, dwv, dbv


_qkv_norm.register_autograd(_qkv_grads, setup_context=_qkv_setup)


def qkv_norm(mixed: Tensor, heads: int, dim: int, eps: float, is_rms: bool, q_norm, k_norm,
             v_norm) -> tuple[Tensor, Tensor, Tensor]:
    """``triton_ops.qkv_norm``, as the registered op inside a compiled region."""
    if not torch.compiler.is_compiling():
        return triton_ops.qkv_norm(mixed, heads, dim, eps, is_rms, q_norm, k_norm, v_norm)
    biases = [None if is_rms else n.bias for n in (q_norm, k_norm, v_norm)]
    q, k, v, _ = _qkv_norm(mixed, heads, dim, eps, is_rms, q_norm.weight, biases[0],
                           k_norm.weight, biases[1], v_norm.weight, biases[2])
    return q, k, v
