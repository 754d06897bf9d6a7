"""The batch-invariant attention forward for Hopper, warp-specialised, in Gluon (Triton's explicit-layout language,
Triton 3.6's API; packed 16-bit K/V, head size 64 or 128). ``triton_attention_fwd.attention_fwd`` runs it for the
packed calls that pick the "long" tile on sm_90 (``use_gluon``: the trainer's forward); the engine's paged calls
keep the Triton kernel, whose bits these are.

Why it exists (issue #27): Triton 3.6 cannot warp-specialise the ``tl`` forward for sm_90 (its ``warp_specialize``
pass fails there), and that is much of what FlashAttention-3 has over it. Gluon states partitions, barriers and
wgmma layouts itself:

- a **producer** partition streams the KV tiles of one KV head by TMA into a ring of ``STAGES`` shared-memory
  stages (K and V with their own "ready" barriers);
- **consumer** warpgroups (64 rows each) run the online softmax on the tiles in order and release a stage when all
  of them are done with it, software-pipelined as FlashAttention-3 overlaps within a warpgroup
  (:func:`_pipelined_tiles`: ``Q @ K_{t+1}^T`` and ``P_t @ V_t`` issued together, tile ``t + 1``'s softmax while
  ``P_t @ V_t`` runs).

The arithmetic is :func:`.triton_attention_fwd._attn_fwd_kernel`'s, operation for operation, in the same layouts:
64-position KV tiles from position 0; ``s = qk * scale`` (masked ``-inf`` past a row's position in the diagonal
tiles); ``m = max(m, rowmax s)``; ``p = exp2(s - m)``; ``alpha = exp2(m_old - m)``; ``l = l * alpha + rowsum p``;
``acc = p.bf16 @ V + acc * alpha`` on the tensor cores; ``out = acc / l``, ``lse = m + log2 l``; no multiply-add
contraction. A row is ``(query, head of the GQA group)`` as there. The sm_90a PTX has the Triton kernel's float
instructions (``ex2.approx.ftz.f32``, ``div.full.f32``, FMAs only inside ``log2``). In the other reduction order
(``RLREPRO_ATTENTION_ORDER=128f``: ``block_kv=128, fma=True``) it takes 128-position tiles and folds the scale into
one FMA, as the Triton kernel then does (the same bits again; 0.93-1.04x FlashAttention-3 at 8k-16k tokens).
Where a sequence ends inside its last tile, the rows TMA loaded from the next sequence are zeroed in shared memory
before ``P @ V`` (:func:`.gluon_attention_parts.zero_past`), so a neighbour's non-finite values cannot reach it. O
leaves through the warpgroup's own Q buffer (free once its last ``Q @ K^T`` is done; with Q by TMA released to the
producer after that): written there in the wgmma layout, read back a row's 16 bytes to a thread and stored with
16-byte stores (``OSM``, the default; ``GLW_OSM=0``: straight from the wgmma layout, 4-byte stores, 1.07-1.12x slower
at 1-2k-token sequences on the H100, 2026-12-06).

Variants, each with the same bits (the battery of ``benchmarks/bench_attention_gluon.py`` and the GPU tests, H100,
2026-12-06/07; docs/BENCHMARKS.md), switched by environment variables (:func:`flag`): ``GLW_PP=1`` ping-pongs the
two consumer warpgroups (:func:`_turn`); ``GLW_PERSIST`` runs one program per SM over the works sorted longest
first (:func:`persistent_order`); ``GLW_KV2=1`` puts two KV tiles in a ring stage; ``GLW_QTMA`` has the producer
load each work's Q by TMA into a ring of Q buffers, the tile's rows head-major (:func:`_load_q`,
:func:`_row_query`); ``GLW_META`` (with Q by TMA) has the producer hand each work's slot row to the consumers in
shared memory (:func:`_put_meta`), so a persistent consumer's next work starts without global loads; ``GLW_KVS``
frees a ring stage's K buffer once its ``Q @ K^T`` is done and its V buffer after ``P @ V`` (FlashAttention-3's
separate K and V pipelines), so two stages keep the producer a tile ahead and leave room for a second Q buffer,
into which the next work's Q is loaded while the current one finishes; ``GLW_HALF=1`` runs a work's last tile on its
lower half where the upper half is past every query (:func:`_half_tile`; 1-5 % slower); ``GLW_TMAX=1`` takes the
row max as a tree (:func:`.gluon_attention_parts.row_max_tree`); ``GLW_TAB=1`` (persistent) reads each work's slot
row from a table :func:`persistent_order` writes, in one step instead of order, slot and sequence one after another
(:func:`.gluon_attention_parts._work_row`); ``GLW_SKIP=1`` has a warp whose 16 rows' maxima did not grow on a tile
(``alpha == 1`` exactly) skip the accumulator's rescale (:func:`.gluon_attention_parts.rescale`); ``GLW_HOLD=1`` keeps
the wait for ``P_t @ V_t`` below tile ``t + 1``'s softmax in the SASS (:func:`.gluon_attention_parts.hold`);
``GLW_QK2=1`` (64-position order) puts two tiles in a ring stage and issues their ``Q @ K^T`` together
(:func:`.gluon_attention_pair._paired_tiles`).
**Defaults**, in both orders where the sequences average under ``LONG_MEAN`` tokens: persistent, Q by TMA, META,
KVS and TAB (``FAST``), on two ring stages in the 128-position order (0.87-0.92x FlashAttention-3 at 4 x 2048 on
the H100) and three in the 64-position order, which adds SKIP and HOLD (``FAST_64``: 0.82-0.90x FA3 on the H200,
2026-12-07, 5-11 % over ``FAST`` alone); longer ones all off, three stages.
Tried and removed: K and V on one barrier, a slot table of one row a work for one program a work, prefetching the
next slot row, and (commit 762f9aa) persistent consumers that run works back to back, the next work's first
``Q @ K^T`` beside the last one's epilogue (``GLW_XW``: 0.863x against 0.913).

History: an empty schedule slot's consumers once waited for a tile never loaded, a hang (``_program``; its reduced
probe: ``benchmarks/gluon_hang_probes.probe_tma_wait``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Gluon and its Hopper namespace (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .gluon_attention_parts import (_get_meta, _load_pair, _next_work, _pass, _put_meta, _ring, _rounds,
                                        _row_query, _turn, _units, hold, rescale, zero_past)
    from .gluon_attention_pair import _paired_tiles, _qk_issue, _softmax_part
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False
from .gluon_attention_parts import BLOCK_KV, persistent_order  # noqa: F401 (the persistent schedule's order)

ROWS = 64  # query rows of a consumer warpgroup: wgmma's M
CONSUMERS = 2
STAGES = None  # the K/V ring's depth; None: :func:`ring_stages`
# the defaults where the sequences average under LONG_MEAN tokens: persistent, Q by TMA with the slot rows from the
# producer, K freed apart from V, each work's row from the work table, on the deepest ring that leaves room for two Q
# buffers (2 stages in the 128-position order, 3 in the 64). H100, 2026-12-07: 128f 0.87-0.92x FlashAttention-3 at
# 4 x 2048 against 0.84 for one program a work; the 64-position order (thirty-ninth session, one call) 0.835 / 0.832
# at 4 x 2048 / 16 x 1024 against 0.771 / 0.761, ahead at 8k and 16k too (0.824 / 0.838 against 0.803 / 0.818)
FAST = {"GLW_PERSIST": 1, "GLW_QTMA": 1, "GLW_META": 1, "GLW_KVS": 1, "GLW_TAB": 1}
# and in the 64-position order: the rescale skipped where no max grew, the P @ V wait held below the softmax (H200,
# 2026-12-07: 5-11 % faster in two calls; in 128f one call each way, not taken)
FAST_64 = {"GLW_SKIP": 1, "GLW_HOLD": 1}
LONG_MEAN = 12288  # from this mean sequence length on, one program a work on three stages (as fast in 128f at 16k)
Q_ROOM = 200 * 1024  # shared memory for the K/V ring and the Q buffers (of the H100's 227 KB, the rest for barriers)
CONSUMER_REGS = 240
PRODUCER_REGS = 24
LOG2E = 1.4426950408889634


if HAVE_GLUON:

    @gluon.jit
    def _producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, prog_seq_ptr, prog_q0_ptr, cu_ptr,
                  seq_lens_ptr, order_ptr, n_work, hkv, BLOCK_Q: gl.constexpr, BLOCK_KV_: gl.constexpr,
                  D: gl.constexpr, NSTAGE: gl.constexpr, PERSIST: gl.constexpr, KV2: gl.constexpr = 0,
                  q_desc=None, q_bufs=None, q_ready=None, q_empty=None, GROUP: gl.constexpr = 1,
                  QTMA: gl.constexpr = 0, NQ: gl.constexpr = 1, meta_bufs=None, META: gl.constexpr = 0,
                  KVS: gl.constexpr = 0, TAB: gl.constexpr = 0, QK2: gl.constexpr = 0):
        """Each work's KV tiles 0, 1, ... by TMA into the ring; the ring's count ``i`` runs on across works. With
        ``KV2`` a ring stage holds two tiles (two loads on one barrier; the last stage of an odd count one). With
        ``QTMA`` each work's Q tile first (:func:`_load_q`), into the next of ``NQ`` Q buffers; with ``META`` also
        for a work without tiles, with its slot table row beside it (:func:`_put_meta`). With ``KVS`` a stage's K and
        V buffers are freed apart (``kv_empty[NSTAGE + st]`` for K, ``kv_empty[st]`` for V). With ``TAB`` (persistent)
        ``order_ptr`` is :func:`persistent_order`'s work table: a work's row in one step
        (:func:`.gluon_attention_parts._work_row`). With ``QK2`` (and ``KV2``) a stage's two tiles are the halves of
        one ``[2 * BLOCK_KV_, D]`` buffer (:func:`.gluon_attention_pair._paired_tiles`)."""
        tb = gl.program_id(0) * 0
        qc = gl.program_id(0) * 0
        for r in range(_rounds(n_work, PERSIST)):
            seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _next_work(
                r, order_ptr, n_work, hkv, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_KV_,
                PERSIST, TAB)
            if META:
                _load_q(q_desc, q_bufs, q_ready, q_empty, qc, (cu0 + q0).to(gl.int32), hk * GROUP, BLOCK_Q, D, NQ,
                        n_tiles > 0, meta_bufs, (seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk))
                qc += 1
            elif QTMA:
                if n_tiles > 0:
                    _load_q(q_desc, q_bufs, q_ready, q_empty, qc, (cu0 + q0).to(gl.int32), hk * GROUP, BLOCK_Q, D,
                            NQ)
                    qc += 1
            col = (hk * D).to(gl.int32)
            n_units = _units(n_tiles, KV2)
            for t in range(n_units):
                i = tb + t
                st = i % NSTAGE
                if KVS:  # K's buffer first: it is freed a product earlier than V's
                    mbarrier.wait(kv_empty.index(NSTAGE + st), ((i // NSTAGE) & 1) ^ 1)
                else:
                    mbarrier.wait(kv_empty.index(st), ((i // NSTAGE) & 1) ^ 1)  # a fresh barrier passes phase 1
                if KV2:
                    row = (cu0 + 2 * t * BLOCK_KV_).to(gl.int32)
                    two = 2 * t + 1 < n_tiles
                    _load_pair(k_desc, k_ready.index(st), k_bufs, st, row, col, two, BLOCK_KV_, QK2)
                    if KVS:
                        mbarrier.wait(kv_empty.index(st), ((i // NSTAGE) & 1) ^ 1)
                    _load_pair(v_desc, v_ready.index(st), v_bufs, st, row, col, two, BLOCK_KV_, QK2)
                else:
                    row = (cu0 + t * BLOCK_KV_).to(gl.int32)  # TMA coordinates are 32-bit
                    mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(st), k_bufs.index(st))
                    if KVS:
                        mbarrier.wait(kv_empty.index(st), ((i // NSTAGE) & 1) ^ 1)
                    mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(st), v_bufs.index(st))
            tb += n_units

    @gluon.jit
    def _load_q(q_desc, q_bufs, q_ready, q_empty, qc, row, head0, BLOCK_Q: gl.constexpr, D: gl.constexpr,
                NQ: gl.constexpr, has_tiles=True, meta_bufs=None, meta=None):
        """The producer's Q load of a work (``QTMA``): the program's 128 rows head-major (:func:`_row_query`), as
        ``[BQB, D]`` boxes of consecutive queries of one head (packed row ``row``, head ``head0`` on), into Q buffer
        ``qc % NQ`` (its two consumers' halves) once both consumers released it."""
        BQB: gl.constexpr = q_desc.block_type.shape[0]
        NR_: gl.constexpr = q_bufs.shape[1]
        QPB: gl.constexpr = BLOCK_Q // BQB
        qb = qc % NQ
        mbarrier.wait(q_empty.index(qb), ((qc // NQ) & 1) ^ 1)  # a fresh barrier passes phase 1
        if meta is not None:  # META: the work's slot table row for the consumers, before the barrier's arrival
            _put_meta(meta_bufs.index(qb), meta)
            if not has_tiles:  # nothing to load: the arrival alone
                mbarrier.arrive(q_ready.index(qb), count=1)
        mbarrier.expect(q_ready.index(qb), 2 * (NR_ // BQB) * q_desc.block_type.nbytes, pred=has_tiles)
        for j in gl.static_range(2 * NR_ // BQB):
            dst = q_bufs.index(2 * qb + j * BQB // NR_).slice((j * BQB) % NR_, BQB)
            coord_q = row + (j % QPB) * BQB
            coord_d = ((head0 + j // QPB) * D).to(gl.int32)
            tma.async_copy_global_to_shared(q_desc, [coord_q, coord_d], q_ready.index(qb), dst, pred=has_tiles)

    @gluon.jit
    def _pipelined_tiles(m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars, pos, qk_scale,
                         n_tiles, n_full, kv_end, tb, turn, CID: gl.constexpr, PP: gl.constexpr, NR: gl.constexpr,
                         NSTAGE: gl.constexpr, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr,
                         o_layout: gl.constexpr, p_layout: gl.constexpr, KV2: gl.constexpr, FMA: gl.constexpr,
                         NW: gl.constexpr, q_rel, QTMA: gl.constexpr, TMAX: gl.constexpr = 0, KVS: gl.constexpr = 0,
                         SKIP: gl.constexpr = 0, HOLD: gl.constexpr = 0):
        """One work's KV tiles (``n_tiles`` > 0, the ring's tiles ``tb``, ``tb + 1``, ...), software-pipelined as
        FlashAttention-3 overlaps within a warpgroup: ``Q @ K_{t+1}^T`` and ``P_t @ V_t`` are issued together, and
        tile ``t + 1``'s softmax runs while ``P_t @ V_t`` is on the tensor cores. Every value is computed by the
        Triton kernel's operations in its order (``acc = P_t @ V_t + acc * alpha_t``), so the bits are its bits.
        With ``PP`` each issue is one turn of the ping-pong (``turn``, ``turn + 1``, ..., ``n_tiles + 1`` turns);
        with ``KV2`` a ring stage holds two tiles: half the barrier waits and releases. With ``QTMA`` the Q buffer is
        released (``q_rel``) once its last ``Q @ K^T`` is done, so the producer can load the next work's Q.
        The barrier waits and releases are predicated rather than put in ``if`` blocks: Triton's shared-memory
        barrier pass puts a warpgroup ``bar.sync`` at each such block's edges (four a tile instead of two in the
        PTX; measured 2026-12-06: no faster, the same bits). With ``KVS`` a tile's K buffer is freed as soon as its
        ``Q @ K^T`` is done (``kv_empty[NSTAGE + st]``), its V buffer after ``P @ V`` (``kv_empty[st]``), so the
        producer can load K two tiles ahead with two stages (FlashAttention-3's separate K and V pipelines)."""
        st, ph, b, new, last = _ring(tb, 0, n_tiles, NSTAGE, KV2)
        mbarrier.wait(k_ready.index(st), ph)
        _turn(pp_bars, turn, CID, PP)
        tok = _qk_issue(b, q_smem, k_bufs, NR, BLOCK_KV_, qk_layout)
        _pass(pp_bars, CID, PP)
        qk = warpgroup_mma_wait(0, deps=[tok])
        if KVS:
            mbarrier.arrive(kv_empty.index(NSTAGE + st), count=1)
        m_i, l_i, p, alpha = _softmax_part(0, qk, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout, FMA, TMAX)
        for t in range(n_tiles - 1):
            st, ph, b, new, last = _ring(tb, t, n_tiles, NSTAGE, KV2)
            st1, ph1, b1, new1, last1 = _ring(tb, t + 1, n_tiles, NSTAGE, KV2)
            if not SKIP:
                acc = rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), SKIP)
                pb = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
            mbarrier.wait(k_ready.index(st1), ph1, pred=new1)  # predicates, not ifs: see _pipelined_tiles
            if not SKIP:
                mbarrier.wait(v_ready.index(st), ph, pred=new)
            _turn(pp_bars, turn + 1 + t, CID, PP)
            tok = _qk_issue(b1, q_smem, k_bufs, NR, BLOCK_KV_, qk_layout)
            if SKIP:  # the rescale's branch after the issue, so its products still overlap Q @ K^T's (:func:`rescale`)
                acc = rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), SKIP)
                pb = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
                mbarrier.wait(v_ready.index(st), ph, pred=new)
            acc_tok = warpgroup_mma(pb, v_bufs.index(b), acc, is_async=True)
            _pass(pp_bars, CID, PP)
            qk = warpgroup_mma_wait(1, deps=[tok])  # groups finish in order: Q @ K_{t+1}^T is done
            if KVS:
                mbarrier.arrive(kv_empty.index(NSTAGE + st1), count=1)
            m_i, l_i, p, alpha = _softmax_part(t + 1, qk, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout,
                                               FMA, TMAX)
            if HOLD:  # the wait below the softmax in the SASS too (:func:`.gluon_attention_parts.hold`)
                l_i = hold(l_i)
            acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
            mbarrier.arrive(kv_empty.index(st), count=1, pred=last)
        if QTMA:  # every Q @ K^T of the work is done
            mbarrier.arrive(q_rel, count=1)
        st, ph, b, new, last = _ring(tb, n_tiles - 1, n_tiles, NSTAGE, KV2)
        acc = rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), SKIP)
        pb = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
        mbarrier.wait(v_ready.index(st), ph, pred=new)
        if kv_end < n_tiles * BLOCK_KV_:  # the sequence ends inside this tile
            zero_past(v_bufs.index(b), kv_end - (n_tiles - 1) * BLOCK_KV_, BLOCK_KV_, v_bufs.shape[2], NW)
        _turn(pp_bars, turn + n_tiles, CID, PP)
        acc_tok = warpgroup_mma(pb, v_bufs.index(b), acc, is_async=True)
        _pass(pp_bars, CID, PP)
        acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
        mbarrier.arrive(kv_empty.index(st), count=1)
        return m_i, l_i, acc

    @gluon.jit
    def _half_tile(m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars, pos, qk_scale, t, kv_end,
                   tb, turn, CID: gl.constexpr, PP: gl.constexpr, NR: gl.constexpr, NSTAGE: gl.constexpr,
                   BLOCK_KV_: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, FMA: gl.constexpr,
                   NW: gl.constexpr, TMAX: gl.constexpr, KVS: gl.constexpr = 0, SKIP: gl.constexpr = 0):
        """KV tile ``t``, the work's last, when its upper half lies past every row's position (``HALF``): ``Q @ K^T``
        and ``P @ V`` on its lower ``BLOCK_KV_ / 2`` positions only, not pipelined. The same bits as the whole
        tile: the upper half's scores are all masked, so its ``p`` are exact zeros, which leave the row max, the
        row sum (a thread's chain of adds: ``x + 0 == x``) and ``P @ V`` (zero products) as they are."""
        W: gl.constexpr = BLOCK_KV_ // 2
        hl: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, W, 16])
        rows_h: gl.constexpr = gl.SliceLayout(1, hl)
        st, ph, b, new, last = _ring(tb, t, t + 1, NSTAGE, 0)
        mbarrier.wait(k_ready.index(st), ph)
        _turn(pp_bars, turn, CID, PP)
        tok = warpgroup_mma(q_smem, k_bufs.index(b).slice(0, W).permute((1, 0)), gl.zeros([NR, W], gl.float32, hl),
                            use_acc=False, is_async=True)
        _pass(pp_bars, CID, PP)
        qk = warpgroup_mma_wait(0, deps=[tok])
        if KVS:
            mbarrier.arrive(kv_empty.index(NSTAGE + st), count=1)
        m_h, l_h, p, alpha = _softmax_part(2 * t, qk, gl.convert_layout(m_i, rows_h), gl.convert_layout(l_i, rows_h),
                                           gl.convert_layout(pos, rows_h), qk_scale, 0, W, hl, FMA, TMAX)
        acc = rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), SKIP)
        pb = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
        mbarrier.wait(v_ready.index(st), ph)
        v_half = v_bufs.index(b).slice(0, W)
        if kv_end < t * BLOCK_KV_ + W:  # the sequence ends inside this half
            zero_past(v_half, kv_end - t * BLOCK_KV_, W, v_bufs.shape[2], NW)
        _turn(pp_bars, turn + 1, CID, PP)
        acc_tok = warpgroup_mma(pb, v_half, acc, is_async=True)
        _pass(pp_bars, CID, PP)
        acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
        mbarrier.arrive(kv_empty.index(st), count=1)
        return gl.convert_layout(m_h, m_i.type.layout), gl.convert_layout(l_h, m_i.type.layout), acc

    @gluon.jit
    def _consumer(q_ptr, o_ptr, lse_ptr, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars, prog_seq_ptr,
                  prog_q0_ptr, cu_ptr, seq_lens_ptr, order_ptr, n_work, hkv, stride_qn, stride_qh, stride_on,
                  stride_oh, stride_ln, qk_scale, CID: gl.constexpr, NR: gl.constexpr, GROUP: gl.constexpr,
                  GROUP_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_KV_: gl.constexpr, D: gl.constexpr,
                  NSTAGE: gl.constexpr, WRITE_LSE: gl.constexpr, NW: gl.constexpr, PP: gl.constexpr,
                  PERSIST: gl.constexpr, KV2: gl.constexpr = 0, FMA: gl.constexpr = 0, q_ready=None, q_empty=None,
                  QTMA: gl.constexpr = 0, NQ: gl.constexpr = 1, BQB: gl.constexpr = 1,
                  OSM: gl.constexpr = 1, HALF: gl.constexpr = 0, TMAX: gl.constexpr = 0, meta_bufs=None,
                  META: gl.constexpr = 0, KVS: gl.constexpr = 0, TAB: gl.constexpr = 0, SKIP: gl.constexpr = 0,
                  HOLD: gl.constexpr = 0, QK2: gl.constexpr = 0):
        qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, BLOCK_KV_, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [NW, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, qk_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # this warpgroup's rows of the program's tile: (query q0 + offset, head g of the GQA group), _row_query
        r = CID * NR + gl.arange(0, NR, layout=gl.SliceLayout(1, ld_layout))
        q_off_s, g_s = _row_query(CID * NR + gl.arange(0, NR, layout=row_s), GROUP_P, BLOCK_Q, BQB, QTMA)
        q_off_o, g_o = _row_query(CID * NR + gl.arange(0, NR, layout=row_o), GROUP_P, BLOCK_Q, BQB, QTMA)
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
        do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        tb = gl.program_id(0) * 0
        turn = gl.program_id(0) * 0
        qc = gl.program_id(0) * 0
        for rnd in range(_rounds(n_work, PERSIST)):
            if META:  # the producer's row of the work, written before its Q barrier's arrival (_put_meta)
                mbarrier.wait(q_ready.index(qc % NQ), (qc // NQ) & 1)
                seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _get_meta(meta_bufs.index(qc % NQ))
            else:
                seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _next_work(
                    rnd, order_ptr, n_work, hkv, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_KV_,
                    PERSIST, TAB)
            if QTMA:  # the producer loaded this work's Q (if it has tiles) into buffer qc % NQ
                q_smem = q_bufs.index(2 * (qc % NQ) + CID)
                q_rel = q_empty.index(qc % NQ)
                if not META:
                    if n_tiles > 0:
                        mbarrier.wait(q_ready.index(qc % NQ), (qc // NQ) & 1)
            else:
                q_smem = q_bufs.index(CID)
                q_rel = kv_empty.index(0)  # unused
                qi = q0 + r // GROUP_P
                g = r % GROUP_P
                row_ok = (qi < q_len) & (g < GROUP)
                tok = (cu0 + qi).to(gl.int64)
                head = (hk * GROUP + g).to(gl.int64)
                q = gl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                            mask=row_ok[:, None], other=0.0)
                if PERSIST:
                    gl.thread_barrier()  # every warp is past the last work's products, which read the old Q
                q_smem.store(q)
                fence_async_shared()
                gl.thread_barrier()
            pos = first_pos + gl.minimum(q0 + q_off_s, q_len - 1)  # padding rows borrow a real position
            m_i = gl.full([NR], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([NR], gl.float32, row_s)
            acc = gl.zeros([NR, D], gl.float32, o_layout)
            if n_tiles > 0:  # an empty slot has none, and must wait for none
                # HALF: the last tile's upper half is past the program's last query (_half_tile)
                half = HALF and (first_pos + gl.minimum(q0 + BLOCK_Q, q_len) - 1 - (n_tiles - 1) * BLOCK_KV_
                                 < BLOCK_KV_ // 2)
                n_main = n_tiles - half.to(gl.int32)
                if QK2:  # two tiles a stage, their Q @ K^T issued together (gluon_attention_pair)
                    m_i, l_i, acc = _paired_tiles(m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                                                  pos, qk_scale, n_tiles, n_full, first_pos + q_len, tb, NR, NSTAGE,
                                                  BLOCK_KV_, qk_layout, o_layout, p_layout, NW, q_rel,
                                                  QTMA * (1 - OSM), TMAX, KVS, SKIP, HOLD)
                elif n_main > 0:
                    m_i, l_i, acc = _pipelined_tiles(m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready,
                                                     kv_empty, pp_bars, pos, qk_scale, n_main, n_full,
                                                     first_pos + q_len, tb, turn, CID, PP, NR, NSTAGE, BLOCK_KV_,
                                                     qk_layout, o_layout, p_layout, KV2, FMA, NW, q_rel,
                                                     QTMA * (1 - OSM), TMAX, KVS, SKIP, HOLD)
                    turn += n_main + 1
                if half:
                    m_i, l_i, acc = _half_tile(m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                                               pp_bars, pos, qk_scale, n_tiles - 1, first_pos + q_len, tb, turn, CID,
                                               PP, NR, NSTAGE, BLOCK_KV_, o_layout, p_layout, FMA, NW, TMAX, KVS,
                                               SKIP)
                    turn += 2
            tb += _units(n_tiles, KV2)
            if seq >= 0:
                out = acc / gl.convert_layout(l_i, row_o)[:, None]
                if OSM:  # through this warpgroup's Q buffer (its last Q @ K^T is done), 16-byte row stores
                    q_smem.store(out.to(q_smem.dtype))
                    gl.thread_barrier()
                    o_r = q_smem.load(ld_layout)
                    qi, g = _row_query(r, GROUP_P, BLOCK_Q, BQB, QTMA)
                    qi += q0
                    o_off = (cu0 + qi).to(gl.int64) * stride_on + (hk * GROUP + g).to(gl.int64) * stride_oh
                    gl.store(o_ptr + o_off[:, None] + d[None, :], o_r.to(o_ptr.dtype.element_ty),
                             mask=((qi < q_len) & (g < GROUP))[:, None])
                else:
                    qo = q0 + q_off_o
                    ok_o = (qo < q_len) & (g_o < GROUP)
                    o_off = ((cu0 + qo).to(gl.int64)[:, None] * stride_on
                             + (hk * GROUP + g_o).to(gl.int64)[:, None] * stride_oh)
                    gl.store(o_ptr + o_off + do[None, :], out.to(o_ptr.dtype.element_ty), mask=ok_o[:, None])
                if WRITE_LSE:
                    qs = q0 + q_off_s
                    ok_s = (qs < q_len) & (g_s < GROUP)
                    l_off = (cu0 + qs).to(gl.int64) * stride_ln + (hk * GROUP + g_s).to(gl.int64)
                    if FMA:
                        m_i = m_i * qk_scale
                    gl.store(lse_ptr + l_off, m_i + gl.log2(l_i), mask=ok_s)
            if QTMA:  # with OSM the Q buffer is released here, after O went through it, else after the last Q @ K^T
                if META or n_tiles > 0:
                    if OSM:
                        gl.thread_barrier()  # every warp has read its O rows back
                        mbarrier.arrive(q_rel, count=1)
                    elif n_tiles == 0:
                        mbarrier.arrive(q_rel, count=1)
                    qc += 1

    @gluon.jit
    def _stages(k_desc, v_desc, NSTAGE: gl.constexpr, N_CONSUMERS: gl.constexpr, KV2: gl.constexpr = 0,
                KVS: gl.constexpr = 0, QK2: gl.constexpr = 0):
        """The K/V ring (``NSTAGE`` tiles of each) and its barriers: K and V "ready" (one TMA arrival each) and
        "empty" (one arrival per consumer partition; with ``KVS`` V's, then K's), the two ping-pong barriers, and
        the Q buffers' "ready" (the producer's TMA) and "empty" (one arrival per consumer) barriers, initialised."""
        BKV: gl.constexpr = k_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        shape: gl.constexpr = [NSTAGE, 2 * BKV, D] if QK2 else [NSTAGE * (1 + KV2), BKV, D]
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, shape, v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [(1 + KVS) * NSTAGE, 1], mbarrier.MBarrierLayout())  # V, K
        pp_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=N_CONSUMERS)
            if KVS:
                mbarrier.init(kv_empty.index(NSTAGE + i), count=N_CONSUMERS)
        for i in gl.static_range(2):
            mbarrier.init(pp_bars.index(i), count=1)
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=N_CONSUMERS)
        return k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars, q_ready, q_empty

    @gluon.jit
    def _attn_fwd_ws_kernel(q_ptr, q_desc, k_desc, v_desc, o_ptr, lse_ptr, prog_seq_ptr, prog_q0_ptr, cu_ptr,
                            seq_lens_ptr, order_ptr, n_work, hkv, stride_qn, stride_qh, stride_on, stride_oh,
                            stride_ln, qk_scale, q_smem_layout: gl.constexpr, GROUP: gl.constexpr,
                            GROUP_P: gl.constexpr, BLOCK_Q: gl.constexpr, D: gl.constexpr, NSTAGE: gl.constexpr,
                            WRITE_LSE: gl.constexpr, NR: gl.constexpr, CREGS: gl.constexpr,
                            PP: gl.constexpr = 0, PERSIST: gl.constexpr = 0, KV2: gl.constexpr = 0,
                            FMA: gl.constexpr = 0, QTMA: gl.constexpr = 0, NQ: gl.constexpr = 1,
                            OSM: gl.constexpr = 1, HALF: gl.constexpr = 0, TMAX: gl.constexpr = 0,
                            META: gl.constexpr = 0, KVS: gl.constexpr = 0, TAB: gl.constexpr = 0,
                            SKIP: gl.constexpr = 0, HOLD: gl.constexpr = 0, QK2: gl.constexpr = 0):
        """Two 4-warp consumer partitions (``NR`` rows each) and the default partition as the TMA producer (of
        Q too, with ``QTMA``: ``q_desc`` loads ``[BQB, D]`` boxes of it into ``NQ`` buffers)."""
        BKV: gl.constexpr = k_desc.block_type.shape[0]
        BQB: gl.constexpr = BLOCK_Q if BLOCK_Q < NR else NR
        q_bufs = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2 * NQ, NR, D], q_smem_layout)
        k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars, q_ready, q_empty = _stages(k_desc, v_desc, NSTAGE, 2,
                                                                                        KV2, KVS, QK2)
        meta_bufs = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, prog_seq_ptr, prog_q0_ptr,
                         cu_ptr, seq_lens_ptr, order_ptr, n_work, hkv, BLOCK_Q, BKV, D, NSTAGE, PERSIST, KV2,
                         q_desc, q_bufs, q_ready, q_empty, GROUP, QTMA, NQ, meta_bufs, META, KVS, TAB, QK2)),
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars,
                         prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, order_ptr, n_work, hkv, stride_qn,
                         stride_qh, stride_on, stride_oh, stride_ln, qk_scale, 0, NR, GROUP, GROUP_P, BLOCK_Q, BKV,
                         D, NSTAGE, WRITE_LSE, 4, PP, PERSIST, KV2, FMA, q_ready, q_empty, QTMA, NQ, BQB, OSM, HALF,
                         TMAX, meta_bufs, META, KVS, TAB, SKIP, HOLD, QK2)),
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars,
                         prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, order_ptr, n_work, hkv, stride_qn,
                         stride_qh, stride_on, stride_oh, stride_ln, qk_scale, 1, NR, GROUP, GROUP_P, BLOCK_Q, BKV,
                         D, NSTAGE, WRITE_LSE, 4, PP, PERSIST, KV2, FMA, q_ready, q_empty, QTMA, NQ, BQB, OSM, HALF,
                         TMAX, meta_bufs, META, KVS, TAB, SKIP, HOLD, QK2)),
        ], [4, 4], [CREGS, CREGS])


