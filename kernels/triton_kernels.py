"""Triton kernels for the norms of a SiameseNorm block, forward and backward.

Every kernel works on rows of the hidden dimension, holds a whole row in registers and does its
arithmetic in fp32 whatever the storage dtype. These ops move little data per FLOP, so the
point of fusing is to read each input row once and write each output row once:

- ``entry``: from x and y, ``a = Na(x)``, ``s = Nc(Na(x) + Nb(y))`` in one pass. With ``Na,
  Nb, Nc = Npost, Npre, Nin`` it is a SiameseNorm sublayer's entry (``a`` is u); with ``Na,
  Nb, Nc = Na, Nb, Nfinal`` and ``a`` not stored it is the final merge. With ``UPDATE`` the
  kernel first applies the previous sublayer's dual update, ``x = u + r / c``, ``y = y + r``
  (y is written out, x only feeds the norm), so an attention update and the MLP entry cost one
  pass. Its backward re-derives both sums from what the layer keeps anyway, the layer input's
  y and the branch output r, and u; with ``RECOMPUTE_U`` u is never stored: forward and
  backward compute it as the previous entry's ``u = Npost(x)`` from that entry's input x
  (a half of the layer input), and backward sends u's gradient on through Npost to x and
  Npost's weights. The update then keeps one tensor, r, where storing the sums would keep
  two, and the attention entry writes no u. Without ``HAS_C`` the input norm Nc is the
  identity (the paper's ablation).
- ``dual_update``: the layer's last update, written straight into the two halves of the packed
  tensor that layers exchange; its backward reads the two halves of the packed gradient and
  writes the branch output's, ``gx / c + gy``.
- ``entry`` with ``GATE``: siamese_hybrid's attention entry, ``x * g + Nb(y)``, the gate g in
  place of Na. Past block 0 an entry reads the two halves of the packed layer input, and its
  backward writes dx and dy straight into the halves of the packed gradient, adding the
  gradients that later ops of the layer gave x and y (``HAS_GX``, ``HAS_GY``).
- ``qkv_norm``: the per-head Q, K and V norms of QKV-norm attention (siamese_hybrid,
  hybridnorm) read straight from the packed projection, ``ROWS`` (token, K/V group) rows of
  ``heads + 2`` heads per tile, written as contiguous Q, K and V.
- ``norm``: a plain RMSNorm / LayerNorm, or with ``HAS_RESIDUAL`` a Post-Norm sublayer's
  ``N(alpha h + r)`` in one pass (the sum is recomputed in backward, never stored).

An update's c is read from memory (``scale_ptr``, one fp32 value), not passed as a number:
every block then launches with the same arguments but a pointer, so a compiled block's graph
takes c as an input instead of holding it as a per-block constant (``model/compiled.py``).

``HAS_BIAS``: the norms' LayerNorm bias (``model.norm_bias``); RMSNorm never has one. Bias
gradients are accumulated, and their partial slots written, only with it: each accumulator is
a row's width of registers per program.

The row kernels work on tiles of ``ROWS`` rows x ``BLOCK`` columns (``qkv_norm``: heads):
several rows per tile give a program more independent loads in flight (small hidden sizes,
and the backward passes, which are otherwise latency-bound). Forward kernels run one program
per tile and save each norm's mean and rstd (fp32) for the backward. Backward kernels run a
fixed number of programs, each looping over a contiguous block of rows tile by tile,
accumulating weight gradients in registers and writing one fp32 partial per program; the
caller sums the partials (two stages, no atomics, so results are deterministic). Tile shapes
and warps are a fixed function of the hidden size (``triton_ops``), so a run is reproducible
bit for bit.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":  # tests and CPU benchmarks only
    from kernels import interpreter as _interpreter

    _interpreter.adjust()


@triton.jit
def _tile_rows(first, end, ROWS: tl.constexpr):
    """Row indices of the tile starting at ``first`` (int64) and which are below ``end``."""
    rows = first + tl.arange(0, ROWS)
    return rows, rows < end


@triton.jit
def _load(ptr, stride, rows, cols, mask, EVICT: tl.constexpr = ""):
    """[ROWS, BLOCK] tile of a tensor whose rows are contiguous, ``stride`` apart; 0 outside
    ``mask``. ``EVICT``: the cache eviction hint (a row read again soon, or for the last
    time)."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0,
                   eviction_policy=EVICT)


