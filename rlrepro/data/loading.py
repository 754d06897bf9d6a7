"""Load prompt records from local files (or, when allowed, the Hugging Face hub) through ``datasets``.

Every local file goes through ``datasets.load_dataset`` (builders ``json`` and ``parquet``), one file at a time so
that an error can name the file and the row. Each load uses a fresh temporary cache directory: ``datasets``
keys its cache on a file's path and modification time, so a file rewritten in place could otherwise be served
stale from the cache, a silent change of the training data.

Row order is file order (sorted relative paths in a directory) then row order within a file. Without an
``id_field`` a record's uid is ``f"{source_name}:{row_index}"``: the file name (``train.jsonl:17``), or
``"{dir}/{relative path}"`` for a file in a directory, with the 0-based row index counted within that file.

Messages are written for the person who typed the command line: they name the config key of the fix
(``data.on_bad_row=skip``) and the ``key=value`` at fault, and place a row where that person finds it
in the file: ``line N`` (1-based, blank lines counted) in a JSON-lines file, ``row N`` (1-based) in a parquet
file, a JSON array or a hub data set.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import tempfile
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from .jsonlines import blank_lines, empty_array, kept_rows, scan_lines
from .records import PromptRecord, records_digest
from .rows import (BadRow, FieldSpec, NotUTF8, RowPositions, array_as_lines, array_bad_rows, exact_json_numbers,
                   field_value, has_float, has_surrogate_escape, json_array_rows, narrow_floats, nested_columns,
                   row_to_record, utf8_encodable)
from .sources import DATA_FILE_FORMATS, local_files

__all__ = ["load_records", "LoadStats", "SkippedRow", "DATA_FILE_FORMATS", "MAX_LINE_BYTES"]

logger = logging.getLogger(__name__)

# the longest JSON line read: 16 MiB holds a prompt of 32,768 tokens at 64 characters of 4 UTF-8 bytes each, with
# as much again for the answer and other columns. A longer line is refused before it is parsed (a 50 MB line took
# 248 s and 19.4 GB through datasets and the tokenizer).
MAX_LINE_BYTES = 16 << 20
_SKIP_HINT = "or set data.on_bad_row=skip to leave such rows out (each one is logged)"


_Seen = dict[str, tuple[str, RowPositions, int]]  # uid -> (label, positions, row index) of its first row


@dataclass(frozen=True)
class SkippedRow:
    """A row left out under ``on_bad_row="skip"``. ``reason`` is a short category, ``detail`` the full message.

    ``row_index`` is 0-based among the file's rows (as in uids: ``train.jsonl:5``); ``position`` is where a person
    finds the row: ``"line 6"`` in a JSON-lines file, ``"row 6"`` in a parquet file, JSON array or hub data set.
    """

    file: str
    row_index: int
    field: str | None
    reason: str
    detail: str
    position: str = ""


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
    max_line_bytes: int | None = MAX_LINE_BYTES,
) -> tuple[list[PromptRecord], LoadStats]:
    """Load a data set into prompt records.

    ``source``: a local ``.jsonl`` / ``.json`` / ``.parquet`` file, or a directory of them (searched recursively,
    hidden entries ignored). In a directory, ``split`` picks the files under a folder named after it or whose
    name starts with it (``train.jsonl``, ``train-00000-of-00002.parquet``); a directory without split-named files
    is the ``train`` split. Each file is in one split, a split folder winning over its name (rule: ``sources``).
    A single file is the whole data set whatever ``split`` says.
    With ``allow_hub=True`` a source that is not a local path is a hub dataset name (``hub_config``, ``revision``
    and ``split`` are passed on; pin ``revision`` for a reproducible run).

    Fields: ``prompt_field`` (text) or, when ``messages_field`` is given, a list of ``{"role", "content"}``
    chat turns instead; ``answer_field`` (text; numbers are converted with ``str``); ``id_field`` (optional,
    text or integer, must be unique). A field may be a dotted path into a struct column
    (``reward_model.ground_truth``); a text value in ``messages_field`` is a plain prompt. The row's other columns
    become ``record.meta``.

    A bad row (missing or empty value, wrong type, not UTF-8, a line that is not JSON) raises ``ValueError``
    naming the file, the row and the field; with ``on_bad_row="skip"`` it is skipped and listed in
    ``LoadStats.skipped``. A field absent from a whole file, duplicate uids, or no records at all always raise.
    ``limit`` keeps only the first ``limit`` records.

    JSON-lines files are read line by line first: a line longer than ``max_line_bytes`` bytes (None: no limit)
    is a bad row refused with its line number before anything parses it (skipped under ``on_bad_row="skip"``).
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"data.on_bad_row={on_bad_row!r} is not a choice: it must be error or skip. "
                         f"Fix: set data.on_bad_row=error or data.on_bad_row=skip.")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"data.limit={limit!r} is not a positive integer. Fix: set data.limit=N (keep the first N "
                         f"records) or data.limit=null (keep all).")
    if max_line_bytes is not None and (isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int)
                                       or max_line_bytes < 1):
        raise ValueError(f"max_line_bytes must be a positive integer or None, got {max_line_bytes!r}")
    for name, value in (("prompt_field", prompt_field), ("answer_field", answer_field),
                        ("id_field", id_field), ("messages_field", messages_field)):
        if value is not None and (not isinstance(value, str) or not value):
            optional = f", or data.{name}=null" if name in ("id_field", "messages_field") else ""
            raise ValueError(f"data.{name}={value!r} is not a column name (it must be a non-empty string). "
                             f"Fix: set data.{name}=<a column of the data set>{optional}.")

    spec = FieldSpec(prompt_field, answer_field, id_field, messages_field)
    stats = LoadStats(source=str(source), split=split)
    records: list[PromptRecord] = []
    seen_uids: _Seen = {}

    path = Path(source)
    if path.exists():
        for file, source_name in local_files(path, split):
            if limit is not None and len(records) >= limit:
                break
            _load_local_file(file, source_name, spec, on_bad_row, limit, stats, records, seen_uids, max_line_bytes)
    elif allow_hub:
        _load_hub(str(source), split, hub_config, revision, spec, on_bad_row, limit, stats, records, seen_uids)
    else:
        raise FileNotFoundError(
            f"data.source={str(source)!r} does not exist locally (looked for {path.resolve()}). "
            f"Fix: set data.source to the path of a .jsonl/.json/.parquet file or a directory of them; to load a "
            f"Hugging Face hub dataset by name, set data.allow_hub=true (it needs network access or a populated "
            f"HF cache)."
        )

    if not records:
        reasons = ", ".join(f"{n} {why}" for why, n in stats.skipped_by_reason().items())
        raise ValueError(
            f"no records loaded from data.source={str(source)!r} (data.split={split}): {stats.num_rows} rows read, "
            f"{stats.num_skipped} skipped{f' ({reasons})' if reasons else ''}. Fix: check data.source, data.split "
            f"and the field names (data.prompt_field, data.answer_field, data.messages_field)."
        )
    stats.num_records = len(records)
    stats.records_digest = records_digest(records)
    for w in stats.warnings:
        logger.warning(w)
    if stats.skipped:
        logger.warning("data.on_bad_row=skip: left out %d bad row(s) of %s: %s; first: %s", stats.num_skipped,
                       source, stats.skipped_by_reason(), stats.skipped[0].detail)
    return records, stats


