"""The consumer side of the Gluon attention forward (:mod:`.gluon_attention_fwd`): the online-softmax step, the
pipelined loop over a work's middle KV tiles, the epilogue, and the cross-work consumer (``GLW_XW``), which issues
the next work's first ``Q @ K^T`` before its current work's last ``P @ V`` is done and runs the epilogue while it is
on the tensor cores."""
from __future__ import annotations

try:  # Gluon and its Hopper namespace (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from .gluon_attention_parts import _pass, _ring, _rounds, _row_query, _turn, row_max_tree, zero_past
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _get_meta(buf):
        """A consumer's copy of a work's row written by :func:`_put_meta` (after waiting for the work's Q)."""
        lay: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        i = gl.arange(0, 8, layout=lay)
        v = buf.load(lay)
        return (gl.sum(gl.where(i == 0, v, 0), axis=0), gl.sum(gl.where(i == 1, v, 0), axis=0),
                gl.sum(gl.where(i == 2, v, 0), axis=0), gl.sum(gl.where(i == 3, v, 0), axis=0),
                gl.sum(gl.where(i == 4, v, 0), axis=0), gl.sum(gl.where(i == 5, v, 0), axis=0),
                gl.sum(gl.where(i == 6, v, 0), axis=0), gl.sum(gl.where(i == 7, v, 0), axis=0))

    @gluon.jit
    def _qk_issue(b, q_smem, k_bufs, NR: gl.constexpr, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr):
        """Start ``Q @ K^T`` on K buffer ``b`` (already waited for) without waiting for it (a token)."""
        zero = gl.zeros([NR, BLOCK_KV_], gl.float32, qk_layout)
        return warpgroup_mma(q_smem, k_bufs.index(b).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _softmax_part(t, qk, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr,
                      FMA: gl.constexpr, TMAX: gl.constexpr = 0):
        """The Triton kernel's online-softmax arithmetic (``_softmax_step``, in the order ``FMA`` names) on KV tile
        ``t``'s scores, up to ``p`` and ``alpha`` (the causal mask where ``t >= n_full``: a full tile's positions all
        pass it, so it is skipped there, as there)."""
        if FMA:
            s = qk
        else:
            s = qk * qk_scale
        if t >= n_full:
            j = t * BLOCK_KV_ + gl.arange(0, BLOCK_KV_, layout=gl.SliceLayout(0, qk_layout))
            s = gl.where(j[None, :] <= pos[:, None], s, float("-inf"))
        if TMAX:  # the same maximum, as a tree
            m_new = gl.maximum(m_i, row_max_tree(s, BLOCK_KV_))
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
        if FMA:
            p = gl.exp2(gl.fma(s, gl.full_like(s, qk_scale), -(m_new * qk_scale)[:, None]))
            alpha = gl.exp2((m_i - m_new) * qk_scale)
        else:
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return m_new, l_i, p, alpha

    @gluon.jit
    def _tile_loop(m_i, l_i, p, alpha, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pp_bars, pos, qk_scale,
                   n_tiles, n_full, tb, turn, CID: gl.constexpr, PP: gl.constexpr, NR: gl.constexpr,
                   NSTAGE: gl.constexpr, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr, o_layout: gl.constexpr,
                   p_layout: gl.constexpr, KV2: gl.constexpr, FMA: gl.constexpr, TMAX: gl.constexpr,
                   KVS: gl.constexpr):
        """A work's tiles ``0 .. n_tiles - 2`` as :func:`.gluon_attention_fwd._pipelined_tiles` overlaps them:
        ``Q @ K_{t+1}^T`` and ``P_t @ V_t`` issued together, tile ``t + 1``'s softmax while ``P_t @ V_t`` runs. On
        entry tile 0's softmax is done; on return the last tile's is, its ``P @ V`` not issued."""
        for t in range(n_tiles - 1):
            st, ph, b, new, last = _ring(tb, t, n_tiles, NSTAGE, KV2)
            st1, ph1, b1, new1, last1 = _ring(tb, t + 1, n_tiles, NSTAGE, KV2)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            pb = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
            mbarrier.wait(k_ready.index(st1), ph1, pred=new1)  # predicates, not ifs: see _pipelined_tiles
            mbarrier.wait(v_ready.index(st), ph, pred=new)
            _turn(pp_bars, turn + 1 + t, CID, PP)
            tok = _qk_issue(b1, q_smem, k_bufs, NR, BLOCK_KV_, qk_layout)
            acc_tok = warpgroup_mma(pb, v_bufs.index(b), acc, is_async=True)
            _pass(pp_bars, CID, PP)
            qk = warpgroup_mma_wait(1, deps=[tok])  # groups finish in order: Q @ K_{t+1}^T is done
            if KVS:
                mbarrier.arrive(kv_empty.index(NSTAGE + st1), count=1)
            m_i, l_i, p, alpha = _softmax_part(t + 1, qk, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout,
                                               FMA, TMAX)
            acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
            mbarrier.arrive(kv_empty.index(st), count=1, pred=last)
        return m_i, l_i, p, alpha, acc

    @gluon.jit
    def _epilogue(acc, l_i, m_i, q_smem, o_ptr, lse_ptr, q0, q_len, cu0, hk, stride_on, stride_oh, stride_ln,
                  qk_scale, CID: gl.constexpr, NR: gl.constexpr, GROUP: gl.constexpr, GROUP_P: gl.constexpr,
                  BLOCK_Q: gl.constexpr, BQB: gl.constexpr, D: gl.constexpr, QTMA: gl.constexpr, OSM: gl.constexpr,
                  WRITE_LSE: gl.constexpr, FMA: gl.constexpr, NW: gl.constexpr):
        """A work's ``out = acc / l`` stored (with ``OSM`` through the warpgroup's Q buffer ``q_smem``, whose last
        ``Q @ K^T`` is done: written in the wgmma layout, read back a row's 16 bytes to a thread, 16-byte stores; else
        straight from the wgmma layout) and its ``lse = m + log2 l``."""
        o_layout: gl.constexpr = acc.type.layout
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [NW, 1], [1, 0])
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        if OSM:
            q_smem.store(out.to(q_smem.dtype))
            gl.thread_barrier()
            o_r = q_smem.load(ld_layout)
            r = CID * NR + gl.arange(0, NR, layout=gl.SliceLayout(1, ld_layout))
            d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
            qi, g = _row_query(r, GROUP_P, BLOCK_Q, BQB, QTMA)
            qi += q0
            o_off = (cu0 + qi).to(gl.int64) * stride_on + (hk * GROUP + g).to(gl.int64) * stride_oh
            gl.store(o_ptr + o_off[:, None] + d[None, :], o_r.to(o_ptr.dtype.element_ty),
                     mask=((qi < q_len) & (g < GROUP))[:, None])
        else:
            q_off_o, g_o = _row_query(CID * NR + gl.arange(0, NR, layout=row_o), GROUP_P, BLOCK_Q, BQB, QTMA)
            do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            qo = q0 + q_off_o
            ok_o = (qo < q_len) & (g_o < GROUP)
            o_off = ((cu0 + qo).to(gl.int64)[:, None] * stride_on
                     + (hk * GROUP + g_o).to(gl.int64)[:, None] * stride_oh)
            gl.store(o_ptr + o_off + do[None, :], out.to(o_ptr.dtype.element_ty), mask=ok_o[:, None])
        if WRITE_LSE:
            q_off_s, g_s = _row_query(CID * NR + gl.arange(0, NR, layout=m_i.type.layout), GROUP_P, BLOCK_Q, BQB,
                                      QTMA)
            qs = q0 + q_off_s
            ok_s = (qs < q_len) & (g_s < GROUP)
            l_off = (cu0 + qs).to(gl.int64) * stride_ln + (hk * GROUP + g_s).to(gl.int64)
            if FMA:
                m_i = m_i * qk_scale
            gl.store(lse_ptr + l_off, m_i + gl.log2(l_i), mask=ok_s)

    @gluon.jit
    def _xw_head(q_bufs, k_bufs, k_ready, q_ready, meta_bufs, qc, tb, CID: gl.constexpr, NR: gl.constexpr,
                 NQ: gl.constexpr, NSTAGE: gl.constexpr, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr):
        """Work ``qc``'s start: its slot row (written by the producer before its Q barrier's arrival) and its first
        ``Q @ K^T`` issued, not waited for (for a work without tiles, on whatever the buffers hold: the product is
        discarded, and such works come last, after every load)."""
        mbarrier.wait(q_ready.index(qc % NQ), (qc // NQ) & 1)
        seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _get_meta(meta_bufs.index(qc % NQ))
        st = tb % NSTAGE
        mbarrier.wait(k_ready.index(st), (tb // NSTAGE) & 1, pred=n_tiles > 0)
        tok = _qk_issue(st, q_bufs.index(2 * (qc % NQ) + CID), k_bufs, NR, BLOCK_KV_, qk_layout)
        return tok, seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk

    @gluon.jit
    def _xw_body(tok, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_off_s, qc, tb, q0, q_len, first_pos,
                 n_tiles, n_full, qk_scale, CID: gl.constexpr, NR: gl.constexpr, NQ: gl.constexpr, D: gl.constexpr,
                 NSTAGE: gl.constexpr, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr, o_layout: gl.constexpr,
                 p_layout: gl.constexpr, FMA: gl.constexpr, TMAX: gl.constexpr, KVS: gl.constexpr):
        """Work ``qc``'s first tile's softmax (its ``Q @ K^T`` issued by :func:`_xw_head`), then its middle tiles."""
        qk = warpgroup_mma_wait(0, deps=[tok])
        if KVS:
            mbarrier.arrive(kv_empty.index(NSTAGE + tb % NSTAGE), count=1, pred=n_tiles > 0)
        row_s: gl.constexpr = gl.SliceLayout(1, qk_layout)
        pos = first_pos + gl.minimum(q0 + q_off_s, q_len - 1)  # padding rows borrow a real position
        m_i = gl.full([NR], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([NR], gl.float32, row_s)
        acc = gl.zeros([NR, D], gl.float32, o_layout)
        m_i, l_i, p, alpha = _softmax_part(0, qk, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout, FMA, TMAX)
        return _tile_loop(m_i, l_i, p, alpha, acc, q_bufs.index(2 * (qc % NQ) + CID), k_bufs, v_bufs, k_ready,
                          v_ready, kv_empty, kv_empty, pos, qk_scale, n_tiles, n_full, tb, 0, CID, 0, NR, NSTAGE,
                          BLOCK_KV_, qk_layout, o_layout, p_layout, 0, FMA, TMAX, KVS)

    @gluon.jit
    def _xw_last(acc, p, alpha, v_bufs, v_ready, tb, n_tiles, kv_end, BLOCK_KV_: gl.constexpr, NSTAGE: gl.constexpr,
                 p_layout: gl.constexpr, NW: gl.constexpr):
        """A work's last ``P @ V`` issued, not waited for: (its token, P, the ring stage to free after it)."""
        i = gl.maximum(tb + n_tiles - 1, 0)
        st = i % NSTAGE
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        pb = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
        mbarrier.wait(v_ready.index(st), (i // NSTAGE) & 1, pred=n_tiles > 0)
        if (n_tiles > 0) & (kv_end < n_tiles * BLOCK_KV_):  # the sequence ends inside this tile
            zero_past(v_bufs.index(st), kv_end - (n_tiles - 1) * BLOCK_KV_, BLOCK_KV_, v_bufs.shape[2], NW)
        return warpgroup_mma(pb, v_bufs.index(st), acc, is_async=True), pb, st

    @gluon.jit
    def consumer_xw(o_ptr, lse_ptr, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_ready, q_empty, meta_bufs,
                    n_work, stride_on, stride_oh, stride_ln, qk_scale, CID: gl.constexpr, NR: gl.constexpr,
                    GROUP: gl.constexpr, GROUP_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_KV_: gl.constexpr,
                    D: gl.constexpr, NSTAGE: gl.constexpr, WRITE_LSE: gl.constexpr, NW: gl.constexpr,
                    FMA: gl.constexpr, NQ: gl.constexpr, BQB: gl.constexpr, TMAX: gl.constexpr, KVS: gl.constexpr):
        """A persistent consumer warpgroup (Q by TMA, the slot rows from the producer, two Q buffers, O through the
        Q buffer, no ping-pong) that runs its works back to back: a work's last ``P @ V`` is issued, then the next
        work's first ``Q @ K^T``; once the ``P @ V`` is done the work's epilogue runs while the ``Q @ K^T`` is on
        the tensor cores. Each value is computed by the same operations as in :func:`.gluon_attention_fwd._consumer`
        (a work starts from ``m = -inf``, ``l = 0``, ``acc = 0``), so the bits are the same."""
        qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, BLOCK_KV_, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_off_s, g_s = _row_query(CID * NR + gl.arange(0, NR, layout=gl.SliceLayout(1, qk_layout)), GROUP_P,
                                  BLOCK_Q, BQB, 1)
        qc = gl.program_id(0) * 0
        tb = gl.program_id(0) * 0
        tok, seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _xw_head(
            q_bufs, k_bufs, k_ready, q_ready, meta_bufs, qc, tb, CID, NR, NQ, NSTAGE, BLOCK_KV_, qk_layout)
        m_i, l_i, p, alpha, acc = _xw_body(tok, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_off_s, qc, tb,
                                           q0, q_len, first_pos, n_tiles, n_full, qk_scale, CID, NR, NQ, D, NSTAGE,
                                           BLOCK_KV_, qk_layout, o_layout, p_layout, FMA, TMAX, KVS)
        for rnd in range(1, _rounds(n_work, 1)):
            acc_tok, pb, st = _xw_last(acc, p, alpha, v_bufs, v_ready, tb, n_tiles, first_pos + q_len, BLOCK_KV_,
                                       NSTAGE, p_layout, NW)
            p_seq, p_q0, p_cu0, p_q_len, p_hk, p_n = seq, q0, cu0, q_len, hk, n_tiles
            tb += n_tiles
            qc += 1
            tok, seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _xw_head(
                q_bufs, k_bufs, k_ready, q_ready, meta_bufs, qc, tb, CID, NR, NQ, NSTAGE, BLOCK_KV_, qk_layout)
            acc, pb = warpgroup_mma_wait(1, deps=[acc_tok, pb])  # the last work's P @ V is done (in order)
            mbarrier.arrive(kv_empty.index(st), count=1, pred=p_n > 0)
            if p_seq >= 0:
                _epilogue(acc, l_i, m_i, q_bufs.index(2 * ((qc - 1) % NQ) + CID), o_ptr, lse_ptr, p_q0, p_q_len,
                          p_cu0, p_hk, stride_on, stride_oh, stride_ln, qk_scale, CID, NR, GROUP, GROUP_P, BLOCK_Q,
                          BQB, D, 1, 1, WRITE_LSE, FMA, NW)
            gl.thread_barrier()  # every warp has read its O rows back
            mbarrier.arrive(q_empty.index((qc - 1) % NQ), count=1)
            m_i, l_i, p, alpha, acc = _xw_body(tok, q_bufs, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_off_s, qc,
                                               tb, q0, q_len, first_pos, n_tiles, n_full, qk_scale, CID, NR, NQ, D,
                                               NSTAGE, BLOCK_KV_, qk_layout, o_layout, p_layout, FMA, TMAX, KVS)
        acc_tok, pb, st = _xw_last(acc, p, alpha, v_bufs, v_ready, tb, n_tiles, first_pos + q_len, BLOCK_KV_, NSTAGE,
                                   p_layout, NW)
        acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
        mbarrier.arrive(kv_empty.index(st), count=1, pred=n_tiles > 0)
        if seq >= 0:
            _epilogue(acc, l_i, m_i, q_bufs.index(2 * (qc % NQ) + CID), o_ptr, lse_ptr, q0, q_len, cu0, hk, stride_on,
                      stride_oh, stride_ln, qk_scale, CID, NR, GROUP, GROUP_P, BLOCK_Q, BQB, D, 1, 1, WRITE_LSE, FMA,
                      NW)
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(qc % NQ), count=1)
