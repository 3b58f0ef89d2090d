"""Autograd functions over the Triton kernels: shapes, launches and weight-gradient sums.

Tensors in, tensors out. The functions take the norms' own parameters (the ``nn.Parameter``
objects of the ``Norm`` modules), so gradients land on the same tensors whichever backend ran,
and megatron's sequence-parallel all-reduce of norm weights still applies. Activations may be
strided views (the halves of a packed [s, b, 2h] tensor) as long as each row is contiguous;
where a result goes into such halves, the caller gives the output tensor and the function that
finds its halves, so no kernel knows how streams are packed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton

from kernels import triton_kernels as kern


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., h] as 2-D rows with unit column stride; a view whenever the layout allows."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Values per tile (rows x block) of the row kernels. Forward keeps one row per program from
# hidden 2048 up, where it already runs at copy bandwidth; backward passes hold more live
# values per row, and loop over rows, so more rows per tile give them loads in flight; the
# entry's backward, with up to six weight-gradient accumulators, keeps to one row at 2048.
# ``bench.fused_norms --backward-tiles`` times other backward tiles on a GPU.
FORWARD_TILE, NORM_BACKWARD_TILE, ENTRY_BACKWARD_TILE, QKV_BACKWARD_TILE = 2048, 4096, 2048, 2048
MAX_ROWS = 32


def _launch_args(n_cols: int, tile: int = FORWARD_TILE) -> dict:
    """BLOCK (a power of two covering the row), ROWS per tile (filling ``tile`` values) and
    warps (one per 256 values of the tile, 1 to 8) of a row kernel: a fixed function of the
    hidden size, so every run makes the same launches and sums in the same order."""
    block = triton.next_power_of_2(n_cols)
    rows = min(max(tile // block, 1), MAX_ROWS)
    return {"BLOCK": block, "ROWS": rows, "num_warps": min(max(rows * block // 256, 1), 8)}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def backward_programs(n_rows: int, sm_count: int, num_warps: int) -> int:
    """Backward programs on a GPU of ``sm_count`` SMs, each looping over a contiguous block of
    rows: enough to keep ~32 warps resident per SM (where registers allow), but at least 16
    rows each, so the fp32 weight-gradient partials (programs x h each) stay small next to the
    rows they sum."""
    return max(1, min(triton.cdiv(n_rows, 16), max(1, 32 // num_warps) * sm_count))


def _programs(n_rows: int, device: torch.device, num_warps: int) -> int:
    """:func:`backward_programs` on this device; without CUDA (the interpreter) up to 4, so
    tests see several partials."""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    return backward_programs(n_rows, _sm_count(device.index or 0), num_warps)


def weight_grad_partials(programs: int, slots: int, width: int,
                         device: torch.device) -> torch.Tensor:
    """fp32 weight-gradient partials of a backward launch: ``slots`` rows of ``width`` per
    program launched. Not zero-filled: every program stores all its slots (its
    accumulators, zero for a program that got no rows), so a fill would write them twice."""
    return torch.empty((programs, slots, width), dtype=torch.float32, device=device)


def _sum_partials(partials: torch.Tensor, params: list[torch.Tensor | None]):
    sums = partials.sum(0)
    return [None if p is None else sums[i].to(p.dtype) for i, p in enumerate(params)]


class NormFunction(torch.autograd.Function):
    """out = N(x) for RMSNorm (``bias`` None) or LayerNorm; with a ``residual`` r,
    out = N(alpha x + r) (Post-Norm's residual add fused into its norm)."""

    @staticmethod
    def forward(ctx, x, residual, alpha: float, weight, bias, eps: float, is_rms: bool):
        rows = _rows(x)
        res = rows if residual is None else _rows(residual)
        n_rows, n_cols = rows.shape
        out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        stats = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)
        if n_rows:
            launch = _launch_args(n_cols)
            kern.norm_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
                rows, rows.stride(0), res, res.stride(0), alpha, weight,
                weight if bias is None else bias, out, stats, n_rows, n_cols, eps,
                IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                **launch)
        ctx.save_for_backward(rows, res, weight, stats)
        ctx.has_bias, ctx.is_rms = bias is not None, is_rms
        ctx.has_residual, ctx.alpha = residual is not None, alpha
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, res, weight, stats = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        grad = grad.contiguous()
        dx = torch.empty((n_rows, n_cols), dtype=rows.dtype, device=rows.device)
        dr = torch.empty_like(dx) if ctx.has_residual else dx
        launch = _launch_args(n_cols, NORM_BACKWARD_TILE)
        programs = _programs(n_rows, rows.device, launch["num_warps"])
        partials = weight_grad_partials(programs, 2, n_cols, rows.device)
        if n_rows:
            kern.norm_bwd[(programs,)](
                rows, rows.stride(0), res, res.stride(0), ctx.alpha, weight, stats, grad, dx,
                dr, partials, n_rows, n_cols, triton.cdiv(n_rows, programs),
                IS_RMS=ctx.is_rms, HAS_RESIDUAL=ctx.has_residual, **launch)
        dw, db = _sum_partials(partials, [weight, weight if ctx.has_bias else None])
        dres = dr.view(grad.shape) if ctx.has_residual else None
        return dx.view(grad.shape), dres, None, dw, db, None, None


