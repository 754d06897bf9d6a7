"""Row-wise and element-wise Triton kernels: RMSNorm, log-softmax, SwiGLU, rotary embedding, embedding gather.

Reductions run one program per row, over the row in chunks of a block size that depends only on the row length,
in a fixed order, so a row's result is the same whatever else is in the call. Element-wise kernels compute each
element with the same instructions wherever it falls.

Backward kernels (training): ``rms_norm_bwd``, ``silu_and_mul_bwd`` and ``apply_rope_bwd`` compute in one pass
what the float32 torch compositions in ``triton_ops`` compute in five to ten (the rotary backward is the forward
kernel rotating by -angle). They are reproducible run to run: no atomics, and every split depends on the shape
only. RMSNorm's backward runs at most 1024 programs, each over a fixed run of rows in order ([rows, D] tiles when
D is small, e.g. the per-head q/k norms), writing its share of the weight gradient to a [programs, D] float32
buffer, which one fixed-shape torch sum then reduces over the programs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_ROW_BLOCK = 8192  # elements of a row held at once; longer rows are walked in chunks of this size


def _row_block(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), MAX_ROW_BLOCK)


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as [rows, last] with a contiguous last dim (a copy only when needed)."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: a last dim of 0 leaves -1 undefined
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# ----------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, H, stride_h, res_ptr, sum_ptr,
                     BLOCK: tl.constexpr, SINGLE: tl.constexpr, HAS_RES: tl.constexpr = False):
    """Row-wise RMSNorm. HAS_RES (single-block rows, contiguous [rows, D] x/res/sum): the row is first
    ``x + res`` rounded to x's dtype, as torch's add gives it, and that sum is also written to ``sum``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // H) * stride_x + (row % H) * stride_h  # rows of [N, H, D] with any N/H strides
    o_row = out_ptr + row * stride_o
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < D
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_x + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_x + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / D
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        y = (xf * rstd).to(x.dtype).to(tl.float32)  # normalised, rounded to x's dtype (as the torch version)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            mask = start + cols < D
            xf = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            sq += xf * xf
        var = tl.sum(sq, axis=0) / D
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        for start in range(0, D, BLOCK):
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0)
            y = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_row + start + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, gx_ptr, gwp_ptr, R, D, stride_x, stride_g, stride_gx, eps,
                         rows_per_prog, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, NEED_GX: tl.constexpr,
                         NEED_GW: tl.constexpr):
    """Program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog) and walks them in order, BLOCK_R rows
    (a [BLOCK_R, BLOCK] tile) at a time; it writes those rows' gx and row p of the [programs, D] partial sums of
    the weight gradient. rows_per_prog is a multiple of BLOCK_R."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    gw = tl.zeros((BLOCK_R, BLOCK), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_prog
    for i in range(0, rows_per_prog, BLOCK_R):
        rows = first + i + rr
        mask = (rows < R)[:, None] & cmask[None, :]  # rows past the end load zeros: gx not stored, gw += 0
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=1) / D
        rstd = (1.0 / tl.sqrt_rn(var + eps))[:, None]  # as the forward: float32 mean of squares + eps, 1 / sqrt
        y = xf * rstd
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if NEED_GW:
            gw += g * y.to(x.dtype).to(tl.float32)  # the forward multiplies the weight by y rounded to x's dtype
        if NEED_GX:
            gy = g * w
            dot = (tl.sum(gy * y, axis=1) / D)[:, None]
            gx = rstd * (gy - y * dot)
            tl.store(gx_ptr + rows[:, None] * stride_gx + cols[None, :], gx.to(gx_ptr.dtype.element_ty), mask=mask)
    if NEED_GW:
        tl.store(gwp_ptr + pid.to(tl.int64) * D + cols, tl.sum(gw, axis=0), mask=cmask)


RMS_BWD_MAX_PROGRAMS = 1024  # programs of the RMSNorm backward (and rows of its weight-gradient partials), at most
RMS_BWD_TILE = 4096  # elements of the [rows, D] tile a program holds at once (rows = 1 for D >= this)


def rms_norm_bwd_supported(d: int) -> bool:
    return d <= MAX_ROW_BLOCK


def _rms_norm_bwd_split(r: int, d: int) -> tuple[int, int, int, int]:
    """(block, block_r, rows_per_prog, programs): a function of the shape only, so every run splits the rows
    the same way and sums the weight gradient in the same order."""
    block = _row_block(d)
    per = triton.cdiv(r, RMS_BWD_MAX_PROGRAMS)
    block_r = max(1, min(RMS_BWD_TILE // block, triton.next_power_of_2(per)))
    rows_per_prog = triton.cdiv(per, block_r) * block_r
    return block, block_r, rows_per_prog, triton.cdiv(r, rows_per_prog)


def rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, need_gx: bool = True,
                 need_gw: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``rms_norm_fwd`` for rows of at most MAX_ROW_BLOCK: (grad of x in x's dtype, grad of the weight
    in its dtype), float32 inside, the math of the torch composition in ``triton_ops._RMSNorm.backward``. At most
    RMS_BWD_MAX_PROGRAMS programs, each a fixed run of rows in order; the weight gradient's per-program float32
    partials [programs, D] are then summed over programs by one fixed-shape torch sum. No atomics."""
    d = x.shape[-1]
    if not rms_norm_bwd_supported(d):
        raise ValueError(f"rms_norm_bwd: rows of {d} > {MAX_ROW_BLOCK} elements are not supported")
    if grad.shape != x.shape:
        raise ValueError(f"rms_norm_bwd: grad has shape {tuple(grad.shape)}, x {tuple(x.shape)}")
    x2, g2 = _rows(x), _rows(grad)
    r = x2.shape[0]
    gx = torch.empty(x2.shape, device=x.device, dtype=x.dtype) if need_gx else None
    gw = None
    if r == 0 or d == 0:
        gw = torch.zeros_like(weight) if need_gw else None
    elif need_gx or need_gw:
        block, block_r, rows_per_prog, progs = _rms_norm_bwd_split(r, d)
        partial = torch.empty((progs, d), device=x.device, dtype=torch.float32) if need_gw else None
        _rms_norm_bwd_kernel[(progs,)](  # an output not needed is not written: x2 stands in for its pointer
            x2, weight.contiguous(), g2, gx if need_gx else x2, partial if need_gw else x2, r, d, x2.stride(0),
            g2.stride(0), gx.stride(0) if need_gx else 0, float(eps), rows_per_prog, BLOCK_R=block_r, BLOCK=block,
            NEED_GX=need_gx, NEED_GW=need_gw, num_warps=_row_warps(block_r * block))
        gw = partial.sum(0).to(weight.dtype) if need_gw else None
    return (gx.reshape(x.shape) if need_gx else None), gw


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if x.dim() == 3 and x.stride(-1) == 1 and x.shape[1] > 0:
        # [N, H, D] read in place (e.g. the per-head q/k norms on column slices of the fused q/k/v product), rows
        # in (n, h) order: the same values as reading a contiguous copy, without the copy
        src, rows, h, stride_n, stride_h = x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    else:
        src = _rows(x)
        rows, h, stride_n, stride_h = src.shape[0], 1, src.stride(0), 0
    out = torch.empty((rows, d), device=x.device, dtype=out_dtype)
    if rows > 0:
        block = _row_block(d)
        _rms_norm_kernel[(rows,)](src, weight.contiguous(), out, d, stride_n, out.stride(0), float(eps), h, stride_h,
                                  src, src, BLOCK=block, SINGLE=block >= d, num_warps=_row_warps(block))
    return out.reshape(x.shape)


