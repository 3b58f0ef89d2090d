"""The two-stream fused kernels as registered operators (``torch.library``), for compiled blocks.

The eager path runs ``triton_ops.EntryFunction`` and ``DualUpdateFunction``: autograd
Functions that take a callable finding the two streams in a packed tensor, return views of
their inputs (the streams a later op reads again) and write the packed gradient in place.
Dynamo can do none of that through a Triton launch (tried: it traces into the launch and
fails), so inside a compiled block the same launches run as custom ops, each with a fake
implementation (shapes and dtypes only) and its backward as a second op: one opaque call each
way, which inductor fuses around.

What an operator may not do shapes this form:

- it takes no callable, so a packed input is split here: the last dimension holds [x | y],
  as ``model.streams`` packs them (the only layout in use);
- its outputs may not alias its inputs, so the streams a later op reads again are not
  outputs: the caller takes them as views of its own input, and autograd adds their
  gradients to the op's (eager adds them inside the backward kernel, one pass less);
- its outputs may not alias each other, so the weight gradients (rows of one sum) are
  copied, and an absent result is an empty tensor that the autograd formula turns into None.

:func:`entry` and :func:`dual_update` take the autograd Functions' arguments and return
their results, choosing by ``torch.compiler.is_compiling()``, so a layer calls one function
either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import triton_ops
from kernels.triton_ops import Entry


def _streams(packed: Tensor) -> tuple[Tensor, Tensor]:
    return packed.chunk(2, dim=-1)


def _absent(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _kind(eps, is_rms, store_a, gate, u_from_x) -> Entry:
    return Entry(eps, is_rms, store_a=store_a, gate=gate, u_from_x=u_from_x)


@torch.library.custom_op("siamesenorm::entry", mutates_args=())
def _entry(x: Tensor, y: Tensor | None, r: Tensor | None, scale: Tensor | None, wa: Tensor,
           ba: Tensor | None, wb: Tensor, bb: Tensor | None, wc: Tensor | None,
           bc: Tensor | None, wu: Tensor | None, bu: Tensor | None, eps: float, is_rms: bool,
           store_a: bool, gate: bool, u_from_x: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(a, y_new, s, stats); ``y`` None: ``x`` is the packed [.., 2h] tensor of both."""
    if y is None:
        x, y = _streams(x)
    kind = _kind(eps, is_rms, store_a, gate, u_from_x)
    a, y_new, s, stats = triton_ops.entry_forward(kind, x, y, r, wa, ba, wb, bb, wc, bc, wu,
                                                  bu, scale=scale, zero_stats=True)
    return (_absent(s) if a is None else a.view(x.shape),
            _absent(s) if y_new is None else y_new.view(x.shape), s.view(x.shape), stats)


@_entry.register_fake
def _(x, y, r, scale, wa, ba, wb, bb, wc, bc, wu, bu, eps, is_rms, store_a, gate, u_from_x):
    if y is None:
        x, y = _streams(x)
    rows = x.numel() // x.shape[-1]
    full = x.new_empty(x.shape)
    return (full if store_a else _absent(x), x.new_empty(x.shape) if r is not None
            else _absent(x), x.new_empty(x.shape), x.new_empty((rows, 6), dtype=torch.float32))


@torch.library.custom_op("siamesenorm::entry_backward", mutates_args=())
def _entry_backward(ga: Tensor | None, gy: Tensor | None, gs: Tensor, x: Tensor,
                    y: Tensor | None, r: Tensor | None, scale: Tensor | None, wa: Tensor,
                    ba: Tensor | None, wb: Tensor, bb: Tensor | None, wc: Tensor | None,
                    bc: Tensor | None, wu: Tensor | None, bu: Tensor | None, stats: Tensor,
                    eps: float, is_rms: bool, store_a: bool, gate: bool,
                    u_from_x: bool) -> list[Tensor]:
    """[dx (or the packed gradient when ``y`` is None), dy, dr, then the eight parameters'
    gradients], each empty where absent."""
    packed = y is None
    dpacked = x.new_empty(x.shape) if packed else None
    if packed:
        x, y = _streams(x)
        dx, dy = (half.view(-1, x.shape[-1]) for half in _streams(dpacked))
    else:
        dx = x.new_empty((x.numel() // x.shape[-1], x.shape[-1]))
        dy = y.new_empty(dx.shape)
    params = (wa, ba, wb, bb, wc, bc, wu, bu)
    dr, grads = triton_ops.entry_backward(_kind(eps, is_rms, store_a, gate, u_from_x),
                                          x, y, r, params, stats, ga, gy, None, gs, dx, dy,
                                          scale)
    streams = [dpacked, _absent(gs)] if packed else [dx.view(x.shape), dy.view(x.shape)]
    return [*streams, _absent(gs) if dr is None else dr.view(x.shape),
            *(_absent(gs) if g is None else g.clone() for g in grads)]


@_entry_backward.register_fake
def _(ga, gy, gs, x, y, r, scale, wa, ba, wb, bb, wc, bc, wu, bu, stats, eps, is_rms,
      store_a, gate, u_from_x):
    streams = [x.new_empty(x.shape), _absent(gs)] if y is None else \
        [x.new_empty(x.shape), y.new_empty(y.shape)]
    recompute_u = r is not None and u_from_x
    grads = [p.new_empty(p.shape) if p is not None else _absent(gs)
             for p in (wa, ba, wb, bb, wc, bc)]
    grads += [p.new_empty(p.shape) if p is not None and recompute_u else _absent(gs)
              for p in (wu, bu)]
    return [*streams, gs.new_empty(gs.shape) if r is not None else _absent(gs), *grads]


_ENTRY_TENSORS = ("x", "y", "r", "scale", "wa", "ba", "wb", "bb", "wc", "bc", "wu", "bu")


def _entry_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:len(_ENTRY_TENSORS)], output[3])
    ctx.flags = inputs[len(_ENTRY_TENSORS):]
    ctx.has = [t is not None for t in inputs[:len(_ENTRY_TENSORS)]]