def _descriptor(t: torch.Tensor, rows: int):
    n, hkv, d = t.shape
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], dt)
    return TensorDescriptor(t, [n, hkv * d], [t.stride(0), 1], [rows, d], layout)


def fast_defaults(n: int, n_seqs: int | None) -> bool:
    """Whether ``FAST`` are the call's defaults, in either order: unless its ``n_seqs`` sequences (``n`` tokens)
    average ``LONG_MEAN`` tokens or more (there one program a work on three stages was as fast or faster in the
    128-position order: 0.91-1.03x FA3 at 16k against 0.92-0.97, H100, 2026-12-07)."""
    return not (n_seqs and n >= LONG_MEAN * n_seqs)


def flag(name: str, fast: bool = False, block_kv: int = 0) -> int:
    """A variant switch: the environment's ``name`` if set, else its default (``FAST`` where ``fast``, see
    :func:`fast_defaults`, with ``FAST_64`` in the 64-position order, ``block_kv`` 64; otherwise off)."""
    defaults = {**FAST, **FAST_64} if block_kv == BLOCK_KV else FAST
    return _env(name, defaults.get(name, 0) if fast else 0)


def pair_tiles(block_kv: int, fast: bool = False) -> int:
    """Whether two 64-position tiles share a ring stage and one ``Q @ K^T`` (``GLW_QK2``, the 64-position order
    only: :func:`.gluon_attention_pair._paired_tiles`)."""
    return int(block_kv == BLOCK_KV and flag("GLW_QK2", fast, block_kv) == 1)