def add_rms_norm_supported(x: torch.Tensor, res: torch.Tensor) -> bool:
    """Whether ``add_rms_norm_fwd`` fuses this call: equal shapes and dtypes, contiguous, a row in one block."""
    d = x.shape[-1]
    return (x.shape == res.shape and x.dtype == res.dtype and x.is_contiguous() and res.is_contiguous()
            and _row_block(d) >= d)


def add_rms_norm_fwd(x: torch.Tensor, res: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm_fwd(s, weight, eps))`` with ``s = x + res`` in one pass: the same bits as the two calls
    (the add rounds as torch's does, and the norm runs the same per-row code on the rounded sum)."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    if not add_rms_norm_supported(x, res):
        raise ValueError("add_rms_norm_fwd: x and res must be contiguous, of one shape and dtype, rows of at most "
                         f"{_row_block(d)} values; got {tuple(x.shape)} {x.dtype} and {tuple(res.shape)} {res.dtype}")
    src, r = _rows(x), _rows(res)
    rows = src.shape[0]
    total = torch.empty_like(src)
    out = torch.empty((rows, d), device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    if rows > 0:
        block = _row_block(d)
        _rms_norm_kernel[(rows,)](src, weight.contiguous(), out, d, src.stride(0), out.stride(0), float(eps), 1, 0,
                                  r, total, BLOCK=block, SINGLE=True, HAS_RES=True, num_warps=_row_warps(block))
    return total.reshape(x.shape), out.reshape(x.shape)


# ----------------------------------------------------------------------------------------------- log-softmax
LSM_BLOCK = 4096  # values of a row per program: a row of V values is cut into cdiv(V, LSM_BLOCK) fixed ranges


@triton.jit
def _lse_partial_kernel(x_ptr, m_ptr, s_ptr, V, stride_x, P, BLOCK: tl.constexpr):
    """Program (row, p): the maximum of range p of the row and the sum of exp(x - that maximum) over it."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(m_ptr + row * P + part, m)
    tl.store(s_ptr + row * P + part, tl.sum(tl.exp(x - m_safe), axis=0))


@triton.jit
def _row_lse(m_ptr, s_ptr, row, P, P_P: tl.constexpr):
    """A row's log-sum-exp from its P range partials, in one fixed order (the same in every program of the row,
    and in every kernel that calls it: the log-softmax's write and the trainer's fused token logprob)."""
    i = tl.arange(0, P_P)
    ok = i < P
    mp = tl.load(m_ptr + row * P + i, mask=ok, other=float("-inf"))
    sp = tl.load(s_ptr + row * P + i, mask=ok, other=0.0)
    m = tl.max(mp, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m + tl.log(tl.sum(sp * tl.exp(mp - m_safe), axis=0))


@triton.jit
def _log_softmax_write_kernel(x_ptr, out_ptr, m_ptr, s_ptr, V, stride_x, stride_o, P, P_P: tl.constexpr,
                              BLOCK: tl.constexpr):
    """Program (row, p): the row's log-sum-exp from its P range partials (the same reduction in every program of
    the row), then x - lse over range p."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lse = _row_lse(m_ptr, s_ptr, row, P, P_P)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, x - lse, mask=mask)


