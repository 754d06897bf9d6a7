"""The layout-invariant pieces' products for CUDA in Triton (``train.tp_partials``, :mod:`rlrepro.kernels.tp_fused`):
a product as ``P`` K-pieces in one launch (:func:`matmul_k_pieces`), the ordered float32 sum of partials
(:func:`ordered_sum`), and a linear's gradients with the operands read as stored (:func:`linear_grad_input`,
:func:`linear_grad_weight`, :func:`linear_grad_input_n_pieces`).

Every kernel here runs :mod:`rlrepro.kernels.triton_matmul`'s K loop (the same ``BLOCK_K``, the same ``tl.dot`` on
the same tiles from the piece's first index): an element is one float32 chain over its piece, whatever the tiling,
config, kernel (TMA or pointers) or operand layout, which is what makes a TP rank's piece the TP=1 piece's bits.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_matmul import (BLOCK_K_16BIT, BLOCK_K_FP32, CONFIG_FP32, CONFIGS_16BIT, SMALL_M, MatmulConfig,
                            TensorDescriptor, _aligned, _device_sms, _least_cost, _operand_shapes, _tile_coords,
                            pick_config)

__all__ = ["matmul_k_pieces", "ordered_sum", "linear_grad_input", "linear_grad_weight", "linear_grad_input_n_pieces",
           "pick_pieces_config", "PIECES_SMALL_M", "PIECES_LARGE_M_CANDIDATES", "BLOCK_K_16BIT", "BLOCK_K_FP32"]


# --------------------------------------------------------------- piecewise-K products (rlrepro.kernels.tp pieces)
#
# ``train.tp_partials=P`` computes a row-parallel product as P K-pieces: piece r is ``matmul(x[:, a_r:b_r],
# weight[:, a_r:b_r])`` on contiguous copies, rounded to the output dtype, and the P partials are added in piece order
# with a float32 accumulator cast once (``tp.sum_in_rank_order``). ``matmul_k_pieces`` computes exactly that in one
# launch: per output tile, for each piece, the same K loop as the kernels above (the same BLOCK_K, the same tl.dot
# on the same operand tiles, from the piece's first column, the piece's tail masked to zeros as a standalone call on
# the slice masks its own), the tile rounded to the output dtype, then added as float32 into the tile's total in
# piece order; the total is stored rounded once. Its tile shapes come from ``pick_pieces_config``: the same configs
# (any config gives the same bits), restricted to those that hold two float32 tiles (the piece's and the total) in
# registers. ``stack=True`` stores the rounded partials ``[P, M, N]`` instead, for ranks that gather them.


@triton.jit
def _store_tile(c, rows, cols, M, N, stride_cm, value):
    # the tile's pointers are made here, not kept through the K loops (64-bit pointers: registers)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(c + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], value, mask=mask)


@triton.jit
def _add_piece(acc, r, total, c_slab, rows, cols, M, N, stride_cm, stride_cp, STACK: tl.constexpr):
    """Piece ``r``'s float32 tile ``acc``, rounded to the output dtype as a standalone call stores it: stored in its
    ``[M, N]`` slab (``STACK``; ``c_slab``, a scalar 64-bit pointer, then steps to the next slab), or added as float32
    to ``total`` (sum_in_rank_order: the first partial is the start, not ``0.0 + p``: -0.0 stays)."""
    part = acc.to(c_slab.dtype.element_ty)
    if STACK:
        _store_tile(c_slab, rows, cols, M, N, stride_cm, part)
        c_slab += stride_cp
    else:
        total = tl.where(r == 0, part.to(tl.float32), total + part.to(tl.float32))
    return total, c_slab


@triton.jit
def _load_a(a_desc, off_m, k, A_KM: tl.constexpr):
    # the [BLOCK_M, BLOCK_K] tile of A at (off_m, k): from A itself, or (A_KM) the transpose of A^T's tile
    if A_KM:  # (one return: Triton compiles a constexpr branch's early return and the code after it alike)
        a = a_desc.load([k, off_m]).T
    else:
        a = a_desc.load([off_m, k])
    return a


@triton.jit
def _load_bt(b_desc, off_n, k, B_KN: tl.constexpr):
    # the [BLOCK_K, BLOCK_N] tile of B^T at (k, off_n): B^T's own tile (B_KN), or the transpose of B's
    if B_KN:
        b = b_desc.load([k, off_n])
    else:
        b = b_desc.load([off_n, k]).T
    return b


@triton.jit
def _tail_tiles(a_ptr, b_ptr, stride_a, stride_b, off_m, off_n, k, k_end, M, N, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr):
    # a piece's last, partial K tile [k, k_end) through pointers, zeros past its end (and past M, N): the values the
    # pointer kernel's masked tile holds, where a TMA box would read into the next piece
    offs_k = k + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_end
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    if A_KM:
        a = tl.load(a_ptr + offs_k.to(tl.int64)[:, None] * stride_a + rows[None, :],
                    mask=k_ok[:, None] & (rows < M)[None, :], other=0.0).T
    else:
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :],
                    mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
    if B_KN:
        b = tl.load(b_ptr + offs_k.to(tl.int64)[:, None] * stride_b + cols[None, :],
                    mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
    else:
        b = tl.load(b_ptr + cols.to(tl.int64)[:, None] * stride_b + offs_k[None, :],
                    mask=(cols < N)[:, None] & k_ok[None, :], other=0.0).T
    return a, b


@triton.jit
def _tma_piece(a_desc, b_desc, a_ptr, b_ptr, stride_a, stride_b, r, total, c_slab, off_m, off_n, rows, cols, M, N,
               K_PIECE, k_tiles, stride_cm, stride_cp, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, STACK: tl.constexpr, A_KM: tl.constexpr,
               B_KN: tl.constexpr, TAIL: tl.constexpr):
    # piece r of an output tile: its K chain from the piece's first index, rounded, added to the total (or stored)
    k0 = r * K_PIECE
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):  # the piece's k = 0, 64, 128, ...: _mm_tma_kernel's loop on the slice
        a = _load_a(a_desc, off_m, k0 + ki * BLOCK_K, A_KM)
        b = _load_bt(b_desc, off_n, k0 + ki * BLOCK_K, B_KN)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if TAIL:
        a, b = _tail_tiles(a_ptr, b_ptr, stride_a, stride_b, off_m, off_n, k0 + k_tiles * BLOCK_K, k0 + K_PIECE, M,
                           N, BLOCK_M, BLOCK_N, BLOCK_K, A_KM, B_KN)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return _add_piece(acc, r, total, c_slab, rows, cols, M, N, stride_cm, stride_cp, STACK)


@triton.jit
def _mm_k_pieces_tma_kernel(a_desc, b_desc, c_ptr, M, N, K_PIECE, PIECES, stride_cp, stride_cm,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, PRECISION: tl.constexpr,
                            STACK: tl.constexpr, A_KM: tl.constexpr = False, B_KN: tl.constexpr = False,
                            SINGLE: tl.constexpr = False, TAIL: tl.constexpr = False, a_ptr=None, b_ptr=None,
                            stride_a=0, stride_b=0, FLATTEN_PIECES: tl.constexpr = False):
    # Without TAIL, K_PIECE is a multiple of BLOCK_K (the host checks): a piece's TMA boxes never reach into the next
    # piece. TAIL: a piece's whole tiles through TMA, its last partial one through pointers (_tail_tiles; a_ptr,
    # b_ptr: the stored operands, stride_a, stride_b their row strides). A_KM / B_KN: the operands are stored
    # transposed ([K, M] / [K, N]); SINGLE: one piece, stored as it comes
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = K_PIECE // BLOCK_K if TAIL else tl.cdiv(K_PIECE, BLOCK_K)  # the TMA boxes of a piece
    for tile_id in tl.range(pid, num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        c_slab = c_ptr
        if SINGLE:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = _load_a(a_desc, off_m, ki * BLOCK_K, A_KM)
                b = _load_bt(b_desc, off_n, ki * BLOCK_K, B_KN)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            _store_tile(c_ptr, rows, cols, M, N, stride_cm, acc.to(c_ptr.dtype.element_ty))
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if FLATTEN_PIECES and not TAIL:  # one K loop over all pieces (whole tiles): one software pipeline
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for t in range(PIECES * k_tiles):  # piece t // k_tiles, its tile t % k_tiles: k = t * BLOCK_K
                    a = _load_a(a_desc, off_m, t * BLOCK_K, A_KM)
                    b = _load_bt(b_desc, off_n, t * BLOCK_K, B_KN)
                    acc = tl.dot(a, b, acc, input_precision=PRECISION)
                    if t % k_tiles == k_tiles - 1:  # the piece's chain is complete: round, add, start the next
                        total, c_slab = _add_piece(acc, t // k_tiles, total, c_slab, rows, cols, M, N, stride_cm,
                                                   stride_cp, STACK)
                        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            else:
                for r in range(PIECES):
                    total, c_slab = _tma_piece(a_desc, b_desc, a_ptr, b_ptr, stride_a, stride_b, r, total, c_slab,
                                               off_m, off_n, rows, cols, M, N, K_PIECE, k_tiles, stride_cm,
                                               stride_cp, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, STACK, A_KM, B_KN,
                                               TAIL)
            if not STACK:
                _store_tile(c_ptr, rows, cols, M, N, stride_cm, total.to(c_ptr.dtype.element_ty))


@triton.jit
def _mm_k_pieces_ptr_kernel(a_ptr, b_ptr, c_ptr, M, N, K_PIECE, PIECES, stride_am, stride_bn, stride_cp, stride_cm,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, PRECISION: tl.constexpr,
                            STACK: tl.constexpr, A_KM: tl.constexpr = False, B_KN: tl.constexpr = False,
                            SINGLE: tl.constexpr = False):
    # stride_am / stride_bn: the row stride of the stored operand (of A^T / B^T when A_KM / B_KN)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K_PIECE, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(pid, num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ok = rows < M
        cols_ok = cols < N
        c_slab = c_ptr
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in range(PIECES):
            k0 = r * K_PIECE
            if A_KM:  # [BLOCK_K, BLOCK_M] tiles of A^T
                a_ptrs = a_ptr + (k0 + offs_k).to(tl.int64)[:, None] * stride_am + rows[None, :]
            else:
                a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + (k0 + offs_k)[None, :]
            if B_KN:  # [BLOCK_K, BLOCK_N] tiles of B^T
                b_ptrs = b_ptr + (k0 + offs_k).to(tl.int64)[:, None] * stride_bn + cols[None, :]
            else:
                b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_bn + (k0 + offs_k)[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):  # _mm_ptr_kernel's loop on the slice: its tail masked at the piece's end
                k_ok = offs_k < K_PIECE - ki * BLOCK_K
                if A_KM:
                    a = tl.load(a_ptrs, mask=k_ok[:, None] & rows_ok[None, :], other=0.0).T
                    a_ptrs += BLOCK_K * stride_am
                else:
                    a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
                    a_ptrs += BLOCK_K
                if B_KN:
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
                    b_ptrs += BLOCK_K * stride_bn
                else:
                    b = tl.load(b_ptrs, mask=cols_ok[:, None] & k_ok[None, :], other=0.0).T
                    b_ptrs += BLOCK_K
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SINGLE:
                _store_tile(c_ptr, rows, cols, M, N, stride_cm, acc.to(c_ptr.dtype.element_ty))
            else:
                total, c_slab = _add_piece(acc, r, total, c_slab, rows, cols, M, N, stride_cm, stride_cp, STACK)
        if not STACK and not SINGLE:
            _store_tile(c_ptr, rows, cols, M, N, stride_cm, total.to(c_ptr.dtype.element_ty))


# Configs of matmul_k_pieces: a piece's accumulator and the total are both float32 tiles in registers, so at most
# 64 + 64 registers a thread for the two (the 128x256 and 64x256 tiles would spill). The relative speeds per
# output element are the H200's (benchmarks/bench_pieces_products.py --sweep at the 8B width, P=8): the 128x128
# tile was 1.2-2.9x faster than the smaller ones on every product there.
PIECES_SMALL_M = ("64x128x64w4s8c1", "64x64x64w4s10c1")
PIECES_LARGE_M_CANDIDATES = (("128x128x64w8s4c1", 1.00), ("64x128x64w4s8c1", 0.60), ("64x64x64w4s6c2", 0.45))


def pick_pieces_config(m: int, n: int, dtype: torch.dtype, sms: int) -> MatmulConfig:
    """The config of :func:`matmul_k_pieces` (any config gives the same bits; ``RLREPRO_MATMUL_CONFIG`` is not
    read: its large tiles may not fit the kernel's two accumulators)."""
    if dtype == torch.float32:
        return CONFIG_FP32
    if m <= SMALL_M:
        return CONFIGS_16BIT[PIECES_SMALL_M[0] if triton.cdiv(n, 128) >= sms else PIECES_SMALL_M[1]]
    return _least_cost(PIECES_LARGE_M_CANDIDATES, m, n, sms)


def matmul_k_pieces(x2d: torch.Tensor, weight: torch.Tensor, pieces: int, stack: bool = False,
                    config: MatmulConfig | None = None, use_tma: bool | None = None) -> torch.Tensor:
    """``x2d [M, K] @ weight[N, K]^T`` as ``pieces`` equal consecutive K-pieces, in one launch, with the bits of

        parts = [matmul(x2d[:, a:b].contiguous(), weight[:, a:b].contiguous()) for each piece [a, b)]
        tp.sum_in_rank_order(parts)            # stack=False: [M, N]
        torch.stack(parts)                     # stack=True: [pieces, M, N]

    ``config`` and ``use_tma`` override the automatic choice (tests only). No autograd."""
    m, k, n = _operand_shapes(x2d, weight)
    return _pieces_product(x2d, weight, m, n, k, pieces, stack, False, False, False, config, use_tma)


FLATTEN_MAX_TILES = 16  # automatic: one K loop over the pieces when a piece has at most this many K tiles


def _flatten_pieces(k_tiles: int) -> bool:
    """Whether the TMA kernel runs the pieces' K loops as one loop, rounding and adding at each piece's last tile
    (the same operations in the same order, so the same bits; ``tests/test_tp_pieces_fast.py`` checks it on the GPU)
    rather than one loop a piece, whose software pipeline restarts at every piece. ``RLREPRO_PIECES_FLATTEN``:
    unset or ``auto`` (default) flattens pieces of at most ``FLATTEN_MAX_TILES`` K tiles, where the restarts cost
    most; ``0`` never, ``1`` always. On the H200 at the 8B width and P=8 (benchmarks/bench_pieces_products.py
    --sweep, 128x128 tiles) the one loop was 1.09-1.13x faster for pieces of 8 and 12 tiles (o_proj's forward,
    q|k|v's input gradient) and 0.84-0.87x as fast for pieces of 24 and 48 (down_proj's forward, gate|up's input
    gradient). Decided by the piece length only, never by M."""
    value = os.environ.get("RLREPRO_PIECES_FLATTEN", "auto").strip()
    if value not in ("0", "1", "auto"):
        raise ValueError(f"RLREPRO_PIECES_FLATTEN must be auto, 0 or 1, not {value!r}")
    return value == "1" or (value == "auto" and k_tiles <= FLATTEN_MAX_TILES)


def _store_usable(t: torch.Tensor) -> bool:
    """A stored operand a TMA descriptor can read: 16-byte aligned base and row stride (decided by its shape)."""
    return TensorDescriptor is not None and _aligned(t)


def _pieces_product(a: torch.Tensor, b: torch.Tensor, m: int, n: int, k: int, pieces: int, stack: bool,
                    a_km: bool, b_kn: bool, single: bool, config: MatmulConfig | None = None,
                    use_tma: bool | None = None) -> torch.Tensor:
    """``A [M, K] @ B[N, K]^T`` in ``pieces`` K-pieces (``matmul_k_pieces``), each operand read as stored: ``a`` is
    ``A`` (``[M, K]``) or, with ``a_km``, ``A^T`` (``[K, M]``); ``b`` is ``B`` (``[N, K]``) or, with ``b_kn``,
    ``B^T`` (``[K, N]``), no transposed copy made. ``single`` (one piece, not stacked): the accumulator stored as
    it is (the bits of the piece sum of one piece, with room for the large tiles). Every element is the float32
    chain over its piece's K from the piece's first index, whatever the layout, config or kernel."""
    if pieces < 1 or k % pieces:
        raise ValueError(f"matmul_k_pieces: K={k} is not {pieces} equal pieces")
    k_piece = k // pieces
    out = torch.empty((pieces, m, n) if stack else (m, n), device=a.device, dtype=a.dtype)
    if out.numel() == 0:
        return out
    if k_piece == 0:  # each piece is a product over nothing: zeros, and so is their sum
        return out.zero_()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    sms = _device_sms(a)
    cfg = config or (pick_config(m, n, k, a.dtype, sms, k128=False) if single
                     else pick_pieces_config(m, n, a.dtype, sms))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # as matmul
    es = a.element_size()
    tail = pieces > 1 and k_piece % cfg.block_k != 0  # (with TMA: the last partial tile through pointers)
    # a piece's TMA boxes start at its first K index: where K is an operand's innermost dimension that offset must
    # stay 16-byte aligned (the H200 raised "illegal instruction" for pieces of 125 bf16 columns)
    starts_ok = pieces == 1 or (k_piece * es) % 16 == 0 or (a_km and b_kn)
    if use_tma is None:  # decided by the stored operands' row lengths and the piece length, never by M alone
        strides_ok = all((size * es) % 16 == 0 for size in (m if a_km else k, n if b_kn else k, n))
        # the backward's layouts take pieces of any (aligned) length (TAIL); the forward keeps whole K tiles
        whole = not tail or a_km or b_kn
        use_tma = _store_usable(b) and strides_ok and starts_ok and whole
    if use_tma and not starts_ok:
        raise ValueError(f"matmul_k_pieces: TMA boxes cannot start at pieces of {k_piece} elements "
                         f"({k_piece * es} bytes, not a multiple of 16)")
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = (min(tiles, sms * cfg.ctas_per_sm),)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  FLATTEN=cfg.flatten, PRECISION=precision, STACK=stack, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if a_km or b_kn or single:  # the backward's layouts (the forward's launch keeps its original arguments)
        common.update(A_KM=a_km, B_KN=b_kn, SINGLE=single)
    stride_cp = m * n if stack else 0
    if use_tma:
        if not _aligned(a):
            a = a.contiguous() if not a.is_contiguous() else a.clone()  # fresh memory is aligned
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_k, cfg.block_m] if a_km else [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n] if b_kn else [cfg.block_n, cfg.block_k])
        extra = dict(TAIL=True, a_ptr=a, b_ptr=b, stride_a=a.stride(0), stride_b=b.stride(0)) if tail else {}
        if pieces > 1 and not tail and _flatten_pieces(triton.cdiv(k_piece, cfg.block_k)):
            extra["FLATTEN_PIECES"] = True
        _mm_k_pieces_tma_kernel[grid](a_desc, b_desc, out, m, n, k_piece, pieces, stride_cp, n, **common, **extra)
    else:
        _mm_k_pieces_ptr_kernel[grid](a, b, out, m, n, k_piece, pieces, a.stride(0), b.stride(0), stride_cp, n,
                                      **common)
    return out


