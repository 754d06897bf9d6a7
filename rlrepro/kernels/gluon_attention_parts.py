"""Pieces of the Gluon attention forward (:mod:`.gluon_attention_fwd`) that stand on their own: the row max as a
tree, the half-width last tile's test, the V rows zeroed past a sequence's end, and the persistent schedule's slot
order (a Triton kernel)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Gluon and its Hopper namespace (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False

BLOCK_KV = 64  # the KV positions of one online-softmax step (the fixed order; triton_attention_fwd.BLOCK_KV)


if HAVE_GLUON:

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
                  BLOCK_KV_: tl.constexpr, CHUNK: tl.constexpr):
    """``order``: the schedule's slots sorted by their number of KV tiles, most first (ties by slot; empty slots
    last), for the persistent kernel. Slot i goes to rank #(slots with more tiles) + #(as many, before i)."""
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ci = _slot_tiles(i, G, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_KV_)
    rank = tl.zeros([CHUNK], tl.int32)
    for j0 in range(0, G, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        cj = _slot_tiles(j, G, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_KV_)
        ahead = (cj[None, :] > ci[:, None]) | ((cj[None, :] == ci[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < G)[None, :]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i, mask=i < G)


@triton.jit
def _slot_tiles(i, G, prog_seq_ptr, prog_q0_ptr, cu_ptr, seq_lens_ptr, BLOCK_Q: tl.constexpr,
                BLOCK_KV_: tl.constexpr):
    ok = i < G
    seq = tl.load(prog_seq_ptr + i, mask=ok, other=-1)
    seq_c = tl.maximum(seq, 0)
    q0 = tl.load(prog_q0_ptr + i, mask=ok, other=0)
    cu0 = tl.load(cu_ptr + seq_c)
    q_len = tl.load(cu_ptr + seq_c + 1) - cu0
    first_pos = tl.load(seq_lens_ptr + seq_c) - q_len
    n_tiles = (first_pos + tl.minimum(q0 + BLOCK_Q, q_len) - 1) // BLOCK_KV_ + 1
    return tl.where(seq >= 0, n_tiles, 0).to(tl.int32)


def persistent_order(schedule, cu: torch.Tensor, seq_lens: torch.Tensor, block_q: int,
                     block_kv: int = BLOCK_KV) -> torch.Tensor:
    """The persistent kernel's slot order (``_order_kernel``), on the device with no host wait."""
    g_slots, prog_seq, prog_q0 = schedule
    order = torch.empty(g_slots, device=cu.device, dtype=torch.int32)
    chunk = 128
    _order_kernel[(triton.cdiv(g_slots, chunk),)](prog_seq, prog_q0, cu, seq_lens, order, g_slots, BLOCK_Q=block_q,
                                                  BLOCK_KV_=block_kv, CHUNK=chunk, num_warps=4)
    return order