def split_kv(fast: bool = False) -> int:
    """Whether a ring stage's K is freed apart from its V (``GLW_KVS``; not with two tiles a stage, ``GLW_KV2``)."""
    return int(flag("GLW_KVS", fast) == 1 and _env("GLW_KV2", 0) == 0)


def ring_stages(fast: bool = False, block_kv: int = BLOCK_KV, d: int = 128, size: int = 2) -> int:
    """The K/V ring's depth: ``STAGES`` if set; else where a stage's K is freed apart from its V (:func:`split_kv`:
    the producer stays a tile ahead with two) the deepest of 3 and 2 that leaves room for two Q buffers of ``d``
    columns of ``size`` bytes (2 for the 128-position tiles, 3 for the 64-position ones at D = 128); else 3."""
    if STAGES or not split_kv(fast):
        return STAGES or 3
    return 3 if 3 * 2 * block_kv * d * size + 4 * ROWS * d * size <= Q_ROOM else 2


def q_tma(q: torch.Tensor, group: int, group_p: int, block_q: int, fast: bool = False) -> bool:
    """Whether the producer loads Q by TMA (``GLW_QTMA``, :func:`flag`: by default where ``fast``):
    Q's rows are whole heads of 16-byte aligned rows, and the GQA group is not padded (head-major boxes of one head
    each, :func:`_load_q`)."""
    if not flag("GLW_QTMA", fast) or group != group_p:
        return False
    n, h, d = q.shape
    return (q.stride(2) == 1 and q.stride(1) == d and (q.stride(0) * q.element_size()) % 16 == 0
            and q.data_ptr() % 16 == 0 and block_q * group_p % ROWS == 0 and min(block_q, ROWS) % 8 == 0)


