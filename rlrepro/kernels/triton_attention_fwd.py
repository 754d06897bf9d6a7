"""Batch-invariant causal attention in Triton, for packed sequences and the paged KV cache alike.

One program owns ``BLOCK_Q`` consecutive queries of one sequence and the ``GROUP`` query heads that share one KV
head (GQA), so its tile has ``BLOCK_M = BLOCK_Q * GROUP_P`` rows (16, 64 or 128, see ``ATTENTION_CONFIGS``). It
walks KV positions 0, 64, 128, ... in tiles of ``BLOCK_KV``, in that order, with an online softmax in float32, up
to the block's last query position. A row whose position lies before a tile gets exactly zero weight there
(``alpha == 1``, ``p == 0``), so it leaves the row's state bitwise unchanged: a query's result depends only on its
sequence's K/V at positions ``0..p``.

Packed (no cache) and paged inputs differ only in where KV position ``j`` of sequence ``s`` is read:
``cu_seqlens_q[s] + j`` or ``block_table[s, j // bs] * bs + j % bs``. Both run the same compiled kernel (the
choice is a run-time flag), and the tile configs, chosen by the call's shape, give the same bits (GPU test), so
prefill, chunked prefill, decode and the trainer's full-sequence forward give identical bits.

The backward kernels are in :mod:`.triton_attention_bwd`; :mod:`.triton_attention` exports both.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_rowwise as _rw

try:  # Triton >= 3.4: host-side tensor descriptors (TMA on Hopper)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    _TensorDescriptor = None
from .metadata import AttentionMetadata

BLOCK_KV = 64  # KV positions per step of the online softmax: the fixed reduction order
LOG2E = 1.4426950408889634
# The reduction orders (issue #27): KV positions per online-softmax step, and whether the scale is folded into one
# multiply-add (``p = exp2(fma(qk, scale, -m * scale))``, the running max kept in unscaled units, as FlashAttention-3
# does) rather than ``s = qk * scale`` and ``s - m`` rounded apart. ``RLREPRO_ATTENTION_ORDER`` picks one.
ATTENTION_ORDERS = {"64": (64, False), "128f": (128, True)}
DEFAULT_ORDER = "64"


def attention_order() -> tuple[int, bool]:
    """(KV positions per softmax step, scale folded into an FMA) of ``RLREPRO_ATTENTION_ORDER`` (unset: the
    default order). Every CUDA attention forward of rlrepro's own kernels (Triton and Gluon: prefill, chunked
    prefill, decode, the trainer) reads it, so engine == trainer holds within one order; orders differ in bits."""
    name = os.environ.get("RLREPRO_ATTENTION_ORDER", "").strip() or DEFAULT_ORDER
    if name not in ATTENTION_ORDERS:
        raise ValueError(f"RLREPRO_ATTENTION_ORDER={name!r} is not one of {sorted(ATTENTION_ORDERS)}: unset it for "
                         f"the default order {DEFAULT_ORDER!r}")
    return ATTENTION_ORDERS[name]


@dataclass(frozen=True)
class AttentionConfig:
    rows: int  # query tokens x heads of a group per program (wgmma M: 64 per warpgroup)
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # a cap on registers per thread (ptxas), so that more programs share an SM


# "decode" serves calls of a few queries per sequence (decode steps: one): 16 rows, one warp, so a decode step
# wastes 12 of 16 rows instead of 60 of 64 (H200, 64 x 2048 context: 0.160 vs 0.235 ms a layer). "small" serves
# mixed steps and short prefills; "large" long calls of short query runs (a mixed step: decodes and a chunk);
# "long" long calls whose sequences bring at least LONG_MIN_QUERIES queries each on average (prefill, chunked
# prefill, the trainer): 256 rows in 16 warps, so each KV tile read serves twice the queries (H200, Qwen3-8B heads,
# against "large": 1.22x at 4 x 2048 causal, 1.25x at 16k, 2.1x for 512-token chunks against a paged 2k cache;
# benchmarks/bench_attention_fwd.py). All keep BLOCK_KV, the KV order and one warp per 16 rows (the 1-warp tile runs
# mma.sync where the others run wgmma), so a row's softmax state evolves identically; tests/test_triton_kernels.py
# checks bitwise on the GPU that every config gives the same output. (A 2-warp, 32-row tile does not: it splits the
# KV columns across warps.)
ATTENTION_CONFIGS = {
    "small": AttentionConfig(rows=64, num_warps=4, num_stages=2),
    "large": AttentionConfig(rows=128, num_warps=8, num_stages=2),
    "large3": AttentionConfig(rows=128, num_warps=8, num_stages=3),
    "long": AttentionConfig(rows=256, num_warps=16, num_stages=3),
    "decode": AttentionConfig(rows=16, num_warps=1, num_stages=2),
    "small1": AttentionConfig(rows=64, num_warps=4, num_stages=1),
}
LARGE_MIN_TOKENS = 1024  # calls with at least this many query tokens use "large" or "long" (H200: prefill 13% faster)
LONG_MIN_QUERIES = 128  # ... and "long" when they average at least this many queries per sequence
LONG_MAX_HEAD_DIM = 128  # "long" holds 256 x D of Q and 3 stages of 64 x D of K and V in shared memory
# Packed calls read whole KV tiles by tensor descriptors (TMA) in tiles of at most this many rows; the 256-row tile
# reads them with pointer loads (H200, "long": 1.08x at 4 x 2048, 1.05x at 2 x 16384). The same bits either way.
DESC_MAX_ROWS = 128


def pick_attention_config(num_tokens: int, num_seqs: int = 0, group: int = 1,
                          dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> AttentionConfig:
    """The tile config for a call of ``num_tokens`` queries over ``num_seqs`` sequences with ``group`` query heads
    per KV head and heads of ``head_dim`` (``RLREPRO_ATTENTION_CONFIG`` forces one by name). Speed only: every
    config gives the same bits.

    "decode" and "long" are taken for bf16 inputs only: that is where the GPU test proves them equal to the others
    (float16 is likely the same but unproven; float32 runs ``ieee`` dots whose order may follow the tile, and the
    interpreter's numpy dots do change with it; and "long"'s float32 tiles would not fit shared memory)."""
    forced = os.environ.get("RLREPRO_ATTENTION_CONFIG")
    if forced:
        if forced not in ATTENTION_CONFIGS:
            raise ValueError(f"RLREPRO_ATTENTION_CONFIG={forced!r} is not one of {sorted(ATTENTION_CONFIGS)}")
        return ATTENTION_CONFIGS[forced]
    if num_tokens >= LARGE_MIN_TOKENS:
        if (dtype == torch.bfloat16 and num_seqs and num_tokens >= LONG_MIN_QUERIES * num_seqs
                and triton.next_power_of_2(head_dim) <= LONG_MAX_HEAD_DIM):
            return ATTENTION_CONFIGS["long"]
        return ATTENTION_CONFIGS["large"]
    per_program = ATTENTION_CONFIGS["decode"].rows // triton.next_power_of_2(group)
    if dtype == torch.bfloat16 and num_seqs and per_program >= 1 and num_tokens <= num_seqs * per_program:
        return ATTENTION_CONFIGS["decode"]  # every sequence's queries fit one 16-row tile
    return ATTENTION_CONFIGS["small"]


def config_for_order(cfg: AttentionConfig, block_kv: int, element_size: int = 2,
                     head_dim: int = 128) -> AttentionConfig:
    """The auto-picked tile ``cfg`` for an order of ``block_kv``-position steps (speed only: every tile gives the
    order's bits). With 128-position steps (H100, ``benchmarks/bench_attention_fwd.py``, 2026-12-06): the 16-row
    one-warp tile holds a whole 128 x D K tile in registers for its mma.sync and spills (decode 64 x 2048: 0.35 ms
    against 0.205 for "small1"), and the 256-row tile's 16 warps get 128 registers a thread (4 x 2048: 4.2 ms
    against 0.46 for "large"), so "large" serves the calls of the 128- and 256-row tiles (packed ones go to the
    Gluon kernel on Hopper first) and "small1" the others, and every call whose 128-position K and V tiles would
    not fit two stages of "large" in shared memory (float32, heads over 128)."""
    if block_kv <= BLOCK_KV:
        return cfg
    d_p = triton.next_power_of_2(head_dim)
    if element_size * d_p * block_kv * 2 > 128 * 1024:
        raise ValueError(f"attention: RLREPRO_ATTENTION_ORDER with {block_kv}-position steps cannot hold the K and "
                         f"V tiles of {element_size * 8}-bit heads of {head_dim} in shared memory: unset "
                         "RLREPRO_ATTENTION_ORDER for the default order")
    if cfg.rows >= 128 and element_size == 2 and d_p <= LONG_MAX_HEAD_DIM:
        return ATTENTION_CONFIGS["large"]
    return ATTENTION_CONFIGS["small1"]


def tile_shape(group: int, rows: int = 64) -> tuple[int, int]:
    """(BLOCK_Q, GROUP_P): query tokens per program and the group size padded to a power of two."""
    group_p = triton.next_power_of_2(group)
    if group_p > rows:
        raise ValueError(f"attention: {group} query heads per KV head is more than the {rows}-row tile supports")
    return rows // group_p, group_p


@triton.jit
def _schedule_kernel(cu_ptr, S, G, prog_seq_ptr, prog_q0_ptr, BLOCK_Q: tl.constexpr, S_P: tl.constexpr,
                     G_CHUNK: tl.constexpr):
    """Program slot -> (sequence, first query index). Slots past the last block get sequence -1.

    Slot g (counted from the end, so the longest-running blocks of causal attention start first) is block
    b = G-1-g of the list of all sequences' query blocks, in sequence order.
    """
    s = tl.arange(0, S_P)
    s_ok = s < S
    c0 = tl.load(cu_ptr + s, mask=s_ok, other=0)
    c1 = tl.load(cu_ptr + s + 1, mask=s_ok, other=0)
    nblk = (c1 - c0 + BLOCK_Q - 1) // BLOCK_Q
    cum = tl.cumsum(nblk, axis=0)  # blocks up to and including sequence s
    first = cum - nblk
    for g0 in range(0, G, G_CHUNK):
        b = g0 + tl.arange(0, G_CHUNK)
        seq = tl.sum((cum[None, :] <= b[:, None]).to(tl.int32), axis=1)
        sel = (s[None, :] == seq[:, None]) & s_ok[None, :]
        start = tl.sum(tl.where(sel, first[None, :], 0), axis=1)
        q0 = (b - start) * BLOCK_Q
        seq_out = tl.where(seq < S, seq, -1)
        slot = G - 1 - b
        tl.store(prog_seq_ptr + slot, seq_out, mask=b < G)
        tl.store(prog_q0_ptr + slot, q0, mask=b < G)


@triton.jit
def _softmax_step(qk, allowed, m_i, l_i, qk_scale, MASK: tl.constexpr, FMA: tl.constexpr):
    """One online-softmax step on a tile's scores ``qk`` (with ``MASK``, ``-inf`` where not ``allowed``): the new
    running max, ``p``, the rescale ``alpha`` of the old state, and the new row sum. ``FMA``: the max is unscaled
    and the scale folded into one multiply-add; else ``s = qk * scale`` first (the max scaled), ``s - m`` apart."""
    if FMA:
        if MASK:
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(tl.fma(qk, qk_scale, -(m_new * qk_scale)[:, None]))
        alpha = tl.exp2((m_i - m_new) * qk_scale)
    else:
        s = qk * qk_scale
        if MASK:
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, p, alpha, l_i


@triton.jit(do_not_specialize=["stride_bt", "block_size", "paged"])
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr,
                     bt_ptr, stride_bt, block_size, paged,
                     stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
                     qk_scale, D, k_desc, v_desc, lse_ptr, stride_ln,
                     GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_KV: tl.constexpr, D_P: tl.constexpr, PRECISION: tl.constexpr, USE_DESC: tl.constexpr,
                     WRITE_LSE: tl.constexpr, FMA: tl.constexpr = False):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + pid)
    if seq >= 0:
        q0 = tl.load(prog_q0_ptr + pid)
        cu0 = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - cu0
        kv_len = tl.load(seq_lens_ptr + seq)
        first_pos = kv_len - q_len  # position of the sequence's first query in this call

        r = tl.arange(0, BLOCK_M)
        qi = q0 + r // GROUP_P  # query index within the sequence
        g = r % GROUP_P
        row_ok = (qi < q_len) & (g < GROUP)
        tok = (cu0 + qi).to(tl.int64)
        head = (hk * GROUP + g).to(tl.int64)
        pos = first_pos + tl.minimum(qi, q_len - 1)  # padding rows borrow a real position: finite, never stored
        d = tl.arange(0, D_P)
        d_ok = d < D
        q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D_P), dtype=tl.float32)
        last_pos = first_pos + tl.minimum(q0 + BLOCK_Q, q_len) - 1  # the block's last query position
        n_tiles = last_pos // BLOCK_KV + 1
        # Tiles wholly at or before the block's first query position are visible to every row (and lie inside
        # the sequence): they run without the causal mask and the bounds masks, which would select every entry
        # there; the same values reach the same operations, so the bits are those of the masked loop.
        n_full = tl.minimum((first_pos + q0 + 1) // BLOCK_KV, n_tiles)
        j = tl.arange(0, BLOCK_KV)
        kv_head = hk.to(tl.int64)
        is_paged = (j * 0 + paged) != 0  # the run-time flag as a vector (one compiled kernel for both layouts)
        for t in range(0, n_full):
            kv_pos = t * BLOCK_KV + j
            if USE_DESC:  # packed, D a power of two: one bulk tensor copy (TMA) per tile instead of pointer loads
                k = k_desc.load([(cu0 + t * BLOCK_KV).to(tl.int32), hk * D_P])
            else:
                if paged != 0:
                    blk = tl.load(bt_ptr + seq * stride_bt + kv_pos // block_size)
                    kv_row = (blk * block_size + kv_pos % block_size).to(tl.int64)
                else:
                    kv_row = (cu0 + kv_pos).to(tl.int64)
                k = tl.load(k_ptr + kv_row[:, None] * stride_kn + kv_head * stride_kh + d[None, :],
                            mask=d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            m_new, p, alpha, l_i = _softmax_step(qk, qk, m_i, l_i, qk_scale, False, FMA)
            if USE_DESC:
                v = v_desc.load([(cu0 + t * BLOCK_KV).to(tl.int32), hk * D_P])
            else:
                v = tl.load(v_ptr + kv_row[:, None] * stride_vn + kv_head * stride_vh + d[None, :],
                            mask=d_ok[None, :], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        for t in range(n_full, n_tiles):
            kv_pos = t * BLOCK_KV + j
            kv_ok = kv_pos <= last_pos  # never read past the sequence (cache slots beyond it hold anything)
            blk = tl.load(bt_ptr + seq * stride_bt + kv_pos // block_size, mask=kv_ok & is_paged, other=0)
            kv_row = tl.where(is_paged, blk * block_size + kv_pos % block_size, cu0 + kv_pos).to(tl.int64)
            k = tl.load(k_ptr + kv_row[:, None] * stride_kn + kv_head * stride_kh + d[None, :],
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            allowed = kv_pos[None, :] <= pos[:, None]
            m_new, p, alpha, l_i = _softmax_step(qk, allowed, m_i, l_i, qk_scale, True, FMA)
            v = tl.load(v_ptr + kv_row[:, None] * stride_vn + kv_head * stride_vh + d[None, :],
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if WRITE_LSE:  # the backward's softmax statistics: log2 of the row's sum of 2^(score * log2(e))
            m_s = m_i * qk_scale if FMA else m_i
            tl.store(lse_ptr + tok * stride_ln + head, m_s + tl.log2(l_i), mask=row_ok)


def _device_schedule(cu: torch.Tensor, s_count: int, n: int, block: int,
                     meta: AttentionMetadata | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``_schedule_kernel``'s slot table for tiles of ``block`` tokens: (slots, slot -> sequence, -> first token).

    With ``meta`` the table is kept in ``meta.cache``, so the layers of one forward (and its backward) that share
    the metadata compute it once."""
    if meta is not None:
        key = ("attention_schedule", block)
        if key not in meta.cache:
            meta.cache[key] = _device_schedule(cu, s_count, n, block)
        return meta.cache[key]
    g_slots = triton.cdiv(n, block) + s_count  # >= sum over sequences of ceil(len / block)
    prog_seq = torch.empty(g_slots, device=cu.device, dtype=torch.int32)
    prog_t0 = torch.empty(g_slots, device=cu.device, dtype=torch.int32)
    s_p = triton.next_power_of_2(s_count)
    _schedule_kernel[(1,)](cu, s_count, g_slots, prog_seq, prog_t0, BLOCK_Q=block, S_P=s_p,
                           G_CHUNK=max(16, 2048 // s_p), num_warps=4)
    return g_slots, prog_seq, prog_t0


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_cs, stride_ch, HKV, D, HKV_P: tl.constexpr, D_P: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    h = tl.arange(0, HKV_P)
    d = tl.arange(0, D_P)
    ok = (h < HKV)[:, None] & (d < D)[None, :]
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + i * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + i * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata) -> None:
    """``cache[slot_mapping[i]] = k[i]`` (and v) for the paged cache [blocks, bs, Hkv, D], in one launch: the
    same bytes as ``cpu.write_kv_cache``'s two ``index_copy_`` (a copy; casts only if the dtypes differ)."""
    k_cache, v_cache = kv_cache
    n, hkv, d = k.shape
    if n == 0:
        return
    k = k.detach() if k.stride(-1) == 1 else k.detach().contiguous()
    v = v.detach() if v.stride(-1) == 1 else v.detach().contiguous()
    for name, c in (("k", k_cache), ("v", v_cache)):
        if not c.is_contiguous():
            raise ValueError(f"write_kv_cache: the {name} cache must be contiguous")
    _write_kv_kernel[(n,)](k, v, k_cache, v_cache, meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), hkv * d, d, hkv, d, HKV_P=triton.next_power_of_2(hkv),
                           D_P=triton.next_power_of_2(d), num_warps=4)


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, stride_t, wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_cn, stride_sn, eps,
                               q_ptr, stride_qn, kc_ptr, vc_ptr, slot_ptr, stride_cs, stride_ch, H, HKV, D, half,
                               BLOCK: tl.constexpr, HALF_P: tl.constexpr):
    """Program (token t, head h) of a fused q|k|v row: h < H a query head, h < H + HKV a key head, else a value
    head. Query and key heads: RMSNorm over the head (``_rms_norm_kernel``'s SINGLE code: the same float32
    statistics from the same [BLOCK] load, rounded to the input's dtype, times the weight, rounded), then the
    rotary of ``_rope_kernel`` on the rounded result; queries go to ``q``, keys into the cache at ``slot[t]``.
    Value heads are copied into the cache. Each value is the same expression as in the separate kernels."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = qkv_ptr + t * stride_t + h.to(tl.int64) * D  # q heads, then k heads, then v heads: D columns each
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if h < H + HKV:
        cols = tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < D, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / D
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        hc = tl.arange(0, HALF_P)
        hm = hc < half
        is_q = h < H
        w_ptr = tl.where(is_q, wq_ptr, wk_ptr)
        x1 = tl.load(row + hc, mask=hm, other=0.0)
        x2 = tl.load(row + half + hc, mask=hm, other=0.0)
        w1 = tl.load(w_ptr + hc, mask=hm, other=0.0)
        w2 = tl.load(w_ptr + half + hc, mask=hm, other=0.0)
        # the norm's output, in its dtype (x's and the weight's promoted; the rotary keeps it)
        y1 = ((x1.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w1.to(tl.float32)).to(q_ptr.dtype.element_ty)
        y2 = ((x2.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w2.to(tl.float32)).to(q_ptr.dtype.element_ty)
        c = tl.load(cos_ptr + t * stride_cn + hc, mask=hm, other=0.0).to(y1.dtype).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sn + hc, mask=hm, other=0.0).to(y1.dtype).to(tl.float32)
        y1f = y1.to(tl.float32)
        y2f = y2.to(tl.float32)
        r1 = (y1f * c - y2f * s).to(q_ptr.dtype.element_ty)
        r2 = (y2f * c + y1f * s).to(q_ptr.dtype.element_ty)
        if is_q:
            dst = q_ptr + t * stride_qn + h.to(tl.int64) * D
            tl.store(dst + hc, r1, mask=hm)
            tl.store(dst + half + hc, r2, mask=hm)
        else:
            dst = kc_ptr + slot * stride_cs + (h - H).to(tl.int64) * stride_ch
            tl.store(dst + hc, r1.to(kc_ptr.dtype.element_ty), mask=hm)
            tl.store(dst + half + hc, r2.to(kc_ptr.dtype.element_ty), mask=hm)
    else:
        cols = tl.arange(0, BLOCK)
        v = tl.load(row + cols, mask=cols < D, other=0.0)
        dst = vc_ptr + slot * stride_cs + (h - H - HKV).to(tl.int64) * stride_ch
        tl.store(dst + cols, v.to(vc_ptr.dtype.element_ty), mask=cols < D)


def qk_norm_rope_cache_supported(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                 kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether ``qk_norm_rope_cache`` serves this call: the cache, the product and the weights of one 16-bit dtype
    (so that each separate op's output dtype is that dtype), a head of at most 8192 values, contiguous caches.

    Not float32: there the roundings to the input's dtype between the norm, the weight and the rotary are no-ops,
    the compiler may then contract products across them into FMAs, and the H200 gave other bits than the
    separate kernels (bfloat16 and float16 gave equal bits)."""
    k_cache, v_cache = kv_cache
    d = k_cache.shape[-1]
    dt = qkv.dtype
    return (dt in (torch.bfloat16, torch.float16) and qkv.dim() == 2 and qkv.stride(-1) == 1 and d % 2 == 0
            and d <= 8192 and q_norm_weight.dtype == dt and k_norm_weight.dtype == dt and k_cache.dtype == dt
            and v_cache.dtype == dt and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q_norm_weight.shape == (d,) and k_norm_weight.shape == (d,))


