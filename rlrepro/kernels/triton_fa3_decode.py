"""Decode attention in Triton with the bits of flashinfer's FA3 kernel (issue #27, ``RLREPRO_ATTENTION=fa3``).

``RLREPRO_ATTENTION=fa3`` runs the trainer's forward and the engine's prefill on FA3 (:mod:`.fa3_attention`), whose
folded decode is 0.72-0.79x as fast as rlrepro's own Triton decode. This kernel is a decode row's attention with
FA3's arithmetic, written in Triton, so that the engine's decode keeps FA3's bits at Triton's speed. It follows
flashinfer 0.5.3's sm90 kernel (``hopper/mainloop_mma.cuh`` and ``attention_updater.cuh``, compiled with
``-use_fast_math``) step by step:

* KV in tiles of 96 positions aligned to position 0 (the paged kernel's tile at head size 128), walked from the
  last tile to the first; positions at or past the row's length score ``-5e4`` (``math::inf``) in the first tile;
* the scores ``S = Q K^T`` on the tensor cores in float32, 16 products at a time along the head dimension (the
  same instruction steps as FA3's wgmma: the bits do not depend on the tile's rows or warps);
* the row maximum (exact in any order); ``p = 2^(s * c - m * c)`` as one fused multiply-add and ``ex2.approx.ftz``
  (``c = sm_scale * log2(e)`` rounded to float32 once, as the kernel does); the rescale ``2^((m_old - m) * c)``;
* the row sum kept **per thread of a quad**, as FA3's wgmma fragment leaves it: thread ``q`` of a row's quad owns
  the tile's columns ``8 j + 2 q + i`` and adds them in the order ``(j, i)``, starting from its rescaled previous
  sum (``fma(sum, scale, p_first)``: the compiler fuses the two); the four partial sums meet only at the end,
  ``(s0 + s2) + (s1 + s3)`` (the quad's xor-2 then xor-1 shuffles);
* ``O = O * scale + P V`` with ``P`` rounded to bf16 and ``P V`` on the tensor cores 16 positions at a time in
  ascending order; finally ``O * (1 / sum)`` with ``div.approx.ftz``.

Every float operation is an explicit PTX instruction with FA3's flush-to-zero where FA3 has it, so the kernel's own
layout (its warps, its 16-row tile, how Triton lays the tile out) cannot change a bit. ``ASM=False`` (the CPU
interpreter) uses Triton's plain operations instead: the same order, but not FA3's bits.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["KV_TILE", "decode", "scale_log2"]

KV_TILE = 96  # FA3's KV tile at head size 128 (flashinfer's sm90 paged kernel): three 32-position pieces here
_PIECE = 32
_ROWS = 16  # a tile's rows: the query heads of one GQA group, padded (tl.dot needs 16)
_FILL = -5.0e4  # flashinfer's math::inf: masked scores


@triton.jit
def _ex2(x, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _fma(a, b, c, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.ftz.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b + c


@triton.jit
def _mul(a, b, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.ftz.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _add(a, b, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("add.rn.ftz.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a + b


@triton.jit
def _sub(a, b, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("sub.rn.ftz.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a - b


@triton.jit
def _lg2(x, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _recip(x, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, 0f3F800000, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _quad_cols(x, R: tl.constexpr):
    """A [R, 32] piece of a tile's probabilities (columns 8 j + 2 q + i, j < 4) as its eight columns per quad
    thread: eight [R, 4] tensors (index q) in the order (j, i) = (0, 0), (0, 1), (1, 0), ... (3, 1)."""
    x = tl.permute(tl.reshape(x, [R, 4, 4, 2]), (0, 2, 1, 3))  # [R, q, j, i]
    x = tl.reshape(x, [R, 4, 2, 2, 2])  # [R, q, jh, jl, i], j = 2 jh + jl
    i0, i1 = tl.split(x)  # [R, q, jh, jl]
    i0l0, i0l1 = tl.split(i0)  # [R, q, jh]
    i1l0, i1l1 = tl.split(i1)
    a00, a10 = tl.split(i0l0)  # (j = 0, i = 0), (j = 2, i = 0)
    b00, b10 = tl.split(i1l0)  # (0, 1), (2, 1)
    a01, a11 = tl.split(i0l1)  # (1, 0), (3, 0)
    b01, b11 = tl.split(i1l1)  # (1, 1), (3, 1)
    return a00, b00, a01, b01, a10, b10, a11, b11


@triton.jit
def _add_piece(acc, scale, x, R: tl.constexpr, FIRST: tl.constexpr, ASM: tl.constexpr):
    """The quad threads' sums ``acc`` [R, 4] after the piece ``x``'s eight columns each, one by one. ``FIRST``: how
    the first column enters: 0 added to ``acc``; 1 it starts the sums (a row's first tile); 2 ``fma(acc, scale, c0)``
    (a tile's first piece: the rescaled sum, fused with its first add as FA3's compiler does); 3 the same unfused."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _quad_cols(x, R)
    if FIRST == 1:
        acc = c0
    elif FIRST == 2:
        acc = _fma(acc, scale[:, None], c0, ASM)
    elif FIRST == 3:
        acc = _add(_mul(acc, scale[:, None], ASM), c0, ASM)
    else:
        acc = _add(acc, c0, ASM)
    acc = _add(acc, c1, ASM)
    acc = _add(acc, c2, ASM)
    acc = _add(acc, c3, ASM)
    acc = _add(acc, c4, ASM)
    acc = _add(acc, c5, ASM)
    acc = _add(acc, c6, ASM)
    acc = _add(acc, c7, ASM)
    return acc


@triton.jit
def _load_piece(ptr, stride_n, kv_head_off, bt_row_ptr, block_size, pos, kv_len, d, ASM: tl.constexpr):
    ok = pos < kv_len
    blk = tl.load(bt_row_ptr + pos // block_size, mask=ok, other=0)
    row = (blk * block_size + pos % block_size).to(tl.int64)
    x = tl.load(ptr + row[:, None] * stride_n + kv_head_off + d[None, :], mask=ok[:, None], other=0.0)
    if ASM:
        return x
    else:  # the interpreter's dots read 16-bit floats wrongly: widen them (exactly)
        return x.to(tl.float32)


@triton.jit
def _p16(p, dtype: tl.constexpr, ASM: tl.constexpr):
    """P rounded to the cache's dtype for the ``P V`` product (widened again under the interpreter)."""
    if ASM:
        return p.to(dtype)
    else:
        return p.to(dtype).to(tl.float32)


@triton.jit
def _exp_piece(s, m_scaled, c, EXP_FMA: tl.constexpr, ASM: tl.constexpr):
    if EXP_FMA:
        return _ex2(_fma(s, c, -m_scaled[:, None], ASM), ASM)
    else:
        return _ex2(_sub(_mul(s, c, ASM), m_scaled[:, None], ASM), ASM)


@triton.jit
def _tile(q, k_ptr, v_ptr, stride_kn, stride_vn, k_off, v_off, bt_row_ptr, block_size, kv_len, t, d, c,
          m_prev, l_prev, acc, INIT: tl.constexpr, SUM_FMA: tl.constexpr, EXP_FMA: tl.constexpr,
          R: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """One 96-position tile ``t`` of a row's KV: FA3's ``update`` and its ``O = O * scale + P V``."""
    j = tl.arange(0, 32)
    pa = t * 96 + j
    pb = pa + 32
    pc = pa + 64
    ka = _load_piece(k_ptr, stride_kn, k_off, bt_row_ptr, block_size, pa, kv_len, d, ASM)
    kb = _load_piece(k_ptr, stride_kn, k_off, bt_row_ptr, block_size, pb, kv_len, d, ASM)
    kc = _load_piece(k_ptr, stride_kn, k_off, bt_row_ptr, block_size, pc, kv_len, d, ASM)
    sa = tl.dot(q, tl.trans(ka))
    sb = tl.dot(q, tl.trans(kb))
    sc = tl.dot(q, tl.trans(kc))
    if INIT:  # the last tile: positions past the row score -5e4 (p = 0 after the max)
        sa = tl.where(pa[None, :] < kv_len, sa, -5.0e4)
        sb = tl.where(pb[None, :] < kv_len, sb, -5.0e4)
        sc = tl.where(pc[None, :] < kv_len, sc, -5.0e4)
    m_tile = tl.maximum(tl.maximum(tl.max(sa, axis=1), tl.max(sb, axis=1)), tl.max(sc, axis=1))
    if INIT:
        m_new = m_tile
        scale = m_tile  # unused
    else:
        m_new = tl.maximum(m_prev, m_tile)
        scale = _ex2(_mul(_sub(m_prev, m_new, ASM), c, ASM), ASM)
    m_scaled = _mul(m_new, c, ASM)
    p_a = _exp_piece(sa, m_scaled, c, EXP_FMA, ASM)
    p_b = _exp_piece(sb, m_scaled, c, EXP_FMA, ASM)
    p_c = _exp_piece(sc, m_scaled, c, EXP_FMA, ASM)
    if INIT:
        l_new = _add_piece(l_prev, scale, p_a, R, 1, ASM)
    elif SUM_FMA:
        l_new = _add_piece(l_prev, scale, p_a, R, 2, ASM)
    else:
        l_new = _add_piece(l_prev, scale, p_a, R, 3, ASM)
    l_new = _add_piece(l_new, scale, p_b, R, 0, ASM)
    l_new = _add_piece(l_new, scale, p_c, R, 0, ASM)
    va = _load_piece(v_ptr, stride_vn, v_off, bt_row_ptr, block_size, pa, kv_len, d, ASM)
    vb = _load_piece(v_ptr, stride_vn, v_off, bt_row_ptr, block_size, pb, kv_len, d, ASM)
    vc = _load_piece(v_ptr, stride_vn, v_off, bt_row_ptr, block_size, pc, kv_len, d, ASM)
    if INIT:
        acc = tl.dot(_p16(p_a, DT, ASM), va)
    else:
        acc = tl.dot(_p16(p_a, DT, ASM), va, _mul(acc, scale[:, None], ASM))
    acc = tl.dot(_p16(p_b, DT, ASM), vb, acc)
    acc = tl.dot(_p16(p_c, DT, ASM), vc, acc)
    return m_new, l_new, acc


@triton.jit
def _fa3_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_lens_ptr, bt_ptr, stride_bt, block_size,
                       stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, c,
                       lse_ptr, stride_ln, GROUP: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                       SUM_FMA: tl.constexpr, EXP_FMA: tl.constexpr, WRITE_LSE: tl.constexpr, LSE_FMA: tl.constexpr,
                       ASM: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    kv_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    r = tl.arange(0, R)
    d = tl.arange(0, D)
    row_ok = r < GROUP
    head = hk * GROUP + r
    q = tl.load(q_ptr + req * stride_qn + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    DT: tl.constexpr = k_ptr.dtype.element_ty
    if not ASM:
        q = q.to(tl.float32)
    bt_row = bt_ptr + req * stride_bt
    k_off = hk * stride_kh
    v_off = hk * stride_vh
    n_tiles = (kv_len + 95) // 96
    zero = tl.zeros((R,), dtype=tl.float32)
    m_i, l_i, acc = _tile(q, k_ptr, v_ptr, stride_kn, stride_vn, k_off, v_off, bt_row, block_size, kv_len,
                          n_tiles - 1, d, c, zero, tl.zeros((R, 4), dtype=tl.float32),
                          tl.zeros((R, D), dtype=tl.float32), True, SUM_FMA, EXP_FMA, R, DT, ASM)
    for i in range(1, n_tiles):
        m_i, l_i, acc = _tile(q, k_ptr, v_ptr, stride_kn, stride_vn, k_off, v_off, bt_row, block_size, kv_len,
                              n_tiles - 1 - i, d, c, m_i, l_i, acc, False, SUM_FMA, EXP_FMA, R, DT, ASM)
    # the quad's partial sums meet: xor 2, then xor 1
    lh = tl.reshape(l_i, [R, 2, 2])  # [R, qh, ql], q = 2 qh + ql
    l_even, l_odd = tl.split(lh)  # ql = 0: q = 0, 2; ql = 1: q = 1, 3
    s0, s2 = tl.split(l_even)
    s1, s3 = tl.split(l_odd)
    total = _add(_add(s0, s2, ASM), _add(s1, s3, ASM), ASM)
    out = _mul(acc, _recip(total, ASM)[:, None], ASM)
    tl.store(o_ptr + req * stride_on + head[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if WRITE_LSE:  # FA3's log-sum-exp (base 2 of the scaled scores): m * c + log2(sum)
        if LSE_FMA:
            lse = _fma(m_i, c, _lg2(total, ASM), ASM)
        else:
            lse = _add(_mul(m_i, c, ASM), _lg2(total, ASM), ASM)
        tl.store(lse_ptr + req * stride_ln + head, lse, mask=row_ok)


def scale_log2(scale: float) -> float:
    """``sm_scale * log2(e)`` as FA3 computes it: both rounded to float32, their product rounded once."""
    return float(np.float32(np.float32(scale) * np.float32(1.44269504088896340736)))


def decode(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], seq_lens: torch.Tensor,
           block_table: torch.Tensor, scale: float, *, return_lse: bool = False, num_warps: int = 4,
           num_stages: int = 3, sum_fma: bool = True, exp_fma: bool = True, lse_fma: bool = True):
    """One query per request, ``q`` [R, H, D], against the paged cache ``kv_cache`` = (k, v), each
    [blocks, block_size, Hkv, D], already holding the request's K/V at positions ``0..seq_lens[r] - 1`` through
    ``block_table`` [R, max_blocks]. Returns [R, H, D] in ``q``'s dtype with FA3's bits (on CUDA), and with
    ``return_lse`` also FA3's log-sum-exp [R, H] (float32, base 2 of the scaled scores). No host synchronisation
    (CUDA-graph friendly). ``num_warps``/``num_stages``: speed only (the bits are the same for all); the defaults
    were the fastest on an H100 (docs/BENCHMARKS.md). ``sum_fma``/``exp_fma``/``lse_fma``: which of FA3's steps its
    compiler fuses into one multiply-add (the defaults are FA3's; the others are for ``probe_fa3_decode.py``)."""
    k_cache, v_cache = kv_cache
    n, h, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if d != dk or d != triton.next_power_of_2(d):
        raise ValueError(f"fa3 decode: head size {d} must match the cache's {dk} and be a power of two")
    if h % hkv or h // hkv > _ROWS:
        raise ValueError(f"fa3 decode: {h} query heads over {hkv} KV heads (at most {_ROWS} per KV head)")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("fa3 decode: q and the cache must have a contiguous last dim")
    out = torch.empty_like(q)
    lse = torch.empty((n, h), dtype=torch.float32, device=q.device) if return_lse else out
    if n == 0:
        return (out, lse) if return_lse else out
    kf, vf = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    _fa3_decode_kernel[(n, hkv)](
        q, kf, vf, out, seq_lens, block_table, block_table.stride(0), bs,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1), out.stride(0),
        out.stride(1), scale_log2(scale), lse, h if return_lse else 0, GROUP=h // hkv, D=d, R=_ROWS,
        SUM_FMA=sum_fma, EXP_FMA=exp_fma, WRITE_LSE=return_lse, LSE_FMA=lse_fma, ASM=q.is_cuda,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    return (out, lse) if return_lse else out
