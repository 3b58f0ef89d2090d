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
from typing import NamedTuple

import torch
import triton

from kernels import occupancy
from kernels import triton_kernels as kern


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., h] as 2-D rows with unit column stride; a view whenever the layout allows (the
    kernels read rows with their own stride, so a half of a packed tensor is not copied)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Values per tile (rows x block) of the row kernels. Forward keeps one row per program from
# hidden 2048 up, where it already runs at copy bandwidth; backward passes hold more live
# values per row, and loop over rows, so more rows per tile give them loads in flight; the
# entry's backward, with up to six weight-gradient accumulators, keeps to one row at 2048.
# ``bench.fused_norms --backward-tiles`` times other backward tiles on a GPU.
FORWARD_TILE, NORM_BACKWARD_TILE, ENTRY_BACKWARD_TILE, QKV_BACKWARD_TILE = 2048, 4096, 2048, 2048
MAX_ROWS = 32


# Warps of a row kernel at most: forward kernels keep a row's few live values in 8 warps at
# every width; the entry's backward holds about ten fp32 values per column of its tile plus up
# to eight weight-gradient accumulators, which from hidden 4096 on spill out of 8 warps'
# registers, so its warps grow with the row, to 16 (at 4096 ten launches still spill, eight of
# them LayerNorm with bias; at 8192 most variants do: ``bench.kernel_resources``).
MAX_WARPS, MAX_BACKWARD_WARPS = 8, 16
# The plain norm's backward holds fewer rows of values (one or two accumulators): 8 warps keep
# a 4096-wide row in 64-119 registers, two or more programs per SM, where 16 warps would hold
# one (its warps grow past 8 from 8192 on).
NORM_BACKWARD_WARP_VALUES = 512

# Row width from which the entry's backward reads each stream's row a second time after Nc's
# reductions (a cache hit) instead of holding it normalised across them: two rows of
# registers fewer where a program's register file holds about eight fp32 rows (8192 on sm_90:
# 14,352 bytes of local memory over the 74 backward launches instead of 19,352,
# ``bench.kernel_resources``); at 4096 the re-reads spill more in 7 launches and less in 5.
RELOAD_FROM = 8192