@triton.jit
def _store(ptr, stride, rows, cols, mask, value):
    tl.store(ptr + rows[:, None] * stride + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _normalize(v, mask, n_cols, eps, IS_RMS: tl.constexpr):
    """(v_hat, mean, rstd) of each fp32 row of a tile that is 0 outside ``mask``. The RMS path
    neither uses nor saves the mean, so the compiler drops its reduction."""
    mean = tl.sum(v, axis=1) / n_cols
    if IS_RMS:
        centered = v
    else:
        centered = tl.where(mask, v - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    return centered * rstd[:, None], mean, rstd


@triton.jit
def _save_stats(stats_ptr, rows, row_mask, WIDTH: tl.constexpr, slot: tl.constexpr, mean, rstd,
                IS_RMS: tl.constexpr):
    """Norm ``slot``'s (mean, rstd) of each row, at [row, 2 slot] of a [rows, WIDTH] array."""
    base = stats_ptr + rows * WIDTH + 2 * slot
    if not IS_RMS:
        tl.store(base, mean, mask=row_mask)
    tl.store(base + 1, rstd, mask=row_mask)


@triton.jit
def _hat(v, mask, mean, rstd, IS_RMS: tl.constexpr):
    """v normalised with given per-row statistics (fp32)."""
    if IS_RMS:
        return v * rstd[:, None]
    return tl.where(mask, (v - mean[:, None]) * rstd[:, None], 0.0)


@triton.jit
def _reload_hat(v, mask, stats_ptr, rows, row_mask, WIDTH: tl.constexpr, slot: tl.constexpr,
                IS_RMS: tl.constexpr):
    """v_hat and rstd of each row, from the statistics :func:`_save_stats` wrote."""
    base = stats_ptr + rows * WIDTH + 2 * slot
    rstd = tl.load(base + 1, mask=row_mask, other=0.0)
    mean = rstd  # RMSNorm saves no mean and uses none
    if not IS_RMS:
        mean = tl.load(base, mask=row_mask, other=0.0)
    return _hat(v, mask, mean, rstd, IS_RMS), rstd


@triton.jit
def _affine(v_hat, w_ptr, b_ptr, cols, col_mask, HAS_BIAS: tl.constexpr,
            EVICT: tl.constexpr = ""):
    out = v_hat * tl.load(w_ptr + cols, mask=col_mask, other=0.0,
                          eviction_policy=EVICT).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_mask, other=0.0,
                       eviction_policy=EVICT).to(tl.float32)[None, :]
    return out


@triton.jit
def _input_grad(g_hat, v_hat, rstd, n_cols, IS_RMS: tl.constexpr):
    """d loss / d v of a norm per row, given g_hat = (d loss / d out) * weight."""
    dot = (tl.sum(g_hat * v_hat, axis=1) / n_cols)[:, None]
    if IS_RMS:
        dv = (g_hat - v_hat * dot) * rstd[:, None]
    else:
        dv = (g_hat - (tl.sum(g_hat, axis=1) / n_cols)[:, None] - v_hat * dot) * rstd[:, None]
    return dv


@triton.jit
def _add_branch(v, r, scale):
    """v + r / c in fp32, rounded to v's storage dtype like the stream it stands for."""
    return (v.to(tl.float32) + r / scale).to(v.dtype)


@triton.jit
def entry_fwd(
    x_ptr, y_ptr, r_ptr, x_stride, y_stride, r_stride,
    wa_ptr, ba_ptr, wb_ptr, bb_ptr, wc_ptr, bc_ptr, wu_ptr, bu_ptr,
    a_out_ptr, y_out_ptr, s_out_ptr, stats_ptr,
    n_rows, n_cols, scale_ptr, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, UPDATE: tl.constexpr, STORE_A: tl.constexpr,
    HAS_C: tl.constexpr, GATE: tl.constexpr, RECOMPUTE_U: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """With ``GATE``, Na is no norm but a per-channel gate, a = x * wa (no statistics, no
    bias): siamese_hybrid's attention entry a = x g + Npre(y). With UPDATE and
    ``RECOMPUTE_U``, ``x_ptr`` is the previous entry's input x0 and the update's u is
    Npost(x0) by ``wu``/``bu``, computed here (as in backward), so that entry never stores
    u."""
    rows, row_mask = _tile_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = _load(x_ptr, x_stride, rows, cols, mask)
    y = _load(y_ptr, y_stride, rows, cols, mask)
    if UPDATE:
        if RECOMPUTE_U:
            x = _recompute_u(x, cols, mask, col_mask, wu_ptr, bu_ptr, n_cols, eps, IS_RMS,
                             HAS_BIAS)
        r = _load(r_ptr, r_stride, rows, cols, mask).to(tl.float32)
        x = _add_branch(x, r, tl.load(scale_ptr))
        y = _add_branch(y, r, 1.0)
        _store(y_out_ptr, n_cols, rows, cols, mask, y)

    if GATE:  # rounded to the stream's dtype, as x * g is in the unfused layer
        a = (x.to(tl.float32) * tl.load(wa_ptr + cols, mask=col_mask, other=0.0).to(
            tl.float32)[None, :]).to(x.dtype).to(tl.float32)
    else:
        x_hat, mean, rstd = _normalize(x.to(tl.float32), mask, n_cols, eps, IS_RMS)
        _save_stats(stats_ptr, rows, row_mask, 6, 0, mean, rstd, IS_RMS)
        a = _affine(x_hat, wa_ptr, ba_ptr, cols, col_mask, HAS_BIAS)
    if STORE_A:
        _store(a_out_ptr, n_cols, rows, cols, mask, a)

    y_hat, mean, rstd = _normalize(y.to(tl.float32), mask, n_cols, eps, IS_RMS)
    _save_stats(stats_ptr, rows, row_mask, 6, 1, mean, rstd, IS_RMS)
    b = _affine(y_hat, wb_ptr, bb_ptr, cols, col_mask, HAS_BIAS)
    if GATE:  # the gate's sum is of two values of the stream's dtype, as in the unfused layer
        b = b.to(x.dtype).to(tl.float32)
    z = a + b

    if HAS_C:
        z_hat, mean, rstd = _normalize(z, mask, n_cols, eps, IS_RMS)
        _save_stats(stats_ptr, rows, row_mask, 6, 2, mean, rstd, IS_RMS)
        z = _affine(z_hat, wc_ptr, bc_ptr, cols, col_mask, HAS_BIAS)
    _store(s_out_ptr, n_cols, rows, cols, mask, z)


@triton.jit
def _recompute_u(x, cols, mask, col_mask, wu_ptr, bu_ptr, n_cols, eps, IS_RMS: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """u = Npost(x), rounded to x's dtype as a stored u would be (same fp32 math forward and
    backward)."""
    x_hat, _, _ = _normalize(x.to(tl.float32), mask, n_cols, eps, IS_RMS)
    return _affine(x_hat, wu_ptr, bu_ptr, cols, col_mask, HAS_BIAS).to(x.dtype)


@triton.jit
def _entry_x_hat(x, r, wu_ptr, bu_ptr, stats_ptr, rows, row_mask, cols, col_mask, mask, mean_u,
                 rstd_u, scale_ptr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 UPDATE: tl.constexpr, RECOMPUTE_U: tl.constexpr, GATE: tl.constexpr):
    """The entry backward's x_hat and Na's rstd of a tile of x as forward computed them: x,
    or with UPDATE u + r / c (u itself Npost(x0) with RECOMPUTE_U, ``x`` then x0, from its
    statistics); with GATE x itself (the gate's gradient is sum(g x), a norm's with x for
    x_hat; rstd unused)."""
    if UPDATE:
        if RECOMPUTE_U:
            x = _affine(_hat(x.to(tl.float32), mask, mean_u, rstd_u, IS_RMS), wu_ptr, bu_ptr,
                        cols, col_mask, HAS_BIAS).to(x.dtype)
        x = _add_branch(x, r, tl.load(scale_ptr))
    if GATE:
        x_hat, rstd = x.to(tl.float32), rstd_u
    else:
        x_hat, rstd = _reload_hat(x.to(tl.float32), mask, stats_ptr, rows, row_mask, 6, 0,
                                  IS_RMS)
    return x_hat, rstd


@triton.jit
def _entry_y_hat(y, r, stats_ptr, rows, row_mask, mask, IS_RMS: tl.constexpr,
                 UPDATE: tl.constexpr):
    """The entry backward's y_hat and Nb's rstd of a tile of y: y, or with UPDATE y + r."""
    if UPDATE:
        y = _add_branch(y, r, 1.0)
    return _reload_hat(y.to(tl.float32), mask, stats_ptr, rows, row_mask, 6, 1, IS_RMS)


@triton.jit
def _branch(r_ptr, r_stride, rows, cols, mask, UPDATE: tl.constexpr, EVICT: tl.constexpr):
    """The branch output r of an UPDATE entry (fp32), else 0."""
    r = 0.0
    if UPDATE:
        r = _load(r_ptr, r_stride, rows, cols, mask, EVICT).to(tl.float32)
    return r


@triton.jit
def _weight(w_ptr, cols, col_mask):
    """A norm weight as an fp32 [1, BLOCK] row. Backward kernels load it where it is used, once
    per tile (a cache hit after the first), rather than holding it in registers across the
    row loop: at hidden 8192 each weight held would cost 32 registers a thread."""
    return tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _store_partial(dw_ptr, slot: tl.constexpr, n_cols, cols, col_mask, acc):
    tl.store(dw_ptr + slot * n_cols + cols, acc, mask=col_mask)


@triton.jit
def entry_bwd(
    x_ptr, y_ptr, r_ptr, x_stride, y_stride, r_stride,
    wa_ptr, ba_ptr, wb_ptr, bb_ptr, wc_ptr, wu_ptr, bu_ptr, stats_ptr,
    ga_ptr, gy_ptr, gx_ptr, gs_ptr, ga_stride, gy_stride, gx_stride, gs_stride,
    dx_ptr, dy_ptr, dr_ptr, dx_stride, dy_stride, dw_ptr,
    n_rows, n_cols, rows_per_program, scale_ptr, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, UPDATE: tl.constexpr, STORE_A: tl.constexpr,
    HAS_C: tl.constexpr, RECOMPUTE_U: tl.constexpr, GATE: tl.constexpr, HAS_GX: tl.constexpr,
    HAS_GY: tl.constexpr, RELOAD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Gradients of :func:`entry_fwd`. ``gs``/``ga`` are the gradients of the outputs s and a,
    ``gy`` (``HAS_GY``) one added to y's: that of y_out with UPDATE, else that of y itself
    where the caller reuses y; ``gx`` (``HAS_GX``) one added to x's. Every gradient is read
    and dx, dy written with their own row strides, so they may be halves of packed tensors.
    With UPDATE, ``y_ptr`` is the old y and ``x_ptr`` u (or, with RECOMPUTE_U, the previous
    entry's input x0, u = Npost(x0) by the weights ``wu``/``bu``); both updated streams are
    recomputed with r; dx is the gradient of u (with RECOMPUTE_U, of x0, through Npost), dy
    that of the old y and dr = du / c + dy that of the branch output r. ``dw`` receives this
    program's partial sums of the weight gradients (wa, wb, wc, and wu with RECOMPUTE_U),
    then with HAS_BIAS the bias gradients (ba, bb, bc, bu), each ``n_cols`` long: RMSNorm
    keeps three or four accumulators, not six or eight.

    ``RELOAD`` (with HAS_C, for wide rows): after Nc's reductions, each stream's row is read
    (and its update recomputed) again where its side needs it, rather than held normalised
    across them. The second reads are cache hits; the two reads carry different eviction
    hints (kept, then last use), which is also what keeps the compiler from merging them
    back into one held value."""
    KEEP: tl.constexpr = "evict_last" if RELOAD else ""  # the first reads, with RELOAD
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    acc_wa = tl.zeros([BLOCK], dtype=tl.float32)
    acc_wb = tl.zeros([BLOCK], dtype=tl.float32)
    acc_wc = tl.zeros([BLOCK], dtype=tl.float32)
    if RECOMPUTE_U:
        acc_wu = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BIAS:
        acc_ba = tl.zeros([BLOCK], dtype=tl.float32)
        acc_bb = tl.zeros([BLOCK], dtype=tl.float32)
        acc_bc = tl.zeros([BLOCK], dtype=tl.float32)
        if RECOMPUTE_U:
            acc_bu = tl.zeros([BLOCK], dtype=tl.float32)

    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for first in range(start, end, ROWS):
        rows, row_mask = _tile_rows(first, end, ROWS)
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load(x_ptr, x_stride, rows, cols, mask, KEEP)
        y = _load(y_ptr, y_stride, rows, cols, mask, KEEP)
        r = _branch(r_ptr, r_stride, rows, cols, mask, UPDATE, KEEP)
        mean_u = 0.0
        rstd_u = 1.0
        if RECOMPUTE_U:  # Npost's statistics of x0, for each recomputation of u
            _, mean_u, rstd_u = _normalize(x.to(tl.float32), mask, n_cols, eps, IS_RMS)
        x_hat, rstd_a = _entry_x_hat(x, r, wu_ptr, bu_ptr, stats_ptr, rows, row_mask, cols,
                                     col_mask, mask, mean_u, rstd_u, scale_ptr, IS_RMS, HAS_BIAS,
                                     UPDATE, RECOMPUTE_U, GATE)
        y_hat, rstd_b = _entry_y_hat(y, r, stats_ptr, rows, row_mask, mask, IS_RMS, UPDATE)
        g_z = _load(gs_ptr, gs_stride, rows, cols, mask).to(tl.float32)
        if HAS_C:
            z = (_affine(x_hat, wa_ptr, ba_ptr, cols, col_mask, HAS_BIAS and not GATE, KEEP)
                 + _affine(y_hat, wb_ptr, bb_ptr, cols, col_mask, HAS_BIAS, KEEP))
            z_hat, rstd_c = _reload_hat(z, mask, stats_ptr, rows, row_mask, 6, 2, IS_RMS)
            acc_wc += tl.sum(g_z * z_hat, axis=0)
            if HAS_BIAS:
                acc_bc += tl.sum(g_z, axis=0)
            g_z = _input_grad(g_z * _weight(wc_ptr, cols, col_mask), z_hat, rstd_c, n_cols,
                              IS_RMS)
            if RELOAD:  # x's row again, after Nc's reductions (see the docstring)
                x_hat, rstd_a = _entry_x_hat(
                    _load(x_ptr, x_stride, rows, cols, mask, "evict_first"),
                    _branch(r_ptr, r_stride, rows, cols, mask, UPDATE, "evict_first"), wu_ptr,
                    bu_ptr, stats_ptr, rows, row_mask, cols, col_mask, mask, mean_u, rstd_u,
                    scale_ptr, IS_RMS, HAS_BIAS, UPDATE, RECOMPUTE_U, GATE)
        # x's side: Na (or the gate)
        g_a = g_z
        if STORE_A:
            g_a += _load(ga_ptr, ga_stride, rows, cols, mask).to(tl.float32)
        acc_wa += tl.sum(g_a * x_hat, axis=0)
        if not (RELOAD and HAS_C):  # y_hat held: its sums where the compiler had them
            acc_wb += tl.sum(g_z * y_hat, axis=0)
        if HAS_BIAS:
            acc_ba += tl.sum(g_a, axis=0)
            acc_bb += tl.sum(g_z, axis=0)
        if GATE:
            dx = g_a * _weight(wa_ptr, cols, col_mask)
        else:
            dx = _input_grad(g_a * _weight(wa_ptr, cols, col_mask), x_hat, rstd_a, n_cols,
                             IS_RMS)
        if HAS_GX:
            dx += _load(gx_ptr, gx_stride, rows, cols, mask).to(tl.float32)
        # y's side: Nb
        if RELOAD and HAS_C:  # y's row again
            y_hat, rstd_b = _entry_y_hat(
                _load(y_ptr, y_stride, rows, cols, mask, "evict_first"),
                _branch(r_ptr, r_stride, rows, cols, mask, UPDATE, "evict_first"), stats_ptr,
                rows, row_mask, mask, IS_RMS, UPDATE)
            acc_wb += tl.sum(g_z * y_hat, axis=0)
        dy = _input_grad(g_z * _weight(wb_ptr, cols, col_mask), y_hat, rstd_b, n_cols, IS_RMS)
        if HAS_GY:
            dy += _load(gy_ptr, gy_stride, rows, cols, mask).to(tl.float32)
        if UPDATE:
            _store(dr_ptr, n_cols, rows, cols, mask, dx / tl.load(scale_ptr) + dy)
            if RECOMPUTE_U:  # u = Npost(x0): on to x0 and Npost's weights
                u_hat = _hat(_load(x_ptr, x_stride, rows, cols, mask).to(tl.float32), mask,
                             mean_u, rstd_u, IS_RMS)
                acc_wu += tl.sum(dx * u_hat, axis=0)
                if HAS_BIAS:
                    acc_bu += tl.sum(dx, axis=0)
                dx = _input_grad(dx * _weight(wu_ptr, cols, col_mask), u_hat, rstd_u, n_cols,
                                 IS_RMS)
        _store(dx_ptr, dx_stride, rows, cols, mask, dx)
        _store(dy_ptr, dy_stride, rows, cols, mask, dy)

    weights: tl.constexpr = 4 if RECOMPUTE_U else 3
    partial = dw_ptr + pid.to(tl.int64) * (2 * weights if HAS_BIAS else weights) * n_cols
    _store_partial(partial, 0, n_cols, cols, col_mask, acc_wa)
    _store_partial(partial, 1, n_cols, cols, col_mask, acc_wb)
    _store_partial(partial, 2, n_cols, cols, col_mask, acc_wc)
    if RECOMPUTE_U:
        _store_partial(partial, 3, n_cols, cols, col_mask, acc_wu)
    if HAS_BIAS:
        _store_partial(partial, weights + 0, n_cols, cols, col_mask, acc_ba)
        _store_partial(partial, weights + 1, n_cols, cols, col_mask, acc_bb)
        _store_partial(partial, weights + 2, n_cols, cols, col_mask, acc_bc)
        if RECOMPUTE_U:
            _store_partial(partial, weights + 3, n_cols, cols, col_mask, acc_bu)


@triton.jit
def dual_update_fwd(
    u_ptr, y_ptr, r_ptr, u_stride, y_stride, r_stride, ox_ptr, oy_ptr, out_stride,
    n_rows, n_cols, scale_ptr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """x = u + r / c and y = y + r, written into two strided outputs (the packed halves)."""
    rows, row_mask = _tile_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    r = _load(r_ptr, r_stride, rows, cols, mask).to(tl.float32)
    u = _load(u_ptr, u_stride, rows, cols, mask).to(tl.float32)
    y = _load(y_ptr, y_stride, rows, cols, mask).to(tl.float32)
    _store(ox_ptr, out_stride, rows, cols, mask, u + r / tl.load(scale_ptr))
    _store(oy_ptr, out_stride, rows, cols, mask, y + r)


@triton.jit
def dual_update_bwd(
    gx_ptr, gy_ptr, gx_stride, gy_stride, dr_ptr, n_rows, n_cols, scale_ptr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """dr = gx / c + gy, the branch output's gradient, read from the two strided halves of the
    packed gradient (u's and y's gradients are those halves themselves)."""
    rows, row_mask = _tile_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    gx = _load(gx_ptr, gx_stride, rows, cols, mask).to(tl.float32)
    gy = _load(gy_ptr, gy_stride, rows, cols, mask).to(tl.float32)
    _store(dr_ptr, n_cols, rows, cols, mask, gx / tl.load(scale_ptr) + gy)


@triton.jit
def _norm_input(x_ptr, x_stride, r_ptr, r_stride, alpha, rows, cols, mask,
                HAS_RESIDUAL: tl.constexpr):
    """The rows a norm reads: x, or alpha x + r for a Post-Norm residual (fp32)."""
    x = _load(x_ptr, x_stride, rows, cols, mask).to(tl.float32)
    if HAS_RESIDUAL:
        x = alpha * x + _load(r_ptr, r_stride, rows, cols, mask).to(tl.float32)
    return x


@triton.jit
def norm_fwd(
    x_ptr, x_stride, r_ptr, r_stride, alpha, w_ptr, b_ptr, out_ptr, stats_ptr, n_rows, n_cols,
    eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """out = N(x), or N(alpha x + r) with ``HAS_RESIDUAL`` (the sum is never stored)."""
    rows, row_mask = _tile_rows(tl.program_id(0).to(tl.int64) * ROWS, n_rows, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = _norm_input(x_ptr, x_stride, r_ptr, r_stride, alpha, rows, cols, mask, HAS_RESIDUAL)
    x_hat, mean, rstd = _normalize(x, mask, n_cols, eps, IS_RMS)
    _save_stats(stats_ptr, rows, row_mask, 2, 0, mean, rstd, IS_RMS)
    out = _affine(x_hat, w_ptr, b_ptr, cols, col_mask, HAS_BIAS)
    _store(out_ptr, n_cols, rows, cols, mask, out)


@triton.jit
def norm_bwd(
    x_ptr, x_stride, r_ptr, r_stride, alpha, w_ptr, stats_ptr, g_ptr, g_stride, dx_ptr, dr_ptr,
    dw_ptr, n_rows, n_cols, rows_per_program,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Gradients of :func:`norm_fwd` (the sum recomputed from x and r); ``dw`` gets this
    program's partial w sums, then with HAS_BIAS its b sums. With a residual, dr = dN and
    dx = alpha dN."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BIAS:
        acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for first in range(start, end, ROWS):
        rows, row_mask = _tile_rows(first, end, ROWS)
        mask = row_mask[:, None] & col_mask[None, :]
        x = _norm_input(x_ptr, x_stride, r_ptr, r_stride, alpha, rows, cols, mask,
                        HAS_RESIDUAL)
        x_hat, rstd = _reload_hat(x, mask, stats_ptr, rows, row_mask, 2, 0, IS_RMS)
        g = _load(g_ptr, g_stride, rows, cols, mask).to(tl.float32)
        acc_w += tl.sum(g * x_hat, axis=0)
        if HAS_BIAS:
            acc_b += tl.sum(g, axis=0)
        dx = _input_grad(g * _weight(w_ptr, cols, col_mask), x_hat, rstd, n_cols, IS_RMS)
        if HAS_RESIDUAL:
            _store(dr_ptr, n_cols, rows, cols, mask, dx)
            dx = alpha * dx
        _store(dx_ptr, n_cols, rows, cols, mask, dx)
    partial = dw_ptr + pid.to(tl.int64) * (2 if HAS_BIAS else 1) * n_cols
    _store_partial(partial, 0, n_cols, cols, col_mask, acc_w)
    if HAS_BIAS:
        _store_partial(partial, 1, n_cols, cols, col_mask, acc_b)


@triton.jit
def _head_tile(mixed_ptr, first, end, heads, head_dim, ROWS: tl.constexpr, HEADS: tl.constexpr,
               DIM: tl.constexpr):
    """``ROWS`` (token, K/V group) rows of the packed Q/K/V projection from row ``first`` as a
    [ROWS x HEADS, DIM] fp32 tile, one head per tile row: each row's query heads, then its
    key head, then its value head (HEADS >= heads + 2; the rest masked). Returns the tile,
    each tile row's (token, group) row and head index j, the columns c and the mask."""
    t = tl.arange(0, ROWS * HEADS)
    row = (first + t // HEADS)[:, None]
    j = (t % HEADS)[:, None]
    c = tl.arange(0, DIM)[None, :]
    mask = (row < end) & (j < heads + 2) & (c < head_dim)
    x = tl.load(mixed_ptr + row * (heads + 2) * head_dim + j * head_dim + c, mask=mask,
                other=0.0).to(tl.float32)
    return x, row, j, c, mask


@triton.jit
def _head_weights(q_ptr, k_ptr, v_ptr, j, c, heads, head_dim):
    """Tile of the norm weight (or bias) each head row uses: Q's for the query heads, K's for
    the key head, V's for the value head."""
    cm = c < head_dim
    wq = tl.load(q_ptr + c, mask=cm, other=0.0).to(tl.float32)
    wk = tl.load(k_ptr + c, mask=cm, other=0.0).to(tl.float32)
    wv = tl.load(v_ptr + c, mask=cm, other=0.0).to(tl.float32)
    return tl.where(j < heads, wq, tl.where(j == heads, wk, wv))


@triton.jit
def qkv_norm_fwd(
    mixed_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, q_ptr, k_ptr, v_ptr, stats_ptr,
    n_rows, heads, head_dim, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
    DIM: tl.constexpr,
):
    """Per-head norms of ``ROWS`` (token, group) rows of the packed projection, written as
    contiguous Q [.., heads, dim], K and V [.., dim]; per-head (mean, rstd) saved."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    x, row, j, c, mask = _head_tile(mixed_ptr, first, n_rows, heads, head_dim, ROWS, HEADS,
                                    DIM)
    mean = tl.sum(x, axis=1) / head_dim
    if IS_RMS:
        centered = x
    else:
        centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / head_dim + eps)
    out = centered * rstd[:, None] * _head_weights(wq_ptr, wk_ptr, wv_ptr, j, c, heads,
                                                   head_dim)
    if HAS_BIAS:
        out += _head_weights(bq_ptr, bk_ptr, bv_ptr, j, c, heads, head_dim)
    head_row = (row < n_rows) & (j < heads + 2)  # [ROWS x HEADS, 1]
    stats = stats_ptr + (row * (heads + 2) + j) * 2
    if not IS_RMS:
        tl.store(stats, mean[:, None], mask=head_row)
    tl.store(stats + 1, rstd[:, None], mask=head_row)
    in_dim = (row < n_rows) & (c < head_dim)
    tl.store(q_ptr + (row * heads + j) * head_dim + c, out.to(q_ptr.dtype.element_ty),
             mask=(j < heads) & in_dim)
    tl.store(k_ptr + row * head_dim + c, out.to(k_ptr.dtype.element_ty),
             mask=(j == heads) & in_dim)
    tl.store(v_ptr + row * head_dim + c, out.to(v_ptr.dtype.element_ty),
             mask=(j == heads + 1) & in_dim)


@triton.jit
def qkv_norm_bwd(
    mixed_ptr, wq_ptr, wk_ptr, wv_ptr, stats_ptr, gq_ptr, gk_ptr, gv_ptr, dmixed_ptr, dw_ptr,
    n_rows, heads, head_dim, rows_per_program,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
    DIM: tl.constexpr,
):
    """Gradients of :func:`qkv_norm_fwd`: the packed projection's, and this program's partial
    sums of the weight gradients (rows wq, wk, wv of ``dw``), then with HAS_BIAS the bias
    gradients (bq, bk, bv)."""
    pid = tl.program_id(0)
    j0 = (tl.arange(0, ROWS * HEADS) % HEADS)[:, None]
    c0 = tl.arange(0, DIM)[None, :]
    w = _head_weights(wq_ptr, wk_ptr, wv_ptr, j0, c0, heads, head_dim)
    acc_w = tl.zeros([ROWS * HEADS, DIM], dtype=tl.float32)
    if HAS_BIAS:
        acc_b = tl.zeros([ROWS * HEADS, DIM], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for first in range(start, end, ROWS):
        x, row, j, c, mask = _head_tile(mixed_ptr, first, end, heads, head_dim, ROWS, HEADS,
                                        DIM)
        head_row = (row < end) & (j < heads + 2)
        stats = stats_ptr + (row * (heads + 2) + j) * 2
        rstd = tl.load(stats + 1, mask=head_row, other=0.0)
        if IS_RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(mask, (x - tl.load(stats, mask=head_row, other=0.0)) * rstd, 0.0)
        in_dim = (row < end) & (c < head_dim)
        g = tl.load(gq_ptr + (row * heads + j) * head_dim + c, mask=(j < heads) & in_dim,
                    other=0.0).to(tl.float32)
        g += tl.load(gk_ptr + row * head_dim + c, mask=(j == heads) & in_dim,
                     other=0.0).to(tl.float32)
        g += tl.load(gv_ptr + row * head_dim + c, mask=(j == heads + 1) & in_dim,
                     other=0.0).to(tl.float32)
        acc_w += g * x_hat
        if HAS_BIAS:
            acc_b += g
        g_hat = g * w
        dot = tl.sum(g_hat * x_hat, axis=1)[:, None] / head_dim
        if IS_RMS:
            dx = (g_hat - x_hat * dot) * rstd
        else:
            dx = (g_hat - tl.sum(g_hat, axis=1)[:, None] / head_dim - x_hat * dot) * rstd
        tl.store(dmixed_ptr + row * (heads + 2) * head_dim + j * head_dim + c,
                 dx.to(dmixed_ptr.dtype.element_ty), mask=mask)
    partial = dw_ptr + pid.to(tl.int64) * (6 if HAS_BIAS else 3) * head_dim
    _store_head_sums(partial, 0, acc_w, j0, heads, head_dim, DIM)
    if HAS_BIAS:
        _store_head_sums(partial, 3, acc_b, j0, heads, head_dim, DIM)


@triton.jit
def _store_head_sums(partial, first_slot: tl.constexpr, acc, j0, heads, head_dim,
                     DIM: tl.constexpr):
    """Slots ``first_slot`` .. + 2 of a Q/K/V backward partial: ``acc`` summed over the query
    heads, the key head and the value head."""
    cols = tl.arange(0, DIM)
    cm = cols < head_dim
    base = partial + first_slot * head_dim + cols
    tl.store(base, tl.sum(tl.where(j0 < heads, acc, 0.0), axis=0), mask=cm)
    tl.store(base + head_dim, tl.sum(tl.where(j0 == heads, acc, 0.0), axis=0), mask=cm)
    tl.store(base + 2 * head_dim, tl.sum(tl.where(j0 == heads + 1, acc, 0.0), axis=0),
             mask=cm)