# ----------------------------------------------------------------------------------------------------- files


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# datasets' json builder logs "Failed to load JSON from file ..." (its ERROR) before it raises; rlrepro turns that
# exception into its own message naming the line and the fix, so the builder's line is noise before it
_JSON_BUILDER_LOGGER = "datasets.packaged_modules.json.json"


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """``datasets`` without its progress bars ("Generating train split: ...") for one local load, then as it
    was, and without its json builder's error line (rlrepro's own error follows, naming the line). Its other
    logging is left alone; HF_DATASETS_DISABLE_PROGRESS_BARS=0 keeps the bars."""
    builder_log = logging.getLogger(_JSON_BUILDER_LOGGER)
    level = builder_log.level
    builder_log.setLevel(logging.CRITICAL)
    try:
        with _no_progress_bars():
            yield
    finally:
        builder_log.setLevel(level)


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    import datasets

    if datasets.are_progress_bars_disabled():
        yield
        return
    with warnings.catch_warnings():  # datasets warns when the environment variable forces the bars on
        warnings.simplefilter("ignore")
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            datasets.enable_progress_bars()


def _load_local_file(file: Path, source_name: str, spec: FieldSpec, on_bad_row: str, limit: int | None,
                     stats: LoadStats, records: list[PromptRecord], seen_uids: _Seen,
                     max_line_bytes: int | None = MAX_LINE_BYTES) -> None:
    builder = DATA_FILE_FORMATS[file.suffix.lower()]
    stats.files.append({"path": str(file), "sha256": _sha256_file(file)})
    lines = scan_lines(file, max_line_bytes) if builder == "json" else None  # in chunks, holding no line
    if lines is not None and (lines.blank or (lines.array and empty_array(file))):
        stats.warnings.append(f"{file}: {'empty file' if lines.blank else 'an empty JSON array'}, no rows")
        stats.files[-1]["num_rows"] = 0
        return
    if builder == "parquet" and _parquet_num_rows(file) == 0:  # datasets refuses one ("BatchSize must be > 0")
        stats.warnings.append(f"{file}: a parquet file with no rows")
        stats.files[-1]["num_rows"] = 0
        return

    row_map: list[int] | None = None  # row index in the cleaned copy -> row index in the file
    long_rows: list[int] = []         # rows (of the file) whose line is over max_line_bytes, never parsed
    with tempfile.TemporaryDirectory(prefix="rlrepro-data-") as tmp, _quiet_datasets():
        import datasets  # imported here: it is slow to import and only loading needs it

        src = loaded = file
        if lines is not None and lines.long:
            row, line_no, size = lines.long[0]
            problem = (f"the line is {size} bytes, over the limit of {max_line_bytes} bytes; it was not parsed")
            if on_bad_row == "error":
                raise ValueError(f"{file}: line {line_no}: {problem}. Fix: shorten or remove that line (a row that "
                                 f"long cannot be a prompt), {_SKIP_HINT}.")
            for row, line_no, size in lines.long:
                stats.skipped.append(SkippedRow(str(file), row, None, "too long",
                                                f"{file}: line {line_no}: the line is {size} bytes, over the limit "
                                                f"of {max_line_bytes} bytes; it was not parsed", f"line {line_no}"))
            stats.num_rows += len(lines.long)
            long_rows = [row for row, _, _ in lines.long]
            src = loaded = blank_lines(file, Path(tmp) / ("short-" + file.name.rsplit(".", 1)[0] + ".jsonl"),
                                       {line_no for _, line_no, _ in lines.long})
        try:
            if builder == "json" and _has_lone_surrogate(src):
                # datasets may drop such an escape silently (a mixed-type column, a JSON array): the scan names it
                raise ValueError("a row holds a lone surrogate escape")
            ds, loaded = _load(datasets, builder, src, Path(tmp), lines is not None and bool(lines.array))
            if lines is not None:  # an array read as lines is no longer one
                lines.array = lines.array and loaded == src
        except Exception as e:  # datasets raises several kinds (DatasetGenerationError, UnicodeDecodeError, ...)
            if builder != "json":
                raise ValueError(f"{file}: datasets could not read this {builder} file ({_describe(e)}). "
                                 f"Fix: rewrite it with pyarrow/pandas as a valid parquet file.") from e
            bad_lines = _original_rows(_scan_json_lines(src, arrays=True), long_rows)
            if not bad_lines and _only_empty_objects(src):
                raise ValueError(_no_columns_message(file, spec)) from e
            if not bad_lines:
                raise ValueError(f"{file}: datasets could not read this JSON file ({_describe(e)}). Fix: write one "
                                 f"JSON object per line (.jsonl) or a JSON array of objects (.json), UTF-8.") from e
            if on_bad_row == "error":
                row, line_no, reason, problem = bad_lines[0]
                unit, form = ("row", "an array of objects") if lines.array else ("line", "one object per line")
                raise ValueError(f"{file}: {unit} {line_no}: {problem}. Fix: correct or remove that {unit} "
                                 f"(the file must be UTF-8 JSON, {form}), {_SKIP_HINT}.") from e
            clean, row_map = _clean_copy(src, Path(tmp), bad_lines, stats, file, long_rows, lines.array)
            if lines.array:  # scan_lines counts no rows in an array
                lines.num_rows = len(row_map) + len(bad_lines)
            ds, loaded = _load(datasets, "json", clean, Path(tmp) / "cache", lines.array) if row_map else (None, clean)
            lines.array = lines.array and loaded == clean
        if row_map is None and long_rows:
            row_map = kept_rows(long_rows, lines.num_rows - len(long_rows))
        json_src = (loaded, bool(lines.array)) if lines is not None else None  # the file datasets read, if JSON
        columns, rows = _rows_as_python(ds, spec, str(file), stats, json_src) if ds is not None else ([], [])

    stats.files[-1]["num_rows"] = len(rows) if row_map is None else lines.num_rows
    stats.num_rows += len(rows)
    if not rows:
        stats.warnings.append(f"{file}: no rows")
        return
    spec.check_columns(columns, str(file))
    where = RowPositions(file, stats.files[-1]["num_rows"])
    for i, row in enumerate(rows):
        if limit is not None and len(records) >= limit:
            break
        row_index = i if row_map is None else row_map[i]
        _add_row(row, row_index, str(file), where, source_name, spec, on_bad_row, stats, records, seen_uids)