def log_softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the last dim. Each row is cut into ranges of LSM_BLOCK values (a function of V
    alone), one program per (row, range) for the partial maxima and sums, then one per (row, range) to combine them
    in a fixed order and write: a decode step's few rows still fill the GPU, and a row's result does not depend on
    the other rows. Engine and trainer both take their logprobs from here (``kernels.token_logprob``)."""
    v = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty(x2.shape, device=x.device, dtype=torch.float32)
    if rows > 0 and v > 0:
        m, s = lse_partials(x2)
        parts = m.shape[1]
        _log_softmax_write_kernel[(rows, parts)](x2, out, m, s, v, x2.stride(0), out.stride(0), parts,
                                                 P_P=triton.next_power_of_2(parts), BLOCK=LSM_BLOCK,
                                                 num_warps=_row_warps(LSM_BLOCK))
    return out.reshape(x.shape)


@triton.jit
def _picked_log_softmax_kernel(x_ptr, t_ptr, m_ptr, s_ptr, out_ptr, V, stride_x, P, P_P: tl.constexpr):
    """Program row: ``x[row, t[row]] - lse``, the write kernel's value at one column (the same float32 difference,
    ``lse`` by ``_row_lse``); a column outside ``[0, V)`` gives NaN."""
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(m_ptr, s_ptr, row, P, P_P)
    t = tl.load(t_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + t, mask=(t >= 0) & (t < V), other=float("nan")).to(tl.float32)
    tl.store(out_ptr + row, x - lse)


def picked_log_softmax(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax_fwd(x)[..., ids]`` (one id a row, float32 result of ``ids.shape``) without writing the
    ``[rows, V]`` log-softmax: the same range partials and combining code, then one value a row, so the same bits
    (GPU test ``test_gpu_picked_log_softmax_equals_the_gather``). The sampler's logprob takes it; an id outside
    ``[0, V)`` gives NaN (the gather would fail on the device)."""
    v = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    if ids.numel() != rows:
        raise ValueError(f"picked_log_softmax: {ids.numel()} ids for {rows} rows of shape {tuple(x.shape)}")
    out = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows > 0:
        if v == 0:
            raise ValueError("picked_log_softmax: rows of 0 values have no token to pick")
        m, s = lse_partials(x2)
        parts = m.shape[1]
        _picked_log_softmax_kernel[(rows,)](x2, ids.reshape(-1).contiguous(), m, s, out, v, x2.stride(0), parts,
                                            P_P=triton.next_power_of_2(parts), num_warps=_row_warps(LSM_BLOCK))
    return out.reshape(ids.shape)


