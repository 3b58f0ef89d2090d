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
  y and the branch output r, and u, which with ``RECOMPUTE_U`` it recomputes too, as the
  previous entry's ``u = Npost(x)`` from that entry's input x: the update then keeps one
  tensor, r, where storing the sums would keep two. Without ``HAS_C`` the input norm Nc is the
  identity (the paper's ablation).
- ``dual_update``: the layer's last update, written straight into the two halves of the packed
  tensor that layers exchange.
- ``qkv_norm``: the per-head Q, K and V norms of QKV-norm attention (siamese_hybrid,
  hybridnorm) read straight from the packed projection, one (token, K/V group) row of
  ``heads + 2`` heads per program, written as contiguous Q, K and V.
- ``norm``: a plain RMSNorm / LayerNorm, or with ``HAS_RESIDUAL`` a Post-Norm sublayer's
  ``N(alpha h + r)`` in one pass (the sum is recomputed in backward, never stored).

``HAS_BIAS``: the norms' LayerNorm bias (``model.norm_bias``); RMSNorm never has one. Bias
gradients are accumulated either way and dropped by the caller when there is no bias.

Forward kernels run one program per row and save each norm's mean and rstd (fp32) for the
backward. Backward kernels run a fixed number of programs, each looping over a contiguous block
of rows, accumulating weight gradients in registers and writing one fp32 partial per program;
the caller sums the partials. This avoids atomics, so results are deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _normalize(v, mask, n_cols, eps, IS_RMS: tl.constexpr):
    """(v_hat, mean, rstd) of one fp32 row that is 0 outside ``mask``. The RMS path neither
    uses nor saves the mean, so the compiler drops its reduction."""
    mean = tl.sum(v, axis=0) / n_cols
    if IS_RMS:
        centered = v
    else:
        centered = tl.where(mask, v - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    return centered * rstd, mean, rstd


@triton.jit
def _save_stats(stats_row, slot: tl.constexpr, mean, rstd, IS_RMS: tl.constexpr):
    if not IS_RMS:
        tl.store(stats_row + 2 * slot, mean)
    tl.store(stats_row + 2 * slot + 1, rstd)


@triton.jit
def _affine(v_hat, w_ptr, b_ptr, cols, mask, HAS_BIAS: tl.constexpr):
    out = v_hat * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return out


@triton.jit
def _reload_hat(v, mask, stats_row, slot: tl.constexpr, IS_RMS: tl.constexpr):
    """v_hat and rstd recomputed from the saved statistics of norm ``slot``."""
    rstd = tl.load(stats_row + 2 * slot + 1)
    if IS_RMS:
        v_hat = v * rstd
    else:
        v_hat = tl.where(mask, (v - tl.load(stats_row + 2 * slot)) * rstd, 0.0)
    return v_hat, rstd


@triton.jit
def _input_grad(g_hat, v_hat, rstd, n_cols, IS_RMS: tl.constexpr):
    """d loss / d v of a norm, given g_hat = (d loss / d out) * weight."""
    dot = tl.sum(g_hat * v_hat, axis=0) / n_cols
    if IS_RMS:
        dv = (g_hat - v_hat * dot) * rstd
    else:
        dv = (g_hat - tl.sum(g_hat, axis=0) / n_cols - v_hat * dot) * rstd
    return dv


@triton.jit
def _add_branch(v, r, scale):
    """v + r / c in fp32, rounded to v's storage dtype like the stream it stands for."""
    return (v.to(tl.float32) + r / scale).to(v.dtype)


@triton.jit
def entry_fwd(
    x_ptr, y_ptr, r_ptr, x_stride, y_stride, r_stride,
    wa_ptr, ba_ptr, wb_ptr, bb_ptr, wc_ptr, bc_ptr,
    a_out_ptr, y_out_ptr, s_out_ptr, stats_ptr,
    n_cols, scale, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, UPDATE: tl.constexpr, STORE_A: tl.constexpr,
    HAS_C: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0)
    out = row * n_cols + cols
    stats_row = stats_ptr + row * 6
    if UPDATE:
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _add_branch(x, r, scale)
        y = _add_branch(y, r, 1.0)
        tl.store(y_out_ptr + out, y, mask=mask)

    x_hat, mean, rstd = _normalize(x.to(tl.float32), mask, n_cols, eps, IS_RMS)
    _save_stats(stats_row, 0, mean, rstd, IS_RMS)
    a = _affine(x_hat, wa_ptr, ba_ptr, cols, mask, HAS_BIAS)
    if STORE_A:
        tl.store(a_out_ptr + out, a.to(a_out_ptr.dtype.element_ty), mask=mask)

    y_hat, mean, rstd = _normalize(y.to(tl.float32), mask, n_cols, eps, IS_RMS)
    _save_stats(stats_row, 1, mean, rstd, IS_RMS)
    z = a + _affine(y_hat, wb_ptr, bb_ptr, cols, mask, HAS_BIAS)

    if HAS_C:
        z_hat, mean, rstd = _normalize(z, mask, n_cols, eps, IS_RMS)
        _save_stats(stats_row, 2, mean, rstd, IS_RMS)
        z = _affine(z_hat, wc_ptr, bc_ptr, cols, mask, HAS_BIAS)
    tl.store(s_out_ptr + out, z.to(s_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _recompute_u(x, cols, mask, wu_ptr, bu_ptr, n_cols, eps, IS_RMS: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """u = Npost(x) as the previous entry computed and rounded it (same fp32 math)."""
    x_hat, _, _ = _normalize(x.to(tl.float32), mask, n_cols, eps, IS_RMS)
    return _affine(x_hat, wu_ptr, bu_ptr, cols, mask, HAS_BIAS).to(x.dtype)


@triton.jit
def entry_bwd(
    x_ptr, y_ptr, r_ptr, x_stride, y_stride, r_stride,
    wa_ptr, ba_ptr, wb_ptr, bb_ptr, wc_ptr, wu_ptr, bu_ptr, stats_ptr,
    ga_ptr, gy_ptr, gs_ptr,
    dx_ptr, dy_ptr, dr_ptr, dw_ptr,
    n_rows, n_cols, rows_per_program, scale, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, UPDATE: tl.constexpr, STORE_A: tl.constexpr,
    HAS_C: tl.constexpr, RECOMPUTE_U: tl.constexpr, BLOCK: tl.constexpr,
):
    """Gradients of :func:`entry_fwd`. ``ga``/``gy``/``gs`` are the (contiguous) gradients of
    the outputs a, y_out and s; ``dw`` receives this program's partial sums for
    (wa, ba, wb, bb, wc, bc), each ``n_cols`` long. With UPDATE, ``y_ptr`` is the old y and
    ``x_ptr`` u (or, with RECOMPUTE_U, the previous entry's input, u = Npost(x) by the weights
    ``wu``/``bu``); both updated streams are recomputed with r. dx is the gradient of u, dy that
    of the old y and dr = dx / c + dy that of the branch output r."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    wa = tl.load(wa_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wb = tl.load(wb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wc = tl.load(wc_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # wa when there is no Nc
    acc_wa = tl.zeros([BLOCK], dtype=tl.float32)
    acc_ba = tl.zeros([BLOCK], dtype=tl.float32)
    acc_wb = tl.zeros([BLOCK], dtype=tl.float32)
    acc_bb = tl.zeros([BLOCK], dtype=tl.float32)
    acc_wc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_bc = tl.zeros([BLOCK], dtype=tl.float32)

    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0)
        if UPDATE:
            if RECOMPUTE_U:
                x = _recompute_u(x, cols, mask, wu_ptr, bu_ptr, n_cols, eps, IS_RMS, HAS_BIAS)
            r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
            x = _add_branch(x, r, scale)
            y = _add_branch(y, r, 1.0)
        stats_row = stats_ptr + row * 6
        out = row * n_cols + cols
        x_hat, rstd_a = _reload_hat(x.to(tl.float32), mask, stats_row, 0, IS_RMS)
        y_hat, rstd_b = _reload_hat(y.to(tl.float32), mask, stats_row, 1, IS_RMS)
        g_z = tl.load(gs_ptr + out, mask=mask, other=0.0).to(tl.float32)
        if HAS_C:
            z = (_affine(x_hat, wa_ptr, ba_ptr, cols, mask, HAS_BIAS)
                 + _affine(y_hat, wb_ptr, bb_ptr, cols, mask, HAS_BIAS))
            z_hat, rstd_c = _reload_hat(z, mask, stats_row, 2, IS_RMS)
            acc_wc += g_z * z_hat
            acc_bc += g_z
            g_z = _input_grad(g_z * wc, z_hat, rstd_c, n_cols, IS_RMS)
        g_a = g_z
        if STORE_A:
            g_a += tl.load(ga_ptr + out, mask=mask, other=0.0).to(tl.float32)
        acc_wa += g_a * x_hat
        acc_ba += g_a
        acc_wb += g_z * y_hat
        acc_bb += g_z
        dx = _input_grad(g_a * wa, x_hat, rstd_a, n_cols, IS_RMS)
        dy = _input_grad(g_z * wb, y_hat, rstd_b, n_cols, IS_RMS)
        if UPDATE:
            dy += tl.load(gy_ptr + out, mask=mask, other=0.0).to(tl.float32)
            tl.store(dr_ptr + out, (dx / scale + dy).to(dr_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dy_ptr + out, dy.to(dy_ptr.dtype.element_ty), mask=mask)

    partial = dw_ptr + pid.to(tl.int64) * 6 * n_cols + cols
    tl.store(partial + 0 * n_cols, acc_wa, mask=mask)
    tl.store(partial + 1 * n_cols, acc_ba, mask=mask)
    tl.store(partial + 2 * n_cols, acc_wb, mask=mask)
    tl.store(partial + 3 * n_cols, acc_bb, mask=mask)
    tl.store(partial + 4 * n_cols, acc_wc, mask=mask)
    tl.store(partial + 5 * n_cols, acc_bc, mask=mask)


@triton.jit
def dual_update_fwd(
    u_ptr, y_ptr, r_ptr, u_stride, y_stride, r_stride, ox_ptr, oy_ptr, out_stride,
    n_cols, scale, BLOCK: tl.constexpr,
):
    """x = u + r / c and y = y + r, written into two strided outputs (the packed halves)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(ox_ptr + row * out_stride + cols, (u + r / scale).to(ox_ptr.dtype.element_ty),
             mask=mask)
    tl.store(oy_ptr + row * out_stride + cols, (y + r).to(oy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_input(x_ptr, x_stride, r_ptr, r_stride, alpha, row, cols, mask,
                HAS_RESIDUAL: tl.constexpr):
    """The row a norm reads: x, or alpha x + r for a Post-Norm residual (fp32)."""
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = alpha * x + tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(
            tl.float32)
    return x


@triton.jit
def norm_fwd(
    x_ptr, x_stride, r_ptr, r_stride, alpha, w_ptr, b_ptr, out_ptr, stats_ptr, n_cols, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = N(x), or N(alpha x + r) with ``HAS_RESIDUAL`` (the sum is never stored)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _norm_input(x_ptr, x_stride, r_ptr, r_stride, alpha, row, cols, mask, HAS_RESIDUAL)
    x_hat, mean, rstd = _normalize(x, mask, n_cols, eps, IS_RMS)
    _save_stats(stats_ptr + row * 2, 0, mean, rstd, IS_RMS)
    out = _affine(x_hat, w_ptr, b_ptr, cols, mask, HAS_BIAS)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd(
    x_ptr, x_stride, r_ptr, r_stride, alpha, w_ptr, stats_ptr, g_ptr, dx_ptr, dr_ptr, dw_ptr,
    n_rows, n_cols, rows_per_program,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Gradients of :func:`norm_fwd` (the sum recomputed from x and r); ``dw`` gets this
    program's partial (w, b) sums. With a residual, dr = dN and dx = alpha dN."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        x = _norm_input(x_ptr, x_stride, r_ptr, r_stride, alpha, row, cols, mask, HAS_RESIDUAL)
        x_hat, rstd = _reload_hat(x, mask, stats_ptr + row * 2, 0, IS_RMS)
        g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        acc_w += g * x_hat
        acc_b += g
        dx = _input_grad(g * w, x_hat, rstd, n_cols, IS_RMS)
        if HAS_RESIDUAL:
            tl.store(dr_ptr + row * n_cols + cols, dx.to(dr_ptr.dtype.element_ty), mask=mask)
            dx = alpha * dx
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    partial = dw_ptr + pid.to(tl.int64) * 2 * n_cols + cols
    tl.store(partial, acc_w, mask=mask)
    tl.store(partial + n_cols, acc_b, mask=mask)


@triton.jit
def _head_tile(mixed_ptr, row, heads, head_dim, HEADS: tl.constexpr, DIM: tl.constexpr):
    """One (token, K/V group) row of the packed Q/K/V projection as a [HEADS, DIM] fp32 tile:
    the group's query heads, then its key head, then its value head."""
    j = tl.arange(0, HEADS)[:, None]
    c = tl.arange(0, DIM)[None, :]
    mask = (j < heads + 2) & (c < head_dim)
    x = tl.load(mixed_ptr + row * (heads + 2) * head_dim + j * head_dim + c, mask=mask,
                other=0.0).to(tl.float32)
    return x, j, c, mask


@triton.jit
def _head_weights(q_ptr, k_ptr, v_ptr, j, c, heads, head_dim):
    """[HEADS, DIM] tile of the norm weight (or bias) each head row uses: Q's for the query
    heads, K's for the key head, V's for the value head."""
    cm = c < head_dim
    wq = tl.load(q_ptr + c, mask=cm, other=0.0).to(tl.float32)
    wk = tl.load(k_ptr + c, mask=cm, other=0.0).to(tl.float32)
    wv = tl.load(v_ptr + c, mask=cm, other=0.0).to(tl.float32)
    return tl.where(j < heads, wq, tl.where(j == heads, wk, wv))


@triton.jit
def qkv_norm_fwd(
    mixed_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, q_ptr, k_ptr, v_ptr, stats_ptr,
    heads, head_dim, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
):
    """Per-head norms of one (token, group) row of the packed projection, written as
    contiguous Q [.., heads, dim], K and V [.., dim]; per-head (mean, rstd) saved."""
    row = tl.program_id(0).to(tl.int64)
    x, j, c, mask = _head_tile(mixed_ptr, row, heads, head_dim, HEADS, DIM)
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
    rows = tl.arange(0, HEADS)
    stats = stats_ptr + row * (heads + 2) * 2 + rows * 2
    if not IS_RMS:
        tl.store(stats, mean, mask=rows < heads + 2)
    tl.store(stats + 1, rstd, mask=rows < heads + 2)
    in_dim = c < head_dim
    tl.store(q_ptr + (row * heads + j) * head_dim + c, out.to(q_ptr.dtype.element_ty),
             mask=(j < heads) & in_dim)
    tl.store(k_ptr + row * head_dim + c + 0 * j, out.to(k_ptr.dtype.element_ty),
             mask=(j == heads) & in_dim)
    tl.store(v_ptr + row * head_dim + c + 0 * j, out.to(v_ptr.dtype.element_ty),
             mask=(j == heads + 1) & in_dim)


@triton.jit
def qkv_norm_bwd(
    mixed_ptr, wq_ptr, wk_ptr, wv_ptr, stats_ptr, gq_ptr, gk_ptr, gv_ptr, dmixed_ptr, dw_ptr,
    n_rows, heads, head_dim, rows_per_program,
    IS_RMS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
):
    """Gradients of :func:`qkv_norm_fwd`: the packed projection's, and this program's partial
    sums of the six weight/bias gradients (rows wq, wk, wv, bq, bk, bv of ``dw``)."""
    pid = tl.program_id(0)
    j0 = tl.arange(0, HEADS)[:, None]
    c0 = tl.arange(0, DIM)[None, :]
    w = _head_weights(wq_ptr, wk_ptr, wv_ptr, j0, c0, heads, head_dim)
    acc_w = tl.zeros([HEADS, DIM], dtype=tl.float32)
    acc_b = tl.zeros([HEADS, DIM], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        x, j, c, mask = _head_tile(mixed_ptr, row, heads, head_dim, HEADS, DIM)
        stats = stats_ptr + row * (heads + 2) * 2 + tl.arange(0, HEADS) * 2
        valid = tl.arange(0, HEADS) < heads + 2
        rstd = tl.load(stats + 1, mask=valid, other=0.0)[:, None]
        if IS_RMS:
            x_hat = x * rstd
        else:
            mean = tl.load(stats, mask=valid, other=0.0)[:, None]
            x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        in_dim = c < head_dim
        g = tl.load(gq_ptr + (row * heads + j) * head_dim + c, mask=(j < heads) & in_dim,
                    other=0.0).to(tl.float32)
        g += tl.load(gk_ptr + row * head_dim + c + 0 * j, mask=(j == heads) & in_dim,
                     other=0.0).to(tl.float32)
        g += tl.load(gv_ptr + row * head_dim + c + 0 * j, mask=(j == heads + 1) & in_dim,
                     other=0.0).to(tl.float32)
        acc_w += g * x_hat
        acc_b += g
        g_hat = g * w
        dot = tl.sum(g_hat * x_hat, axis=1)[:, None] / head_dim
        if IS_RMS:
            dx = (g_hat - x_hat * dot) * rstd
        else:
            dx = (g_hat - tl.sum(g_hat, axis=1)[:, None] / head_dim - x_hat * dot) * rstd
        tl.store(dmixed_ptr + row * (heads + 2) * head_dim + j * head_dim + c,
                 dx.to(dmixed_ptr.dtype.element_ty), mask=mask)
    partial = dw_ptr + pid.to(tl.int64) * 6 * head_dim + tl.arange(0, DIM)
    rows = tl.arange(0, HEADS)[:, None]
    cm = tl.arange(0, DIM) < head_dim
    is_q, is_k, is_v = rows < heads, rows == heads, rows == heads + 1
    tl.store(partial, tl.sum(tl.where(is_q, acc_w, 0.0), axis=0), mask=cm)
    tl.store(partial + head_dim, tl.sum(tl.where(is_k, acc_w, 0.0), axis=0), mask=cm)
    tl.store(partial + 2 * head_dim, tl.sum(tl.where(is_v, acc_w, 0.0), axis=0), mask=cm)
    tl.store(partial + 3 * head_dim, tl.sum(tl.where(is_q, acc_b, 0.0), axis=0), mask=cm)
    tl.store(partial + 4 * head_dim, tl.sum(tl.where(is_k, acc_b, 0.0), axis=0), mask=cm)
    tl.store(partial + 5 * head_dim, tl.sum(tl.where(is_v, acc_b, 0.0), axis=0), mask=cm)
