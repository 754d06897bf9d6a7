"""The constants of the counter-based Gumbel noise (:mod:`rlrepro.rollout.sampler`'s definition), shared by the
eager path and the fused Triton kernel (:mod:`rlrepro.rollout.sampler_triton`) so that neither imports the other.
Plain Python: no torch."""
from __future__ import annotations

import math

__all__ = ["GAMMA", "MIX1", "MIX2", "ROW_SALT", "SQRT_HALF", "LN2", "LOG_TERMS", "as_int64"]

_MASK64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """A 64-bit pattern as the signed int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


GAMMA = as_int64(0x9E3779B97F4A7C15)  # splitmix64's increment (golden ratio)
MIX1 = as_int64(0xBF58476D1CE4E5B9)
MIX2 = as_int64(0x94D049BB133111EB)
ROW_SALT = as_int64(0xD1B54A32D192ED03)
SQRT_HALF = math.sqrt(0.5)
LN2 = math.log(2.0)
# log(m) = 2 atanh(s) = 2 (s + s^3/3 + ... + s^11/11) with |s| <= 0.172: truncation error < 2e-11 absolute.
# The noise needs no more: it only has to be a fixed function (for determinism) close to Gumbel (for fidelity),
# and float32 logits resolve 6e-8. Fewer terms = fewer passes over the [rows, vocab] tensors.
LOG_TERMS = 6