def lse_partials(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The range maxima and sums ``[rows, cdiv(V, LSM_BLOCK)]`` of a 2-D ``x2`` (rows >= 1, V >= 1, last stride 1)
    from which ``_row_lse`` combines each row's log-sum-exp."""
    rows, v = x2.shape
    parts = triton.cdiv(v, LSM_BLOCK)
    m = torch.empty((rows, parts), device=x2.device, dtype=torch.float32)
    s = torch.empty_like(m)
    _lse_partial_kernel[(rows, parts)](x2, m, s, v, x2.stride(0), parts, BLOCK=LSM_BLOCK,
                                       num_warps=_row_warps(LSM_BLOCK))
    return m, s


# ----------------------------------------------------------------------------------------------- SwiGLU
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_fwd(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate and up halves); got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], d), device=x.device, dtype=x.dtype)
    if x2.shape[0] > 0 and d > 0:
        block = min(triton.next_power_of_2(d), 2048)
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, x2.stride(0), out.stride(0), BLOCK=block,
                                                               num_warps=4)
    return out.reshape(*x.shape[:-1], d)


@triton.jit
def _silu_mul_bwd_kernel(x_ptr, g_ptr, out_ptr, d, stride_x, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_up = g * gate * sig
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(out_ptr + row * stride_o + cols, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * stride_o + d + cols, d_up.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_bwd(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of ``silu_and_mul_fwd`` w.r.t. x [..., 2d] (gate | up), in x's dtype, float32 inside."""
    d = x.shape[-1] // 2
    if grad.shape != (*x.shape[:-1], d):
        raise ValueError(f"silu_and_mul_bwd: grad has shape {tuple(grad.shape)}, expected {(*x.shape[:-1], d)}")
    x2, g2 = _rows(x), _rows(grad)
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0] > 0 and d > 0:
        block = min(triton.next_power_of_2(d), 2048)
        _silu_mul_bwd_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, g2, out, d, x2.stride(0), g2.stride(0),
                                                                   out.stride(0), BLOCK=block, num_warps=4)
    return out.reshape(x.shape)


# ----------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, half, stride_xn, stride_xh, stride_cn, stride_sn,
                 stride_on, stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NEG_SIN: tl.constexpr):
    """Rotates each (x1, x2) half-pair by the angle (cos, sin), or by -angle with NEG_SIN (the backward)."""
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < half
    mask = (heads < H)[:, None] & cmask[None, :]
    x_base = x_ptr + n * stride_xn + heads.to(tl.int64)[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(x_base, mask=mask, other=0.0)
    x2 = tl.load(x_base + half, mask=mask, other=0.0)
    # cos/sin rounded to x's dtype first, as the torch version does
    c = tl.load(cos_ptr + n * stride_cn + cols, mask=cmask, other=0.0).to(x1.dtype).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + n * stride_sn + cols, mask=cmask, other=0.0).to(x1.dtype).to(tl.float32)[None, :]
    if NEG_SIN:  # exact: negation commutes with the rounding to x's dtype
        s = -s
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o_base = out_ptr + n * stride_on + heads.to(tl.int64)[:, None] * stride_oh + cols[None, :]
    tl.store(o_base, (x1f * c - x2f * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + half, (x2f * c + x1f * s).to(out_ptr.dtype.element_ty), mask=mask)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neg_sin: bool, what: str) -> torch.Tensor:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"{what}: x must be [N, H, D] with D even; got {tuple(x.shape)}")
    n, h, dd = x.shape
    half = dd // 2
    if cos.shape != (n, half) or sin.shape != (n, half):
        raise ValueError(f"{what}: cos/sin must be [{n}, {half}]; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((n, h, dd), device=x.device, dtype=x.dtype)
    if n > 0 and h > 0 and half > 0:
        block_d = triton.next_power_of_2(half)
        block_h = max(1, min(triton.next_power_of_2(h), 4096 // block_d))
        _rope_kernel[(n, triton.cdiv(h, block_h))](
            x, cos, sin, out, h, half, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            out.stride(0), out.stride(1), BLOCK_H=block_h, BLOCK_D=block_d, NEG_SIN=neg_sin, num_warps=4)
    return out


def apply_rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rope(x, cos, sin, False, "apply_rope")


def apply_rope_bwd(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of ``apply_rope_fwd`` w.r.t. x (in grad's dtype, x's in ``triton_ops``): the rotation by -angle,
    i.e. the forward kernel with sin negated inside (``x1 c - x2 (-s) = x1 c + x2 s`` exactly), one pass."""
    return _rope(grad, cos, sin, True, "apply_rope_bwd")


# ----------------------------------------------------------------------------------------------- embedding
@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, D, stride_w, stride_o, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    tok = tl.load(ids_ptr + i).to(tl.int64)
    vals = tl.load(w_ptr + tok * stride_w + cols, mask=mask)
    tl.store(out_ptr + i * stride_o + cols, vals, mask=mask)


def embedding_fwd(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    d = weight.shape[1]
    out = torch.empty((flat.shape[0], d), device=weight.device, dtype=weight.dtype)
    if flat.shape[0] > 0 and d > 0:
        block = min(triton.next_power_of_2(d), 4096)
        _embedding_kernel[(flat.shape[0], triton.cdiv(d, block))](flat, weight, out, d, weight.stride(0),
                                                                  out.stride(0), BLOCK=block, num_warps=4)
    return out.reshape(*ids.shape, d)


@triton.jit
def _embedding_bwd_kernel(sorted_ids_ptr, order_ptr, grad_ptr, gw_ptr, n, D, stride_g, stride_gw,
                          BLOCK: tl.constexpr):
    """Program i owns the run of equal ids that starts at sorted position i (others exit): it sums the run's
    gradient rows in sorted (= original, the sort is stable) order, so no two programs touch one row."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    tok = tl.load(sorted_ids_ptr + i)
    prev = tl.load(sorted_ids_ptr + i - 1, mask=i > 0, other=-1)
    if (i == 0) | (prev != tok):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        j = i
        cur = tok
        while (j < n) & (cur == tok):
            src = tl.load(order_ptr + j).to(tl.int64)
            acc += tl.load(grad_ptr + src * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
            j += 1
            cur = tl.load(sorted_ids_ptr + j, mask=j < n, other=-1)
        tl.store(gw_ptr + tok.to(tl.int64) * stride_gw + cols, acc.to(gw_ptr.dtype.element_ty), mask=mask)


def embedding_bwd(ids: torch.Tensor, grad: torch.Tensor, num_embeddings: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic dense gradient of the embedding table: a fixed-order sum per id, no atomics."""
    d = grad.shape[-1]
    g2 = _rows(grad)
    flat = ids.reshape(-1)
    gw = torch.zeros((num_embeddings, d), device=grad.device, dtype=dtype)
    n = flat.shape[0]
    if n == 0 or d == 0:
        return gw
    sorted_ids, order = torch.sort(flat, stable=True)
    block = min(triton.next_power_of_2(d), 1024)
    _embedding_bwd_kernel[(n, triton.cdiv(d, block))](sorted_ids.contiguous(), order.contiguous(), g2, gw, n, d,
                                                      g2.stride(0), gw.stride(0), BLOCK=block, num_warps=4)
    return gw
