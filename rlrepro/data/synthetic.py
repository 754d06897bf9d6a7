"""Synthetic tasks with verifiable answers, for the CPU recipe ``grpo_tiny``.

Every prompt and answer uses only ``SYNTHETIC_CHARSET``, the alphabet of the tiny model's character-level
tokenizer. Records are a pure function of (kind, num, seed, options), and the first ``k`` records do not
depend on ``num``. Write them with ``write_jsonl`` and load them with ``load_records(path, id_field="id")`` so
that the recipe reads them through the same ``datasets`` path as real data.

=============  =====================  ========  ==============================================
kind           prompt                 answer    options (defaults)
=============  =====================  ========  ==============================================
first_letter   ``first: qbz=``        ``q``     min_len=1, max_len=5, alphabet=a-z  (easiest)
copy           ``copy: qbz=``         ``qbz``   min_len=1, max_len=5, alphabet=a-z
reverse        ``reverse: qbz=``      ``zbq``   min_len=1, max_len=5, alphabet=a-z
add            ``12+7=``              ``19``    max_value=20 (operands uniform in 0..max_value)
multiply       ``123*456=``           ``56088`` digits=3 (operands uniform over the digits-digit numbers;
                                                more than a tiny model can do in its head: ``grpo_tiny_tool``
                                                gives it a calculator)
=============  =====================  ========  ==============================================
"""
from __future__ import annotations

import string
from typing import Any

import numpy as np

from .records import PromptRecord, write_jsonl

__all__ = ["make_synthetic_records", "write_jsonl", "SYNTHETIC_KINDS", "SYNTHETIC_CHARSET"]

# The grpo_tiny character vocabulary: digits, lowercase letters, space, punctuation, newline.
SYNTHETIC_CHARSET = string.digits + string.ascii_lowercase + " " + "+-*=?.,:;()[]<>!#'" + "\n"

# kind -> stream id mixed into the seed, so kinds with one seed draw independent streams. Never renumber.
SYNTHETIC_KINDS = {"copy": 0, "reverse": 1, "add": 2, "first_letter": 3, "multiply": 4}

_STRING_PREFIX = {"copy": "copy: ", "reverse": "reverse: ", "first_letter": "first: "}
_STRING_OPTIONS = {"min_len": 1, "max_len": 5, "alphabet": string.ascii_lowercase}
_ADD_OPTIONS = {"max_value": 20}
_MULTIPLY_OPTIONS = {"digits": 3}


def make_synthetic_records(kind: str, num: int, seed: int, **kw: Any) -> list[PromptRecord]:
    """``num`` records of task ``kind`` (see the module table); uids are ``f"{kind}-s{seed}:{i}"``."""
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r} (data.synthetic.task); known: {sorted(SYNTHETIC_KINDS)}. "
                         f"Fix: set data.synthetic.task=<one of those>")
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"data.synthetic.num (num) must be a positive integer, got {num!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"data.synthetic.seed (seed) must be a non-negative integer, got {seed!r}")
    defaults = {"add": _ADD_OPTIONS, "multiply": _MULTIPLY_OPTIONS}.get(kind, _STRING_OPTIONS)
    unknown = sorted(set(kw) - set(defaults))
    if unknown:
        raise ValueError(f"synthetic kind {kind!r} takes the options {sorted(defaults)}, not {unknown}. Fix: set "
                         f"only those in data.synthetic.kwargs (e.g. data.synthetic.kwargs.{sorted(defaults)[0]}=...)")
    opts = {**defaults, **kw}
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, SYNTHETIC_KINDS[kind]])))
    meta = {"kind": kind}

    records = []
    if kind == "multiply":
        digits = opts["digits"]
        if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"data.synthetic.kwargs.digits must be an integer in 1..9, got {digits!r}")
        low = 10 ** (digits - 1) if digits > 1 else 0
        for i in range(num):
            a, b = (int(x) for x in rng.integers(low, 10 ** digits, size=2))
            records.append(PromptRecord(uid=f"{kind}-s{seed}:{i}", prompt=f"{a}*{b}=", answer=str(a * b),
                                        meta=dict(meta)))
        return records
    if kind == "add":
        max_value = opts["max_value"]
        if isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 0:
            raise ValueError(f"data.synthetic.kwargs.max_value must be a non-negative integer, got {max_value!r}")
        for i in range(num):
            a, b = (int(x) for x in rng.integers(0, max_value, size=2, endpoint=True))
            records.append(PromptRecord(uid=f"{kind}-s{seed}:{i}", prompt=f"{a}+{b}=", answer=str(a + b),
                                        meta=dict(meta)))
        return records

    min_len, max_len, alphabet = opts["min_len"], opts["max_len"], opts["alphabet"]
    for name, value in (("min_len", min_len), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"data.synthetic.kwargs.{name} must be a positive integer, got {value!r}")
    if min_len > max_len:
        raise ValueError(f"data.synthetic.kwargs.min_len ({min_len}) must not exceed data.synthetic.kwargs.max_len "
                         f"({max_len})")
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"data.synthetic.kwargs.alphabet must be a non-empty string, got {alphabet!r}")
    not_allowed = sorted((set(alphabet) - set(SYNTHETIC_CHARSET)) | (set(alphabet) & set("= \n")))
    if not_allowed:
        raise ValueError(f"data.synthetic.kwargs.alphabet={alphabet!r} has the characters {not_allowed}: outside "
                         f"the tiny tokenizer's vocabulary, or '=' (ends the prompt), space or newline (stripped from "
                         f"answers). "
                         f"Use characters of {SYNTHETIC_CHARSET.strip()!r} other than '=' and space.")
    chars = np.array(list(alphabet))
    for i in range(num):
        length = int(rng.integers(min_len, max_len, endpoint=True))
        s = "".join(chars[rng.integers(0, len(chars), size=length)].tolist())
        answer = {"copy": s, "reverse": s[::-1], "first_letter": s[0]}[kind]
        records.append(PromptRecord(uid=f"{kind}-s{seed}:{i}", prompt=f"{_STRING_PREFIX[kind]}{s}=", answer=answer,
                                    meta=dict(meta)))
    return records
