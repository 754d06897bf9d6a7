"""Batch-invariant matmul for CUDA in Triton: ``x [M, K] @ weight[N, K]^T``.

Why a row's result does not depend on ``M``: every output element is one chain of tensor-core instructions over
K, in tiles of ``BLOCK_K`` from k = 0 upwards, accumulated in float32 in registers, with no split-K. The K tile
(64 for 16-bit inputs), the K order and the instruction kind (Hopper ``wgmma`` for bf16/fp16, float32 FMA for
float32) are the same for every config below. What may follow ``M`` (and ``N``) is only the *output* tiling: the
block's M/N size, the warps, the pipeline depth and the persistent grid. None of them changes the per-element
reduction; ``tests/test_triton_kernels.py`` checks this bitwise at every M boundary, across all configs, and
that every 16-bit config compiles to ``wgmma``.

Two kernels share the same loop: one reads through TMA descriptors (Hopper's bulk tensor copy) when the tensors
are 16-byte aligned, the other through pointers (any layout). Which one runs depends on the weight and the
shapes K and N, never on ``M``: ``x`` is copied into an aligned buffer when it is not aligned already.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 (host-side TMA descriptors)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None

BLOCK_K_16BIT = 64  # the one K tile of every bf16/fp16 config: fixes the reduction order
BLOCK_K_FP32 = 32  # the one K tile of the float32 config


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    subtile: bool = False  # store the output tile as two halves (less shared memory for the epilogue)
    flatten: bool = False  # let Triton pipeline across tiles of the persistent loop
    ctas_per_sm: int = 1  # persistent grid = min(tiles, SMs * ctas_per_sm)

    @property
    def name(self) -> str:
        extra = ("s" if self.subtile else "") + ("f" if self.flatten else "")
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
                f"c{self.ctas_per_sm}{extra}")


# Candidate configs for 16-bit inputs, all with BLOCK_K = 64 and 4 or 8 warps (whole warpgroups: wgmma).
CONFIGS_16BIT: dict[str, MatmulConfig] = {c.name: c for c in [
    MatmulConfig(128, 256, 64, 8, 3, subtile=True),
    MatmulConfig(128, 256, 64, 8, 4, subtile=True),
    MatmulConfig(128, 256, 64, 8, 3, subtile=True, flatten=True),
    MatmulConfig(128, 128, 64, 8, 4),
    MatmulConfig(128, 128, 64, 4, 4),
    MatmulConfig(64, 256, 64, 4, 4, subtile=True),
    MatmulConfig(64, 128, 64, 4, 6),
    MatmulConfig(64, 128, 64, 4, 8),
    MatmulConfig(64, 128, 64, 4, 4, ctas_per_sm=2),
    MatmulConfig(64, 64, 64, 4, 6, ctas_per_sm=2),
    MatmulConfig(64, 64, 64, 4, 10),
    MatmulConfig(64, 32, 64, 4, 8, ctas_per_sm=2),
    MatmulConfig(64, 16, 64, 4, 10, ctas_per_sm=2),
]}
CONFIG_FP32 = MatmulConfig(64, 64, BLOCK_K_FP32, 4, 3)

# Small-M configs with a 128-wide K tile (fewer, larger K steps for the decode-sized products that read the weight
# once). A wgmma chain over K runs 16 K-values an instruction, in order, whatever the tile, so they give the
# 64-wide tile's bits: ``test_gpu_matmul_k128_configs_give_the_k64_bits`` passed on the H200 (2026-12-04, M 1/7/16/64,
# K 4096 and 12288, TMA and pointer loads), and the sweep (``bench_kernels.py --sweep --k128``) found no config
# with other bits. The sweep had "64x64x128w4s6c1" 1.01 / 0.97 / 1.03 of cuBLAS at M = 64 on the 8B's qkv / o_proj
# / down_proj where "64x64x64w4s10c1" gave 0.95 / 0.85 / 0.91, so the small-M rule takes it for 16 < M <= 64 and
# narrow N (``RLREPRO_MATMUL_K128=0`` restores the 64-wide tile there: the same bits, for measuring). The
# K-pieces kernel (:mod:`.triton_pieces`) keeps the 64-wide tile: its bit tests ran with that.
CONFIGS_16BIT_K128: dict[str, MatmulConfig] = {c.name: c for c in [
    MatmulConfig(64, 256, 128, 4, 2, subtile=True),
    MatmulConfig(64, 128, 128, 4, 4),
    MatmulConfig(64, 128, 128, 4, 2, ctas_per_sm=2),
    MatmulConfig(64, 64, 128, 4, 6),
    MatmulConfig(64, 64, 128, 4, 3, ctas_per_sm=2),
]}

# Which config serves which M (16-bit); chosen from the H200 sweep in docs/BENCHMARKS.md ("Kernels"), where all
# configs gave bitwise-identical outputs. M <= 64 is bound by reading the weight once; no split-K means N alone
# sets the parallelism, so wide N tiles (more bytes per K step) win unless N is small.
SMALL_M = 64
SMALL_M_WIDE_N_TILES = 64  # at least this many 256-wide N tiles: 64x256 tiles
# Larger M: the candidate with the least estimated time, waves * tile area / relative speed per element, so that
# shapes whose tile count would leave most SMs idle in a last wave get smaller tiles.
LARGE_M_CANDIDATES = (("128x256x64w8s3c1s", 1.00), ("128x128x64w8s4c1", 0.92), ("64x256x64w4s4c1s", 0.88),
                      ("64x128x64w4s8c1", 0.80))


SMALL_M_K128 = "64x64x128w4s6c1"  # 16 < M <= 64, narrow N (see CONFIGS_16BIT_K128)
ALL_CONFIGS_16BIT = {**CONFIGS_16BIT, **CONFIGS_16BIT_K128}


def _small_m_config(m: int, n: int, k128: bool = True) -> str:
    if triton.cdiv(n, 256) >= SMALL_M_WIDE_N_TILES:
        return "64x256x64w4s4c1s"
    if m <= 16:
        return "64x128x64w4s8c1"
    return SMALL_M_K128 if k128 and os.environ.get("RLREPRO_MATMUL_K128", "1") != "0" else "64x64x64w4s10c1"


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4  # the CPU interpreter: a small persistent grid still exercises the tile loop
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda else -1)


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int, k128: bool = True) -> MatmulConfig:
    """The config for an ``m x k @ k x n`` product. Any choice is numerically the same (see module docstring).
    ``k128=False``: only 64-wide K tiles (the K-pieces kernel)."""
    forced = os.environ.get("RLREPRO_MATMUL_CONFIG")
    if dtype == torch.float32:
        return CONFIG_FP32
    if forced:
        if forced not in ALL_CONFIGS_16BIT:
            raise ValueError(f"RLREPRO_MATMUL_CONFIG={forced!r} is not one of {sorted(ALL_CONFIGS_16BIT)}")
        if k128 or forced in CONFIGS_16BIT:
            return ALL_CONFIGS_16BIT[forced]
    if m <= SMALL_M:
        return ALL_CONFIGS_16BIT[_small_m_config(m, n, k128)]
    return _least_cost(LARGE_M_CANDIDATES, m, n, sms)


def _least_cost(candidates, m: int, n: int, sms: int) -> MatmulConfig:
    """The candidate ``(name, relative speed)`` with the least estimated time, waves x tile area / speed (the first
    of equal ones)."""
    best, best_cost = None, None
    for name, speed in candidates:
        c = CONFIGS_16BIT[name]
        tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
        waves = triton.cdiv(tiles, sms * c.ctas_per_sm)
        cost = waves * c.block_m * c.block_n / speed
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # grouped order: GROUP_M row-tiles share each weight column-tile while it is in L2
    num_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size)
    pid_n = (tile_id % num_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _mm_tma_kernel(a_desc, b_desc, c_desc, bias_ptr, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                   PRECISION: tl.constexpr, OUT_DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(pid, num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):  # k = 0, 64, 128, ...: the fixed order; out-of-range K reads as zeros
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if HAS_BIAS:
            cols = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            c_desc.store([off_m, off_n], acc0.to(OUT_DTYPE))
            c_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(OUT_DTYPE))
        else:
            c_desc.store([off_m, off_n], acc.to(OUT_DTYPE))


@triton.jit
def _mm_ptr_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(pid, num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ok = rows < M
        cols_ok = cols < N
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k_ok = offs_k < K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=cols_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cols_ok, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.dim() < 2 or (t.stride(0) * t.element_size()) % 16 == 0)


def tma_usable(weight: torch.Tensor, n: int, k: int) -> bool:
    """TMA needs 16-byte aligned bases and row strides: decided by the weight and K, N alone, never by M."""
    esize = weight.element_size()
    return (TensorDescriptor is not None and _aligned(weight)
            and (k * esize) % 16 == 0 and (n * esize) % 16 == 0)


def _operand_shapes(x2d: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """``(M, K, N)`` of ``x2d [M, K] @ weight[N, K]^T``, after checking the dtypes and K."""
    if x2d.dtype != weight.dtype:
        raise TypeError(f"linear: x is {x2d.dtype} but weight is {weight.dtype}; cast one of them first")
    if x2d.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"linear: unsupported dtype {x2d.dtype}; use bfloat16, float16 or float32")
    m, k = x2d.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has K={k} but weight is {tuple(weight.shape)}")
    return m, k, n


def matmul(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: MatmulConfig | None = None, use_tma: bool | None = None) -> torch.Tensor:
    """``x2d [M, K] @ weight[N, K]^T (+ bias)`` in the input dtype, batch-invariant in M.

    ``config`` and ``use_tma`` override the automatic choice (tests and benchmarks only).
    """
    m, k, n = _operand_shapes(x2d, weight)
    out = torch.empty((m, n), device=x2d.device, dtype=x2d.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    sms = _device_sms(x2d)
    cfg = config or pick_config(m, n, k, x2d.dtype, sms)
    precision = "ieee" if x2d.dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs
    if bias is not None:
        bias = bias.contiguous()
    tma = tma_usable(weight, n, k) if use_tma is None else use_tma
    if tma:
        if not _aligned(x2d):
            x2d = x2d.contiguous() if not x2d.is_contiguous() else x2d.clone()  # fresh memory is aligned
        a_desc = TensorDescriptor.from_tensor(x2d, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
        c_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n // 2 if cfg.subtile else cfg.block_n])
    else:
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = (min(tiles, sms * cfg.ctas_per_sm),)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  HAS_BIAS=bias is not None, SUBTILE=cfg.subtile, FLATTEN=cfg.flatten, PRECISION=precision,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    bias_arg = bias if bias is not None else out
    if tma:
        _mm_tma_kernel[grid](a_desc, b_desc, c_desc, bias_arg, m, n, k, OUT_DTYPE=_TL_DTYPES[out.dtype], **common)
    else:
        _mm_ptr_kernel[grid](x2d, weight, out, bias_arg, m, n, k, x2d.stride(0), weight.stride(0), out.stride(0),
                             **common)
    return out