def _launch_args(n_cols: int, tile: int = FORWARD_TILE, max_warps: int = MAX_WARPS,
                 warp_values: int = 256) -> dict:
    """BLOCK (a power of two covering the row), ROWS per tile (filling ``tile`` values) and
    warps (one per 256 values of the tile, 1 to 8; up to ``max_warps``, one per
    ``warp_values`` values of a row, where a row holds more than 8 x ``warp_values``) of a
    row kernel: a fixed function of the hidden size, so every run makes the same launches
    and sums in the same order."""
    block = triton.next_power_of_2(n_cols)
    rows = min(max(tile // block, 1), MAX_ROWS)
    cap = max(MAX_WARPS, min(max_warps, block // warp_values))  # > 8 only for a longer row
    return {"BLOCK": block, "ROWS": rows, "num_warps": min(max(rows * block // 256, 1), cap)}


def _arguments(*args, **kwargs) -> tuple[tuple, dict]:
    """Stands in for a kernel launch: what it was given."""
    return args, kwargs


def weight_grad_partials(programs: int, slots: int, width: int,
                         device: torch.device) -> torch.Tensor:
    """fp32 weight-gradient partials of a backward launch: ``slots`` rows of ``width`` per
    program launched, one per gradient the launch computes (no bias slots without biases).
    Not zero-filled: every program stores all its slots (its accumulators, zero for a program
    that got no rows), so a fill would write them twice."""
    return torch.empty((programs, slots, width), dtype=torch.float32, device=device)


def _backward(kernel: triton.JITFunction, n_rows: int, device: torch.device, slots: int,
              width: int, run: Callable[[Callable, torch.Tensor, int], object]) -> torch.Tensor:
    """Launches a row-looping backward ``kernel`` over ``n_rows`` rows as
    ``run(kernel[(programs,)], partials, rows_per_program)`` and returns its weight-gradient
    partials (``slots`` x ``width`` per program; zeros when there is no row, so no launch).

    ``programs`` is one wave of the kernel as Triton compiles it for this launch on a GPU,
    capped to fit two programs per SM where that compiles without a spill, a few in the
    interpreter (:func:`kernels.occupancy.launch_programs`). The grid comes first
    (it sizes the partials and the rows per program), so ``run`` gives the launch's arguments
    with stand-ins for those two: an empty fp32 tensor and the 16-row floor. Triton
    specialises pointers on 16-byte alignment and integers on being 1 or a multiple of 16, so
    the stand-ins may pick a variant whose hints differ from the launch's; the rows per
    program only bound the row loop and the partials take one store per slot, so no register
    count that matters changes."""
    stand_in = torch.empty(0, dtype=torch.float32, device=device)
    args, kwargs = run(_arguments, stand_in, occupancy.MIN_ROWS_PER_PROGRAM)
    programs, options = occupancy.launch_programs(kernel, n_rows, device, args, kwargs)
    partials = weight_grad_partials(programs, slots, width, device)
    if not n_rows:
        return partials.zero_()
    run(functools.partial(kernel[(programs,)], **options), partials,
        triton.cdiv(n_rows, programs))
    return partials


def _sum_partials(partials: torch.Tensor, params: list[torch.Tensor | None]):
    """Each parameter's gradient from its slot of the partials (``params`` in slot order;
    None where the launch has no such parameter, past the last slot too)."""
    sums = partials.sum(0)
    return [None if p is None else sums[i].to(p.dtype) for i, p in enumerate(params)]


def norm_forward(x, residual, alpha: float, weight, bias, eps: float, is_rms: bool,
                 zero_stats: bool = False):
    """(out, stats) of N(x), or N(alpha x + r) with a ``residual`` r: out shaped like x,
    stats the per-row fp32 values backward reads. Shared by :class:`NormFunction` (eager) and
    the registered op ``siamesenorm::norm`` (compiled blocks, ``kernels/norm_library.py``),
    which sets ``zero_stats``: RMSNorm leaves a column of stats unwritten, and an op's output
    must be a function of its inputs."""
    rows = _rows(x)
    res = rows if residual is None else _rows(residual)
    n_rows, n_cols = rows.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    stats = (torch.zeros if zero_stats else torch.empty)((n_rows, 2), dtype=torch.float32,
                                                         device=x.device)
    if n_rows:
        launch = _launch_args(n_cols)
        kern.norm_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
            rows, rows.stride(0), res, res.stride(0), alpha, weight,
            weight if bias is None else bias, out, stats, n_rows, n_cols, eps,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
            **launch)
    return out.view(x.shape), stats


def norm_backward(grad, x, residual, alpha: float, weight, stats, has_bias: bool,
                  is_rms: bool):
    """(dx, dr, dw, db) of :func:`norm_forward` (dr None without a residual, db None without
    a bias), dx and dr shaped like ``grad``."""
    rows = _rows(x)
    res = rows if residual is None else _rows(residual)
    n_rows, n_cols = rows.shape
    g = _rows(grad)
    dx = torch.empty((n_rows, n_cols), dtype=rows.dtype, device=rows.device)
    has_residual = residual is not None
    dr = torch.empty_like(dx) if has_residual else dx
    launch = _launch_args(n_cols, NORM_BACKWARD_TILE, MAX_BACKWARD_WARPS,
                          NORM_BACKWARD_WARP_VALUES)

    def run(kernel, partials, rows_per_program):
        return kernel(
            rows, rows.stride(0), res, res.stride(0), alpha, weight, stats, g,
            g.stride(0), dx, dr, partials, n_rows, n_cols, rows_per_program,
            IS_RMS=is_rms, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, **launch)

    partials = _backward(kern.norm_bwd, n_rows, rows.device, 1 + has_bias, n_cols, run)
    dw, db = _sum_partials(partials, [weight, weight if has_bias else None])
    dres = dr.view(grad.shape) if has_residual else None
    return dx.view(grad.shape), dres, dw, db


class NormFunction(torch.autograd.Function):
    """out = N(x) for RMSNorm (``bias`` None) or LayerNorm; with a ``residual`` r,
    out = N(alpha x + r) (Post-Norm's residual add fused into its norm)."""

    @staticmethod
    def forward(ctx, x, residual, alpha: float, weight, bias, eps: float, is_rms: bool):
        out, stats = norm_forward(x, residual, alpha, weight, bias, eps, is_rms)
        ctx.save_for_backward(x, residual, weight, stats)
        ctx.has_bias, ctx.is_rms, ctx.alpha = bias is not None, is_rms, alpha
        return out

    @staticmethod
    def backward(ctx, grad):
        x, residual, weight, stats = ctx.saved_tensors
        dx, dres, dw, db = norm_backward(grad, x, residual, ctx.alpha, weight, stats,
                                         ctx.has_bias, ctx.is_rms)
        return dx, dres, None, dw, db, None, None


class Entry(NamedTuple):
    """What an :class:`EntryFunction` launch computes besides its tensors: fixed when a layer
    is built, so it is one hashable argument.

    ``store_a``: a = Na(x) is an output; ``gate``: Na is a per-channel gate a = x * wa, not a
    norm (siamese_hybrid's attention entry); ``pass_x`` / ``pass_y``: x / y are outputs too,
    for a later op of the layer to read, so that their gradients come back into this
    function's backward and join the stream gradients inside the kernel, not in autograd's
    sums; ``u_from_x``: in an update, x is not u but the previous entry's input, u = Nu(x) by
    the weights ``wu``, ``bu`` (computed forward and backward, never stored; its gradient goes
    on to x and Nu's weights). An update's c is no part of it but an operand
    (:func:`scale_operand`)."""

    eps: float
    is_rms: bool
    store_a: bool = True
    gate: bool = False
    pass_x: bool = False
    pass_y: bool = False
    u_from_x: bool = False


def scale_operand(scale: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An update's c as the kernels read it: one fp32 value in memory on ``like``'s device. A
    layer passes its own, made once (``TwoStreamLayer.c_operand``); a number is copied there
    (a test's or a benchmark's convenience: a host-to-device copy per call). Applied where a
    scale enters (the autograd Functions, the compiled path's wrappers); the launch functions
    below take its result."""
    if not isinstance(scale, torch.Tensor):
        return torch.full((), float(scale), dtype=torch.float32, device=like.device)
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != like.device:
        raise ValueError(f"an update's scale must be one fp32 value on {like.device}, not "
                         f"{tuple(scale.shape)} {scale.dtype} on {scale.device}")
    return scale


def entry_forward(kind: Entry, x, y, r, wa, ba, wb, bb, wc, bc, wu=None, bu=None,
                  scale: torch.Tensor | None = None, zero_stats: bool = False):
    """The entry's launch: (a, y_new, s, stats) as [rows, h] tensors (a None unless
    ``kind.store_a``, y_new None without an update ``r``, whose x share is r / ``scale``) and
    the per-row fp32 values backward reads. Shared by :class:`EntryFunction` and the
    registered op ``siamesenorm::entry`` (``kernels/stream_library.py``), which sets
    ``zero_stats`` (a launch writes only the columns its kind needs; an op's output must be a
    function of its inputs)."""
    update = r is not None
    xr, yr = _rows(x), _rows(y)
    rr = _rows(r) if update else xr
    n_rows, n_cols = xr.shape
    new = functools.partial(torch.empty, (n_rows, n_cols), device=x.device)
    a = new(dtype=x.dtype) if kind.store_a else None
    y_new = new(dtype=y.dtype) if update else None
    s = new(dtype=x.dtype)
    stats = (torch.zeros if zero_stats else torch.empty)((n_rows, 6), dtype=torch.float32,
                                                         device=x.device)
    if n_rows:
        launch = _launch_args(n_cols)
        kern.entry_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
            xr, yr, rr, xr.stride(0), yr.stride(0), rr.stride(0),
            wa, wa if ba is None else ba, wb, wb if bb is None else bb,
            wa if wc is None else wc, wa if bc is None else bc,
            wa if wu is None else wu, wa if bu is None else bu,
            s if a is None else a, s if y_new is None else y_new, s, stats,
            n_rows, n_cols, scale if update else stats, kind.eps,
            IS_RMS=kind.is_rms, HAS_BIAS=bb is not None, UPDATE=update, STORE_A=kind.store_a,
            HAS_C=wc is not None, GATE=kind.gate, RECOMPUTE_U=update and kind.u_from_x,
            **launch)
    return a, y_new, s, stats


def entry_backward(kind: Entry, x, y, r, params, stats, ga, gy, gx, gs, dx, dy,
                   scale: torch.Tensor | None = None):
    """Backward of :func:`entry_forward`: writes the streams' gradients into the [rows, h]
    tensors ``dx`` and ``dy`` (which may be the halves of one packed tensor) and returns
    (dr, the gradients of ``params`` = (wa, ba, wb, bb, wc, bc, wu, bu)), None where absent
    (dr without an update). ``ga`` / ``gy`` / ``gx`` are the gradients of a, of y_new or the
    passed y, and of the passed x, None where the launch has no such output."""
    wa, ba, wb, bb, wc, bc, wu, bu = params
    update = r is not None
    recompute_u = update and kind.u_from_x
    xr, yr = _rows(x), _rows(y)
    rr = _rows(r) if update else xr
    n_rows, n_cols = xr.shape
    has_gx, has_gy = gx is not None, gy is not None
    gs = _rows(gs)  # stands in for an absent gradient, which the kernel does not read
    ga = gs if ga is None else _rows(ga)
    gy = _rows(gy) if has_gy else gs
    gx = _rows(gx) if has_gx else gs
    dr = torch.empty((n_rows, n_cols), dtype=rr.dtype, device=rr.device) if update else dx
    has_bias = bb is not None
    launch = _launch_args(n_cols, ENTRY_BACKWARD_TILE, MAX_BACKWARD_WARPS)

    def run(kernel, partials, rows_per_program):
        return kernel(
            xr, yr, rr, xr.stride(0), yr.stride(0), rr.stride(0),
            wa, wa if ba is None else ba, wb, wb if bb is None else bb,
            wa if wc is None else wc, wa if wu is None else wu, wa if bu is None else bu,
            stats, ga, gy, gx, gs, ga.stride(0), gy.stride(0), gx.stride(0), gs.stride(0),
            dx, dy, dr, dx.stride(0), dy.stride(0), partials,
            n_rows, n_cols, rows_per_program, scale if update else stats, kind.eps,
            IS_RMS=kind.is_rms, HAS_BIAS=has_bias, UPDATE=update,
            STORE_A=kind.store_a, HAS_C=wc is not None, RECOMPUTE_U=recompute_u,
            GATE=kind.gate, HAS_GX=has_gx, HAS_GY=has_gy,
            RELOAD=wc is not None and launch["BLOCK"] >= RELOAD_FROM, **launch)

    weights = [wa, wb, wc] + ([wu] if recompute_u else [])  # the kernel's slots
    biases = [ba, bb, bc] + ([bu] if recompute_u else [])
    partials = _backward(kern.entry_bwd, n_rows, xr.device,
                         len(weights) * (1 + has_bias), n_cols, run)
    grads = _sum_partials(partials, weights + biases)  # biases None without bias slots
    dwa, dwb, dwc, *dwu = grads[:len(weights)]
    dba, dbb, dbc, *dbu = grads[len(weights):]
    return (dr if update else None,
            (dwa, dba, dwb, dbb, dwc, dbc, *(dwu or [None]), *(dbu or [None])))


class EntryFunction(torch.autograd.Function):
    """(a, y_out, x_out, s) with a = Na(x), s = Nc(Na(x) + Nb(y)); see ``triton_kernels``.

    The streams are either one ``packed`` tensor whose two views ``halves(packed)`` are
    (x, y), then x and y are None and backward writes the packed gradient in place (no
    concatenation), or two tensors x and y (block 0, where both are the embedding).

    With ``r`` given, (x, y) first become (x + r / scale, y + r) and y_out is the new y;
    otherwise y_out is y itself where ``kind.pass_y`` (a view of ``packed``), else None;
    x_out likewise with ``kind.pass_x``. ``a`` is None unless ``kind.store_a``; ``wc`` None
    drops Nc. Biases are None for RMSNorm and for LayerNorm without bias (all norms alike:
    ``fuse``; a gate has none). Backward of an update keeps x (here u), y and r, not the
    updated streams; with ``kind.u_from_x``, x is the previous entry's input and u = Nu(x)
    (weight ``wu``, bias ``bu``) is computed from it: when x is a half of the layer input,
    which the attention entry keeps anyway, u is then neither stored nor kept.
    """

    @staticmethod
    def forward(ctx, kind: Entry, halves: Callable | None, packed, x, y, r, scale,
                wa, ba, wb, bb, wc, bc, wu=None, bu=None):
        if packed is not None:
            x, y = halves(packed)
        params = (wa, ba, wb, bb, wc, bc, wu, bu)
        scale = scale_operand(scale, x) if r is not None else None
        a, y_new, s, stats = entry_forward(kind, x, y, r, *params, scale=scale)
        ctx.save_for_backward(x, y, r, *params, stats)
        ctx.kind, ctx.halves, ctx.scale = kind, halves, scale
        ctx.packed_shape = None if packed is None else packed.shape
        shape = x.shape
        y_out = y_new.view(shape) if r is not None else (y if kind.pass_y else None)
        return (None if a is None else a.view(shape), y_out, x if kind.pass_x else None,
                s.view(shape))

    @staticmethod
    def backward(ctx, grad_a, grad_y, grad_x, grad_s):
        x, y, r, *params, stats = ctx.saved_tensors
        kind = ctx.kind
        n_cols = x.shape[-1]
        dpacked = None
        if ctx.packed_shape is not None:
            dpacked = x.new_empty(ctx.packed_shape)
            dx, dy = (half.view(-1, n_cols) for half in ctx.halves(dpacked))  # in place
        else:
            dx = x.new_empty((x.numel() // n_cols, n_cols))
            dy = y.new_empty((y.numel() // n_cols, n_cols))
        dr, param_grads = entry_backward(
            kind, x, y, r, params, stats, grad_a if kind.store_a else None,
            grad_y if r is not None or kind.pass_y else None,
            grad_x if kind.pass_x else None, grad_s, dx, dy, ctx.scale)
        shape = grad_s.shape
        if dpacked is not None:
            stream_grads = (dpacked, None, None)
        else:
            stream_grads = (None, dx.view(shape), dy.view(shape))
        return (None, None, *stream_grads, None if dr is None else dr.view(shape), None,
                *param_grads)


def dual_update_forward(u, y, r, scale: torch.Tensor, ox, oy) -> None:
    """Writes u + r / scale into ``ox`` and y + r into ``oy`` ([rows, h], one row stride)."""
    ur, yr, rr = _rows(u), _rows(y), _rows(r)
    n_rows, n_cols = ur.shape
    if n_rows:
        launch = _launch_args(n_cols)
        kern.dual_update_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
            ur, yr, rr, ur.stride(0), yr.stride(0), rr.stride(0), ox, oy, ox.stride(0),
            n_rows, n_cols, scale, **launch)


def dual_update_backward(gx, gy, scale: torch.Tensor):
    """r's gradient gx / scale + gy of :func:`dual_update_forward`, shaped like ``gx``."""
    n_cols = gx.shape[-1]
    gxr, gyr = _rows(gx), _rows(gy)
    n_rows = gxr.shape[0]
    dr = torch.empty((n_rows, n_cols), dtype=gx.dtype, device=gx.device)
    if n_rows:
        launch = _launch_args(n_cols)
        kern.dual_update_bwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
            gxr, gyr, gxr.stride(0), gyr.stride(0), dr, n_rows, n_cols, scale, **launch)
    return dr.view(gx.shape)


class DualUpdateFunction(torch.autograd.Function):
    """out with halves(out) = (u + r / scale, y + r): the two results written in place into
    the given (fresh, grad-less) tensor ``out``, whose two views ``halves`` returns. Backward
    hands u and y the halves of the packed gradient as they are (strided views, which the
    entry kernels read in place) and computes r's, gx / scale + gy, in one pass."""

    @staticmethod
    def forward(ctx, u, y, r, scale: float | torch.Tensor, out: torch.Tensor,
                halves: Callable):
        ox, oy = (half.view(-1, u.shape[-1]) for half in halves(out))  # written in place
        if ox.stride(0) != oy.stride(0) or ox.stride(-1) != 1 or oy.stride(-1) != 1:
            raise ValueError("the packed halves must be row-contiguous with one row stride")
        ctx.scale, ctx.halves = scale_operand(scale, u), halves
        dual_update_forward(u, y, r, ctx.scale, ox, oy)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx, gy = ctx.halves(grad)
        return gx, gy, dual_update_backward(gx, gy, ctx.scale), None, None, None


def qkv_norm_forward(mixed, heads: int, dim: int, eps: float, is_rms: bool,
                     wq, bq, wk, bk, wv, bv, zero_stats: bool = False):
    """(q, k, v, rows, stats) of :class:`QKVNormFunction`: ``rows`` is the projection as
    contiguous [rows, (heads + 2) dim], which backward reads. Shared with the registered op
    ``siamesenorm::qkv_norm`` (``kernels/norm_library.py``), which sets ``zero_stats``."""
    lead = mixed.shape[:-2]
    groups = mixed.shape[-2]
    rows = mixed.reshape(-1, (heads + 2) * dim)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    n_rows = rows.shape[0]
    q = torch.empty((*lead, groups * heads, dim), dtype=mixed.dtype, device=mixed.device)
    k = torch.empty((*lead, groups, dim), dtype=mixed.dtype, device=mixed.device)
    v = torch.empty_like(k)
    stats = (torch.zeros if zero_stats else torch.empty)(
        (n_rows, heads + 2, 2), dtype=torch.float32, device=mixed.device)
    has_bias = bq is not None
    if n_rows:
        launch = _head_launch_args(heads, dim)
        kern.qkv_norm_fwd[(triton.cdiv(n_rows, launch["ROWS"]),)](
            rows, wq, wk, wv, bq if has_bias else wq, bk if has_bias else wk,
            bv if has_bias else wv, q, k, v, stats, n_rows, heads, dim, eps,
            IS_RMS=is_rms, HAS_BIAS=has_bias, **launch)
    return q, k, v, rows, stats


def qkv_norm_backward(gq, gk, gv, rows, wq, wk, wv, stats, heads: int, dim: int,
                      is_rms: bool, has_bias: bool):
    """(d rows, dwq, dbq, dwk, dbk, dwv, dbv) of :func:`qkv_norm_forward` (biases' None
    without a bias)."""
    n_rows = rows.shape[0]
    gq, gk, gv = (g.contiguous() for g in (gq, gk, gv))
    drows = torch.empty_like(rows)
    launch = _head_launch_args(heads, dim, QKV_BACKWARD_TILE)

    def run(kernel, partials, rows_per_program):
        return kernel(
            rows, wq, wk, wv, stats, gq, gk, gv, drows, partials, n_rows, heads, dim,
            rows_per_program, IS_RMS=is_rms, HAS_BIAS=has_bias, **launch)

    partials = _backward(kern.qkv_norm_bwd, n_rows, rows.device, 6 if has_bias else 3, dim,
                         run)
    dwq, dwk, dwv, dbq, dbk, dbv = _sum_partials(
        partials, [wq, wk, wv] + ([wq, wk, wv] if has_bias else [None] * 3))
    return drows, dwq, dbq, dwk, dbk, dwv, dbv


class QKVNormFunction(torch.autograd.Function):
    """(Q, K, V) with per-head norms, from the packed projection [.., groups, (heads + 2) dim]
    (megatron's layout per K/V group: its query heads, its key head, its value head).
    Q is [.., groups * heads, dim], K and V [.., groups, dim], all contiguous."""

    @staticmethod
    def forward(ctx, mixed, heads: int, dim: int, eps: float, is_rms: bool,
                wq, bq, wk, bk, wv, bv):
        q, k, v, rows, stats = qkv_norm_forward(mixed, heads, dim, eps, is_rms,
                                                wq, bq, wk, bk, wv, bv)
        ctx.save_for_backward(rows, wq, wk, wv, stats)
        ctx.heads, ctx.dim, ctx.is_rms, ctx.has_bias = heads, dim, is_rms, bq is not None
        ctx.mixed_shape = mixed.shape
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        rows, wq, wk, wv, stats = ctx.saved_tensors
        drows, *param_grads = qkv_norm_backward(gq, gk, gv, rows, wq, wk, wv, stats,
                                                ctx.heads, ctx.dim, ctx.is_rms, ctx.has_bias)
        return (drows.view(ctx.mixed_shape), None, None, None, None, *param_grads)


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


def dual_update(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float | torch.Tensor,
                out: torch.Tensor, halves: Callable) -> torch.Tensor:
    """``out`` with its halves set to (u + r / scale, y + r); see :class:`DualUpdateFunction`."""
    return DualUpdateFunction.apply(u, y, r, scale, out, halves)
