"""Per-request sampling that no other request in the batch can influence.

Definition (one row of logits, the request's temperature ``T``, seed ``s``, and ``pos``, the position the
new token will occupy, i.e. the sequence length before it is appended):

* ``T == 0``: the token is ``argmax(logits)``, the first maximal entry.
* ``T > 0``: ``x = logits.float() / T``; if top-k or top-p is set, tokens outside the kept set get ``-inf``;
  the token is ``argmax(x.double() + g)`` (first maximum) with Gumbel noise ``g[v] = -log(-log(u[v]))`` and
  ``u[v] = (k + 0.5) / 2**52``, ``k`` the top 52 bits of ``mix64(row_key(s, pos) + (v + 1) * GAMMA)``.
  This is the Gumbel-max trick: an exact draw from ``softmax(x)`` restricted to the kept set.

The noise is counter-based: a pure function of (seed, position, token id), drawn from no RNG state, so a
request's tokens do not depend on what else is in the batch, on the step a token is sampled in, or on
preemption and recompute. The hash is splitmix64's finaliser in int64 arithmetic (multiplication wraps modulo
2**64, shifts are made logical by masking). The two logarithms are computed from ``frexp`` and a polynomial in
IEEE-correctly-rounded ``+ - * /`` only (no libm ``log``, whose SIMD body and scalar tail can round
differently), evaluated op by op in float64, so every element's noise is the same whatever the tensor size,
vector width, thread count or device.

Top-k / top-p (nucleus). Sort ``x`` descending with a stable sort, so equal values keep token-id order: ties
are broken toward the lower token id. top-k keeps the first ``k`` of that order (exactly ``k``, even if the k-th
value is tied with later ones). top-p then gives each top-k survivor ``j`` (in sorted order) the integer mass
``m_j = floor(exp(x_j - x_0) * 2**32)`` (float32 ``exp``; tokens outside the top-k get 0) and keeps it while
``M_before_j / M_total < top_p`` in float64, ``M`` being integer sums (the first token is always kept). Integer
sums are exact in any order, so no reduction order enters the mask. The fixed point resolves ``2**-32`` of the
top token's weight: a mass share is within ``V * 2**-32`` (plus float32 ``exp``'s ~1e-7 relative rounding) of
the probability, and tokens below that weight are never kept when ``top_p < 1``. (A float32 softmax + cumsum,
the rule before 2026-11-30, gave a row another mask alone than among 64 rows on the H200: near the ``top_p``
boundary one rounding flips a token.) The filtered rows of a step are sorted together, ``FILTER_ROWS`` at a
time (``keep_masks``): the sort is a permutation and ``exp`` elementwise, so a row's mask does not depend on the
other rows. Tests: batched masks == one-row masks == the rule written out with Python integers (``torch.equal``,
CPU and CUDA).

On CUDA the noise, the sum and the argmax run as one fused Triton kernel (``sampler_triton``) that repeats
this arithmetic operation for operation; it returns the same tokens as the eager path (tested on the GPU). It
computes the exact noise only for the vocabulary chunks that a float32 estimate with a 1e-2 margin cannot rule
out (the skipped chunks provably hold no maximum: same tokens, tested pruned == unpruned == eager, the last
for rows without a NaN logit, where ``torch.argmax`` takes the NaN).

Logprob. The reported logprob is ``kernels.token_logprob(logits_row, token, T)``: float32
``log_softmax(logits.float() / T)`` at the token, over the *unfiltered* distribution, ``T = 1`` for greedy.
The trainer evaluates the same function on the same logits, so the two agree bit for bit. Rows are grouped by
temperature and evaluated together; ``kernels.log_softmax`` is batch-invariant, so grouping changes nothing. At
``T = 1`` without filters the bfloat16/float16 logits go to the argmax and the logprob unconverted (both widen
exactly, as ``.float()`` would): no float32 copy of ``[rows, V]``; on CUDA the logprob is formed for the chosen
token only (``kernels.scaled_token_logprob``), from the log-softmax's own partials.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch

from rlrepro import kernels
from rlrepro.kernels.metadata import tensor_to_device

# the noise's constants live in .sampler_constants, where the fused kernel (.sampler_triton) reads them too
from .sampler_constants import GAMMA, LN2, LOG_TERMS, MIX1, MIX2, ROW_SALT, SQRT_HALF


def _lsr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; products wrap modulo 2**64."""
    z = (z ^ _lsr(z, 30)) * MIX1
    z = (z ^ _lsr(z, 27)) * MIX2
    return z ^ _lsr(z, 31)


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [R, V] hash of (seed, position, token id) for each row's seed and position."""
    row = mix64(mix64(seeds.to(torch.int64) ^ ROW_SALT) + positions.to(torch.int64) * GAMMA)  # [R]
    tokens = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * GAMMA  # wraps
    return mix64(row.unsqueeze(1) + tokens.unsqueeze(0))