class EntryFunction(torch.autograd.Function):
    """(a, y_out, s) with a = Na(x), s = Nc(Na(x) + Nb(y)); see ``triton_kernels``.

    With ``r`` given, (x, y) first become (x + r / scale, y + r) and y_out is the new y;
    otherwise y_out is None. ``a`` is None unless ``store_a``; ``wc`` None drops Nc. Biases are
    None for RMSNorm and for LayerNorm without bias (all three norms alike: ``fuse``).
    Backward of an update keeps x (here u), y and r, not the updated streams; ``u_from`` (the
    input that gave u = Npost(u_from), whose norm has weight ``wu`` and bias ``bu``) keeps
    that instead of u and recomputes u, for when u is not kept anyway and u_from is.
    """

    @staticmethod
    def forward(ctx, x, y, r, wa, ba, wb, bb, wc, bc, scale: float, eps: float, is_rms: bool,
                store_a: bool, u_from=None, wu=None, bu=None):
        update, has_c = r is not None, wc is not None
        xr, yr = _rows(x), _rows(y)
        rr = _rows(r) if update else xr
        n_rows, n_cols = xr.shape
        new = functools.partial(torch.empty, (n_rows, n_cols), device=x.device)
        a = new(dtype=x.dtype) if store_a else None
        y_out = new(dtype=y.dtype) if update else None
        s = new(dtype=x.dtype)
        stats = torch.empty((n_rows, 6), dtype=torch.float32, device=x.device)
        if n_rows:
            launch = _launch_args(n_cols)
            kern.entry_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
                xr, yr, rr, xr.stride(0), yr.stride(0), rr.stride(0),
                wa, wa if ba is None else ba, wb, wb if bb is None else bb,
                wa if wc is None else wc, wa if bc is None else bc,
                s if a is None else a, s if y_out is None else y_out, s, stats,
                n_rows, n_cols, float(scale), eps,
                IS_RMS=is_rms, HAS_BIAS=ba is not None, UPDATE=update, STORE_A=store_a,
                HAS_C=has_c, **launch)
        recompute_u = update and u_from is not None
        ctx.save_for_backward(_rows(u_from) if recompute_u else xr, yr, rr, wa, ba, wb, bb, wc,
                              bc, wu if recompute_u else None, bu if recompute_u else None,
                              stats)
        ctx.flags = dict(scale=float(scale), eps=eps, is_rms=is_rms, update=update,
                         store_a=store_a, recompute_u=recompute_u)
        shape = x.shape
        return (None if a is None else a.view(shape),
                None if y_out is None else y_out.view(shape), s.view(shape))

    @staticmethod
    def backward(ctx, grad_a, grad_y, grad_s):
        xr, yr, rr, wa, ba, wb, bb, wc, bc, wu, bu, stats = ctx.saved_tensors
        f = ctx.flags
        n_rows, n_cols = xr.shape
        grad_s = grad_s.contiguous()
        grad_a = grad_a.contiguous() if f["store_a"] else grad_s
        grad_y = grad_y.contiguous() if f["update"] else grad_s
        dx = torch.empty((n_rows, n_cols), dtype=xr.dtype, device=xr.device)
        dy = torch.empty((n_rows, n_cols), dtype=yr.dtype, device=yr.device)
        dr = torch.empty_like(dx, dtype=rr.dtype) if f["update"] else dx
        launch = _launch_args(n_cols, ENTRY_BACKWARD_TILE)
        programs = _programs(n_rows, xr.device, launch["num_warps"])
        partials = weight_grad_partials(programs, 6, n_cols, xr.device)
        if n_rows:
            kern.entry_bwd[(programs,)](
                xr, yr, rr, xr.stride(0), yr.stride(0), rr.stride(0),
                wa, wa if ba is None else ba, wb, wb if bb is None else bb,
                wa if wc is None else wc, wa if wu is None else wu, wa if bu is None else bu,
                stats, grad_a, grad_y, grad_s, dx, dy, dr, partials,
                n_rows, n_cols, triton.cdiv(n_rows, programs), f["scale"], f["eps"],
                IS_RMS=f["is_rms"], HAS_BIAS=ba is not None, UPDATE=f["update"],
                STORE_A=f["store_a"], HAS_C=wc is not None, RECOMPUTE_U=f["recompute_u"],
                **launch)
        weight_grads = _sum_partials(partials, [wa, ba, wb, bb, wc, bc])
        shape = grad_s.shape
        return (dx.view(shape), dy.view(shape), dr.view(shape) if f["update"] else None,
                *weight_grads, None, None, None, None, None, None, None)


