"""The prompt record: one row of a data set, as every other layer sees it.

A record carries a stable ``uid`` because the rollout derives each request's sampling seed from
(run seed, step, prompt uid, sample index) and the buffer orders samples by (uid, sample index):
the uid is part of what makes a run reproducible, so it must not depend on load order or timing.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = ["PromptRecord", "records_digest", "write_jsonl", "jsonl_bytes", "RESERVED_COLUMNS"]

# Column names write_jsonl uses for the record's own fields; meta keys may not take them.
RESERVED_COLUMNS = ("id", "prompt", "messages", "answer")


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt with its gold answer.

    Exactly one of ``prompt`` (plain text) and ``messages`` (chat turns, each ``{"role", "content"}``) is set.
    ``answer`` is the gold answer as text (reward functions compare completions with it).
    ``meta`` holds the row's other columns (informational; rewards may read it).
    All fields are keyword-only, so a prompt can never be passed where the answer belongs.
    """

    uid: str
    answer: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"PromptRecord.uid must be a non-empty string, got {self.uid!r}")
        if not isinstance(self.answer, str):
            raise ValueError(f"PromptRecord {self.uid!r}: answer must be a string, got {type(self.answer).__name__}")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(
                f"PromptRecord {self.uid!r}: set exactly one of prompt and messages "
                f"(got prompt={'set' if self.prompt is not None else 'None'}, "
                f"messages={'set' if self.messages is not None else 'None'})"
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"PromptRecord {self.uid!r}: prompt must be a string, got {type(self.prompt).__name__}")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise ValueError(f"PromptRecord {self.uid!r}: messages must be a non-empty list of dicts")
            for i, m in enumerate(self.messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ValueError(
                        f"PromptRecord {self.uid!r}: messages[{i}] must be a dict with string 'role' and 'content', "
                        f"got {m!r}"
                    )
        if not isinstance(self.meta, dict):
            raise ValueError(f"PromptRecord {self.uid!r}: meta must be a dict, got {type(self.meta).__name__}")

    def to_json_dict(self) -> dict[str, Any]:
        """The row write_jsonl writes: id, prompt or messages, answer, then the meta keys as columns."""
        clash = sorted(set(self.meta) & set(RESERVED_COLUMNS))
        if clash:
            raise ValueError(
                f"PromptRecord {self.uid!r}: meta keys {clash} clash with the columns {list(RESERVED_COLUMNS)}; "
                f"rename them in meta"
            )
        row: dict[str, Any] = {"id": self.uid}
        if self.prompt is not None:
            row["prompt"] = self.prompt
        else:
            row["messages"] = [dict(m) for m in self.messages]  # type: ignore[union-attr]
        row["answer"] = self.answer
        row.update(self.meta)
        return row


def records_digest(records: Iterable[PromptRecord]) -> str:
    """sha256 hex digest of the records' uid, prompt/messages and answer, in order.

    Two loads that give the same digest feed the same prompts with the same ids (meta is not included:
    it does not reach the model). Suitable for a run record / fingerprint. Text is hashed as UTF-8; a lone
    surrogate (``"\\ud800"``, in a record built in Python) as its ``surrogatepass`` bytes.
    """
    h = hashlib.sha256()
    for r in records:
        item = [r.uid, r.prompt, r.messages, r.answer]
        h.update(json.dumps(item, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
                 .encode("utf-8", "surrogatepass"))  # a lone surrogate: a digest, not a UnicodeEncodeError
        h.update(b"\n")
    return h.hexdigest()


def jsonl_bytes(records: Iterable[PromptRecord]) -> bytes:
    """The bytes :func:`write_jsonl` writes: one JSON line per record (UTF-8, ``\\n`` line ends)."""
    return b"".join(_json_line(r) for r in records)


def _json_line(record: PromptRecord) -> bytes:
    row = record.to_json_dict()
    try:
        line = json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:  # json's own message names neither the record nor the key
        bad = [k for k, v in row.items() if not _json_writable(v)]
        raise ValueError(f"PromptRecord {record.uid!r}: {', '.join(map(repr, bad)) or 'a value'} cannot be written "
                         f"as JSON ({e}); make meta values str, finite numbers, bools, None, lists or dicts (e.g. "
                         "str() of a timestamp)") from None
    try:
        return line.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: not UTF-8, and load_records refuses the row it would write
        bad = [k for k, v in row.items() if not _utf8(json.dumps(v, ensure_ascii=False))]
        where = ", ".join(map(repr, bad)) or "a column name"
        raise ValueError(f"PromptRecord {record.uid!r}: {where} holds a lone surrogate (like '\\ud800'), which is "
                         "not UTF-8, so the line cannot be written (load_records would refuse it). Fix: drop or "
                         "replace it, e.g. text.encode('utf-8', 'replace').decode()") from None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _json_writable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def write_jsonl(records: Iterable[PromptRecord], path: str | os.PathLike) -> Path:
    """Write records as JSON lines (``id``, ``prompt`` or ``messages``, ``answer``, then the meta keys).

    ``load_records(path, id_field="id")`` (or ``messages_field="messages"`` for chat records) reads them back
    equal. Written by ``rlrepro._files.atomic_write_bytes``: into a temporary ``.NAME.<random>.tmp`` beside it
    (the name ``run.overwrite`` cleans up), fsynced, renamed, the directory fsynced; a reader sees the old file or
    the complete new one.
    """
    from rlrepro._files import atomic_write_bytes

    data = jsonl_bytes(records)  # a record that cannot be written fails before any file is made
    atomic_write_bytes(path, data)
    return Path(path)
