"""Pieces of the Gluon attention forward (:mod:`.gluon_attention_fwd`) that stand on their own: a program's works
and their slot table rows, the ring's bookkeeping, the ping-pong turns, the row max as a tree, the V rows zeroed past
a sequence's end, and the persistent schedule's slot order (a Triton kernel)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Gluon and its Hopper namespace (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False

BLOCK_KV = 64  # the KV positions of one online-softmax step (the fixed order; triton_attention_fwd.BLOCK_KV)
# GLW_SKIP (:func:`rescale`): whether any of a thread's two rows has alpha != 1, voted across its warp (uniform)
_ANY_ROW_RESCALED_S = """{
.reg .pred a, b;
setp.neu.f32 a, $2, 0f3F800000;
setp.neu.f32 b, $3, 0f3F800000;
or.pred a, a, b;
vote.sync.any.pred a, a, 0xffffffff;
selp.s32 $0, 1, 0, a;
mov.b32 $1, $0;
}"""


def _rescale_asm(pack: int) -> tuple[str, str]:
    """The PTX of :func:`rescale` for ``pack`` accumulator values a thread: ``acc * alpha`` (``mul.rn``, as the
    plain code), branched over where the warp's vote (the last operand) says no row changed its max."""
    muls = "\n".join(f"mul.rn.f32 ${i}, ${i}, ${pack + pack + i};" for i in range(pack))
    asm = "{\n.reg .pred keep;\nsetp.eq.s32 keep, $" + str(3 * pack) + ", 0;\n@keep bra.uni done;\n" + muls + \
        "\ndone:\n}"
    constraints = ",".join(["=f"] * pack + [str(i) for i in range(pack)] + ["f"] * pack + ["r"] * pack)
    return asm, constraints


# GLW_HOLD (:func:`hold`): a loop that runs once (it loops again only if the SM clock reads 0xffffffff, then once
# more), i.e. a basic block boundary ptxas cannot fold or schedule across
_HOLD_S = """{
.reg .pred q;
.reg .u32 c;
again:
mov.u32 c, %clock;
setp.eq.u32 q, c, 0xffffffff;
@q bra again;
mov.b32 $0, $2;
mov.b32 $1, $3;
}"""


if HAVE_GLUON:
    _HOLD = gl.constexpr(_HOLD_S)
    _ANY_ROW_RESCALED = gl.constexpr(_ANY_ROW_RESCALED_S)
    _RESCALE_64 = gl.constexpr(_rescale_asm(64)[0])
    _RESCALE_64_C = gl.constexpr(_rescale_asm(64)[1])
    _RESCALE_32 = gl.constexpr(_rescale_asm(32)[0])
    _RESCALE_32_C = gl.constexpr(_rescale_asm(32)[1])


