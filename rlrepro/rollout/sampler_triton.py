"""Fused Gumbel-max on CUDA: the noise of :mod:`rlrepro.rollout.sampler`, added and arg-maxed in one pass.

The eager torch path materialises ~70 float64/int64 tensors of ``[rows, vocab]``; this kernel reads each row of
scaled logits once and writes one index. It must give the same bits as the eager definition, so it repeats it
operation for operation: the same wrapping int64 hash, ``frexp`` done on the bit pattern (exact for the normal
numbers that occur), the same float64 ``+ - * /`` sequence with the polynomial's constants loaded as float64
(Triton literals would be float32), and fp fusion off (no FMA contraction). ``tests/test_rollout_cuda.py``
compares the two paths with ``torch.equal``. Each row's vocabulary is cut into ``splits`` equal ranges of whole
chunks, one program each (a decode step has few rows: one program per row left most SMs idle); a program keeps its
range's first maximum, and the ranges' results are then taken in order, the first maximum again. The maximum of
exact float64 scores with the lowest index on ties does not depend on how the row is cut, so neither the split
count nor the other rows can change a token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampler_constants import GAMMA, LN2, LOG_TERMS, MIX1, MIX2, ROW_SALT, SQRT_HALF

BLOCK = 2048


@triton.jit
def _lsr(z, shift: tl.constexpr):
    return (z.to(tl.uint64, bitcast=True) >> shift).to(tl.int64, bitcast=True)


@triton.jit
def _mix64(z, mix1, mix2):
    z = (z ^ _lsr(z, 30)) * mix1
    z = (z ^ _lsr(z, 27)) * mix2
    return z ^ _lsr(z, 31)


@triton.jit
def _exact_log(x, c_ptr, TERMS: tl.constexpr):
    """``sampler.exact_log`` for positive normal float64 values; c_ptr: [sqrt(1/2), ln 2, 1/1, 1/3, 1/5, ...]."""
    sqrt_half = tl.load(c_ptr)
    ln2 = tl.load(c_ptr + 1)
    b = x.to(tl.int64, bitcast=True)
    e = ((b >> 52) & 0x7FF) - 1022
    m = ((b & 0xFFFFFFFFFFFFF) | (1022 << 52)).to(tl.float64, bitcast=True)  # frexp: x = m * 2**e, m in [.5, 1)
    small = m < sqrt_half
    m = tl.where(small, m * 2.0, m)
    e = tl.where(small, e - 1, e)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = tl.zeros_like(z) + tl.load(c_ptr + 2 + TERMS - 1)
    for i in tl.static_range(TERMS - 1):
        k = TERMS - 2 - i
        p = p * z
        p = p + tl.load(c_ptr + 2 + k)
    return e.to(tl.float64) * ln2 + (s * 2.0) * p


@triton.jit
def _gumbel_argmax_kernel(x_ptr, stride_x, seed_ptr, pos_ptr, val_ptr, idx_ptr, noise_ptr, c_ptr, V, span,
                          salt, gamma, mix1, mix2, BLOCK: tl.constexpr, TERMS: tl.constexpr,
                          WRITE_NOISE: tl.constexpr):
    """Program (r, s): row r's vocabulary range [s * span, (s + 1) * span) (span a multiple of BLOCK); writes its
    first maximum's score and index to val/idx[r, s] (-inf and the range's start when all of it is -inf)."""
    r = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    seed = tl.load(seed_ptr + r)
    pos = tl.load(pos_ptr + r)
    row = _mix64(_mix64(seed ^ salt, mix1, mix2) + pos * gamma, mix1, mix2)
    lo = part * span
    best = tl.full([], float("-inf"), tl.float64)
    best_idx = lo
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(lo, tl.minimum(lo + span, V), BLOCK):
        v = start + offs
        ok = v < V
        x = tl.load(x_ptr + r * stride_x + v, mask=ok, other=float("-inf")).to(tl.float64)
        bits = _lsr(_mix64(row + (v + 1) * gamma, mix1, mix2), 12)
        u = (bits.to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52, exact in float32 too
        g = -_exact_log(-_exact_log(u, c_ptr, TERMS), c_ptr, TERMS)
        if WRITE_NOISE:
            tl.store(noise_ptr + r * V + v, g, mask=ok)
        score = tl.where(ok, x + g, float("-inf"))
        chunk_max = tl.max(score, axis=0)
        chunk_idx = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64)
        take = chunk_max > best  # strict: an earlier chunk keeps a tie
        best_idx = tl.where(take, start + chunk_idx, best_idx)
        best = tl.where(take, chunk_max, best)
    tl.store(val_ptr + r * tl.num_programs(1) + part, best)
    tl.store(idx_ptr + r * tl.num_programs(1) + part, best_idx)


_CONSTANTS: dict[torch.device, torch.Tensor] = {}


def _constants(device: torch.device) -> torch.Tensor:
    if device not in _CONSTANTS:
        values = [SQRT_HALF, LN2] + [1.0 / (2 * k + 1) for k in range(LOG_TERMS)]
        _CONSTANTS[device] = torch.tensor(values, dtype=torch.float64, device=device)
    return _CONSTANTS[device]


def default_splits(rows: int, vocab: int, device: torch.device, block: int = BLOCK) -> int:
    """Ranges per row: enough programs for ~4 per SM, no more ranges than BLOCK-wide chunks (speed only; the
    tokens do not depend on it)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(vocab, block), triton.cdiv(4 * sms, max(rows, 1))))


def gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  return_noise: bool = False, splits: int | None = None,
                  block: int = BLOCK) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``argmax(scaled.double() + gumbel_noise(seeds, positions, V), -1)``; scaled: float32 [R, V], with -inf
    for tokens a filter removed. ``splits``: vocabulary ranges per row, one program each (default
    ``default_splits``); any value gives the same tokens. ``return_noise`` also returns the noise (for tests)."""
    r, v = scaled.shape
    scaled = scaled if scaled.stride(-1) == 1 else scaled.contiguous()
    noise = torch.empty((r, v) if return_noise else (1,), dtype=torch.float64, device=scaled.device)
    if not r:
        out = torch.empty(0, dtype=torch.int64, device=scaled.device)
        return (out, noise) if return_noise else out
    chunks = triton.cdiv(v, block)
    splits = default_splits(r, v, scaled.device, block) if splits is None else splits
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"gumbel_argmax: splits must be a positive int, got {splits!r}")
    span = triton.cdiv(chunks, min(splits, chunks)) * block
    parts = triton.cdiv(v, span)
    vals = torch.empty((r, parts), dtype=torch.float64, device=scaled.device)
    idxs = torch.empty((r, parts), dtype=torch.int64, device=scaled.device)
    _gumbel_argmax_kernel[(r, parts)](
        scaled, scaled.stride(0), seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(),
        vals, idxs, noise, _constants(scaled.device), v, span, ROW_SALT, GAMMA, MIX1, MIX2,
        BLOCK=block, TERMS=LOG_TERMS, WRITE_NOISE=return_noise, num_warps=8, enable_fp_fusion=False)
    # the ranges in order, the first maximum (torch.argmax returns the first of equal maxima)
    out = idxs.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
    return (out, noise) if return_noise else out