def _given(grad: Tensor | None, like: Tensor) -> Tensor:
    """An output's gradient, zeros where autograd passes none (an output nothing read)."""
    return torch.zeros_like(like) if grad is None else grad


def _entry_grads(ctx, grad_a, grad_y, grad_s, _grad_stats):
    *tensors, stats = ctx.saved_tensors
    x, y, r = tensors[:3]
    eps, is_rms, store_a, gate, u_from_x = ctx.flags
    ga = _given(grad_a, grad_s) if store_a else None
    gy = _given(grad_y, grad_s) if r is not None else None
    grads = _entry_backward(ga, gy, grad_s.contiguous(), x, y, r, *tensors[3:], stats, eps,
                            is_rms, store_a, gate, u_from_x)
    dx, dy, dr, *param_grads = grads
    out = [dx, dy if y is not None else None, dr if r is not None else None, None,
           *param_grads]  # c (scale) has no gradient
    out = [g if has else None for g, has in zip(out, ctx.has, strict=True)]
    if not (r is not None and u_from_x):
        out[-2:] = [None, None]
    return (*out, None, None, None, None, None)


_entry.register_autograd(_entry_grads, setup_context=_entry_setup)


def entry(kind: Entry, halves: Callable | None, packed: Tensor | None, x: Tensor | None,
          y: Tensor | None, r: Tensor | None, scale: float | Tensor | None, wa, ba, wb, bb,
          wc, bc, wu=None, bu=None):
    """``triton_ops.EntryFunction.apply``, or inside a compiled region the registered op with
    the same arguments and results (the streams it passes on, ``kind.pass_x`` / ``pass_y``,
    are then ``halves(packed)`` as they are). ``scale``: an update's c (with ``r``), a tensor
    inside a compiled region (a number there would be a constant of the graph)."""
    if not torch.compiler.is_compiling():
        return triton_ops.EntryFunction.apply(kind, halves, packed, x, y, r, scale, wa, ba, wb,
                                              bb, wc, bc, wu, bu)
    if packed is not None:
        x, y = halves(packed)
    scale = triton_ops.scale_operand(scale, r) if r is not None else None
    a, y_new, s, _ = _entry(packed if packed is not None else x,
                            None if packed is not None else y, r, scale, wa, ba, wb, bb, wc, bc,
                            wu, bu, kind.eps, kind.is_rms, kind.store_a, kind.gate,
                            kind.u_from_x)
    y_out = y_new if r is not None else (y if kind.pass_y else None)
    return (a if kind.store_a else None, y_out, x if kind.pass_x else None, s)


@torch.library.custom_op("siamesenorm::dual_update", mutates_args=())
def _dual_update(u: Tensor, y: Tensor, r: Tensor, scale: Tensor) -> Tensor:
    """The packed [.., 2h] tensor [u + r / scale | y + r]."""
    out = u.new_empty((*u.shape[:-1], 2 * u.shape[-1]))
    ox, oy = (half.view(-1, u.shape[-1]) for half in _streams(out))
    triton_ops.dual_update_forward(u, y, r, scale, ox, oy)
    return out


@_dual_update.register_fake
def _(u, y, r, scale):
    return u.new_empty((*u.shape[:-1], 2 * u.shape[-1]))


@torch.library.custom_op("siamesenorm::dual_update_backward", mutates_args=())
def _dual_update_backward(grad: Tensor, scale: Tensor) -> Tensor:
    """r's gradient gx / scale + gy from the packed gradient [gx | gy]."""
    return triton_ops.dual_update_backward(*_streams(grad), scale)


@_dual_update_backward.register_fake
def _(grad, scale):
    return _streams(grad)[0].new_empty((*grad.shape[:-1], grad.shape[-1] // 2))


def _dual_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[3])


def _dual_grads(ctx, grad):
    gx, gy = _streams(grad)
    return gx, gy, _dual_update_backward(grad, *ctx.saved_tensors), None


_dual_update.register_autograd(_dual_grads, setup_context=_dual_setup)


def dual_update(u: Tensor, y: Tensor, r: Tensor, scale: float | Tensor,
                empty: Callable[[Tensor], Tensor], halves: Callable) -> Tensor:
    """``triton_ops.dual_update`` into ``empty(u)`` split by ``halves``, or inside a compiled
    region the registered op (which packs [x | y] itself; ``scale`` a tensor there, as for
    :func:`entry`)."""
    if torch.compiler.is_compiling():
        return _dual_update(u, y, r, triton_ops.scale_operand(scale, u))
    return triton_ops.dual_update(u, y, r, scale, empty(u), halves)
