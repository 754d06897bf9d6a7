"""One-kernel deterministic backward of packed causal attention (experimental; ``RLREPRO_ATTENTION_BWD=triton_fused``).

:mod:`.triton_attention_bwd` runs two kernels without atomics: dQ by query tiles (3 products per tile pair) and
dK/dV by KV tiles (4 products), 7 in all. FlashAttention's backward runs one kernel by KV tiles (5 products) and
adds each pair's dQ contribution to a float32 buffer with atomics, in whatever order the tiles finish. This kernel
does the same work in one pass and keeps a fixed order: the contributions to the rows of query step ``t`` are added
from the KV tile that holds ``t`` (the diagonal one) down to tile 0. The program of KV tile ``n`` adds to step
``t`` only after the programs of tiles ``n+1 .. t // BLOCK_N`` have added theirs, which it learns from a counter
per (query block, KV head) (acquire spin on the counter, add, release). So dQ is the float32 sum of the
contributions in descending tile order, the same bits run to run, and a sequence's gradients are independent of
the batch (the tiles start at the sequence's first token). The dQ bits differ from the two-kernel backward's
(another summation); dK and dV are computed as there. The adds are float32 atomics in the counters' order: a bulk
TMA reduce per whole step where tensor descriptors work (``bulk``, the default; masked steps and the CPU use
element atomics), else element atomics. ``turns``: a counter per (query block of BLOCK_N tokens, KV head), waited
on once a block (``block``, the default), or one per query step, waited on every step (``step``). All of these
give the same bits (GPU benchmark and CPU checks).

Progress: program ``pid`` handles block ``pid`` of the schedule, which lists the blocks last-first (sequences from
the last, KV tiles descending), and CUDA starts blocks in index order, so a program only ever waits for programs
that started before it. It rarely waits at all: tile ``n+1`` reaches a step ``BLOCK_N / BLOCK_Q`` steps before
tile ``n`` does. (The first version added in ascending tile order: every tile then waited on tile 0's pace and
held its SM the whole time, 4-6x slower than the two kernels on the H200.) Triton's interpreter runs programs one
after another in index order, so a wait there is always already met.

Measured on the H200 (docs/BENCHMARKS.md, "The one-kernel backward, measured"): correct and deterministic, but
2.1x slower than the two kernels (2.36 vs 1.13 ms at 4 x 2048), hence opt-in.
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
                head, g_ok, d, d_ok, tile, q_desc, do_desc, dqa_desc,
                stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an, stride_ah, stride_semn, qk_scale,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D_P: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, USE_DESC: tl.constexpr,
                BLOCK_Q: tl.constexpr, PER_BLOCK: tl.constexpr, BULK: tl.constexpr):
    """One query step (tokens ``t0 ..``, x the group's heads) against the program's KV tile: dK, dV accumulate in
    registers; the step's dQ contribution is added to the float32 buffer in descending KV tile order (its turn:
    how many tiles above ``tile`` see the step)."""
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
    # the contributions to query block ``blk`` (BLOCK_N tokens) come from its own KV tile down to tile 0: wait for
    # the tiles above this one to have added theirs (PER_BLOCK: once, at the block's first step; else every step,
    # with a counter per step), add by float32 atomics, pass the turn on after the block's (or step's) last add
    blk = t0 // BLOCK_N
    my_turn = blk - tile
    if PER_BLOCK:
        s_ptr = sem_ptr + (cu0 + blk * BLOCK_N).to(tl.int64) * stride_semn + hk
        first = t0 % BLOCK_N == 0
        last = ((t0 + BLOCK_Q) % BLOCK_N == 0) | (t0 + BLOCK_Q >= seq_len)
    else:
        s_ptr = sem_ptr + (cu0 + t0).to(tl.int64) * stride_semn + hk
        first = True
        last = True
    if first:
        if my_turn > 0:
            turn = tl.atomic_add(s_ptr, 0, sem="acquire", scope="gpu")
            while turn != my_turn:
                turn = tl.atomic_add(s_ptr, 0, sem="acquire", scope="gpu")
            if BULK:  # what the generic proxy acquired, ordered before this program's bulk (async proxy) adds
                tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [my_turn],
                                          dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
    if BULK and USE_DESC and not MASKED:  # the whole step's rows in one bulk reduce (TMA), else element atomics
        dqa_desc.atomic_add([(cu0 + t0).to(tl.int32), hk * GROUP, 0], tl.reshape(dq_part, (BLOCK_Q, GROUP, D_P)))
    else:
        a_ptrs = dqa_ptr + tok[:, None] * stride_an + head[:, None] * stride_ah + d[None, :]
        tl.atomic_add(a_ptrs, dq_part, mask=rmask, sem="relaxed", scope="gpu")
    if last:
        if BULK:  # the bulk adds written (not only read from shared memory) before the turn passes on
            tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, $1;", "=r,r", [my_turn],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        tl.atomic_xchg(s_ptr, my_turn + 1, sem="release", scope="gpu")
    return dk, dv


@triton.jit
def _attn_bwd_fused_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dqa_ptr, sem_ptr, lse_ptr, delta_ptr,
                           prog_seq_ptr, prog_n0_ptr, cu_ptr, G_SLOTS,
                           stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                           stride_don, stride_doh, stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_sn,
                           stride_an, stride_ah, stride_semn, qk_scale, scale, D, q_desc, do_desc, dqa_desc,
                           GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_P: tl.constexpr, PRECISION: tl.constexpr,
                           USE_DESC: tl.constexpr, PER_BLOCK: tl.constexpr, BULK: tl.constexpr):
    slot = tl.program_id(0)  # the schedule lists blocks last-first: each chain's KV tiles descending
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
        tile = n0 // BLOCK_N
        n_steps = (seq_len - n0 + BLOCK_Q - 1) // BLOCK_Q
        n_diag = tl.minimum((BLOCK_N + BLOCK_Q - 2) // BLOCK_Q, n_steps)
        n_whole = tl.maximum((seq_len - n0) // BLOCK_Q, n_diag)
        for i in range(0, n_diag):
            dk, dv = _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos,
                                 n0 + i * BLOCK_Q, cu0, seq_len, hk, head, g_ok, d, d_ok, tile, q_desc, do_desc,
                                 dqa_desc, stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an,
                                 stride_ah, stride_semn, qk_scale, GROUP, GROUP_P, BLOCK_M, BLOCK_N, D_P,
                                 PRECISION, True, False, BLOCK_Q, PER_BLOCK, BULK)
        for i in range(n_diag, n_whole):
            dk, dv = _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos,
                                 n0 + i * BLOCK_Q, cu0, seq_len, hk, head, g_ok, d, d_ok, tile, q_desc, do_desc,
                                 dqa_desc, stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an,
                                 stride_ah, stride_semn, qk_scale, GROUP, GROUP_P, BLOCK_M, BLOCK_N, D_P,
                                 PRECISION, False, USE_DESC, BLOCK_Q, PER_BLOCK, BULK)
        for i in range(n_whole, n_steps):
            dk, dv = _fused_step(q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, sem_ptr, k, v, dk, dv, kv_pos,
                                 n0 + i * BLOCK_Q, cu0, seq_len, hk, head, g_ok, d, d_ok, tile, q_desc, do_desc,
                                 dqa_desc, stride_qn, stride_qh, stride_don, stride_doh, stride_sn, stride_an,
                                 stride_ah, stride_semn, qk_scale, GROUP, GROUP_P, BLOCK_M, BLOCK_N, D_P,
                                 PRECISION, True, False, BLOCK_Q, PER_BLOCK, BULK)
        tl.store(dk_ptr + kv_row[:, None] * stride_dkn + kv_head * stride_dkh + d[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + kv_row[:, None] * stride_dvn + kv_head * stride_dvh + d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def attention_bwd_fused_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                               meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                               config: AttentionBwdConfig | None = None, lse: torch.Tensor | None = None,
                               turns: str = "block", bulk: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_bwd_packed_triton``'s inputs and results, by one kernel (see the module): dK and dV with the
    two-kernel backward's arithmetic, dQ summed over KV tiles in descending tile order in float32. Deterministic
    run to run; bits differ from the two-kernel backward's in dQ."""
    if turns not in ("block", "step"):
        raise ValueError(f"attention_bwd_fused_triton: turns={turns!r}; use 'block' or 'step'")
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
    counters = torch.zeros((n, hkv), device=q.device, dtype=torch.int32)
    block_q = cfg.kv_rows // group_p
    g_slots, prog_seq, prog_n0 = _device_schedule(meta.cu_seqlens_q, meta.num_seqs, n, cfg.kv_block, meta)
    q_desc = do_desc = dqa_desc = None
    if group == group_p and _descriptors_ok(q, grad_out):
        q_desc, do_desc = (_rows_descriptor(t, block_q, group) for t in (q, grad_out))
        if bulk:
            dqa_desc = _rows_descriptor(dq_acc, block_q, group)
    _attn_bwd_fused_kernel[(g_slots, hkv)](
        q, k, v, grad_out, dk, dv, dq_acc, counters, lse, delta, prog_seq, prog_n0, meta.cu_seqlens_q, g_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), dq_acc.stride(0), dq_acc.stride(1), counters.stride(0), float(scale) * LOG2E, float(scale), d,
        q_desc, do_desc, dqa_desc,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=cfg.kv_rows, BLOCK_N=cfg.kv_block, D_P=d_p,
        PRECISION=precision, USE_DESC=q_desc is not None, PER_BLOCK=turns == "block", BULK=dqa_desc is not None,
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages)
    return (dq_acc * scale).to(q.dtype), dk, dv
