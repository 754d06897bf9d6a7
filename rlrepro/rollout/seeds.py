"""Request seeds: pure functions of integer/string keys, via SHA-256, so they never depend on Python's hash
randomisation, the platform, or the order in which work happens to run.

The key is JSON-encoded before hashing, so ``5`` and ``"5"`` are different keys and no two key tuples encode
to the same bytes. The seed is the first 8 bytes of the digest (big-endian) shifted right by one: 63 bits.
"""
from __future__ import annotations

import hashlib
import json


def _seed_from_key(key: list) -> int:
    digest = hashlib.sha256(json.dumps(key, separators=(",", ":")).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _check_key(name: str, value: object, allow_str: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if allow_str:
        ok = ok or isinstance(value, str)
    if not ok:
        kinds = "an int or a str" if allow_str else "an int"
        raise ValueError(f"{name} must be {kinds}, got {value!r} ({type(value).__name__})")


def request_seed(run_seed: int, step: int, prompt_uid: int | str, sample_index: int) -> int:
    """The sampling seed of sample ``sample_index`` of prompt ``prompt_uid`` at GRPO step ``step``.

    63-bit, a pure function of its arguments: the same request re-run anywhere (another worker, after a restart)
    samples the same tokens.
    """
    _check_key("run_seed", run_seed)
    _check_key("step", step)
    _check_key("prompt_uid", prompt_uid, allow_str=True)
    _check_key("sample_index", sample_index)
    return _seed_from_key(["rlrepro.request", run_seed, step, prompt_uid, sample_index])


def eval_seed(run_seed: int, step: int, prompt_uid: int | str, sample_index: int) -> int:
    """The sampling seed of evaluation sample ``sample_index`` of held-out prompt ``prompt_uid`` after GRPO step
    ``step``: a stream of its own (another salt than :func:`request_seed`), so evaluating draws no training seed
    and the two never coincide by construction of the key."""
    _check_key("run_seed", run_seed)
    _check_key("step", step)
    _check_key("prompt_uid", prompt_uid, allow_str=True)
    _check_key("sample_index", sample_index)
    return _seed_from_key(["rlrepro.eval", run_seed, step, prompt_uid, sample_index])


def derive_seed(engine_seed: int, request_index: int) -> int:
    """The seed of a request submitted without one: ``request_index`` counts every request this engine has
    accepted (0-based, in submission order across ``generate`` calls), so a fresh engine given the same seed
    and the same sequence of calls reproduces its samples, while repeated calls do not repeat them."""
    _check_key("engine_seed", engine_seed)
    _check_key("request_index", request_index)
    return _seed_from_key(["rlrepro.engine", engine_seed, request_index])