if HAVE_GLUON:

    @gluon.jit
    def _work(r, order_ptr, n_work, hkv, PERSIST: gl.constexpr):
        """Round ``r``'s work of this program: (schedule slot, KV head, whether there is one). A persistent program
        takes works ``r * P + lane`` of the slots sorted longest first (``order``), the lane snaking (``pid`` on
        even rounds, ``P - 1 - pid`` on odd ones) so that the long works spread evenly; otherwise the grid is
        (slots, KV heads) and a program has one work. Which program runs a work does not change its bits."""
        if PERSIST:
            idx, valid = _persistent_index(r, n_work)
            slot = gl.load(order_ptr + idx // hkv)
            hk = idx % hkv
        else:
            slot = gl.program_id(0)
            hk = gl.program_id(1)
            valid = slot >= 0
        return slot, hk, valid

    @gluon.jit
    def _persistent_index(r, n_work):
        """A persistent program's round ``r`` work index (the lane snaking: ``pid`` on even rounds, ``P - 1 - pid``
        on odd ones), clamped to the last work, and whether there is one."""
        n_prog = gl.num_programs(0)
        pid = gl.program_id(0)
        lane = gl.where(r % 2 == 0, pid, n_prog - 1 - pid)
        idx = r * n_prog + lane
        valid = idx < n_work
        return gl.minimum(idx, n_work - 1), valid

    @gluon.jit
    def _next_work(r, order_ptr, n_work, hkv, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q: gl.constexpr,
                   BLOCK_KV_: gl.constexpr, PERSIST: gl.constexpr, TAB: gl.constexpr):
        """Round ``r``'s work: ``(seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk)``, from the work table
        (``TAB``: :func:`_work_row`) or through the order and the slot table (:func:`_work`, :func:`_program`)."""
        if TAB:
            seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk = _work_row(r, order_ptr, n_work, hkv)
        else:
            slot, hk, valid = _work(r, order_ptr, n_work, hkv, PERSIST)
            seq, q0, cu0, q_len, first_pos, n_tiles, n_full = _program(slot, valid, prog_seq_ptr, prog_q0_ptr, cu_ptr,
                                                                       seq_lens_ptr, BLOCK_Q, BLOCK_KV_)
        return seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk

    @gluon.jit
    def _rounds(n_work, PERSIST: gl.constexpr):
        if PERSIST:
            n = gl.cdiv(n_work, gl.num_programs(0))
        else:
            n = gl.program_id(0) * 0 + 1
        return n

    @gluon.jit
    def _program(slot, valid, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q: gl.constexpr,
                 BLOCK_KV_: gl.constexpr):
        """Slot ``slot``'s sequence (-1: none), first query, packed row, query count, first position, and its
        number of KV tiles and of tiles that need no causal mask (as in the Triton kernel)."""
        seq = gl.where(valid, gl.load(prog_seq_ptr + slot), -1)
        seq_c = gl.maximum(seq, 0)
        q0 = gl.load(prog_q0_ptr + slot)
        cu0 = gl.load(cu_ptr + seq_c)
        q_len = gl.load(cu_ptr + seq_c + 1) - cu0
        kv_len = gl.load(seq_lens_ptr + seq_c)
        first_pos = kv_len - q_len
        last_pos = first_pos + gl.minimum(q0 + BLOCK_Q, q_len) - 1
        n_tiles = last_pos // BLOCK_KV_ + 1
        n_full = gl.minimum((first_pos + q0 + 1) // BLOCK_KV_, n_tiles)
        n_tiles = gl.where(seq >= 0, n_tiles, 0).to(gl.int32)  # stage indices must be int32 (seq_lens may be int64)
        # an empty slot (seq -1) has no tiles at all: its producer loads none, so its consumers must wait on none
        # (n_full was computed from sequence 0's length, with the slot's q0 past its end: 1 for a 64-token batch,
        # and the consumers waited for a tile that never came: the hang of 2026-12-05)
        n_full = gl.minimum(n_full, n_tiles).to(gl.int32)
        return seq, q0, cu0, q_len, first_pos, n_tiles, n_full

    @gluon.jit
    def _work_row(r, table_ptr, n_work, hkv):
        """Round ``r``'s work of a persistent program (``TAB``) from :func:`persistent_order`'s table: :func:`_work`'s
        lane rule, then :func:`_program`'s values for the slot in one row of independent loads (no chain through
        the slot and its sequence), and the KV head: ``(seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk)``."""
        idx, valid = _persistent_index(r, n_work)
        row = table_ptr + (idx // hkv) * 8
        seq = gl.where(valid, gl.load(row), -1)
        n_tiles = gl.where(valid, gl.load(row + 5), 0)  # past the last work: none, as _program's empty slot
        n_full = gl.where(valid, gl.load(row + 6), 0)
        return seq, gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4), n_tiles, n_full, idx % hkv

    @gluon.jit
    def _put_meta(buf, meta):
        """The producer writes a work's ``(seq, q0, cu0, q_len, first_pos, n_tiles, n_full, hk)`` into ``buf`` (8
        int32), every thread of the partition before one of them arrives on the work's Q barrier."""
        lay: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
        i = gl.arange(0, 8, layout=lay)
        v = gl.zeros([8], gl.int32, lay)
        for k in gl.static_range(8):
            v = gl.where(i == k, meta[k].to(gl.int32), v)
        buf.store(v)
        gl.thread_barrier()

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
    def _row_query(r, GROUP_P: gl.constexpr, BLOCK_Q: gl.constexpr, BQB: gl.constexpr, QTMA: gl.constexpr):
        """Tile row ``r``'s (query offset, head of the GQA group): query-major (``r // GROUP_P``, ``r % GROUP_P``,
        the Triton kernel's rows) or, with ``QTMA``, head-major in boxes of ``BQB`` queries (:func:`_load_q`). A
        row's arithmetic does not depend on where in the tile it sits, so both give the same bits."""
        if QTMA:
            j = r // BQB
            qo = (j % (BLOCK_Q // BQB)) * BQB + r % BQB
            g = j // (BLOCK_Q // BQB)
        else:
            qo = r // GROUP_P
            g = r % GROUP_P
        return qo, g

    @gluon.jit
    def _units(n_tiles, KV2: gl.constexpr):
        """Ring stages a work of ``n_tiles`` KV tiles takes."""
        if KV2:
            n = (n_tiles + 1) // 2
        else:
            n = n_tiles
        return n

    @gluon.jit
    def _load_pair(desc, bar, bufs, st, row, col, two, BLOCK_KV_: gl.constexpr, HALVES: gl.constexpr = 0):
        """Tiles at ``row`` (and ``row + BLOCK_KV_`` if ``two``) into ring stage ``st``'s two buffers, on ``bar``:
        ``bufs[2 st]`` and ``bufs[2 st + 1]``, or with ``HALVES`` (``GLW_QK2``) the halves of ``bufs[st]``."""
        if HALVES:
            dst0 = bufs.index(st).slice(0, BLOCK_KV_)
            dst1 = bufs.index(st).slice(BLOCK_KV_, BLOCK_KV_)
        else:
            dst0 = bufs.index(2 * st)
            dst1 = bufs.index(2 * st + 1)
        if two:
            mbarrier.expect(bar, 2 * desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, col], bar, dst0)
        tma.async_copy_global_to_shared(desc, [row + BLOCK_KV_, col], bar, dst1, pred=two)

    @gluon.jit
    def _ring(tb, t, n_tiles, NSTAGE: gl.constexpr, KV2: gl.constexpr):
        """Where a work's tile ``t`` is (the work's first stage ``tb``): (stage, phase, buffer, whether it starts
        its stage: wait for it, whether it ends it: release the stage after it)."""
        if KV2:
            i = tb + t // 2
            st = i % NSTAGE
            b = 2 * st + t % 2
            new = t % 2 == 0
            last = (t % 2 == 1) | (t == n_tiles - 1)
        else:
            i = tb + t
            st = i % NSTAGE
            b = st
            new = t >= 0
            last = t >= 0
        return st, (i // NSTAGE) & 1, b, new, last

    @gluon.jit
    def _turn(pp_bars, turn, CID: gl.constexpr, PP: gl.constexpr):
        """Ping-pong (``PP``): wait until it is this warpgroup's turn ``turn`` to issue its products. Turns
        alternate: warpgroup 0's turn ``k`` follows warpgroup 1's turn ``k - 1``, which follows warpgroup 0's turn
        ``k - 1``, so one warpgroup's softmax runs while the other's products hold the tensor cores (a fresh
        barrier passes parity 1: warpgroup 0's first turn is free)."""
        if PP:
            mbarrier.wait(pp_bars.index(CID), (turn & 1) ^ (1 - CID))

    @gluon.jit
    def _pass(pp_bars, CID: gl.constexpr, PP: gl.constexpr):
        """Ping-pong: hand the turn to the other warpgroup, once this one's products are issued."""
        if PP:
            mbarrier.arrive(pp_bars.index(1 - CID), count=1)

    @gluon.jit
    def rescale(acc, alpha, SKIP: gl.constexpr):
        """``acc * alpha[:, None]`` (``alpha`` in the rows' layout of ``acc``'s). With ``SKIP`` (``GLW_SKIP``) a warp
        whose 16 rows all have ``alpha == 1`` exactly (no row's max grew on this tile: ``exp2(0)``) skips the
        multiplies, which would leave every bit as it is (``x * 1.0 == x``): a warp-uniform branch in PTX over the
        thread's 64 products (:func:`_rescale_asm`), decided by a vote of the warp (``_ANY_ROW_RESCALED``)."""
        if SKIP:
            vote = gl.inline_asm_elementwise(_ANY_ROW_RESCALED, "=r,=r,f,f", [alpha], dtype=gl.int32, is_pure=True,
                                             pack=2)
            if acc.shape[1] == 128:  # 64 values a thread (4 warps, 64 rows)
                out = gl.inline_asm_elementwise(_RESCALE_64, _RESCALE_64_C, [acc, alpha[:, None], vote[:, None]],
                                                dtype=gl.float32, is_pure=True, pack=64)
            else:
                out = gl.inline_asm_elementwise(_RESCALE_32, _RESCALE_32_C, [acc, alpha[:, None], vote[:, None]],
                                                dtype=gl.float32, is_pure=True, pack=32)
        else:
            out = acc * alpha[:, None]
        return out

    @gluon.jit
    def hold(x):
        """``x`` (a row vector, two values a thread) through a block boundary of the PTX (``_HOLD``), so that ptxas
        cannot move an instruction placed after it in the source (the wait for ``P_t @ V_t``, ``GLW_HOLD``) above the
        code that computed ``x`` (the softmax's exponentials and row sums): by itself ptxas puts that
        ``WARPGROUP.DEPBAR`` before the exponentials, which then run with the product done."""
        return gl.inline_asm_elementwise(_HOLD, "=f,=f,f,f", [x], dtype=gl.float32, is_pure=False, pack=2)

    @gluon.jit
    def _halve(x, W: gl.constexpr):
        """The larger of ``x``'s two column halves, elementwise (``[rows, W]`` -> ``[rows, W // 2]``)."""
        NR: gl.constexpr = x.shape[0]
        a, b = gl.split(gl.permute(gl.reshape(x, [NR, 2, W // 2]), (0, 2, 1)))
        return gl.maximum(a, b)

    @gluon.jit
    def row_max_tree(s, W: gl.constexpr):
        """Each row's max of ``s`` (``[rows, W]`` in the wgmma accumulator layout) as a tree: halving the columns a
        thread holds (the 8-column chunks, W / 8 of them, in registers; then the chunk's column pair), then across
        the quad's 4 threads. ``gl.max`` runs a thread's 2 W / 8 values as one chain of dependent ``max.f32``
        instead; max is exact, so both give the same bits (``GLW_TMAX``)."""
        NR: gl.constexpr = s.shape[0]
        x = s
        for i in gl.static_range(5):  # the chunk bits: W / 8 chunks (at most 32) -> 1
            if W >> i > 8:
                x = _halve(x, W >> i)
        a, b = gl.split(gl.reshape(x, [NR, 4, 2]))  # the pair a thread holds of each chunk
        return gl.convert_layout(gl.max(gl.maximum(a, b), axis=1), gl.SliceLayout(1, s.type.layout))

    @gluon.jit
    def zero_past(v_tile, n_valid, BLOCK_KV_: gl.constexpr, D: gl.constexpr, NW: gl.constexpr):
        """Zero the rows of a V tile in shared memory from row ``n_valid`` on: the rows past the sequence's end in its
        last tile, which TMA loads from the next sequence (or zero-fills past the tensor). Their scores are masked,
        so ``p == 0`` there, but ``0 * inf`` or ``0 * nan`` in ``P @ V`` would carry a neighbour's non-finite values
        into this sequence, which the Triton kernel's masked loads never read. Both consumer warpgroups zero the same
        rows before their own product (they write what is there or zeros, so the order between them is moot)."""
        CH: gl.constexpr = 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [NW, 1], [1, 0])
        rows = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(BLOCK_KV_ // CH):
            if (c + 1) * CH > n_valid:
                part = v_tile.slice(c * CH, CH)
                x = part.load(layout)
                part.store(gl.where((c * CH + rows)[:, None] < n_valid, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()


@triton.jit
def _order_kernel(prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, order_ptr, G, BLOCK_Q: tl.constexpr,
                  BLOCK_KV_: tl.constexpr, CHUNK: tl.constexpr, TAB: tl.constexpr = 0):
    """``order``: the schedule's slots sorted by their number of KV tiles, most first (ties by slot; empty slots
    last), for the persistent kernel. Slot i goes to rank #(slots with more tiles) + #(as many, before i). With
    ``TAB``, ``order_ptr`` gets rank k's slot row instead (8 int32: :func:`_slot_row`'s values, then 0)."""
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    seq, q0, cu0, q_len, first_pos, ci, n_full = _slot_row(i, G, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr,
                                                           BLOCK_Q, BLOCK_KV_)
    rank = tl.zeros([CHUNK], tl.int32)
    for j0 in range(0, G, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        _, _, _, _, _, cj, _ = _slot_row(j, G, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_KV_)
        ahead = (cj[None, :] > ci[:, None]) | ((cj[None, :] == ci[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < G)[None, :]).to(tl.int32), axis=1)
    if TAB:
        row = order_ptr + rank * 8
        ok = i < G
        tl.store(row, seq, mask=ok)
        tl.store(row + 1, q0, mask=ok)
        tl.store(row + 2, cu0, mask=ok)
        tl.store(row + 3, q_len, mask=ok)
        tl.store(row + 4, first_pos, mask=ok)
        tl.store(row + 5, ci, mask=ok)
        tl.store(row + 6, n_full, mask=ok)
        tl.store(row + 7, tl.zeros_like(seq), mask=ok)
    else:
        tl.store(order_ptr + rank, i, mask=i < G)


@triton.jit
def _slot_row(i, G, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q: tl.constexpr, BLOCK_KV_: tl.constexpr):
    """Slots ``i``'s ``_program`` values as int32 (an empty slot or one past ``G``: seq -1, no tiles)."""
    ok = i < G
    seq = tl.load(prog_seq_ptr + i, mask=ok, other=-1)
    seq_c = tl.maximum(seq, 0)
    q0 = tl.load(prog_q0_ptr + i, mask=ok, other=0)
    cu0 = tl.load(cu_ptr + seq_c)
    q_len = tl.load(cu_ptr + seq_c + 1) - cu0
    first_pos = tl.load(seq_lens_ptr + seq_c) - q_len
    n_tiles = (first_pos + tl.minimum(q0 + BLOCK_Q, q_len) - 1) // BLOCK_KV_ + 1
    n_full = tl.minimum((first_pos + q0 + 1) // BLOCK_KV_, n_tiles)
    n_tiles = tl.where(seq >= 0, n_tiles, 0).to(tl.int32)
    n_full = tl.minimum(n_full, n_tiles).to(tl.int32)
    return (seq.to(tl.int32), q0.to(tl.int32), cu0.to(tl.int32), q_len.to(tl.int32), first_pos.to(tl.int32), n_tiles,
            n_full)


def persistent_order(schedule, cu: torch.Tensor, seq_lens: torch.Tensor, block_q: int, block_kv: int = BLOCK_KV,
                     table: bool = False) -> torch.Tensor:
    """The persistent kernel's slot order (``_order_kernel``), on the device with no host wait; with ``table``, a
    ``[slots, 8]`` int32 table instead whose row k is the k-th slot's ``(seq, q0, cu0, q_len, first_pos, n_tiles,
    n_full, 0)`` (``GLW_TAB``: the producer reads a work in one step, :func:`_work_row`)."""
    g_slots, prog_seq, prog_q0 = schedule
    order = torch.empty((g_slots, 8) if table else g_slots, device=cu.device, dtype=torch.int32)
    chunk = 128
    _order_kernel[(triton.cdiv(g_slots, chunk),)](prog_seq, prog_q0, cu, seq_lens, order, g_slots, BLOCK_Q=block_q,
                                                  BLOCK_KV_=block_kv, CHUNK=chunk, TAB=int(table), num_warps=4)
    return order