def exact_log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64 values from frexp and correctly rounded + - * / only."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    small = m < SQRT_HALF
    m = torch.where(small, m * 2.0, m)  # exact; now m in [sqrt(1/2), sqrt(2))
    e = torch.where(small, e - 1, e)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = torch.full_like(z, 1.0 / (2 * LOG_TERMS - 1))
    for k in range(LOG_TERMS - 2, -1, -1):
        p = p * z
        p = p + 1.0 / (2 * k + 1)
    return e.to(torch.float64) * LN2 + (s * 2.0) * p


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 [R, V] Gumbel(0, 1) noise keyed on (seed, position, token id)."""
    bits = _lsr(noise_bits(seeds, positions, vocab_size), 12)  # 52 uniform bits
    u = (bits.to(torch.float64) + 0.5) * (2.0 ** -52)  # exact; in (0, 1)
    return -exact_log(-exact_log(u))


MASS_BITS = 32  # top-p's fixed-point unit: a token's mass is floor(exp(x - max) * 2**MASS_BITS), an integer
MAX_FILTER_VOCAB = 2 ** (53 - MASS_BITS)  # the mass totals stay exact in float64
FILTER_ROWS = 64  # rows per batched sort (bounds the int64/float64 temporaries to ~1.5 GB at 151,936 columns)


def keep_masks(scaled: torch.Tensor, top_k: Seq[int], top_p: Seq[float]) -> torch.Tensor:
    """bool [R, V]: the tokens top-k / top-p keep, row ``i`` of ``logits / T`` with ``top_k[i]``, ``top_p[i]``
    (see the module docstring; ``top_k <= 0`` and ``top_p >= 1`` disable a filter). Rows go through one sort
    ``FILTER_ROWS`` at a time; each row's mask is the same in any grouping."""
    r, v = scaled.shape
    if len(top_k) != r or len(top_p) != r:
        raise ValueError(f"keep_masks: {r} rows but {len(top_k)} top_k and {len(top_p)} top_p values")
    if v > MAX_FILTER_VOCAB:
        raise ValueError(f"keep_masks: a vocabulary of {v} tokens; top-p's integer masses are exact in float64 up "
                         f"to {MAX_FILTER_VOCAB} (V * 2**{MASS_BITS} < 2**53)")
    if r <= FILTER_ROWS:
        return _keep_masks(scaled, top_k, top_p)
    return torch.cat([_keep_masks(scaled[i:i + FILTER_ROWS], top_k[i:i + FILTER_ROWS], top_p[i:i + FILTER_ROWS])
                      for i in range(0, r, FILTER_ROWS)])


def _keep_masks(scaled: torch.Tensor, top_k: Seq[int], top_p: Seq[float]) -> torch.Tensor:
    r, v = scaled.shape
    device = scaled.device
    sorted_vals, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # a permutation: exact
    limits = tensor_to_device([k if 0 < k < v else v for k in top_k], torch.int64, device)
    keep_sorted = torch.arange(v, device=device).unsqueeze(0) < limits.unsqueeze(1)
    nucleus = [i for i, p in enumerate(top_p) if p < 1.0]
    if nucleus:
        whole = len(nucleus) == r
        idx = None if whole else tensor_to_device(nucleus, torch.int64, device)
        vals = sorted_vals if whole else sorted_vals.index_select(0, idx)
        kept = keep_sorted if whole else keep_sorted.index_select(0, idx)
        # integer masses: exact sums in any order (no float reduction whose order a kernel picks)
        weight = torch.exp(vals - vals[:, :1])  # float32, elementwise; the first is exp(0) = 1
        mass = torch.floor(weight.double() * 2.0 ** MASS_BITS).to(torch.int64).masked_fill_(~kept, 0)
        before = torch.cumsum(mass, dim=-1) - mass  # < V * 2**32 < 2**53: exact as float64 below
        total = before[:, -1:] + mass[:, -1:]
        limit_p = tensor_to_device([top_p[i] for i in nucleus], torch.float64, device)
        in_nucleus = before.double() / total.double() < limit_p.unsqueeze(1)  # correctly rounded division
        in_nucleus[:, 0] = True
        if whole:
            keep_sorted &= in_nucleus
        else:
            keep_sorted[idx] = kept & in_nucleus
    mask = torch.empty_like(keep_sorted)
    mask.scatter_(1, order, keep_sorted)
    return mask