def _load(datasets: Any, builder: str, src: Path, tmp: Path, array: bool) -> tuple[Any, Path]:
    """``src`` loaded by ``datasets``, and the file it read: an ``array`` that pyarrow refused (an integer past int64
    inside a struct) is read from a JSON-lines copy of its rows (its numbers then put back: ``exact_json_numbers``)."""
    try:
        return datasets.load_dataset(builder, data_files=str(src), split="train", cache_dir=str(tmp)), src
    except Exception as e:
        if not array:
            raise
        try:
            copy = array_as_lines(src, tmp / "rows.jsonl")
            return datasets.load_dataset("json", data_files=str(copy), split="train", cache_dir=str(tmp / "l")), copy
        except Exception:
            pass
        raise  # the array's own error: the caller's scan names a bad row


def _parquet_num_rows(file: Path) -> int | None:
    """The number of rows in the footer of a parquet file; None when it cannot be read (datasets then says why)."""
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    except Exception:  # a damaged file: the load that follows names it
        return None


def _has_lone_surrogate(file: Path) -> bool:
    """Whether a JSON file has a row whose JSON holds a lone surrogate (``\\ud800`` alone: not UTF-8). Only a file
    whose bytes hold a surrogate escape is parsed, line by line or, for a JSON array, whole (a pair, like an
    emoji's ``\\ud83d\\ude00``, is valid)."""
    return has_surrogate_escape(file) and any(reason == "not UTF-8"
                                              for _, _, reason, _ in _scan_json_lines(file, arrays=True))


