"""Backward of batch-invariant causal attention (training). ``attention_bwd_packed`` recomputes the gradients in
float32 torch math; ``attention_bwd_packed_triton`` is the deterministic FlashAttention-2-style backward of packed
causal GQA attention (q_len == kv_len per sequence), from the forward's output O and log-sum-exp (``attention_fwd(
..., return_lse=True)``, the statistics of the softmax in base 2):

* ``_attn_bwd_dq_kernel``: one program per (query tile of one sequence, KV head), its rows the tile's tokens x
  the GROUP query heads of the KV head (as in the forward). Per row: delta = rowsum(dO * O) in float32; one pass
  over KV tiles 0..last accumulates dQ in float32, the tiles every row sees whole without masks (read by tensor
  descriptors, TMA, on Hopper), the diagonal ones masked. It writes dQ and, for the next kernel, delta.
* ``_attn_bwd_dkdv_kernel``: one program per (KV tile of one sequence, KV head), which walks the sequence's
  query tokens from the tile's first position to the end in steps of BLOCK_Q tokens x GROUP heads, accumulating
  dK and dV in float32 registers: the diagonal steps masked, the steps that see the whole tile without masks (Q
  and dO by tensor descriptors when the group is a power of two), the sequence's partial last step masked.
Every output element is written by exactly one program, reduced in a fixed order: no atomics, so the result is
bitwise reproducible run to run (it differs in the last bits from ``attention_bwd_packed``). A sequence's
gradients depend only on its own tokens (tiles start at the sequence's first token; which loop runs a tile
depends only on positions within the sequence), and the tile shapes depend only on D and the dtype, not on the
call's size. The schedule is ``_schedule_kernel``'s, computed on the device: no host synchronisation.

:mod:`.triton_attention` exports these names with the forward's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata
from .triton_attention_fwd import (LOG2E, _TensorDescriptor, _device_schedule, _kv_descriptor, _use_descriptors,
                                   attention_fwd)


def attention_bwd_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         max_scores_bytes: int = 1 << 29) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of packed causal attention, recomputed in float32 torch math (deterministic, no atomics).

    Per sequence, in chunks of KV heads sized so one [heads, L, L] score tensor stays under ``max_scores_bytes``.
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    dq = torch.zeros((n, h, d), device=q.device, dtype=torch.float32)
    dk = torch.zeros((n, hkv, d), device=q.device, dtype=torch.float32)
    dv = torch.zeros((n, hkv, d), device=q.device, dtype=torch.float32)
    cu = meta.cu_seqlens_q.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        length = b - a
        if length == 0:
            continue
        causal = torch.ones(length, length, device=q.device, dtype=torch.bool).tril()
        per_kv_head = group * length * length * 4
        chunk = max(1, min(hkv, max_scores_bytes // max(per_kv_head, 1)))
        for c0 in range(0, hkv, chunk):
            c1 = min(hkv, c0 + chunk)
            nk = c1 - c0
            qh = q[a:b, c0 * group:c1 * group].float().permute(1, 0, 2).reshape(nk, group, length, d)
            kh = k[a:b, c0:c1].float().permute(1, 0, 2).unsqueeze(1)  # [nk, 1, L, D]
            vh = v[a:b, c0:c1].float().permute(1, 0, 2).unsqueeze(1)
            go = grad_out[a:b, c0 * group:c1 * group].float().permute(1, 0, 2).reshape(nk, group, length, d)
            s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
            s = s.masked_fill(~causal, float("-inf"))
            p = torch.softmax(s, dim=-1)
            del s
            dv_h = torch.matmul(p.transpose(-1, -2), go).sum(dim=1)  # [nk, L, D]
            dp = torch.matmul(go, vh.transpose(-1, -2))
            delta = (p * dp).sum(dim=-1, keepdim=True)
            ds = p * (dp - delta) * scale
            del p, dp
            dq_h = torch.matmul(ds, kh)  # [nk, G, L, D]
            dk_h = torch.matmul(ds.transpose(-1, -2), qh).sum(dim=1)
            dq[a:b, c0 * group:c1 * group] = dq_h.reshape(nk * group, length, d).permute(1, 0, 2)
            dk[a:b, c0:c1] = dk_h.permute(1, 0, 2)
            dv[a:b, c0:c1] = dv_h.permute(1, 0, 2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dataclass(frozen=True)
class AttentionBwdConfig:
    dq_rows: int  # dQ kernel: query rows (tokens x padded group) per program
    dq_kv: int  # dQ kernel: KV positions per step
    dq_warps: int
    dq_stages: int
    kv_block: int  # dK/dV kernel: KV positions per program
    kv_rows: int  # dK/dV kernel: query rows (tokens x padded group) per step
    kv_warps: int
    kv_stages: int


def pick_attention_bwd_config(d_p: int, elem_size: int) -> AttentionBwdConfig:
    """Tile shapes by padded head dim and element size only (never by the call's size): fixed reduction orders."""
    forced = os.environ.get("RLREPRO_ATTENTION_BWD_CONFIG")  # benchmarks: "dq_rows,dq_kv,...,kv_stages"
    if forced:
        return AttentionBwdConfig(*(int(x) for x in forced.split(",")))
    row_bytes = d_p * elem_size
    if elem_size == 2 and d_p <= 128:  # H200, bf16 32/8x128 (benchmarks/bench_attention_bwd.py): 1 x 16k 13.9 ms
        return AttentionBwdConfig(128, 64, 8, 3, 64, 32, 4, 3)  # (5.6 ms of dQ with 64 query rows, 2 stages: 5.2)
    if row_bytes <= 256:  # fp32 D <= 64
        return AttentionBwdConfig(64, 64, 4, 2, 64, 32, 4, 3)
    if row_bytes <= 512:  # 16-bit D = 256, fp32 D = 128
        return AttentionBwdConfig(64, 32, 4, 2, 64, 32, 8, 2)
    return AttentionBwdConfig(32, 32, 4, 1, 32, 32, 4, 1)  # fp32 D = 256


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr,
                        prog_seq_ptr, prog_q0_ptr, cu_ptr,
                        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                        stride_on, stride_oh, stride_don, stride_doh, stride_dqn, stride_dqh, stride_sn,
                        qk_scale, scale, D, k_desc, v_desc,
                        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, D_P: tl.constexpr, PRECISION: tl.constexpr,
                        USE_DESC: tl.constexpr):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + pid)
    if seq >= 0:
        q0 = tl.load(prog_q0_ptr + pid)
        cu0 = tl.load(cu_ptr + seq)
        seq_len = tl.load(cu_ptr + seq + 1) - cu0

        r = tl.arange(0, BLOCK_M)
        qi = q0 + r // GROUP_P  # query index (= position) within the sequence
        g = r % GROUP_P
        row_ok = (qi < seq_len) & (g < GROUP)
        tok = (cu0 + qi).to(tl.int64)
        head = (hk * GROUP + g).to(tl.int64)
        pos = tl.minimum(qi, seq_len - 1)  # padding rows borrow a real position: finite, never stored
        d = tl.arange(0, D_P)
        d_ok = d < D
        rmask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=rmask, other=0.0)
        do = tl.load(do_ptr + tok[:, None] * stride_don + head[:, None] * stride_doh + d[None, :], mask=rmask,
                     other=0.0)
        o = tl.load(o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + d[None, :], mask=rmask, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        lse = tl.load(lse_ptr + tok * stride_sn + head, mask=row_ok, other=0.0)  # the forward's, base 2

        last = tl.minimum(q0 + BLOCK_Q, seq_len) - 1  # the tile's last query position
        n_tiles = last // BLOCK_N + 1
        n_full = tl.minimum((q0 + 1) // BLOCK_N, n_tiles)  # tiles every row sees whole: no masks
        j = tl.arange(0, BLOCK_N)
        kv_head = hk.to(tl.int64)
        # dQ = scale * sum_j dS_ij k_j, dS = P * (dP - delta), dP = dO V^T, P = 2^(s * log2(e) - lse)
        acc = tl.zeros((BLOCK_M, D_P), dtype=tl.float32)
        for t in range(0, n_full):
            if USE_DESC:  # one bulk tensor copy (TMA) per tile
                k = k_desc.load([(cu0 + t * BLOCK_N).to(tl.int32), hk * D_P])
                v = v_desc.load([(cu0 + t * BLOCK_N).to(tl.int32), hk * D_P])
            else:
                kv_row = (cu0 + t * BLOCK_N + j).to(tl.int64)
                k = tl.load(k_ptr + kv_row[:, None] * stride_kn + kv_head * stride_kh + d[None, :],
                            mask=d_ok[None, :], other=0.0)
                v = tl.load(v_ptr + kv_row[:, None] * stride_vn + kv_head * stride_vh + d[None, :],
                            mask=d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            p = tl.exp2(qk * qk_scale - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            acc = tl.dot(ds.to(k.dtype), k, acc, input_precision=PRECISION)
        for t in range(n_full, n_tiles):
            kv_pos = t * BLOCK_N + j
            kv_ok = kv_pos <= last
            kv_row = (cu0 + kv_pos).to(tl.int64)
            kv_mask = kv_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_row[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=kv_mask,
                        other=0.0)
            v = tl.load(v_ptr + kv_row[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=kv_mask,
                        other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            p = tl.where(kv_pos[None, :] <= pos[:, None], tl.exp2(qk * qk_scale - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            acc = tl.dot(ds.to(k.dtype), k, acc, input_precision=PRECISION)
        tl.store(dq_ptr + tok[:, None] * stride_dqn + head[:, None] * stride_dqh + d[None, :],
                 (acc * scale).to(dq_ptr.dtype.element_ty), mask=rmask)
        tl.store(delta_ptr + tok * stride_sn + head, delta, mask=row_ok)


@triton.jit
def _dkdv_masked_step(q_ptr, do_ptr, lse_ptr, delta_ptr, k, v, dk, dv, kv_pos, t0, cu0, seq_len, head, g_ok, d, d_ok,
                      stride_qn, stride_qh, stride_don, stride_doh, stride_sn, qk_scale,
                      GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """One masked query step of the dK/dV kernel (tokens from ``t0``: the diagonal ones, and the sequence's last
    partial step): rows past the sequence or padding heads load zeros and get zero weight."""
    r = tl.arange(0, BLOCK_M)
    qi = t0 + r // GROUP_P
    row_ok = (qi < seq_len) & g_ok
    tok = (cu0 + qi).to(tl.int64)
    rmask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=rmask, other=0.0)
    do = tl.load(do_ptr + tok[:, None] * stride_don + head[:, None] * stride_doh + d[None, :], mask=rmask, other=0.0)
    lse = tl.load(lse_ptr + tok * stride_sn + head, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + tok * stride_sn + head, mask=row_ok, other=0.0)
    qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    allowed = (kv_pos[:, None] <= qi[None, :]) & row_ok[None, :]
    p_t = tl.where(allowed, tl.exp2(qk_t * qk_scale - lse[None, :]), 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr,
                          prog_seq_ptr, prog_n0_ptr, cu_ptr, G_SLOTS,
                          stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                          stride_don, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_sn,
                          qk_scale, scale, D, q_desc, do_desc,
                          GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, D_P: tl.constexpr, PRECISION: tl.constexpr,
                          USE_DESC: tl.constexpr):
    slot = G_SLOTS - 1 - tl.program_id(0)  # the schedule lists blocks last-first: start with the first (longest)
    hk = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + slot)
    if seq >= 0:
        n0 = tl.load(prog_n0_ptr + slot)
        cu0 = tl.load(cu_ptr + seq)
        seq_len = tl.load(cu_ptr + seq + 1) - cu0

        d = tl.arange(0, D_P)
        d_ok = d < D
        kv_pos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < seq_len
        kv_row = (cu0 + kv_pos).to(tl.int64)
        kv_head = hk.to(tl.int64)
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_row[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_row[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros((BLOCK_N, D_P), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, D_P), dtype=tl.float32)

        r = tl.arange(0, BLOCK_M)
        g = r % GROUP_P
        g_ok = g < GROUP
        head = (hk * GROUP + g).to(tl.int64)
        n_steps = (seq_len - n0 + BLOCK_Q - 1) // BLOCK_Q  # query tokens n0 .. seq_len-1 (earlier ones see none)
        # steps whose tokens all lie at or after the tile's last KV position and inside the sequence see the
        # whole tile: no causal or bounds masks there (only padding heads, whose q and dO rows are zero)
        n_diag = tl.minimum((BLOCK_N + BLOCK_Q - 2) // BLOCK_Q, n_steps)
        n_whole = tl.maximum((seq_len - n0) // BLOCK_Q, n_diag)
        for i in range(0, n_diag):
            dk, dv = _dkdv_masked_step(q_ptr, do_ptr, lse_ptr, delta_ptr, k, v, dk, dv, kv_pos, n0 + i * BLOCK_Q, cu0,
                                       seq_len, head, g_ok, d, d_ok, stride_qn, stride_qh, stride_don, stride_doh,
                                       stride_sn, qk_scale, GROUP_P, BLOCK_M, PRECISION)
        for i in range(n_diag, n_whole):
            t0 = n0 + i * BLOCK_Q
            tok = (cu0 + t0 + r // GROUP_P).to(tl.int64)
            if USE_DESC:  # BLOCK_Q tokens x the group's GROUP heads, one bulk copy each
                q = tl.reshape(q_desc.load([(cu0 + t0).to(tl.int32), hk * GROUP, 0]), (BLOCK_M, D_P))
                do = tl.reshape(do_desc.load([(cu0 + t0).to(tl.int32), hk * GROUP, 0]), (BLOCK_M, D_P))
            else:
                rmask = g_ok[:, None] & d_ok[None, :]
                q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=rmask,
                            other=0.0)
                do = tl.load(do_ptr + tok[:, None] * stride_don + head[:, None] * stride_doh + d[None, :],
                             mask=rmask, other=0.0)
            lse = tl.load(lse_ptr + tok * stride_sn + head, mask=g_ok, other=0.0)
            delta = tl.load(delta_ptr + tok * stride_sn + head, mask=g_ok, other=0.0)
            qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            p_t = tl.exp2(qk_t * qk_scale - lse[None, :])
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
        for i in range(n_whole, n_steps):  # the sequence's last, partial step
            dk, dv = _dkdv_masked_step(q_ptr, do_ptr, lse_ptr, delta_ptr, k, v, dk, dv, kv_pos, n0 + i * BLOCK_Q, cu0,
                                       seq_len, head, g_ok, d, d_ok, stride_qn, stride_qh, stride_don, stride_doh,
                                       stride_sn, qk_scale, GROUP_P, BLOCK_M, PRECISION)
        tl.store(dk_ptr + kv_row[:, None] * stride_dkn + kv_head * stride_dkh + d[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + kv_row[:, None] * stride_dvn + kv_head * stride_dvh + d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def _descriptors_ok(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors (TMA) may read these [N, heads, D] tensors (``_use_descriptors``' rule)."""
    return _use_descriptors(tensors[0], tensors[0]) and all(_use_descriptors(t, t) for t in tensors[1:])


def _rows_descriptor(t: torch.Tensor, tokens: int, heads: int):
    """A 3-D descriptor of Q or dO [N, H, D], in boxes of ``tokens`` x ``heads`` x D (each box dim <= 256)."""
    return _TensorDescriptor(t, list(t.shape), [t.stride(0), t.stride(1), 1], [tokens, heads, t.shape[2]])


def attention_bwd_packed_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                                config: AttentionBwdConfig | None = None, lse: torch.Tensor | None = None,
                                dq_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of packed causal attention (``attention_fwd`` without a cache), by deterministic Triton kernels.

    ``out`` and ``lse`` are the forward's output and log-sum-exp (``attention_fwd(..., return_lse=True)``); both
    are recomputed by the forward when ``lse`` is not given (the same bits). Same inputs and results as
    ``attention_bwd_packed``, up to rounding; bitwise reproducible run to run. No [L, L] tensor, no host sync.
    ``dq_only`` (benchmarks: the two kernels' shares) runs the dQ kernel alone (dK, dV are left unset).
    """
    if meta.block_table is not None:
        raise ValueError("attention backward: only the packed (no cache) layout has a backward")
    n, h, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"attention: {h} query heads is not a multiple of {hkv} KV heads")
    group = h // hkv
    dq = torch.empty((n, h, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((n, hkv, d), device=k.device, dtype=k.dtype)
    dv = torch.empty((n, hkv, d), device=v.device, dtype=v.dtype)
    s_count = meta.num_seqs
    if n == 0 or s_count == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if lse is None:
        recomputed, lse = attention_fwd(q, k, v, meta, scale, return_lse=True)
        out = recomputed if out is None else out
    elif out is None:
        raise ValueError("attention backward: lse was given without the forward's output (out)")

    def last_contiguous(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()
    q, k, v, out, grad_out = (last_contiguous(t) for t in (q, k, v, out, grad_out))
    d_p = max(16, triton.next_power_of_2(d))
    cfg = config or pick_attention_bwd_config(d_p, q.element_size())
    group_p = triton.next_power_of_2(group)
    if group_p > min(cfg.dq_rows, cfg.kv_rows):
        raise ValueError(f"attention backward: {group} query heads per KV head is more than the tile supports")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * LOG2E
    delta = torch.empty((n, h), device=q.device, dtype=torch.float32)
    cu = meta.cu_seqlens_q

    block_q = cfg.dq_rows // group_p
    g_slots, prog_seq, prog_q0 = _device_schedule(cu, s_count, n, block_q, meta)
    k_desc = v_desc = None
    if _descriptors_ok(k, v):
        k_desc, v_desc = (_kv_descriptor(t, cfg.dq_kv) for t in (k, v))
    _attn_bwd_dq_kernel[(g_slots, hkv)](
        q, k, v, out, grad_out, dq, lse, delta, prog_seq, prog_q0, cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
        lse.stride(0), qk_scale, float(scale), d, k_desc, v_desc,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=cfg.dq_rows, BLOCK_N=cfg.dq_kv, D_P=d_p,
        PRECISION=precision, USE_DESC=k_desc is not None, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)

    if not dq_only:
        block_q = cfg.kv_rows // group_p
        g_slots, prog_seq, prog_n0 = _device_schedule(cu, s_count, n, cfg.kv_block, meta)
        q_desc = do_desc = None
        if group == group_p and _descriptors_ok(q, grad_out):
            q_desc, do_desc = (_rows_descriptor(t, block_q, group) for t in (q, grad_out))
        _attn_bwd_dkdv_kernel[(g_slots, hkv)](
            q, k, v, grad_out, dk, dv, lse, delta, prog_seq, prog_n0, cu, g_slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            lse.stride(0), qk_scale, float(scale), d, q_desc, do_desc,
            GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=cfg.kv_rows, BLOCK_N=cfg.kv_block,
            D_P=d_p, PRECISION=precision, USE_DESC=q_desc is not None, num_warps=cfg.kv_warps,
            num_stages=cfg.kv_stages)
    return dq, dk, dv