def qk_norm_rope_cache(qkv: torch.Tensor, num_heads: int, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                       meta: AttentionMetadata) -> torch.Tensor:
    """One launch for what the model does between its q/k/v product and attention when it decodes: per-head
    RMSNorm of q and k, rotary on both, k and v written into the paged cache at ``meta.slot_mapping``. Returns q
    [N, H, D]. The same bits as ``rms_norm_fwd``, ``apply_rope_fwd`` and ``write_kv_cache`` one after the other
    (GPU test); inference only (no autograd)."""
    k_cache, v_cache = kv_cache
    _, _, hkv, d = k_cache.shape
    n = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * hkv) * d:
        raise ValueError(f"qk_norm_rope_cache: a q|k|v row of {qkv.shape[1]} values is not ({num_heads} + 2 x {hkv})"
                         f" heads x {d}")
    half = d // 2
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q = torch.empty((n, num_heads, d), device=qkv.device, dtype=qkv.dtype)
    if n > 0:
        block = _rw._row_block(d)  # rms_norm_fwd's block (d <= 8192: the whole head)
        _qk_norm_rope_cache_kernel[(n, num_heads + 2 * hkv)](
            qkv, qkv.stride(0), q_norm_weight, k_norm_weight, cos, sin, cos.stride(0), sin.stride(0), float(eps),
            q, q.stride(0), k_cache, v_cache, meta.slot_mapping, hkv * d, d, num_heads, hkv, d, half,
            BLOCK=block, HALF_P=triton.next_power_of_2(half),
            num_warps=_rw._row_warps(block))  # rms_norm_fwd's warps: its layout
    return q