class DualUpdateFunction(torch.autograd.Function):
    """out with halves(out) = (u + r / scale, y + r): the two results written in place into
    the given (fresh, grad-less) tensor ``out``, whose two views ``halves`` returns."""

    @staticmethod
    def forward(ctx, u, y, r, scale: float, out: torch.Tensor, halves: Callable):
        ox, oy = (half.view(-1, u.shape[-1]) for half in halves(out))  # written in place
        if ox.stride(0) != oy.stride(0) or ox.stride(-1) != 1 or oy.stride(-1) != 1:
            raise ValueError("the packed halves must be row-contiguous with one row stride")
        ur, yr, rr = _rows(u), _rows(y), _rows(r)
        n_rows, n_cols = ur.shape
        if n_rows:
            launch = _launch_args(n_cols)
            kern.dual_update_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
                ur, yr, rr, ur.stride(0), yr.stride(0), rr.stride(0), ox, oy, ox.stride(0),
                n_rows, n_cols, float(scale), **launch)
        ctx.scale, ctx.halves = float(scale), halves
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx, gy = ctx.halves(grad)
        return gx, gy, gx / ctx.scale + gy, None, None, None


class QKVNormFunction(torch.autograd.Function):
    """(Q, K, V) with per-head norms, from the packed projection [.., groups, (heads + 2) dim]
    (megatron's layout per K/V group: its query heads, its key head, its value head).
    Q is [.., groups * heads, dim], K and V [.., groups, dim], all contiguous."""

    @staticmethod
    def forward(ctx, mixed, heads: int, dim: int, eps: float, is_rms: bool,
                wq, bq, wk, bk, wv, bv):
        lead = mixed.shape[:-2]
        groups = mixed.shape[-2]
        rows = mixed.reshape(-1, (heads + 2) * dim)
        rows = rows if rows.is_contiguous() else rows.contiguous()
        n_rows = rows.shape[0]
        q = torch.empty((*lead, groups * heads, dim), dtype=mixed.dtype, device=mixed.device)
        k = torch.empty((*lead, groups, dim), dtype=mixed.dtype, device=mixed.device)
        v = torch.empty_like(k)
        stats = torch.empty((n_rows, heads + 2, 2), dtype=torch.float32, device=mixed.device)
        has_bias = bq is not None
        if n_rows:
            launch = _head_launch_args(heads, dim)
            kern.qkv_norm_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
                rows, wq, wk, wv, bq if has_bias else wq, bk if has_bias else wk,
                bv if has_bias else wv, q, k, v, stats, n_rows, heads, dim, eps,
                IS_RMS=is_rms, HAS_BIAS=has_bias, **launch)
        ctx.save_for_backward(rows, wq, wk, wv, stats)
        ctx.heads, ctx.dim, ctx.is_rms, ctx.has_bias = heads, dim, is_rms, has_bias
        ctx.mixed_shape = mixed.shape
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        rows, wq, wk, wv, stats = ctx.saved_tensors
        n_rows, heads, dim = rows.shape[0], ctx.heads, ctx.dim
        gq, gk, gv = (g.contiguous() for g in (gq, gk, gv))
        dmixed = torch.empty_like(rows)
        launch = _head_launch_args(heads, dim, QKV_BACKWARD_TILE)
        programs = _programs(n_rows, rows.device, launch["num_warps"])
        partials = weight_grad_partials(programs, 6, dim, rows.device)
        if n_rows:
            kern.qkv_norm_bwd[(programs,)](
                rows, wq, wk, wv, stats, gq, gk, gv, dmixed, partials, n_rows, heads, dim,
                triton.cdiv(n_rows, programs), IS_RMS=ctx.is_rms, **launch)
        bias = ctx.has_bias
        dwq, dwk, dwv, dbq, dbk, dbv = _sum_partials(
            partials, [wq, wk, wv] + ([wq, wk, wv] if bias else [None] * 3))
        return (dmixed.view(ctx.mixed_shape), None, None, None, None,
                dwq, dbq, dwk, dbk, dwv, dbv)