def attention_fwd_gluon(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, cu: torch.Tensor,
                        seq_lens: torch.Tensor, schedule, scale: float, group: int, group_p: int, block_q: int,
                        out: torch.Tensor, lse: torch.Tensor | None, order: torch.Tensor | None = None,
                        block_kv: int = BLOCK_KV, fma: bool = False, n_seqs: int | None = None) -> None:
    """Run the warp-specialised forward into ``out`` (and ``lse``), given ``_device_schedule``'s slot table for
    tiles of ``block_q`` queries (``block_q * group_p == CONSUMERS * ROWS``). ``GLW_PERSIST`` runs one program
    per SM over the slots in ``order`` (:func:`persistent_order`, computed here if not given); ``GLW_PP=1``
    ping-pongs its two consumer warpgroups; ``GLW_QTMA`` has the producer load Q by TMA (:func:`q_tma`); the
    defaults are ``FAST`` for ``n_seqs`` sequences averaging under ``LONG_MEAN`` tokens (:func:`fast_defaults`).
    None of them changes a bit (the battery checks it)."""
    n, h, d = q.shape
    hkv = k_flat.shape[1]
    if block_q * group_p != CONSUMERS * ROWS:
        raise ValueError(f"gluon attention: a tile of {block_q} x {group_p} rows is not {CONSUMERS} x {ROWS}")
    fast = fast_defaults(n, n_seqs)
    qk2 = pair_tiles(block_kv, fast)
    if qk2 and _env("GLW_PP", 0):
        raise ValueError("gluon attention: GLW_QK2=1 (two tiles a Q @ K^T) does not ping-pong; unset GLW_PP")
    g_slots, prog_seq, prog_q0 = schedule
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    persist = flag("GLW_PERSIST", fast) == 1
    tab = persist and flag("GLW_TAB", fast) == 1  # the works' rows in a table (one step a work), else the order
    if tab or (persist and order is None):
        order = persistent_order(schedule, cu, seq_lens, block_q, block_kv, table=tab)
    n_work = g_slots * hkv
    if persist:
        grid = (min(n_work, torch.cuda.get_device_properties(q.device).multi_processor_count),)
    else:
        grid = (g_slots, hkv)
    k_desc, v_desc = _descriptor(k_flat, block_kv), _descriptor(v_flat, block_kv)
    qtma = q_tma(q, group, group_p, block_q, fast)
    if qtma:
        bqb = min(block_q, ROWS)
        q_layout = gl.NVMMASharedLayout.get_default_for([bqb, d], dt)
        q_desc = TensorDescriptor(q, [n, h * d], [q.stride(0), 1], [bqb, d], q_layout)
    else:
        q_layout, q_desc = gl.NVMMASharedLayout.get_default_for([ROWS, d], dt), k_desc
    # two Q buffers where shared memory holds them beside the ring (both orders on their default rings), else one
    stages = ring_stages(fast, block_kv * (1 + qk2), d, q.element_size())
    ring = stages * 2 * block_kv * (1 + qk2) * d * q.element_size()
    nq = 2 if qtma and ring + 4 * ROWS * d * q.element_size() <= Q_ROOM else 1
    args = (q, q_desc, k_desc, v_desc, out, lse if lse is not None else out, prog_seq, prog_q0, cu, seq_lens,
            order if persist else prog_seq, n_work, hkv, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            h if lse is not None else 0, float(scale) * LOG2E)
    maxnreg = int(os.environ.get("GLW_MAXNREG", "0")) or \
        (CONSUMERS * 4 * CONSUMER_REGS + 4 * PRODUCER_REGS) // (4 * (CONSUMERS + 1))
    _attn_fwd_ws_kernel[grid](
        *args, q_layout, group, group_p, block_q, d, stages, lse is not None, ROWS, CONSUMER_REGS,
        int(os.environ.get("GLW_PP", "0")), int(persist), _env("GLW_KV2", 0) | qk2, int(fma), int(qtma),
        nq, _env("GLW_OSM", 1), half_tile(qtma, nq) * (1 - qk2), _env("GLW_TMAX", 0),
        int(qtma and flag("GLW_META", fast) == 1), split_kv(fast), int(tab), flag("GLW_SKIP", fast, block_kv),
        flag("GLW_HOLD", fast, block_kv), qk2, num_warps=4, maxnreg=maxnreg, enable_fp_fusion=False)


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def half_tile(qtma: bool, nq: int = 1) -> int:
    """Whether a work's last KV tile is computed on its lower half when its upper half is past every query
    (``GLW_HALF``, :func:`_half_tile`): not with two tiles a ring stage (``GLW_KV2``), nor with Q by TMA released
    after the last whole tile (``GLW_OSM=0``; with O through the Q buffer it is released after the epilogue), nor
    with two Q buffers (``nq`` 2: Q by TMA where shared memory holds a second one, D = 64), whose output differed
    from the Triton tile's on an H100 (docs/BENCHMARKS.md, thirty-fifth session; the cause is not found)."""
    return int(_env("GLW_HALF", 0) == 1 and not (qtma and _env("GLW_OSM", 1) == 0) and _env("GLW_KV2", 0) == 0
               and nq == 1)
