"""Load prompt records from local files (or, when allowed, the Hugging Face hub) through ``datasets``.

Every local file goes through ``datasets.load_dataset`` (builders ``json`` and ``parquet``), one file at a time so
that an error can name the file and the row. Each load uses a fresh temporary cache directory: ``datasets``
keys its cache on a file's path and modification time, so a file rewritten in place could otherwise be served
stale from the cache, a silent change of the training data.

Row order is file order (sorted relative paths in a directory) then row order within a file. Without an
``id_field`` a record's uid is ``f"{source_name}:{row_index}"``: the file name (``train.jsonl:17``), or
``"{dir}/{relative path}"`` for a file in a directory, with the row index counted within that file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .records import PromptRecord, records_digest

__all__ = ["load_records", "LoadStats", "SkippedRow", "DATA_FILE_FORMATS"]

logger = logging.getLogger(__name__)

# file suffix -> datasets builder
DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
_SKIP_HINT = "or pass on_bad_row='skip' to skip such rows and count them in LoadStats"


@dataclass(frozen=True)
class SkippedRow:
    """A row left out under ``on_bad_row="skip"``. ``reason`` is a short category, ``detail`` the full message."""

    file: str
    row_index: int
    field: str | None
    reason: str
    detail: str


@dataclass
class LoadStats:
    """What a load read: the files (with sha256 of their bytes), row counts, skipped rows and warnings."""

    source: str
    split: str
    files: list[dict[str, Any]] = field(default_factory=list)
    num_rows: int = 0          # rows seen (kept + skipped)
    num_records: int = 0       # records returned
    skipped: list[SkippedRow] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    records_digest: str = ""   # records.records_digest of the returned records

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def skipped_by_reason(self) -> dict[str, int]:
        """Counts of skipped rows per reason, e.g. ``{"missing": 2, "empty": 1}``."""
        return dict(sorted(Counter(s.reason for s in self.skipped).items()))


class _BadRow(Exception):
    def __init__(self, field: str | None, reason: str, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.field, self.reason, self.problem, self.fix = field, reason, problem, fix


def load_records(
    source: str,
    *,
    split: str = "train",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    id_field: str | None = None,
    messages_field: str | None = None,
    on_bad_row: Literal["error", "skip"] = "error",
    allow_hub: bool = False,
    limit: int | None = None,
    hub_config: str | None = None,
    revision: str | None = None,
) -> tuple[list[PromptRecord], LoadStats]:
    """Load a data set into prompt records.

    ``source``: a local ``.jsonl`` / ``.json`` / ``.parquet`` file, or a directory of them (searched recursively,
    hidden entries ignored). In a directory, ``split`` picks the files under a folder named after it or whose
    name starts with it (``train.jsonl``, ``train-00000-of-00002.parquet``); a directory without split-named files
    is the ``train`` split. A single file is the whole data set whatever ``split`` says.
    With ``allow_hub=True`` a source that is not a local path is a hub dataset name (``hub_config``, ``revision``
    and ``split`` are passed on; pin ``revision`` for a reproducible run).

    Fields: ``prompt_field`` (text) or, when ``messages_field`` is given, a list of ``{"role", "content"}``
    chat turns instead; ``answer_field`` (text; numbers are converted with ``str``); ``id_field`` (optional,
    text or integer, must be unique). The row's other columns become ``record.meta``.

    A bad row (missing or empty value, wrong type, not UTF-8, a line that is not JSON) raises ``ValueError``
    naming the file, the row and the field; with ``on_bad_row="skip"`` it is skipped and listed in
    ``LoadStats.skipped``. A field absent from a whole file, duplicate uids, or no records at all always raise.
    ``limit`` keeps only the first ``limit`` records.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    for name, value in (("prompt_field", prompt_field), ("answer_field", answer_field),
                        ("id_field", id_field), ("messages_field", messages_field)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string{' or None' if name in ('id_field', 'messages_field') else ''}, "
                             f"got {value!r}")

    spec = _FieldSpec(prompt_field, answer_field, id_field, messages_field)
    stats = LoadStats(source=str(source), split=split)
    records: list[PromptRecord] = []
    seen_uids: dict[str, str] = {}

    path = Path(source)
    if path.exists():
        for file, source_name in _local_files(path, split):
            if limit is not None and len(records) >= limit:
                break
            _load_local_file(file, source_name, spec, on_bad_row, limit, stats, records, seen_uids)
    elif allow_hub:
        _load_hub(str(source), split, hub_config, revision, spec, on_bad_row, limit, stats, records, seen_uids)
    else:
        raise FileNotFoundError(
            f"data source {str(source)!r} does not exist locally (looked for {path.resolve()}). "
            f"Fix: give the path of a .jsonl/.json/.parquet file or a directory of them; to load a Hugging Face hub "
            f"dataset by name pass allow_hub=True (it needs network access or a populated HF cache)."
        )

    if not records:
        raise ValueError(
            f"no records loaded from {str(source)!r} (split {split!r}): {stats.num_rows} rows read, "
            f"{stats.num_skipped} skipped {stats.skipped_by_reason()}. Fix: check the path, split and field names."
        )
    stats.num_records = len(records)
    stats.records_digest = records_digest(records)
    for w in stats.warnings:
        logger.warning(w)
    if stats.skipped:
        logger.warning("skipped %d bad rows of %s: %s", stats.num_skipped, source, stats.skipped_by_reason())
    return records, stats