def attention_fwd(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: AttentionMetadata,
                  scale: float, config: AttentionConfig | None = None, return_lse: bool = False):
    """q [N, H, D]; k_flat/v_flat [rows, Hkv, D]: the packed tokens, or the cache viewed as [blocks*bs, Hkv, D].

    Returns the output [N, H, D], and with ``return_lse`` also each row's log-sum-exp [N, H] float32, in base 2 of
    the scores times ``scale * log2(e)`` (what the backward needs; writing it changes no output bit).
    No host synchronisation: the schedule is computed on the device (CUDA-graph friendly).
    """
    n, h, d = q.shape
    hkv = k_flat.shape[1]
    if h % hkv:
        raise ValueError(f"attention: {h} query heads is not a multiple of {hkv} KV heads")
    group = h // hkv
    s_count = meta.num_seqs
    block_kv, fma = attention_order()
    cfg = config or pick_attention_config(n, s_count, group, q.dtype, d)
    if cfg.rows > 128 and q.is_cuda and (q.element_size() > 2 or triton.next_power_of_2(d) > LONG_MAX_HEAD_DIM):
        forced = os.environ.get("RLREPRO_ATTENTION_CONFIG")
        raise ValueError(f"attention: the {cfg.rows}-row tile (RLREPRO_ATTENTION_CONFIG={forced!r} or config=) "
                         f"needs 16-bit inputs with head_dim <= {LONG_MAX_HEAD_DIM} to fit in shared memory; got "
                         f"{q.dtype}, head_dim {d}: unset the variable or choose 'large'")
    out = torch.empty((n, h, d), device=q.device, dtype=q.dtype)
    lse = torch.zeros((n, h), device=q.device, dtype=torch.float32) if return_lse else None
    if n == 0 or s_count == 0:
        return (out, lse) if return_lse else out
    for name, t in (("q", q), ("k", k_flat), ("v", v_flat)):
        if t.stride(-1) != 1:
            raise ValueError(f"attention: {name} must have a contiguous last dim")
    cu = meta.cu_seqlens_q
    paged = meta.block_table is not None
    auto = config is None and not os.environ.get("RLREPRO_ATTENTION_CONFIG")
    if auto and not paged and cfg == ATTENTION_CONFIGS["long"] and use_gluon(q, k_flat, v_flat, group):
        from . import gluon_attention_fwd as G
        gq, gp = tile_shape(group, G.CONSUMERS * G.ROWS)
        G.attention_fwd_gluon(q, k_flat, v_flat, cu, meta.seq_lens, _device_schedule(cu, s_count, n, gq, meta),
                              scale, group, gp, gq, out, lse, block_kv=block_kv, fma=fma, n_seqs=s_count)
        return (out, lse) if return_lse else out
    if auto:
        cfg = config_for_order(cfg, block_kv, q.element_size(), d)
    block_q, group_p = tile_shape(group, cfg.rows)
    g_slots, prog_seq, prog_q0 = _device_schedule(cu, s_count, n, block_q, meta)
    bt = meta.block_table if paged else cu
    # the 256-row tile's 3 stages of 128-position K/V tiles would not fit in shared memory (forced configs only)
    stages = min(cfg.num_stages, 2) if block_kv > BLOCK_KV and cfg.rows > 128 else cfg.num_stages
    k_desc = v_desc = None
    if not paged and cfg.rows <= DESC_MAX_ROWS and _use_descriptors(k_flat, v_flat):
        k_desc, v_desc = (_kv_descriptor(t, block_kv) for t in (k_flat, v_flat))
    _attn_fwd_kernel[(g_slots, hkv)](
        q, k_flat, v_flat, out, prog_seq, prog_q0, cu, meta.seq_lens,
        bt, bt.stride(0) if paged else 0, meta.block_size if paged else 1, int(paged),
        q.stride(0), q.stride(1), k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        out.stride(0), out.stride(1), float(scale) * LOG2E, d, k_desc, v_desc,
        lse if return_lse else out, h if return_lse else 0,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=block_q * group_p, BLOCK_KV=block_kv,
        D_P=triton.next_power_of_2(d),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_DESC=k_desc is not None,
        WRITE_LSE=return_lse, FMA=fma,
        num_warps=cfg.num_warps, num_stages=stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        # no multiply-add contraction: the whole-tile loop's ``qk * scale - m`` could otherwise become one FMA
        # where the masked loop's (a select in between) cannot, and a tile's bits would depend on which loop ran it
        enable_fp_fusion=False)
    return (out, lse) if return_lse else out


