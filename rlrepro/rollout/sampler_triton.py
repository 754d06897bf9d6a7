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

**Chunks that cannot win are skipped** (``prune``, on by default). Most of the kernel's time is the two exact
float64 logarithms of every token. A float32 estimate of the noise (``_fast_noise``: a ``log2`` of ``u``, or a
short series in ``1 - u`` near 1, then a ``log2``) is within ``FAST_NOISE_ERROR`` (5e-5) of the exact noise,
which is itself within 1e-10 of ``-log(-log(u))`` (``sampler.LOG_TERMS``). So where ``|a| < 2**15``, ``a = x +
fast`` in float32 is within 0.002 of the exact float64 score ``x + g`` (the estimate's error and ``a``'s
rounding), and with the margin ``FAST_NOISE_MARGIN`` (1e-2) a chunk's largest ``a`` gives a lower bound
(``- margin``) and an upper bound (``+ margin``) of its exact maximum. A program keeps ``floor``, the largest
lower bound of its range's chunks so far, and skips a chunk whose upper bound lies below ``floor``. By induction
the unpruned scan would not have taken that chunk either: ``floor`` belongs to an evaluated chunk, so the
running best is at least ``floor``, and every exact score of the skipped chunk is below it (``take`` is
strict). The running best, its index and the program's result are therefore those of the unpruned scan, step
for step. A chunk with a NaN, a +inf or a score of ``2**15`` or more is always evaluated and does not raise
``floor``; one of -inf logits only is never taken. Typically a range evaluates its first chunk and the few whose
estimate sets a new record (about 32 % of the chunks at the decode shape). ``passes=2`` (an option, for the
benchmark) first stores every chunk's bound and ``floor`` of the whole range, then evaluates only the chunks
whose upper bound reaches it (~1 a range, 12 %); the result is still the unpruned scan's: the chunk that holds the
range's maximum first has an upper bound above that maximum, which is at least ``floor``, so it is evaluated and
no earlier evaluated chunk reaches its value. ``tests/test_rollout_sampler_interpreted.py`` (Triton's CPU
interpreter) and ``tests/test_rollout_cuda.py`` (GPU) check pruned (one and two passes) == unpruned == the eager
definition with ``torch.equal``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .sampler_constants import GAMMA, LN2, LOG_TERMS, MIX1, MIX2, ROW_SALT, SQRT_HALF

BLOCK = 2048
FAST_NOISE_ERROR = 5e-5  # |_fast_noise - exact noise| stays below this (tests check it on the GPU and the CPU)
FAST_NOISE_MARGIN = 1e-2  # the bounds' half-width around x + fast noise: 5 x (FAST_NOISE_ERROR + rounding)


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
def _log2_approx(x, HW: tl.constexpr):
    """``log2`` of float32 ``x``: the GPU's ``lg2.approx.f32`` (one MUFU instruction; libdevice's ``log2f`` is
    ~25) where ``HW``, else ``tl.log2`` (Triton's CPU interpreter runs no inline assembly)."""
    if HW:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _fast_noise(bits, HW: tl.constexpr = False):
    """float32 estimate of the noise ``-log(-log(u))``, ``u = (bits + 0.5) 2**-52``, within FAST_NOISE_ERROR of
    the exact float64 value, in a few float32 operations and two ``log2`` (the hardware's approximate one on
    the GPU). ``-log(u)`` is taken from ``u`` below 15/16 and, above, from ``w = 1 - u`` (exact in the
    integers, rounded once to float32) as ``w + w^2/2 + ... + w^5/5`` (``w <= 1/16``: the rest is under 2e-7
    relative), so it keeps its relative accuracy as ``u`` nears 1. Errors: float32 rounding of ``u`` or ``w``
    (6e-8 relative), ``log2.approx`` (2**-22.6 absolute near 1, relative elsewhere: at most ~1e-5 in all), far
    under the stated 5e-5, itself 200 times below the margin."""
    near = bits >= 4222124650659840  # 15 * 2**48: u >= 15/16
    t = tl.where(near, 4503599627370495 - bits, bits)  # 2**52 - 1 - bits: then (t + 0.5) 2**-52 = 1 - u
    f = (t.to(tl.float32) + 0.5) * 2.220446049250313e-16
    series = f * tl.fma(f, tl.fma(f, tl.fma(f, tl.fma(f, 0.2, 0.25), 0.33333334), 0.5), 1.0)
    y = tl.where(near, series, _log2_approx(f, HW) * -0.6931471805599453)
    return _log2_approx(y, HW) * -0.6931471805599453


