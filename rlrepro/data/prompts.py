"""Records to the prompts a run samples from: token ids through the template, the length limit, the checks.

``build_prompts`` is what the driver runs once at set-up, after ``load_records``:

    records, load_stats = load_records(source, ...)
    prompts, stats = build_prompts(records, tokenizer, template=..., system_prompt=..., use_chat_template=...,
                                   max_prompt_tokens=512, on_bad_row="error", on_unknown_token="warn")

Each record is tokenized with ``tokenize_prompt``; one of more than ``max_prompt_tokens * CHARS_PER_TOKEN``
characters (64 per token, or twice the tokenizer's longest token when that is longer) cannot fit and is refused
before the tokenizer sees it (a 50 MB prompt would take minutes and gigabytes to tokenize). A prompt longer
than ``max_prompt_tokens`` tokens raises, or with ``on_bad_row="skip"`` is left out (its uid listed in
``PromptStats.skipped``, one line on stderr). Prompt uids must be unique. Tokens that are the tokenizer's
unknown token (``tokenizer.unk_token_id``; a character tokenizer maps text outside its vocabulary, such as
uppercase letters, to it) are counted per prompt: with
``on_unknown_token="warn"`` one line on stderr names how many prompts and tokens, the first prompt's uid and the
characters that became the unknown token; with ``"error"`` a ``ValueError`` names the first such prompt and the
fix. Neither changes the prompts or their token ids. Answers are text given to the reward, never tokenized, so
only prompts count.

Every message names the config key a command-line user types (``data.max_prompt_tokens``, ``data.on_bad_row``,
``data.on_unknown_token``).
"""
from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from .records import PromptRecord
from .templates import render_prompt, tokenize_prompt

__all__ = ["Prompt", "PromptStats", "build_prompts", "ON_UNKNOWN_TOKEN", "CHARS_PER_TOKEN"]

ON_UNKNOWN_TOKEN = ("warn", "error")
_MAX_PIECES_SHOWN = 10


@dataclass
class Prompt:
    """One prompt of a run: the record's uid, its prompt token ids and the record (the reward reads its answer)."""

    uid: str
    token_ids: list[int]
    record: PromptRecord


@dataclass
class PromptStats:
    """What ``build_prompts`` did besides building the prompts.

    ``skipped``: uids left out under ``on_bad_row="skip"`` (longer than ``max_prompt_tokens``), in record order.
    ``unknown_token_id``: the tokenizer's unknown token id (None: it has none, nothing is counted).
    ``unknown_by_uid``: uid -> number of unknown tokens, for the kept prompts that hold any, in record order.
    ``unknown_pieces``: text piece -> how many times it became the unknown token, in order of first appearance
    (empty when the tokenizer cannot give token offsets: it needs ``encode_offsets``).
    ``warnings``: the lines printed to stderr.
    """

    num_records: int = 0
    num_prompts: int = 0
    skipped: list[str] = field(default_factory=list)
    unknown_token_id: int | None = None
    unknown_by_uid: dict[str, int] = field(default_factory=dict)
    unknown_pieces: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_unknown_prompts(self) -> int:
        return len(self.unknown_by_uid)

    @property
    def num_unknown_tokens(self) -> int:
        return sum(self.unknown_by_uid.values())

    @property
    def first_unknown_uid(self) -> str | None:
        return next(iter(self.unknown_by_uid), None)


