"""One-kernel deterministic backward of packed causal attention (experimental; ``RLREPRO_ATTENTION_BWD=triton_fused``).

:mod:`.triton_attention_bwd` runs two kernels without atomics: dQ by query tiles (3 products per tile pair) and
dK/dV by KV tiles (4 products), 7 in all. FlashAttention's backward runs one kernel by KV tiles (5 products) and
adds each pair's dQ contribution to a float32 buffer with atomics, in whatever order the tiles finish. This kernel
does the same work in one pass and keeps a fixed order: the program of KV tile ``n`` adds its contribution to the
rows of query step ``t`` only after the programs of KV tiles ``0 .. n-1`` have added theirs, which it learns from a
per-(step, KV head) counter (acquire spin on the counter, add, release ``n + 1``). So dQ is the float32 sum of the
contributions in tile order, the same bits run to run and a sequence's gradients independent of the batch (the
tiles start at the sequence's first token). The dQ bits differ from the two-kernel backward's (another summation);
dK and dV are computed as there.

Progress: program ``pid`` handles block ``pid`` of the schedule (sequences in order, KV tiles ascending), and CUDA
starts blocks in index order, so a program only ever waits for programs that started before it; tile 0 never
waits. Triton's interpreter runs programs one after another in that order, so a wait there is always already met.

Not yet measured or run on a GPU (written in a session without device time left): the GPU test in
``tests/test_attention_gpu_long.py`` and ``benchmarks/bench_attention_bwd.py --fused`` are the next step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata
from .triton_attention_bwd import AttentionBwdConfig, _descriptors_ok, _rows_descriptor, backward_inputs
from .triton_attention_fwd import LOG2E, _device_schedule


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, stride_on, stride_oh, stride_don, stride_doh, stride_sn, N, H, D,
                  BLOCK_R: tl.constexpr, D_P: tl.constexpr):
    """delta[token, head] = sum_d dO * O in float32, rows (token, head) in blocks of BLOCK_R."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < N * H
    tok = (r // H).to(tl.int64)
    head = (r % H).to(tl.int64)
    d = tl.arange(0, D_P)
    m = ok[:, None] & (d < D)[None, :]
    o = tl.load(o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + d[None, :], mask=m, other=0.0)
    do = tl.load(do_ptr + tok[:, None] * stride_don + head[:, None] * stride_doh + d[None, :], mask=m, other=0.0)
    tl.store(delta_ptr + tok * stride_sn + head, tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1), mask=ok)


