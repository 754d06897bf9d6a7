"""The online-softmax step of the Gluon attention forward (:mod:`.gluon_attention_fwd`), and its loop over KV tiles in
pairs: two 64-position tiles a ring stage, their ``Q @ K^T`` products issued together (``GLW_QK2``).

A tile's softmax step is :func:`.triton_attention_fwd._attn_fwd_kernel`'s (:func:`_softmax_part`). In the
64-position order the one-tile loop waits for each tile's K and V, issues its ``Q @ K^T`` and waits for it, and
releases its stage, a tile at a time (docs/BENCHMARKS.md, fortieth session). :func:`_paired_tiles` does that once for
two tiles: one wait for a stage's two K tiles, their two ``Q @ K^T`` (the one-tile loop's products, same shape) issued
back to back and waited for at once, then the two softmax steps and the two ``P @ V`` products one after the other,
exactly as the one-tile loop runs them: the same operations in the same order on the same values, so the same bits;
the GPU battery checks it (``benchmarks/bench_attention_gluon.py``, spec letter ``n``; ``tests/test_gluon_forward.py``).
411 instructions a tile in the SASS against 431 (2026-12-07). One N = 128 product for both tiles, split into their
halves in registers, would save 8 more; ptxas serialises every wgmma of the kernel then (C7511), see
docs/BENCHMARKS.md "Two KV tiles a ring stage"."""
from __future__ import annotations

try:  # Gluon and its Hopper namespace (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from .gluon_attention_parts import hold, rescale, row_max_tree, zero_past
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False