@triton.jit
def _ordered_sum_kernel(out_ptr, acc_ptr, p0, p1, p2, p3, p4, p5, p6, p7, numel, NUM: tl.constexpr,
                        FROM_ACC: tl.constexpr, TO_ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if FROM_ACC:
        total = tl.load(acc_ptr + offs, mask=mask, other=0.0) + tl.load(p0 + offs, mask=mask).to(tl.float32)
    else:
        total = tl.load(p0 + offs, mask=mask).to(tl.float32)
    if NUM > 1:
        total = total + tl.load(p1 + offs, mask=mask).to(tl.float32)
    if NUM > 2:
        total = total + tl.load(p2 + offs, mask=mask).to(tl.float32)
    if NUM > 3:
        total = total + tl.load(p3 + offs, mask=mask).to(tl.float32)
    if NUM > 4:
        total = total + tl.load(p4 + offs, mask=mask).to(tl.float32)
    if NUM > 5:
        total = total + tl.load(p5 + offs, mask=mask).to(tl.float32)
    if NUM > 6:
        total = total + tl.load(p6 + offs, mask=mask).to(tl.float32)
    if NUM > 7:
        total = total + tl.load(p7 + offs, mask=mask).to(tl.float32)
    if TO_ACC:
        tl.store(acc_ptr + offs, total, mask=mask)
    else:
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


ORDERED_SUM_SLOTS = 8  # partials read per launch; more are added through a float32 accumulator (the same sums)
ORDERED_SUM_BLOCK = 1024


def ordered_sum(parts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tp.sum_in_rank_order`` for 16-bit or float32 tensors of one shape and dtype, in one pass over them:
    ``((p_0 + p_1) + p_2) + ...`` in float32 (each partial converted exactly), cast once to ``dtype`` (default: the
    parts' dtype); the same float32 additions in the same order, so the same bits."""
    first = parts[0]
    if first.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"ordered_sum: unsupported dtype {first.dtype}")
    for p in parts:
        if p.shape != first.shape or p.dtype != first.dtype or p.device != first.device:
            raise ValueError("ordered_sum: the parts must share one shape, dtype and device")
    parts = [p.contiguous() for p in parts]
    out = torch.empty(first.shape, device=first.device, dtype=dtype or first.dtype)
    numel = out.numel()
    if numel == 0:
        return out
    acc = torch.empty(first.shape, device=first.device, dtype=torch.float32) \
        if len(parts) > ORDERED_SUM_SLOTS else out
    grid = (triton.cdiv(numel, ORDERED_SUM_BLOCK),)
    for start in range(0, len(parts), ORDERED_SUM_SLOTS):
        chunk = parts[start:start + ORDERED_SUM_SLOTS]
        slots = chunk + [chunk[0]] * (ORDERED_SUM_SLOTS - len(chunk))
        last = start + ORDERED_SUM_SLOTS >= len(parts)
        _ordered_sum_kernel[grid](out, acc, *slots, numel, NUM=len(chunk), FROM_ACC=start > 0, TO_ACC=not last,
                                  BLOCK=ORDERED_SUM_BLOCK)
    return out


# ------------------------------------------------------------------ the products of a linear's backward (tp pieces)
#
# Every element of :func:`matmul` is one float32 chain over its reduction dim from 0, whatever the M/N tiling, so a
# slice of a product's output along M or N has the bits of the product on the sliced operand. The backward of the
# layout-invariant pieces (``rlrepro.kernels.tp``) relies on this: the gradients of ``y = x @ weight^T`` below are
# the kernels of :func:`matmul_k_pieces` reading the stored operands transposed (``A_KM`` / ``B_KN``: the tiles of
# ``weight``, ``g`` and ``x`` as they lie, no transposed copies), so a TP rank's gradient of its shard is the matching
# slice of the unsharded one. No autograd.


def linear_grad_input(g2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``g2d [M, N] @ weight [N, K] -> [M, K]`` (reduction over N), ``weight`` read as it is stored (no transposed
    copy). Its column slice ``[:, a:b]`` has the bits of ``linear_grad_input(g2d, weight[:, a:b])``."""
    m, n = g2d.shape
    _operand_shapes(g2d, weight.t())
    return _pieces_product(g2d, weight, m, weight.shape[1], n, 1, False, False, True, True)


def linear_grad_weight(g2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """``g2d^T [N, M] @ x2d [M, K] -> [N, K]`` (reduction over M), both read as stored (no transposed copies). Its
    row slice ``[a:b]`` has the bits of ``linear_grad_weight(g2d[:, a:b], x2d)``, its column slice ``[:, a:b]``
    those of ``linear_grad_weight(g2d, x2d[:, a:b])``."""
    m, n = g2d.shape
    _operand_shapes(g2d.t(), x2d.t())
    return _pieces_product(g2d, x2d, n, x2d.shape[1], m, 1, False, True, True, True)


def linear_grad_input_n_pieces(g2d: torch.Tensor, weight: torch.Tensor, pieces: int,
                               stack: bool = False) -> torch.Tensor:
    """``g2d [M, N] @ weight [N, K]`` as ``pieces`` equal consecutive N-pieces (each ``g2d[:, a:b] @ weight[a:b]``,
    rounded to the dtype), their sum in piece order in float32 (``[M, K]``) or the partials (``stack``: ``[pieces,
    M, K]``), ``weight`` read as stored. Piece ``r``'s partial has the bits of the one-piece call on ``g2d[:, a:b]``,
    ``weight[a:b]``."""
    m, n = g2d.shape
    _operand_shapes(g2d, weight.t())
    return _pieces_product(g2d, weight, m, weight.shape[1], n, pieces, stack, False, True, False)