@triton.jit
def _chunk_top(x, bits, HW: tl.constexpr):
    """A chunk's largest ``a = x + fast`` (float32): within 0.002 of the exact score where ``|a| < 2**15`` (the
    estimate's error and a's rounding), so ``top - margin`` and ``top + margin`` bound the chunk's exact maximum.
    A NaN, +inf or larger ``|a|`` makes it +inf ("unclean": always evaluated, never a lower bound); a chunk of
    -inf logits gives -inf (never taken). Also returns the estimate."""
    fast = _fast_noise(bits, HW)
    a = x + fast
    bad = (a != a) | ((tl.abs(a) >= 32768.0) & (a != float("-inf")))
    return tl.max(tl.where(bad, float("inf"), a), axis=0), fast  # lanes past V hold x = -inf


@triton.jit
def _exact_step(x, bits, ok, start, best, best_idx, c_ptr, TERMS: tl.constexpr):
    """The unpruned scan's step on one chunk: its exact noise, scores, first maximum, taken if strictly above the
    running best (an earlier chunk keeps a tie). Returns the new best, its index, and the noise."""
    u = (bits.to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52, exact in float32 too
    g = -_exact_log(-_exact_log(u, c_ptr, TERMS), c_ptr, TERMS)
    score = tl.where(ok, x.to(tl.float64) + g, float("-inf"))
    chunk_max = tl.max(score, axis=0)
    chunk_idx = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64)
    take = chunk_max > best
    return tl.where(take, chunk_max, best), tl.where(take, start + chunk_idx, best_idx), g