def _head_launch_args(heads: int, dim: int, tile: int = FORWARD_TILE) -> dict:
    """HEADS (>= heads + 2) and DIM (>= head_dim) powers of two, ROWS of them per tile
    (filling ``tile`` values) and warps (one per 256 values, 1 to 8) of a QKV-norm kernel."""
    block = triton.next_power_of_2(heads + 2) * triton.next_power_of_2(dim)
    rows = min(max(tile // block, 1), MAX_ROWS)
    return {"HEADS": triton.next_power_of_2(heads + 2), "DIM": triton.next_power_of_2(dim),
            "ROWS": rows, "num_warps": min(max(rows * block // 256, 1), 8)}


def qkv_norm(mixed: torch.Tensor, heads: int, dim: int, eps: float, is_rms: bool,
             q_norm, k_norm, v_norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V normalised by the ``Norm`` modules ``q_norm``, ``k_norm``, ``v_norm`` (see
    :class:`QKVNormFunction`)."""
    biases = [None if is_rms else n.bias for n in (q_norm, k_norm, v_norm)]
    return QKVNormFunction.apply(mixed, heads, dim, eps, is_rms, q_norm.weight, biases[0],
                                 k_norm.weight, biases[1], v_norm.weight, biases[2])


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
         is_rms: bool) -> torch.Tensor:
    """RMSNorm (``is_rms``, no bias) or LayerNorm of the last dimension."""
    return NormFunction.apply(x, None, 1.0, weight, None if is_rms else bias, eps, is_rms)


def add_norm(h: torch.Tensor, r: torch.Tensor, alpha: float, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, is_rms: bool) -> torch.Tensor:
    """N(alpha h + r) in one pass (:class:`NormFunction` with a residual)."""
    return NormFunction.apply(h, r, alpha, weight, None if is_rms else bias, eps, is_rms)


def dual_update(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float,
                out: torch.Tensor, halves: Callable) -> torch.Tensor:
    """``out`` with its halves set to (u + r / scale, y + r); see :class:`DualUpdateFunction`."""
    return DualUpdateFunction.apply(u, y, r, scale, out, halves)