GLUON_MAX_GROUP = 8  # query heads per KV head that the GPU test has proven the Gluon kernel on (1, 2, 4, 5, 8)


def use_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> bool:
    """Whether a packed call that picked the "long" tile runs the warp-specialised Gluon forward instead
    (:mod:`.gluon_attention_fwd`: the same bits, 1.02-1.13x faster on the H100): on an sm_90 GPU (H100/H200),
    with Triton 3.6 (the Gluon API it is written in), bf16 heads of 64 or 128 whose K/V heads are contiguous rows
    at 16-byte aligned addresses, at most ``GLUON_MAX_GROUP`` query heads per KV head, and neither
    ``RLREPRO_ATTENTION_GLUON=0`` nor a forced ``RLREPRO_ATTENTION_CONFIG``. Speed only."""
    if os.environ.get("RLREPRO_ATTENTION_GLUON", "1") == "0" or os.environ.get("RLREPRO_ATTENTION_CONFIG"):
        return False
    if not gluon_layout_ok(q, k, v, group) or not q.is_cuda:
        return False
    if not triton.__version__.startswith("3.6.") or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    from . import gluon_attention_fwd as G
    return G.HAVE_GLUON


def gluon_layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> bool:
    """The Gluon kernel's layout rule: bf16, heads of 64 or 128, at most ``GLUON_MAX_GROUP`` query heads per KV
    head, and K/V whose heads are contiguous rows at 16-byte aligned addresses (what its TMA descriptors read)."""
    d = q.shape[-1]
    if q.dtype != torch.bfloat16 or d not in (64, 128) or group > GLUON_MAX_GROUP or q.stride(-1) != 1:
        return False
    return all(t.dtype == q.dtype and t.stride(2) == 1 and t.stride(1) == d and (t.stride(0) * 2) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (k, v))


def _use_descriptors(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the packed forward reads its whole KV tiles by tensor descriptors (TMA): on a Hopper-or-newer GPU,
    16-bit K/V whose heads are contiguous rows of a power-of-two D at 16-byte aligned addresses, and not disabled
    by ``RLREPRO_ATTENTION_TMA=0``. Speed only: the tiles hold the same values as the pointer loads (GPU test)."""
    if os.environ.get("RLREPRO_ATTENTION_TMA", "1") == "0" or _TensorDescriptor is None or not k.is_cuda:
        return False
    if torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    for t in (k, v):
        n, hkv, d = t.shape
        if (t.dtype not in (torch.bfloat16, torch.float16) or d & (d - 1) or d < 16 or t.stride(2) != 1
                or t.stride(1) != d or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16):
            return False
    return True


def _kv_descriptor(t: torch.Tensor, rows: int, heads: int = 1):
    """A descriptor of K or V [N, Hkv, D] (or Q, dO [N, H, D]) as the 2-D [N, heads * D] (row stride kept), in
    tiles of ``rows`` tokens x ``heads`` consecutive heads."""
    n, hkv, d = t.shape
    return _TensorDescriptor(t, [n, hkv * d], [t.stride(0), 1], [rows, heads * d])



def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