def build_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    *,
    template: str | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool = False,
    tools: list[dict] | None = None,
    max_prompt_tokens: int | None = None,
    on_bad_row: Literal["error", "skip"] = "error",
    on_unknown_token: Literal["warn", "error"] = "warn",
    source: str | None = None,
) -> tuple[list[Prompt], PromptStats]:
    """The prompts of ``records`` in their order, and what was left out or looked wrong (see the module doc).

    ``tools``: tool schemas the chat template renders into every prompt (see ``render_prompt``; None or empty:
    none). ``max_prompt_tokens`` None means no limit. ``source`` only names the data set in the message raised when
    no prompt is left. Raises ``ValueError`` for a prompt over the limit (unless ``on_bad_row="skip"``), when
    no prompt is left, for duplicate uids, and for unknown tokens under ``on_unknown_token="error"``.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"data.on_bad_row={on_bad_row!r} is not a choice: it must be error or skip. "
                         f"Fix: set data.on_bad_row=error or data.on_bad_row=skip.")
    if on_unknown_token not in ON_UNKNOWN_TOKEN:
        raise ValueError(f"data.on_unknown_token={on_unknown_token!r} is not a choice: it must be warn or error. "
                         f"Fix: set data.on_unknown_token=warn or data.on_unknown_token=error.")
    if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool)
                                          or not isinstance(max_prompt_tokens, numbers.Integral)
                                          or max_prompt_tokens < 1):
        raise ValueError(f"data.max_prompt_tokens={max_prompt_tokens!r} is not a positive integer. Fix: set "
                         f"data.max_prompt_tokens=N (a number of tokens) or data.max_prompt_tokens=null (no limit).")
    unk = getattr(tokenizer, "unk_token_id", None)
    unk = int(unk) if isinstance(unk, numbers.Integral) and not isinstance(unk, bool) else None
    render = dict(template=template, system_prompt=system_prompt, use_chat_template=use_chat_template, tools=tools)
    stats = PromptStats(num_records=len(records), unknown_token_id=unk)
    prompts: list[Prompt] = []
    bound = _CharBound(tokenizer, max_prompt_tokens)
    for rec in records:
        chars = bound.over(rec, render)
        if chars is not None:  # far too long to fit: refused before the tokenizer sees it
            problem = (f"prompt {rec.uid!r} has {chars} characters > {bound.limit} = data.max_prompt_tokens="
                       f"{max_prompt_tokens} x {bound.per_token} characters per token, so more than "
                       f"{max_prompt_tokens} tokens (it was not tokenized)")
            if on_bad_row != "skip":
                raise ValueError(f"{problem}; raise the limit, filter the data set, or set data.on_bad_row=skip "
                                 "to leave such prompts out")
            stats.skipped.append(rec.uid)
            continue
        ids = tokenize_prompt(rec, tokenizer, **render)
        # (tokenize_prompt itself raises for a prompt that encodes to no tokens, whatever on_bad_row says)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if on_bad_row != "skip":
                raise ValueError(f"prompt {rec.uid!r} has {len(ids)} tokens > data.max_prompt_tokens="
                                 f"{max_prompt_tokens}; raise the limit, filter the data set, or set "
                                 "data.on_bad_row=skip to leave such prompts out")
            stats.skipped.append(rec.uid)
            continue
        if unk is not None and unk in ids:
            stats.unknown_by_uid[rec.uid] = ids.count(unk)
            _collect_pieces(rec, tokenizer, render, ids, unk, stats.unknown_pieces)
        prompts.append(Prompt(rec.uid, ids, rec))
    stats.num_prompts = len(prompts)
    if stats.skipped:
        _warn(stats, f"rlrepro: data.on_bad_row=skip: left out {len(stats.skipped)} prompt(s) that are empty or "
                     f"longer than data.max_prompt_tokens={max_prompt_tokens} (first: {stats.skipped[0]!r})")
    if not prompts:
        of = f" of {source}" if source is not None else ""
        raise ValueError(f"no prompt{of} is left after leaving out {len(stats.skipped)} empty or too long ones; "
                         "raise data.max_prompt_tokens")
    seen: set[str] = set()
    for p in prompts:
        if p.uid in seen:
            raise ValueError(f"prompt uids are not unique ({p.uid!r} twice); set data.id_field to a unique column")
        seen.add(p.uid)
    if stats.unknown_by_uid:
        _unknown_tokens(stats, tokenizer, on_unknown_token)
    return prompts, stats


# a token stands for at most this many characters (or twice the tokenizer's longest token, when that is longer)
CHARS_PER_TOKEN = 64


class _CharBound:
    """A prompt of more than ``max_prompt_tokens * per_token`` characters cannot fit in ``max_prompt_tokens``
    tokens: ``per_token`` is ``CHARS_PER_TOKEN`` or, when the tokenizer's longest token is longer than half of
    that, twice its length (a tokenizer's normalisation can merge characters, as NFC does with an accent). The
    longest token is looked up only for a prompt over the first bound, so normal prompts cost one ``len``."""

    def __init__(self, tokenizer: Any, max_prompt_tokens: int | None):
        self.tokenizer, self.max_tokens = tokenizer, max_prompt_tokens
        self.per_token, self._asked = CHARS_PER_TOKEN, False

    @property
    def limit(self) -> int:
        return int(self.max_tokens or 0) * self.per_token

    def over(self, rec: PromptRecord, render: dict) -> int | None:
        """The prompt's length in characters when it is over the bound, else None."""
        if self.max_tokens is None:
            return None
        raw = len(rec.prompt) if rec.prompt is not None else sum(len(m["content"]) for m in rec.messages or ())
        if raw <= self.limit:
            return None  # the rendered text holds the raw text, and a template rarely trims it
        chars = len(render_prompt(rec, self.tokenizer, **render))
        if chars > self.limit and not self._asked:
            self._asked = True
            self.per_token = max(CHARS_PER_TOKEN, 2 * _longest_token(self.tokenizer))
        return chars if chars > self.limit else None


def _longest_token(tokenizer: Any) -> int:
    """Characters in the tokenizer's longest token: its ``max_token_chars``, the longest string of its
    ``get_vocab()`` (byte-level BPE vocabularies spell a byte as one character, so this is no shorter), or the
    longest ``decode([i])`` over its ``vocab_size`` ids; 0 when it can tell none of them."""
    known = getattr(tokenizer, "max_token_chars", None)
    if isinstance(known, numbers.Integral) and not isinstance(known, bool):
        return int(known)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if callable(get_vocab):
        try:
            return max((len(t) for t in get_vocab()), default=0)
        except Exception:  # a duck-typed tokenizer: try the next way
            pass
    size, decode = getattr(tokenizer, "vocab_size", None), getattr(tokenizer, "decode", None)
    if not isinstance(size, numbers.Integral) or not callable(decode):
        return 0
    longest = 0
    for i in range(int(size)):
        try:
            longest = max(longest, len(decode([i], skip_special_tokens=False)))
        except TypeError:
            longest = max(longest, len(decode([i])))
        except Exception:  # an id without a token
            continue
    return longest


def _collect_pieces(rec: PromptRecord, tokenizer: Any, render: dict, ids: list[int], unk: int,
                    pieces: dict[str, int]) -> None:
    """Add the text pieces that became the unknown token in ``rec``'s prompt (needs ``encode_offsets``)."""
    encode_offsets = getattr(tokenizer, "encode_offsets", None)
    if encode_offsets is None:
        return
    text = render_prompt(rec, tokenizer, **render)
    try:
        ids2, offsets = encode_offsets(text)
    except Exception:  # a duck-typed tokenizer with another signature: the counts are still right
        return
    if list(ids2) != ids:
        return
    for t, (start, end) in zip(ids2, offsets):
        if t == unk:
            piece = text[start:end]
            pieces[piece] = pieces.get(piece, 0) + 1


def _describe_pieces(pieces: dict[str, int]) -> str:
    if not pieces:
        return ""
    shown = ", ".join(repr(p) for p in list(pieces)[:_MAX_PIECES_SHOWN])
    more = f" and {len(pieces) - _MAX_PIECES_SHOWN} more" if len(pieces) > _MAX_PIECES_SHOWN else ""
    return f"; the text that became it: {shown}{more}"


def _unknown_tokens(stats: PromptStats, tokenizer: Any, policy: str) -> None:
    name = getattr(tokenizer, "unk_token", None)
    token = f"{name!r} (id {stats.unknown_token_id})" if isinstance(name, str) else f"id {stats.unknown_token_id}"
    first = stats.first_unknown_uid
    counts = (f"{stats.num_unknown_prompts} of {stats.num_prompts} prompts hold {stats.num_unknown_tokens} "
              f"unknown tokens {token}, text the tokenizer's vocabulary lacks, all read by the model as that one "
              f"token{_describe_pieces(stats.unknown_pieces)}")
    if policy == "error":
        raise ValueError(f"prompt {first!r} has {stats.unknown_by_uid[first]} unknown token(s): {counts}. Fix: use "
                         f"a tokenizer that covers the text (model.path), change the data or data.template, or set "
                         f"data.on_unknown_token=warn to allow it")
    _warn(stats, f"rlrepro: data.on_unknown_token=warn: {counts} (first: {first!r}); use a tokenizer that covers "
                 f"the text, or data.on_unknown_token=error to stop on it")


def _warn(stats: PromptStats, line: str) -> None:
    stats.warnings.append(line)
    print(line, file=sys.stderr)