def _original_rows(bad_lines: list[tuple[int, int, str, str]],
                   long_rows: list[int]) -> list[tuple[int, int, str, str]]:
    """Row indices of a copy whose ``long_rows`` were emptied (no longer rows there) back to the file's."""
    if not long_rows:
        return bad_lines
    kept = kept_rows(long_rows, max((b[0] for b in bad_lines), default=-1) + 1)
    return [(kept[row], line_no, reason, problem) for row, line_no, reason, problem in bad_lines]


def _load_hub(source: str, split: str, hub_config: str | None, revision: str | None, spec: FieldSpec,
              on_bad_row: str, limit: int | None, stats: LoadStats, records: list[PromptRecord],
              seen_uids: _Seen) -> None:
    import datasets

    try:
        ds = datasets.load_dataset(source, hub_config, split=split, revision=revision)
    except Exception as e:
        raise ValueError(f"could not load hub dataset {source!r} (config {hub_config!r}, split {split!r}, revision "
                         f"{revision!r}): {_describe(e)}. Fix: check data.source (the dataset name), data.split and "
                         f"data.revision (and hub_config), and that the hub is reachable or the dataset is in the HF "
                         f"cache.") from e
    label = f"{source} (split {split})"
    source_name = "/".join(x for x in (source, hub_config, split) if x)
    stats.files.append({"path": source, "config": hub_config, "revision": revision, "split": split,
                        "fingerprint": getattr(ds, "_fingerprint", None), "num_rows": len(ds)})
    columns, rows = _rows_as_python(ds, spec, label, stats)
    stats.num_rows += len(rows)
    spec.check_columns(columns, label)
    where = RowPositions()
    for i, row in enumerate(rows):
        if limit is not None and len(records) >= limit:
            break
        _add_row(row, i, label, where, source_name, spec, on_bad_row, stats, records, seen_uids)