if HAVE_GLUON:

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
    def _qk_issue(b, q_smem, k_bufs, NR: gl.constexpr, BLOCK_KV_: gl.constexpr, qk_layout: gl.constexpr):
        """Start ``Q @ K^T`` on K buffer ``b`` (already waited for) without waiting for it (a token)."""
        zero = gl.zeros([NR, BLOCK_KV_], gl.float32, qk_layout)
        return warpgroup_mma(q_smem, k_bufs.index(b).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _qk_two(q_smem, k_pair, NR: gl.constexpr, qk_layout: gl.constexpr):
        """Start ``Q @ K^T`` on a stage's two K tiles (``k_pair``: ``[2 * BLOCK_KV_, D]``), two products of the
        one-tile loop's shape issued back to back, without waiting for them (their two tokens)."""
        W: gl.constexpr = k_pair.shape[0] // 2
        ta = warpgroup_mma(q_smem, k_pair.slice(0, W).permute((1, 0)), gl.zeros([NR, W], gl.float32, qk_layout),
                           use_acc=False, is_async=True)
        tb = warpgroup_mma(q_smem, k_pair.slice(W, W).permute((1, 0)), gl.zeros([NR, W], gl.float32, qk_layout),
                           use_acc=False, is_async=True)
        return ta, tb

    @gluon.jit
    def _pv(acc, alpha, p, v_tile, o_layout: gl.constexpr, p_layout: gl.constexpr, SKIP: gl.constexpr):
        """``P @ V + acc * alpha`` issued (not waited for): the rescale, ``p`` to the 16-bit type, the product."""
        acc = rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), SKIP)
        pb = gl.convert_layout(p.to(v_tile.dtype), p_layout)
        return warpgroup_mma(pb, v_tile, acc, is_async=True), pb

    @gluon.jit
    def _paired_tiles(m_i, l_i, acc, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, pos, qk_scale, n_tiles,
                      n_full, kv_end, tb, NR: gl.constexpr, NSTAGE: gl.constexpr, BLOCK_KV_: gl.constexpr,
                      qk_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, NW: gl.constexpr,
                      q_rel, QTMA: gl.constexpr, TMAX: gl.constexpr = 0, KVS: gl.constexpr = 0,
                      SKIP: gl.constexpr = 0, HOLD: gl.constexpr = 0):
        """One work's ``n_tiles`` (> 0) KV tiles, two a ring stage (the work's stages ``tb``, ``tb + 1``, ...; a
        stage's buffers are ``[2 * BLOCK_KV_, D]``, the second tile's half unloaded past the work's last tile), each
        pair's two ``Q @ K^T`` issued together (:func:`_qk_two`). The steady pass of a pair ``(a, b)``: ``P_a @ V_a``
        issued, ``b``'s softmax while it runs; the next pair's ``Q @ K^T`` and ``P_b @ V_b`` issued together, the
        next ``a``'s softmax while they run (FlashAttention-3's overlap within a warpgroup). The 64-position order
        only (``FMA`` off): every value is the one-tile loop's (:func:`.gluon_attention_fwd._pipelined_tiles`).
        With ``KVS`` a stage's K buffers are freed once their product is done, its V buffers after ``P_b @ V_b``;
        with ``QTMA`` the Q buffer is released (``q_rel``) after the work's last ``Q @ K^T``."""
        n_pairs = (n_tiles + 1) // 2
        st = tb % NSTAGE
        mbarrier.wait(k_ready.index(st), (tb // NSTAGE) & 1)
        toka, tokb = _qk_two(q_smem, k_bufs.index(st), NR, qk_layout)
        sa, sb = warpgroup_mma_wait(0, deps=[toka, tokb])
        if KVS:
            mbarrier.arrive(kv_empty.index(NSTAGE + st), count=1)
        m_i, l_i, p, alpha = _softmax_part(0, sa, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout, 0, TMAX)
        for u in range(n_pairs - 1):  # pairs with both tiles and a pair after them
            i = tb + u
            st = i % NSTAGE
            st1 = (i + 1) % NSTAGE
            mbarrier.wait(v_ready.index(st), (i // NSTAGE) & 1)
            acc_tok, pb = _pv(acc, alpha, p, v_bufs.index(st).slice(0, BLOCK_KV_), o_layout, p_layout, SKIP)
            m_i, l_i, p, alpha = _softmax_part(2 * u + 1, sb, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout,
                                               0, TMAX)
            if HOLD:
                l_i = hold(l_i)
            acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
            mbarrier.wait(k_ready.index(st1), ((i + 1) // NSTAGE) & 1)
            toka, tokb = _qk_two(q_smem, k_bufs.index(st1), NR, qk_layout)
            acc_tok, pb = _pv(acc, alpha, p, v_bufs.index(st).slice(BLOCK_KV_, BLOCK_KV_), o_layout, p_layout, SKIP)
            sa, sb = warpgroup_mma_wait(1, deps=[toka, tokb])
            if KVS:
                mbarrier.arrive(kv_empty.index(NSTAGE + st1), count=1)
            m_i, l_i, p, alpha = _softmax_part(2 * u + 2, sa, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout,
                                               0, TMAX)
            if HOLD:
                l_i = hold(l_i)
            acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
            mbarrier.arrive(kv_empty.index(st), count=1)
        if QTMA:  # every Q @ K^T of the work is done
            mbarrier.arrive(q_rel, count=1)
        # the last pair: its first tile, then its second where the work has an even count (each product waited for
        # in its own block, so no wgmma is in flight across the branch)
        i = tb + n_pairs - 1
        st = i % NSTAGE
        t = 2 * (n_pairs - 1)
        mbarrier.wait(v_ready.index(st), (i // NSTAGE) & 1)
        v_a = v_bufs.index(st).slice(0, BLOCK_KV_)
        if kv_end < (t + 1) * BLOCK_KV_:  # the sequence ends inside this tile
            zero_past(v_a, kv_end - t * BLOCK_KV_, BLOCK_KV_, v_bufs.shape[2], NW)
        acc_tok, pb = _pv(acc, alpha, p, v_a, o_layout, p_layout, SKIP)
        acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
        if t + 1 < n_tiles:
            m_i, l_i, p, alpha = _softmax_part(t + 1, sb, m_i, l_i, pos, qk_scale, n_full, BLOCK_KV_, qk_layout, 0,
                                               TMAX)
            v_b = v_bufs.index(st).slice(BLOCK_KV_, BLOCK_KV_)
            if kv_end < (t + 2) * BLOCK_KV_:
                zero_past(v_b, kv_end - (t + 1) * BLOCK_KV_, BLOCK_KV_, v_bufs.shape[2], NW)
            acc_tok, pb = _pv(acc, alpha, p, v_b, o_layout, p_layout, SKIP)
            acc, pb = warpgroup_mma_wait(0, deps=[acc_tok, pb])
        mbarrier.arrive(kv_empty.index(st), count=1)
        return m_i, l_i, acc