# ----------------------------------------------------------------------------------------------------- files


def _local_files(path: Path, split: str) -> list[tuple[Path, str]]:
    """(file, source_name) pairs in load order."""
    if path.is_file():
        if path.suffix.lower() not in DATA_FILE_FORMATS:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; supported: {sorted(DATA_FILE_FORMATS)}")
        return [(path, path.name)]
    root = path.resolve()
    files = sorted(
        (p for p in root.rglob("*")
         if p.is_file() and p.suffix.lower() in DATA_FILE_FORMATS
         and not any(part.startswith(".") for part in p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise ValueError(f"{path}: no data files in this directory (looked for {sorted(DATA_FILE_FORMATS)}, recursively)")
    rels = [f.relative_to(root).as_posix() for f in files]
    chosen = [f for f, rel in zip(files, rels) if _in_split(rel, split)]
    if not chosen:
        found = sorted({s for rel in rels for s in _KNOWN_SPLITS if _in_split(rel, s)})
        if not found and split == "train":
            chosen = files  # a directory without split names is one train split
        else:
            raise ValueError(
                f"{path}: no files for split {split!r}; splits found: {found or ['train (no split names)']}; "
                f"files: {rels[:10]}{' ...' if len(rels) > 10 else ''}. Fix: pass one of the splits found."
            )
    return [(f, f"{root.name}/{f.relative_to(root).as_posix()}") for f in chosen]


def _in_split(rel: str, split: str) -> bool:
    parts = rel.split("/")
    return split in parts[:-1] or re.match(rf"{re.escape(split)}([-_.]|$)", parts[-1]) is not None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_local_file(file: Path, source_name: str, spec: "_FieldSpec", on_bad_row: str, limit: int | None,
                     stats: LoadStats, records: list[PromptRecord], seen_uids: dict[str, str]) -> None:
    import datasets  # imported here: it is slow to import and only loading needs it

    builder = DATA_FILE_FORMATS[file.suffix.lower()]
    stats.files.append({"path": str(file), "sha256": _sha256_file(file)})
    if builder == "json" and not file.read_bytes().strip():
        stats.warnings.append(f"{file}: empty file, no rows")
        stats.files[-1]["num_rows"] = 0
        return

    row_map: list[int] | None = None  # row index in the cleaned copy -> row index in the file
    with tempfile.TemporaryDirectory(prefix="rlrepro-data-") as tmp:
        try:
            ds = datasets.load_dataset(builder, data_files=str(file), split="train", cache_dir=tmp)
        except Exception as e:  # datasets raises several kinds (DatasetGenerationError, UnicodeDecodeError, ...)
            if builder != "json":
                raise ValueError(f"{file}: datasets could not read this {builder} file ({_describe(e)}). "
                                 f"Fix: rewrite it with pyarrow/pandas as a valid parquet file.") from e
            bad_lines = _scan_json_lines(file)
            if not bad_lines:
                raise ValueError(f"{file}: datasets could not read this JSON file ({_describe(e)}). Fix: write one "
                                 f"JSON object per line (.jsonl) or a JSON array of objects (.json), UTF-8.") from e
            if on_bad_row == "error":
                row, line_no, reason, problem = bad_lines[0]
                raise ValueError(f"{file}: row {row} (line {line_no}): {problem}. Fix: correct or remove that line "
                                 f"(the file must be UTF-8 JSON, one object per line), {_SKIP_HINT}.") from e
            clean, row_map = _clean_copy(file, Path(tmp), bad_lines, stats)
            ds = None
            if row_map:
                ds = datasets.load_dataset("json", data_files=str(clean), split="train", cache_dir=tmp + "/cache")
        columns, rows = _rows_as_python(ds, spec, str(file), stats) if ds is not None else ([], [])

    stats.files[-1]["num_rows"] = len(rows) + (0 if row_map is None else len(bad_lines))
    stats.num_rows += len(rows)
    if not rows:
        stats.warnings.append(f"{file}: no rows")
        return
    spec.check_columns(columns, str(file))
    for i, row in enumerate(rows):
        if limit is not None and len(records) >= limit:
            break
        row_index = i if row_map is None else row_map[i]
        _add_row(row, row_index, str(file), source_name, spec, on_bad_row, stats, records, seen_uids)


def _load_hub(source: str, split: str, hub_config: str | None, revision: str | None, spec: "_FieldSpec",
              on_bad_row: str, limit: int | None, stats: LoadStats, records: list[PromptRecord],
              seen_uids: dict[str, str]) -> None:
    import datasets

    try:
        ds = datasets.load_dataset(source, hub_config, split=split, revision=revision)
    except Exception as e:
        raise ValueError(f"could not load hub dataset {source!r} (config {hub_config!r}, split {split!r}, revision "
                         f"{revision!r}): {_describe(e)}. Fix: check the name, config and split, and that the hub "
                         f"is reachable or the dataset is in the HF cache.") from e
    label = f"{source} (split {split})"
    source_name = "/".join(x for x in (source, hub_config, split) if x)
    stats.files.append({"path": source, "config": hub_config, "revision": revision, "split": split,
                        "fingerprint": getattr(ds, "_fingerprint", None), "num_rows": len(ds)})
    columns, rows = _rows_as_python(ds, spec, label, stats)
    stats.num_rows += len(rows)
    spec.check_columns(columns, label)
    for i, row in enumerate(rows):
        if limit is not None and len(records) >= limit:
            break
        _add_row(row, i, label, source_name, spec, on_bad_row, stats, records, seen_uids)


def _describe(e: BaseException) -> str:
    cause = e.__cause__ or e.__context__
    text = f"{type(e).__name__}: {e}"
    if cause is not None:
        text += f"; caused by {type(cause).__name__}: {cause}"
    return text[:800]


def _scan_json_lines(file: Path) -> list[tuple[int, int, str, str]]:
    """Find the lines pyarrow's JSON reader rejects: (row index, 1-based line number, reason, problem).

    Row indices count non-blank lines, as ``datasets`` does. Only for one-object-per-line files; a JSON array
    file gives no per-line diagnosis.
    """
    data = file.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if data.lstrip().startswith(b"["):
        return []
    bad = []
    row = 0
    for line_no, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        problem = None
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = ("not UTF-8", f"the line is not valid UTF-8 ({e.reason} at byte {e.start})")
        except ValueError as e:
            problem = ("invalid JSON", f"the line is not valid JSON ({e})")
        else:
            if not isinstance(obj, dict):
                problem = ("invalid JSON", f"the line is a JSON {type(obj).__name__}, not an object")
            elif not _utf8_encodable(obj):
                problem = ("not UTF-8", "a string holds a lone surrogate escape (like \\ud800), which is not UTF-8")
        if problem:
            bad.append((row, line_no, problem[0], problem[1]))
        row += 1
    return bad


def _utf8_encodable(obj: Any) -> bool:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(obj, dict):
        return all(_utf8_encodable(k) and _utf8_encodable(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_utf8_encodable(v) for v in obj)
    return True


def _clean_copy(file: Path, tmp: Path, bad_lines: list[tuple[int, int, str, str]],
                stats: LoadStats) -> tuple[Path, list[int]]:
    """Copy a JSON-lines file without its bad lines (recorded as skipped); return it and its row map."""
    bad_rows = {b[0] for b in bad_lines}
    for row, line_no, reason, problem in bad_lines:
        stats.skipped.append(SkippedRow(str(file), row, None, reason, f"{file}: row {row} (line {line_no}): {problem}"))
    stats.num_rows += len(bad_lines)
    data = file.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    kept, row_map, row = [], [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        if row not in bad_rows:
            kept.append(line)
            row_map.append(row)
        row += 1
    clean = tmp / ("clean-" + file.name.rsplit(".", 1)[0] + ".jsonl")
    clean.write_bytes(b"\n".join(kept) + b"\n")
    return clean, row_map


def _rows_as_python(ds: Any, spec: "_FieldSpec", label: str, stats: LoadStats) -> tuple[list[str], list[dict]]:
    """The data set's column names and rows as Python dicts, undoing datasets' lossy JSON typing where it can.

    ``datasets`` stores a JSON column whose values mix types (strings and numbers, say) as JSON text and
    decodes it with a JSON parser, which turns the string "007" into 7. For the text fields (prompt, answer,
    id) the stored text is read instead: a string comes back as written (a string that is itself valid JSON
    text, e.g. "[1, 2]", is stored as is), a number as its JSON text.
    """
    import datasets

    columns = list(ds.column_names)
    features = ds.features
    try:
        rows = ds.to_list()
    except UnicodeDecodeError:
        # pyarrow's JSON reader does not validate UTF-8, so invalid bytes reach the string columns and fail
        # here; convert column by column and mark the undecodable values, which _add_row reports per row
        rows = [{} for _ in range(len(ds))]
        for col in columns:
            values = _column_to_pylist(ds.data.column(col))
            decode = features[col].decode_example if isinstance(features.get(col), datasets.Json) else None
            for row, value in zip(rows, values):
                row[col] = decode(value) if decode is not None and isinstance(value, str) else value
    for col in spec.text_fields():
        feat = features.get(col)
        if feat is None:
            continue
        if isinstance(feat, datasets.Json):
            raw = _column_to_pylist(ds.data.column(col))
            for row, text in zip(rows, raw):
                row[col] = _json_storage_text(text)
            stats.warnings.append(
                f"{label}: column {col!r} mixes value types across rows; numbers, booleans, lists and objects in it "
                f"are read as their JSON text. Fix: write every {col!r} value as a string.")
        elif isinstance(feat, datasets.Value) and feat.dtype in ("binary", "large_binary"):
            stats.warnings.append(f"{label}: column {col!r} holds bytes; they are decoded as UTF-8.")
        elif isinstance(feat, datasets.Value) and feat.dtype.startswith(("float", "double", "decimal")):
            stats.warnings.append(
                f"{label}: column {col!r} has type {feat.dtype}; its values are converted to text with str() "
                f"(1 written as 1.0 becomes '1.0'). Fix: write the values as strings to control the exact text.")
    return columns, rows


class _NotUTF8:
    """Stands for a stored string whose bytes are not valid UTF-8."""

    def __init__(self, error: UnicodeDecodeError) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<not UTF-8: {self.error.reason} at byte {self.error.start}>"


def _column_to_pylist(column: Any) -> list[Any]:
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        out: list[Any] = []
        for chunk in column.chunks:
            for j in range(len(chunk)):
                try:
                    out.append(chunk[j].as_py())
                except UnicodeDecodeError as e:
                    out.append(_NotUTF8(e))
        return out


def _json_storage_text(text: Any) -> Any:
    if not isinstance(text, str) or not text.startswith('"'):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


# ------------------------------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class _FieldSpec:
    prompt_field: str
    answer_field: str
    id_field: str | None
    messages_field: str | None

    def text_fields(self) -> list[str]:
        fields = [self.answer_field] if self.messages_field else [self.prompt_field, self.answer_field]
        return fields + ([self.id_field] if self.id_field else [])

    def used(self) -> list[tuple[str, str, str]]:
        """(column, role, parameter name) of the columns read."""
        out = [(self.messages_field, "messages", "messages_field") if self.messages_field
               else (self.prompt_field, "prompt", "prompt_field"),
               (self.answer_field, "answer", "answer_field")]
        if self.id_field:
            out.append((self.id_field, "id", "id_field"))
        return out

    def check_columns(self, columns: list[str], label: str) -> None:
        for col, role, param in self.used():
            if col not in columns:
                raise ValueError(f"{label}: the {role} field {col!r} is not in the data set; fields that exist: "
                                 f"{columns}. Fix: pass {param}=<one of those>.")


def _add_row(row: dict, row_index: int, label: str, source_name: str, spec: _FieldSpec, on_bad_row: str,
             stats: LoadStats, records: list[PromptRecord], seen_uids: dict[str, str]) -> None:
    try:
        record = _row_to_record(row, row_index, source_name, spec)
    except _BadRow as bad:
        where = f"{label}: row {row_index}"
        if on_bad_row == "error":
            raise ValueError(f"{where}: field {bad.field!r}: {bad.problem}. Fix: {bad.fix}, {_SKIP_HINT}.") from None
        stats.skipped.append(SkippedRow(label, row_index, bad.field, bad.reason,
                                        f"{where}: field {bad.field!r}: {bad.problem}"))
        return
    previous = seen_uids.get(record.uid)
    if previous is not None:
        raise ValueError(
            f"duplicate uid {record.uid!r} at {label} row {row_index} and at {previous}. Uids key the sampling seeds "
            f"and the sample order, so they must be unique. Fix: make the {spec.id_field!r} column unique, or pass "
            f"id_field=None to use '<source>:<row index>' uids.")
    seen_uids[record.uid] = f"{label} row {row_index}"
    records.append(record)


def _row_to_record(row: dict, row_index: int, source_name: str, spec: _FieldSpec) -> PromptRecord:
    for col, value in row.items():
        if isinstance(value, _NotUTF8):
            raise _BadRow(col, "not UTF-8", f"the text is not valid UTF-8 ({value.error.reason} at byte "
                          f"{value.error.start})", "re-encode the file as UTF-8")
    if spec.messages_field:
        messages = _as_messages(row.get(spec.messages_field), spec.messages_field)
        prompt = None
    else:
        prompt = _as_text(row.get(spec.prompt_field), spec.prompt_field, "prompt")
        messages = None
    answer = _as_text(row.get(spec.answer_field), spec.answer_field, "answer")
    if spec.id_field:
        uid = _as_text(row.get(spec.id_field), spec.id_field, "id")
    else:
        uid = f"{source_name}:{row_index}"
    used = {c for c, _, _ in spec.used()}
    meta = {k: v for k, v in row.items() if k not in used}
    return PromptRecord(uid=uid, prompt=prompt, messages=messages, answer=answer, meta=meta)


def _as_text(value: Any, field: str, role: str) -> str:
    fix = f"give every row a non-empty text {role} in {field!r}"
    if value is None:
        raise _BadRow(field, "missing", "the value is missing (null or absent)", fix)
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _BadRow(field, "not UTF-8", f"the bytes are not valid UTF-8 ({e.reason} at byte {e.start})",
                          "re-encode the text as UTF-8") from None
    if isinstance(value, bool):
        raise _BadRow(field, "wrong type", f"expected text, got a boolean ({value!r})", fix)
    if isinstance(value, numbers.Integral):
        value = str(int(value))
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise _BadRow(field, "wrong type", f"expected text, got the number {value!r}", fix)
        value = str(float(value))
    if not isinstance(value, str):
        raise _BadRow(field, "wrong type", f"expected text, got {type(value).__name__} ({_short(value)})", fix)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadRow(field, "not UTF-8", "the text holds a lone surrogate, which is not UTF-8",
                      "re-encode the text as UTF-8") from None
    if not value.strip():
        raise _BadRow(field, "empty", f"the {role} is empty" + (" (only whitespace)" if value else ""), fix)
    return value


def _as_messages(value: Any, field: str) -> list[dict[str, str]]:
    fix = f"give every row in {field!r} a non-empty list of {{'role': str, 'content': str}} turns"
    if value is None:
        raise _BadRow(field, "missing", "the value is missing (null or absent)", fix)
    if not isinstance(value, list):
        raise _BadRow(field, "wrong type", f"expected a list of chat turns, got {type(value).__name__}", fix)
    if not value:
        raise _BadRow(field, "empty", "the list of chat turns is empty", fix)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _BadRow(field, "wrong type", f"turn {i} is {type(m).__name__}, not a dict", fix)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise _BadRow(field, "wrong type", f"turn {i} needs a string 'role' and 'content', got {_short(m)}", fix)
        if not _utf8_encodable(content) or not _utf8_encodable(role):
            raise _BadRow(field, "not UTF-8", f"turn {i} holds a lone surrogate, which is not UTF-8",
                          "re-encode the text as UTF-8")
        out.append({"role": role, "content": content})  # other keys (tool calls, names) are not used
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