def _describe(e: BaseException) -> str:
    cause = e.__cause__ or e.__context__
    text = f"{type(e).__name__}: {e}"
    if cause is not None:
        text += f"; caused by {type(cause).__name__}: {cause}"
    return text[:800]


def _only_empty_objects(file: Path) -> bool:
    """Whether every row of a JSON file (one object per line, or an array) is the empty object ``{}``: rows
    without columns, which ``datasets`` reads as no data at all."""
    try:
        if scan_lines(file).array:
            rows = json.loads(file.read_text(encoding="utf-8-sig"))
            return isinstance(rows, list) and bool(rows) and all(r == {} for r in rows)
        seen = False
        with open(file, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                line = line[3:] if line_no == 1 and line.startswith(b"\xef\xbb\xbf") else line
                if not line.strip():
                    continue
                if json.loads(line.decode("utf-8")) != {}:
                    return False
                seen = True
        return seen
    except (ValueError, OSError):  # not JSON after all (UnicodeDecodeError is a ValueError): the generic message
        return False


def _no_columns_message(file: Path, spec: FieldSpec) -> str:
    used = spec.used()
    names = [f"the {role} field {col!r} (data.{param})" for col, role, param in used]
    missing = ", ".join(names[:-1]) + " and " + names[-1]  # the prompt (or messages) and answer fields at least
    example = "{" + ", ".join(f'"{col}": ...' for col, _, _ in used) + "}"
    return (f"{file}: the rows have no columns (every row is an empty JSON object {{}}), so {missing} are "
            f"missing. Fix: give every row its fields, e.g. {example}, or point data.source at the file that holds "
            f"them.")


def _scan_json_lines(file: Path, arrays: bool = False) -> list[tuple[int, int, str, str]]:
    """Find the lines pyarrow's JSON reader rejects: (row index, 1-based line number, reason, problem).

    Row indices count non-blank lines, as ``datasets`` does. A JSON array file has no lines: with ``arrays`` its
    rows that are no object or hold a lone surrogate escape are given (1-based row numbers for line numbers).
    """
    if scan_lines(file).array:
        return array_bad_rows(file) if arrays else []
    bad = []
    row = 0
    with open(file, "rb") as f:  # line by line: the lines over max_line_bytes were emptied before
        for line_no, line in enumerate(f, start=1):
            line = (line[3:] if line_no == 1 and line.startswith(b"\xef\xbb\xbf") else line).rstrip(b"\n")
            if not line.strip():
                continue
            problem = _line_problem(line)
            if problem:
                bad.append((row, line_no, problem[0], problem[1]))
            row += 1
    return bad


def _line_problem(line: bytes) -> tuple[str, str] | None:
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return "not UTF-8", f"the line is not valid UTF-8 ({e.reason} at byte {e.start})"
    except ValueError as e:  # json's own "line 1 column 12" counts within the line: give the column only
        why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        return "invalid JSON", f"the line is not valid JSON ({why})"
    if not isinstance(obj, dict):
        return "invalid JSON", f"the line is a JSON {type(obj).__name__}, not an object"
    if not utf8_encodable(obj):
        return "not UTF-8", "a string holds a lone surrogate escape (like \\ud800), which is not UTF-8"
    return None


def _clean_copy(src: Path, tmp: Path, bad_lines: list[tuple[int, int, str, str]], stats: LoadStats,
                file: Path | None = None, long_rows: list[int] = (), array: bool = False) -> tuple[Path, list[int]]:
    """Copy a JSON-lines file without its bad lines (recorded as skipped); return it and its row map (row of the
    copy -> row of ``file``). ``src`` is ``file`` or a copy of it with ``long_rows`` emptied; ``bad_lines`` hold
    rows of ``file``. Streamed line by line. An ``array`` file is copied as a JSON array of its other rows."""
    file, unit = file or src, "row" if array else "line"
    bad_rows = {b[0] for b in bad_lines}
    for row, line_no, reason, problem in bad_lines:
        stats.skipped.append(SkippedRow(str(file), row, None, reason, f"{file}: {unit} {line_no}: {problem}",
                                        f"{unit} {line_no}"))
    stats.num_rows += len(bad_lines)
    gone = set(long_rows)
    clean = tmp / ("clean-" + file.name.rsplit(".", 1)[0] + (".json" if array else ".jsonl"))
    if array:  # the kept rows as written: datasets reads them as it reads the file
        kept = [(row, text) for row, (_, text) in enumerate(json_array_rows(src)) if row not in bad_rows]
        clean.write_text("[" + ",\n".join(text for _, text in kept) + "]\n", encoding="utf-8")
        return clean, [row for row, _ in kept]
    row_map, row = [], 0
    with open(src, "rb") as f, open(clean, "wb") as out:
        for n, line in enumerate(f):
            if n == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue
            while row in gone:  # emptied in src: no longer a line there, still a row of the file
                row += 1
            if row not in bad_rows:
                out.write(line.rstrip(b"\n") + b"\n")
                row_map.append(row)
            row += 1
    return clean, row_map


def _rows_as_python(ds: Any, spec: FieldSpec, label: str, stats: LoadStats,
                    json_src: tuple[Path, bool] | None = None) -> tuple[list[str], list[dict]]:
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
    columns += [c for c in nested_columns(features) if c not in columns]  # reward_model.ground_truth: a field path
    float_cols = []  # text fields pyarrow read as floats, whose numbers a JSON file holds as written
    for col in spec.text_fields():
        feat = features.get(col)
        if feat is None:
            nested = field_value(features, col)  # a field path into a struct's features: a float there is str()'d too
            if isinstance(nested, datasets.Value) and nested.dtype.startswith(("float", "double", "decimal")):
                stats.warnings.append(_float_text_warning(label, col, nested.dtype))
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
            if json_src is not None:
                float_cols.append(col)
            elif feat.dtype in ("float16", "float32"):
                narrow_floats(rows, col, feat.dtype)
            stats.warnings.append(_float_text_warning(label, col, feat.dtype))
    if json_src is not None:  # numbers inside struct and list columns (reward_model.ground_truth, meta) too
        float_cols += [c for c in ds.column_names if c not in float_cols and has_float(features[c])
                       and not isinstance(features[c], (datasets.Value, datasets.Json))]
    if float_cols:  # the numbers as written: 3 next to 0.5 stays '3', big integers exact (one parse of the file)
        exact_json_numbers(json_src[0], rows, float_cols, json_src[1])
    return columns, rows


def _float_text_warning(label: str, col: str, dtype: str) -> str:
    return (f"{label}: column {col!r} has type {dtype}; its values are converted to text with str() (1 written as 1.0 "
            "becomes '1.0'). Fix: write the values as strings to control the exact text.")


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
                    out.append(NotUTF8(e))
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


def _add_row(row: dict, row_index: int, label: str, where: RowPositions, source_name: str, spec: FieldSpec,
             on_bad_row: str, stats: LoadStats, records: list[PromptRecord], seen_uids: _Seen) -> None:
    try:
        record = row_to_record(row, row_index, source_name, spec)
    except BadRow as bad:
        position = where(row_index)
        text = f"{label}: {position}: field {bad.field!r}: {bad.problem}"
        if on_bad_row == "error":
            raise ValueError(f"{text}. Fix: {bad.fix}, {_SKIP_HINT}.") from None
        stats.skipped.append(SkippedRow(label, row_index, bad.field, bad.reason, text, position))
        return
    previous = seen_uids.get(record.uid)
    if previous is not None:
        prev_label, prev_where, prev_index = previous
        fix = (f"make the {spec.id_field!r} column unique, or set data.id_field=null to use "
               f"'<source>:<row index>' uids" if spec.id_field else "give the files distinct names")
        raise ValueError(
            f"duplicate uid {record.uid!r} at {label} {where(row_index)} and at {prev_label} {prev_where(prev_index)}"
            f". Uids key the sampling seeds and the sample order, so they must be unique. Fix: {fix}.")
    seen_uids[record.uid] = (label, where, row_index)  # positions are worked out only for a message
    records.append(record)