@triton.jit
def _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos, t0, cu0, seq_len, hk,
                head, g_ok, d, d_ok, wait_for, q_desc, do_desc,
                stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an, stride_ah, stride_semn, qk_scale,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, D_P: tl.constexpr,
                PRECISION: tl.constexpr, MASKED: tl.constexpr, USE_DESC: tl.constexpr):
    """One query step (tokens ``t0 ..``, x the group's heads) against the program's KV tile: dK, dV accumulate in
    registers; the step's dQ contribution is added to the float32 buffer in KV tile order."""
    r = tl.arange(0, BLOCK_M)
    qi = t0 + r // GROUP_P
    tok = (cu0 + qi).to(tl.int64)
    if MASKED:  # the diagonal steps and the sequence's last partial step
        row_ok = (qi < seq_len) & g_ok
    else:
        row_ok = g_ok
    rmask = row_ok[:, None] & d_ok[None, :]
    if USE_DESC:  # BLOCK_Q tokens x the group's heads, one bulk copy each (unmasked steps only)
        q = tl.reshape(q_desc.load([(cu0 + t0).to(tl.int32), hk * GROUP, 0]), (BLOCK_M, D_P))
        do = tl.reshape(do_desc.load([(cu0 + t0).to(tl.int32), hk * GROUP, 0]), (BLOCK_M, D_P))
    else:
        q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=rmask, other=0.0)
        do = tl.load(do_ptr + tok[:, None] * stride_don + head[:, None] * stride_doh + d[None, :], mask=rmask,
                     other=0.0)
    lse = tl.load(lse_ptr + tok * stride_sn + head, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + tok * stride_sn + head, mask=row_ok, other=0.0)
    qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    if MASKED:
        allowed = (kv_pos[:, None] <= qi[None, :]) & row_ok[None, :]
        p_t = tl.where(allowed, tl.exp2(qk_t * qk_scale - lse[None, :]), 0.0)
    else:
        p_t = tl.exp2(qk_t * qk_scale - lse[None, :])
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
    dq_part = tl.dot(tl.trans(ds_t), k, input_precision=PRECISION)  # [BLOCK_M, D_P]
    # wait until KV tiles 0 .. wait_for-1 of the sequence have added to this step's rows, add, pass the turn on
    s_ptr = sem_ptr + (cu0 + t0).to(tl.int64) * stride_semn + hk
    turn = tl.atomic_add(s_ptr, 0, sem="acquire", scope="gpu")
    while turn != wait_for:
        turn = tl.atomic_add(s_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    a_ptrs = dqa_ptr + tok[:, None] * stride_an + head[:, None] * stride_ah + d[None, :]
    acc = tl.load(a_ptrs, mask=rmask, other=0.0, cache_modifier=".cg")
    tl.store(a_ptrs, acc + dq_part, mask=rmask, cache_modifier=".cg")
    tl.debug_barrier()
    tl.atomic_xchg(s_ptr, wait_for + 1, sem="release", scope="gpu")
    return dk, dv


@triton.jit
def _attn_bwd_fused_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dqa_ptr, sem_ptr, lse_ptr, delta_ptr,
                           prog_seq_ptr, prog_n0_ptr, cu_ptr, G_SLOTS,
                           stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                           stride_don, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_sn,
                           stride_an, stride_ah, stride_semn, qk_scale, scale, D, q_desc, do_desc,
                           GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_P: tl.constexpr, PRECISION: tl.constexpr,
                           USE_DESC: tl.constexpr):
    slot = G_SLOTS - 1 - tl.program_id(0)  # the schedule lists blocks last-first: program i runs block i
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
        wait_for = n0 // BLOCK_N  # every earlier KV tile of the sequence adds to each of this tile's query steps
        n_steps = (seq_len - n0 + BLOCK_Q - 1) // BLOCK_Q
        n_diag = tl.minimum((BLOCK_N + BLOCK_Q - 2) // BLOCK_Q, n_steps)
        n_whole = tl.maximum((seq_len - n0) // BLOCK_Q, n_diag)
        for i in range(0, n_diag):
            dk, dv = _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos,
                                 n0 + i * BLOCK_Q, cu0, seq_len, hk, head, g_ok, d, d_ok, wait_for, q_desc, do_desc,
                                 stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an, stride_ah,
                                 stride_semn, qk_scale, GROUP, GROUP_P, BLOCK_M, D_P, PRECISION, True, False)
        for i in range(n_diag, n_whole):
            dk, dv = _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos,
                                 n0 + i * BLOCK_Q, cu0, seq_len, hk, head, g_ok, d, d_ok, wait_for, q_desc, do_desc,
                                 stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an, stride_ah,
                                 stride_semn, qk_scale, GROUP, GROUP_P, BLOCK_M, D_P, PRECISION, False, USE_DESC)
        for i in range(n_whole, n_steps):
            dk, dv = _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos,
                                 n0 + i * BLOCK_Q, cu0, seq_len, hk, head, g_ok, d, d_ok, wait_for, q_desc, do_desc,
                                 stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an, stride_ah,
                                 stride_semn, qk_scale, GROUP, GROUP_P, BLOCK_M, D_P, PRECISION, True, False)
        tl.store(dk_ptr + kv_row[:, None] * stride_dkn + kv_head * stride_dkh + d[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + kv_row[:, None] * stride_dvn + kv_head * stride_dvh + d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def attention_bwd_fused_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                               meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                               config: AttentionBwdConfig | None = None, lse: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_bwd_packed_triton``'s inputs and results, by one kernel (see the module): dK and dV with the
    two-kernel backward's arithmetic, dQ summed over KV tiles in tile order in float32. Deterministic run to run;
    bits differ from the two-kernel backward's in dQ."""
    x = backward_inputs(q, k, v, grad_out, meta, scale, out, config, lse)
    n, h, d = q.shape
    hkv = k.shape[1]
    dk = torch.empty((n, hkv, d), device=k.device, dtype=k.dtype)
    dv = torch.empty((n, hkv, d), device=v.device, dtype=v.dtype)
    if x is None:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    q, k, v, out, grad_out, lse = x.q, x.k, x.v, x.out, x.grad_out, x.lse
    cfg, group, group_p, d_p, precision = x.cfg, x.group, x.group_p, x.d_p, x.precision
    if group_p > cfg.kv_rows:
        raise ValueError(f"attention backward: {group} query heads per KV head is more than the tile supports")
    delta = torch.empty((n, h), device=q.device, dtype=torch.float32)
    block_r = 64
    _delta_kernel[(triton.cdiv(n * h, block_r),)](
        out, grad_out, delta, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), delta.stride(0),
        n, h, d, BLOCK_R=block_r, D_P=d_p, num_warps=4)
    dq_acc = torch.zeros((n, h, d), device=q.device, dtype=torch.float32)
    turns = torch.zeros((n, hkv), device=q.device, dtype=torch.int32)
    block_q = cfg.kv_rows // group_p
    g_slots, prog_seq, prog_n0 = _device_schedule(meta.cu_seqlens_q, meta.num_seqs, n, cfg.kv_block, meta)
    q_desc = do_desc = None
    if group == group_p and _descriptors_ok(q, grad_out):
        q_desc, do_desc = (_rows_descriptor(t, block_q, group) for t in (q, grad_out))
    _attn_bwd_fused_kernel[(g_slots, hkv)](
        q, k, v, grad_out, dk, dv, dq_acc, turns, lse, delta, prog_seq, prog_n0, meta.cu_seqlens_q, g_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), dq_acc.stride(0), dq_acc.stride(1), turns.stride(0), float(scale) * LOG2E, float(scale), d,
        q_desc, do_desc,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=cfg.kv_rows, BLOCK_N=cfg.kv_block, D_P=d_p,
        PRECISION=precision, USE_DESC=q_desc is not None, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    return (dq_acc * scale).to(q.dtype), dk, dv
