"""Request seeds: pure functions of integer/string keys, via SHA-256, so they never depend on Python's hash
randomisation, the platform, or the order in which work happens to run.

The key is JSON-encoded before hashing, so ``5`` and ``"5"`` are different keys and no two key tuples encode
to the same bytes. The seed is the first 8 bytes of the digest (big-endian) shifted right by one: 63 bits.
"""
from __future__ import annotations

import hashlib
import json
import numbers


def _seed_from_key(key: list) -> int:
    digest = hashlib.sha256(json.dumps(key, separators=(",", ":")).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _check_key(name: str, value: object, allow_str: bool = False) -> int | str:
    """The key as JSON encodes it: a Python int (numpy integer scalars too, as ``SamplingParams`` takes them, so
    ``np.int64(5)`` and ``5`` give the same seed) or, where allowed, a str; bools and floats are refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # as before: JSON encodes it, so no accepted key changes its seed
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy integers (np.bool_ is none)
        return int(value)
    if allow_str and isinstance(value, str):
        return value
    kinds = "an int or a str" if allow_str else "an int"
    raise ValueError(f"{name} must be {kinds}, got {value!r} ({type(value).__name__})")


def request_seed(run_seed: int, step: int, prompt_uid: int | str, sample_index: int) -> int:
    """The sampling seed of sample ``sample_index`` of prompt ``prompt_uid`` at GRPO step ``step``.

    63-bit, a pure function of its arguments: the same request re-run anywhere (another worker, after a restart)
    samples the same tokens.
    """
    key = [_check_key("run_seed", run_seed), _check_key("step", step),
           _check_key("prompt_uid", prompt_uid, allow_str=True), _check_key("sample_index", sample_index)]
    return _seed_from_key(["rlrepro.request", *key])


def eval_seed(run_seed: int, step: int, prompt_uid: int | str, sample_index: int) -> int:
    """The sampling seed of evaluation sample ``sample_index`` of held-out prompt ``prompt_uid`` after GRPO step
    ``step``: a stream of its own (another salt than :func:`request_seed`), so evaluating draws no training seed
    and the two never coincide by construction of the key."""
    key = [_check_key("run_seed", run_seed), _check_key("step", step),
           _check_key("prompt_uid", prompt_uid, allow_str=True), _check_key("sample_index", sample_index)]
    return _seed_from_key(["rlrepro.eval", *key])


def derive_seed(engine_seed: int, request_index: int) -> int:
    """The seed of a request submitted without one: ``request_index`` counts every request this engine has
    accepted (0-based, in submission order across ``generate`` calls), so a fresh engine given the same seed
    and the same sequence of calls reproduces its samples, while repeated calls do not repeat them."""
    return _seed_from_key(["rlrepro.engine", _check_key("engine_seed", engine_seed),
                           _check_key("request_index", request_index)])