def keep_mask(scaled_row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """bool [V]: ``keep_masks`` for one row (the definition's one-row form)."""
    v = scaled_row.shape[-1]
    return keep_masks(scaled_row.reshape(1, v), [top_k], [top_p]).reshape(v)


@dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs of one row: the request's parameters and its noise key."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    position: int  # position of the token being sampled (the sequence length before it is appended)


def _fused_gumbel_argmax(device: torch.device) -> Callable | None:
    """The fused Triton kernel for CUDA tensors (same bits as the eager path), or None to run eagerly."""
    if device.type != "cuda":
        return None
    try:
        from .sampler_triton import gumbel_argmax
    except ImportError:  # pragma: no cover - no Triton
        return None
    return gumbel_argmax


# logits dtypes whose values float32 (and float64) hold exactly: at t = 1 the sampler hands them over unconverted
_WIDENED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


def _lean() -> bool:
    """``RLREPRO_SAMPLER_LEAN`` (default 1): the fused argmax skips the chunks that cannot win and t = 1 logits go
    unconverted; 0 runs the sampler as before 2026-12-08 (every chunk's exact noise, a float32 copy), for
    benchmarks. The tokens and logprobs are the same bits either way."""
    return os.environ.get("RLREPRO_SAMPLER_LEAN", "1") != "0"


def _filters(q: SampleRequest) -> bool:
    return q.top_k > 0 or q.top_p < 1.0


def _filtered(scaled: torch.Tensor, reqs: Seq[SampleRequest]) -> torch.Tensor:
    """``scaled`` with -inf outside each row's top-k / top-p set (the same tensor when no row sets a filter)."""
    rows = [j for j, q in enumerate(reqs) if _filters(q)]
    if not rows:
        return scaled
    ks, ps = [reqs[j].top_k for j in rows], [reqs[j].top_p for j in rows]
    if len(rows) == len(reqs):
        return scaled.masked_fill(~keep_masks(scaled, ks, ps), float("-inf"))
    idx = tensor_to_device(rows, torch.int64, scaled.device)
    part = scaled.index_select(0, idx)
    kept = scaled.clone()
    kept[idx] = part.masked_fill(~keep_masks(part, ks, ps), float("-inf"))
    return kept


def sample(logits: torch.Tensor, requests: Seq[SampleRequest], fused: bool | None = None,
           ) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` [R, V]; returns the tokens and their logprobs (Python lists).

    ``fused`` (default: on for CUDA) uses the fused Triton Gumbel-max, which gives the same tokens as the eager
    definition; ``fused=False`` forces the eager path."""
    tokens, logprobs = sample_on_device(logits, requests, fused)
    return tokens.tolist(), logprobs.tolist()


def sample_on_device(logits: torch.Tensor, requests: Seq[SampleRequest], fused: bool | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` without reading the results back: int64 tokens and float32 logprobs [R] on the logits' device.

    Host values go to the device through pinned memory, so on CUDA nothing here waits for the device."""
    r, v = logits.shape
    if r != len(requests):
        raise ValueError(f"{r} logits rows for {len(requests)} sample requests")
    device = logits.device
    tokens = torch.empty(r, dtype=torch.int64, device=device)
    logprobs = torch.empty(r, dtype=torch.float32, device=device)
    if r == 0:
        return tokens, logprobs
    fused_argmax = _fused_gumbel_argmax(device) if fused is not False else None
    if fused and fused_argmax is None:
        raise ValueError(f"fused=True needs a CUDA tensor and Triton; logits are on {device}")
    lean = _lean()
    by_temperature: dict[float, list[int]] = {}
    for i, req in enumerate(requests):
        by_temperature.setdefault(req.temperature, []).append(i)
    for t, rows in sorted(by_temperature.items()):
        whole = len(rows) == r  # one temperature for the whole batch: no gather or scatter
        idx = None if whole else tensor_to_device(rows, torch.int64, device)
        group = logits if whole else logits.index_select(0, idx)
        if t == 0.0:
            chosen = torch.argmax(group.float(), dim=-1)
        else:
            group_reqs = [requests[i] for i in rows]
            if t == 1.0 and lean and group.dtype in _WIDENED_EXACTLY and not any(map(_filters, group_reqs)):
                scaled = group  # x.float() / 1.0 == x.float(): the argmax and the logprob widen in their kernels
            else:
                scaled = kernels.scale_logits(group, t)  # the same expression token_logprob evaluates
            keys = tensor_to_device([[requests[i].seed for i in rows], [requests[i].position for i in rows]],
                                    torch.int64, device)
            seeds, positions = keys[0], keys[1]
            kept = _filtered(scaled, group_reqs)
            if fused_argmax is not None:
                chosen = fused_argmax(kept, seeds, positions, prune=lean)
            else:
                chosen = torch.argmax(kept.double() + gumbel_noise(seeds, positions, v), dim=-1)
        # token_logprob(group, chosen, t) is scaled_token_logprob(group.float() / t, chosen): reuse `scaled`
        if t == 0.0:
            lp = kernels.token_logprob(group, chosen, t)
        elif lean:
            lp = kernels.scaled_token_logprob(scaled, chosen)
        else:  # the written [rows, V] log-softmax, as before (the same bits)
            lp = kernels.log_softmax(scaled).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        if whole:  # one group: its results are the step's (no copy into the buffers)
            return chosen.to(torch.int64), lp.to(torch.float32)
        else:
            tokens[idx] = chosen
            logprobs[idx] = lp
    return tokens, logprobs