@triton.jit
def _gumbel_argmax_kernel(x_ptr, stride_x, seed_ptr, pos_ptr, val_ptr, idx_ptr, evals_ptr, noise_ptr, top_ptr, c_ptr,
                          V, span, salt, gamma, mix1, mix2, margin, BLOCK: tl.constexpr, TERMS: tl.constexpr,
                          WRITE_NOISE: tl.constexpr, PRUNE: tl.constexpr, TWO_PASS: tl.constexpr,
                          HW_LOG: tl.constexpr):
    """Program (r, s): row r's vocabulary range [s * span, (s + 1) * span) (span a multiple of BLOCK); writes its
    first maximum's score and index to val/idx[r, s] (-inf and the range's start when all of it is -inf), and
    to evals[r, s] how many of its chunks had their exact noise computed. ``PRUNE``: skip the chunks whose upper
    bound lies below ``floor`` (module docstring), in one pass (``floor`` so far) or ``TWO_PASS`` (the chunks'
    tops to ``top_ptr`` first, then ``floor`` of the whole range); ``WRITE_NOISE`` (one pass) writes the exact
    noise of every token (tests) and with ``PRUNE`` the fast estimate into ``noise_ptr + R * V``."""
    r = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    seed = tl.load(seed_ptr + r)
    pos = tl.load(pos_ptr + r)
    row = _mix64(_mix64(seed ^ salt, mix1, mix2) + pos * gamma, mix1, mix2)
    lo = part * span
    hi = tl.minimum(lo + span, V)
    best = tl.full([], float("-inf"), tl.float64)
    best_idx = lo
    floor = tl.full([], float("-inf"), tl.float32)
    evaluated = tl.zeros([], tl.int32)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    tops = top_ptr + (r * tl.num_programs(1) + part) * (span // BLOCK)
    if TWO_PASS:
        for start in range(lo, hi, BLOCK):
            v = start + offs
            x = tl.load(x_ptr + r * stride_x + v, mask=v < V, other=float("-inf")).to(tl.float32)
            top, fast = _chunk_top(x, _lsr(_mix64(row + (v + 1) * gamma, mix1, mix2), 12), HW_LOG)
            floor = tl.where(top < float("inf"), tl.maximum(floor, top - margin), floor)
            tl.store(tops + (start - lo) // BLOCK, top)
    for start in range(lo, hi, BLOCK):
        v = start + offs
        ok = v < V
        if TWO_PASS:
            top = tl.load(tops + (start - lo) // BLOCK)
            if (top + margin >= floor) & (top > float("-inf")):
                evaluated += 1
                x = tl.load(x_ptr + r * stride_x + v, mask=ok, other=float("-inf")).to(tl.float32)
                best, best_idx, g = _exact_step(x, _lsr(_mix64(row + (v + 1) * gamma, mix1, mix2), 12), ok, start,
                                                best, best_idx, c_ptr, TERMS)
        else:
            x = tl.load(x_ptr + r * stride_x + v, mask=ok, other=float("-inf")).to(tl.float32)
            bits = _lsr(_mix64(row + (v + 1) * gamma, mix1, mix2), 12)
            go = True
            if PRUNE:
                top, fast = _chunk_top(x, bits, HW_LOG)
                floor = tl.where(top < float("inf"), tl.maximum(floor, top - margin), floor)
                go = (top + margin >= floor) & (top > float("-inf"))
                if WRITE_NOISE:
                    tl.store(noise_ptr + tl.num_programs(0) * V + r * V + v, fast.to(tl.float64), mask=ok)
                    go = True
            if go:
                evaluated += 1
                best, best_idx, g = _exact_step(x, bits, ok, start, best, best_idx, c_ptr, TERMS)
                if WRITE_NOISE:
                    tl.store(noise_ptr + r * V + v, g, mask=ok)
    tl.store(val_ptr + r * tl.num_programs(1) + part, best)
    tl.store(idx_ptr + r * tl.num_programs(1) + part, best_idx)
    tl.store(evals_ptr + r * tl.num_programs(1) + part, evaluated)


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
                  return_noise: bool = False, splits: int | None = None, block: int = BLOCK,
                  prune: bool = True, return_evaluated: bool = False,
                  passes: int = 1) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``argmax(scaled.double() + gumbel_noise(seeds, positions, V), -1)``; scaled: [R, V] float32 (or bfloat16 /
    float16: widened exactly in the kernel, as ``.double()`` does), with -inf for tokens a filter removed.
    ``splits``: vocabulary ranges per row, one program each (default ``default_splits``); ``prune``: skip the
    chunks that cannot hold the maximum (module docstring); neither changes a token. ``return_noise`` also returns
    the exact noise [R, V] (tests), and with ``prune`` the fast estimate stacked after it ([2, R, V]);
    ``return_evaluated`` then the count of chunks whose exact noise each program computed ([R, ranges] int32,
    the rest were skipped). ``passes=2`` (with ``prune``): each range's chunk bounds first, then only the chunks
    within reach of the range's best lower bound (an experiment for the benchmark; the same tokens)."""
    if passes not in (1, 2) or (passes == 2 and (not prune or return_noise)):
        raise ValueError(f"gumbel_argmax: passes={passes!r}; use 1, or 2 with prune=True and no return_noise")
    r, v = scaled.shape
    if scaled.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"gumbel_argmax: scaled logits of dtype {scaled.dtype}; pass float32 (or bfloat16/float16)")
    scaled = scaled if scaled.stride(-1) == 1 else scaled.contiguous()
    shape = ((2, r, v) if prune else (r, v)) if return_noise else (1,)
    noise = torch.empty(shape, dtype=torch.float64, device=scaled.device)
    if not r:
        out = torch.empty(0, dtype=torch.int64, device=scaled.device)
        none = torch.zeros((0, 1), dtype=torch.int32, device=scaled.device)
        return _results(out, noise if return_noise else None, none if return_evaluated else None)
    chunks = triton.cdiv(v, block)
    splits = default_splits(r, v, scaled.device, block) if splits is None else splits
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"gumbel_argmax: splits must be a positive int, got {splits!r}")
    span = triton.cdiv(chunks, min(splits, chunks)) * block
    parts = triton.cdiv(v, span)
    vals = torch.empty((r, parts), dtype=torch.float64, device=scaled.device)
    idxs = torch.empty((r, parts), dtype=torch.int64, device=scaled.device)
    evals = torch.empty((r, parts), dtype=torch.int32, device=scaled.device)
    tops = torch.empty((r, parts, span // block) if passes == 2 else (1,), dtype=torch.float32, device=scaled.device)
    _gumbel_argmax_kernel[(r, parts)](
        scaled, scaled.stride(0), seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(),
        vals, idxs, evals, noise, tops, _constants(scaled.device), v, span, ROW_SALT, GAMMA, MIX1, MIX2,
        FAST_NOISE_MARGIN, BLOCK=block, TERMS=LOG_TERMS, WRITE_NOISE=return_noise, PRUNE=bool(prune),
        TWO_PASS=passes == 2,
        HW_LOG=os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), num_warps=8, enable_fp_fusion=False)
    # the ranges in order, the first maximum (torch.argmax returns the first of equal maxima)
    out = idxs.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
    return _results(out, noise if return_noise else None, evals if return_evaluated else None)


def _results(out: torch.Tensor, *extra: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    kept = [e for e in extra if e is not None]
    return (out, *kept) if kept else out
