"""One data-set row to one ``PromptRecord``, and where a row is in its file (for messages).

Internal to ``rlrepro.data.loading``: the checks that make a bad row a ``BadRow`` (missing or empty value,
wrong type, not UTF-8), the field specification with its config keys, ``RowPositions``, which turns a row's
0-based index into what a person finds in the file: ``line N`` in a JSON-lines file, ``row N`` elsewhere, and
the rows of a JSON array file as written (to find lone surrogate escapes, which ``datasets`` drops from them).
"""
from __future__ import annotations

import decimal
import json
import math
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .jsonlines import scan_lines
from .records import PromptRecord

# likely column names per role, for the example in a missing-field message
_FIELD_GUESSES = {
    "prompt": ("question", "problem", "prompt", "query", "input", "instruction", "text"),
    "messages": ("messages", "conversations", "chat", "turns"),
    "answer": ("answer", "solution", "final_answer", "ground_truth", "target", "output", "label", "response"),
    "id": ("id", "uid", "idx", "index", "key", "unique_id"),
}


class BadRow(Exception):
    def __init__(self, field: str | None, reason: str, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.field, self.reason, self.problem, self.fix = field, reason, problem, fix


class NotUTF8:
    """Stands for a stored string whose bytes are not valid UTF-8."""

    def __init__(self, error: UnicodeDecodeError) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<not UTF-8: {self.error.reason} at byte {self.error.start}>"


def utf8_encodable(obj: Any) -> bool:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(obj, dict):
        return all(utf8_encodable(k) and utf8_encodable(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(utf8_encodable(v) for v in obj)
    return True


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_JSON_DECODER = json.JSONDecoder(strict=False)


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def has_surrogate_escape(file: Path) -> bool:
    """Whether the bytes of a JSON file hold a surrogate escape (``\\ud800``, half of a pair or alone), searched in
    1 MiB chunks: only such a file needs parsing to find a lone one."""
    tail = b""
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            if _SURROGATE_ESCAPE.search(tail + chunk):
                return True
            tail = chunk[-5:]
    return False


def json_array_rows(file: Path) -> list[tuple[Any, str]]:
    """The rows of a JSON array file, each parsed and as written (its text, for a copy without some rows); [] when
    the file is not a JSON array in UTF-8. Reads the whole file, as ``datasets`` does."""
    try:
        text = file.read_text(encoding="utf-8-sig")
        if not isinstance(_JSON_DECODER.decode(text), list):
            return []
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        return []
    rows, i = [], text.index("[") + 1
    while text[i := _JSON_SPACE.match(text, i).end()] != "]":  # valid JSON: a value, then "," or "]"
        row, end = _JSON_DECODER.raw_decode(text, i)
        rows.append((row, text[i:end]))
        i = _JSON_SPACE.match(text, end).end()
        i += text[i] == ","
    return rows


def array_as_lines(file: Path, dest: Path) -> Path:
    """The rows of a JSON array file as JSON lines at ``dest``, one a line, each written again from its parsed value
    (every digit of an integer kept): pyarrow reads such a file where it refuses the array (an integer past int64
    inside a struct)."""
    with open(dest, "w", encoding="utf-8") as out:
        for row, _ in json_array_rows(file):
            out.write(json.dumps(row) + "\n")
    return dest


def exact_json_numbers(file: Path, rows: list[dict], columns: list[str], array: bool) -> None:
    """Put back, in the ``columns`` where pyarrow read numbers as floats (a JSON column mixing ``3`` and ``0.5``, or
    holding an integer past int64; also inside struct and list columns: ``reward_model.ground_truth``), each number
    as ``file`` writes it: ``3`` stays the int 3 (text ``'3'``, not ``'3.0'``) and an integer of any size keeps every
    digit. ``rows`` are the rows ``datasets`` read from ``file``, in order (a blank line is none); nothing changes
    if the file cannot be parsed here or the counts disagree."""
    try:
        if array:
            objs = [obj for obj, _ in json_array_rows(file)]
        else:
            with open(file, "rb") as f:
                objs = [_JSON_DECODER.decode(line.decode("utf-8").lstrip("\ufeff")) for line in f if line.strip()]
    except ValueError:  # not UTF-8 or not JSON: the rows keep pyarrow's values (and its warning)
        return
    if len(objs) != len(rows) or not all(isinstance(obj, dict) for obj in objs):
        return
    for row, obj in zip(rows, objs):
        for col in columns:
            if col in row and col in obj:
                row[col] = _as_written(row[col], obj[col])


def _as_written(value: Any, written: Any) -> Any:
    """``value`` (as pyarrow read it) with each float the file wrote as a number put back as written: into dicts
    by key and lists of the same length; anything else (a null pyarrow filled in, another type) is left."""
    if isinstance(value, float) and isinstance(written, (int, float)) and not isinstance(written, bool):
        return written
    if isinstance(value, dict) and isinstance(written, dict):
        return {k: _as_written(v, written[k]) if k in written else v for k, v in value.items()}
    if isinstance(value, list) and isinstance(written, list) and len(value) == len(written):
        return [_as_written(v, w) for v, w in zip(value, written)]
    return value


def has_float(feature: Any) -> bool:
    """Whether a ``datasets`` feature is, or holds inside its structs and lists, a float or decimal value."""
    dtype = getattr(feature, "dtype", None)
    if isinstance(dtype, str) and dtype.startswith(("float", "double", "decimal")):
        return True
    if isinstance(feature, dict):
        return any(has_float(f) for f in feature.values())
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and has_float(inner)


def narrow_floats(rows: list[dict], col: str, dtype: str) -> None:
    """A float16/float32 column's values as the floats their shortest text in that type denotes: a float32 0.1
    reaches Python as 0.10000000149011612, whose str() is not the 0.1 the file holds."""
    import numpy as np

    narrow = np.float16 if dtype == "float16" else np.float32
    for row in rows:
        value = row.get(col)
        if isinstance(value, float):
            row[col] = float(str(narrow(value)))


def array_bad_rows(file: Path) -> list[tuple[int, int, str, str]]:
    """The rows of a JSON array file that cannot be rows: not an object, or holding a string that is not UTF-8 (a
    lone surrogate escape such as ``\\ud800``): (row index, 1-based row number, reason, problem naming the field),
    the form of ``loading._scan_json_lines``."""
    bad = []
    for row, (obj, _) in enumerate(json_array_rows(file)):
        if not isinstance(obj, dict):
            bad.append((row, row + 1, "invalid JSON", f"the row is a JSON {type(obj).__name__}, not an object"))
        elif not utf8_encodable(obj):
            cols = [k for k, v in obj.items() if not utf8_encodable([k, v])]
            bad.append((row, row + 1, "not UTF-8", (f"field {cols[0]!r}: " if cols else "") + "a string holds a "
                        "lone surrogate escape (like \\ud800), which is not UTF-8"))
    return bad


def json_lines_numbers(data: bytes) -> list[int] | None:
    """1-based line numbers of the non-blank lines of a JSON-lines file (``datasets`` makes each one a row), or
    None for a JSON array file, whose rows are not lines."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if data.lstrip().startswith(b"["):
        return None
    return [n for n, line in enumerate(data.split(b"\n"), start=1) if line.strip()]


class RowPositions:
    """``position(row_index)``: ``"line N"`` for a row of a JSON-lines file (blank lines counted, as an editor
    counts them), ``"row N"`` (1-based) for a parquet file, a JSON array, a hub data set, or when the lines do
    not match the rows one to one. The file is read only when a message needs a position."""

    def __init__(self, file: Path | None = None, num_rows: int | None = None) -> None:
        self._file, self._num_rows = file, num_rows
        self._lines: list[int] | None = None
        self._read = file is None or file.suffix.lower() == ".parquet"

    def __call__(self, row_index: int) -> str:
        if not self._read:
            self._read = True
            lines = scan_lines(self._file, numbers=True).numbers  # type: ignore[arg-type]  # in chunks
            if lines is not None and (self._num_rows is None or len(lines) == self._num_rows):
                self._lines = lines
        if self._lines is not None and 0 <= row_index < len(self._lines):
            return f"line {self._lines[row_index]}"
        return f"row {row_index + 1}"


@dataclass(frozen=True)
class FieldSpec:
    prompt_field: str
    answer_field: str
    id_field: str | None
    messages_field: str | None

    def text_fields(self) -> list[str]:
        fields = [self.answer_field] if self.messages_field else [self.prompt_field, self.answer_field]
        return fields + ([self.id_field] if self.id_field else [])

    def used(self) -> list[tuple[str, str, str]]:
        """(column, role, parameter name) of the columns read; the config key is ``data.<parameter name>``."""
        out = [(self.messages_field, "messages", "messages_field") if self.messages_field
               else (self.prompt_field, "prompt", "prompt_field"),
               (self.answer_field, "answer", "answer_field")]
        if self.id_field:
            out.append((self.id_field, "id", "id_field"))
        return out

    def check_columns(self, columns: list[str], label: str) -> None:
        used = {c for c, _, _ in self.used()}
        for col, role, param in self.used():
            if col not in columns:
                free = [c for c in columns if c not in used]
                # else the first free column no other role's guesses claim (an id column is no answer)
                other = [c for c in free if not any(c in g for r, g in _FIELD_GUESSES.items() if r != role)]
                guess = next((c for c in _FIELD_GUESSES[role] if c in free), other[0] if other else None)
                example = f", e.g. data.{param}={guess}" if guess is not None else ""
                raise ValueError(f"{label}: the {role} field {col!r} is not in the data set; "
                                 f"fields that exist: {columns}. Fix: set data.{param}=<one of those>{example}.")


def field_value(row: dict, path: str) -> Any:
    """The value of a field: the column ``path`` when the row has one (a name with a dot included), else a dotted
    path into nested objects (``reward_model.ground_truth``: key ``ground_truth`` of the ``reward_model`` column);
    None when any step is missing or not an object."""
    if path in row:
        return row[path]
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def nested_columns(features: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields inside struct columns (``reward_model.ground_truth``), in schema order, for
    ``check_columns`` and its message; a list's or a JSON-text column's insides are not listed."""
    out: list[str] = []
    for name, feat in (features.items() if isinstance(features, dict) else ()):
        if isinstance(feat, dict):
            for sub, inner in feat.items():
                out.append(f"{prefix}{name}.{sub}")
                out += nested_columns({sub: inner}, f"{prefix}{name}.") if isinstance(inner, dict) else []
    return out


def _chat_like(value: Any) -> bool:
    """Whether a value is a list of chat turns, or the JSON text of one (a column mixing text and lists)."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def row_to_record(row: dict, row_index: int, source_name: str, spec: FieldSpec) -> PromptRecord:
    for col, value in row.items():
        if isinstance(value, NotUTF8):
            raise BadRow(col, "not UTF-8", f"the text is not valid UTF-8 ({value.error.reason} at byte "
                         f"{value.error.start})", "re-encode the file as UTF-8")
    prompt, messages = None, None
    if spec.messages_field:
        value = field_value(row, spec.messages_field)
        # a text prompt beside chat turns (slime's prompt column): one plain prompt, its text as written, also when
        # it is the JSON text of chat turns. Only in a JSON column that mixes text with lists is such a string read
        # as the turns: datasets stores a string that is valid JSON as that JSON, the same bytes as the list
        # (docs/DATA.md, "Text beside chat turns")
        if isinstance(value, str):
            prompt = _as_text(value, spec.messages_field, "prompt", "messages_field")
        else:
            messages = _as_messages(value, spec.messages_field)
    else:
        value = field_value(row, spec.prompt_field)
        if _chat_like(value):
            # a string: the JSON text of turns, written as a string or (a column mixing types) as a list
            written = "; turns written as a JSON string stay text there: write them as JSON lists" if isinstance(
                value, str) else ""
            raise BadRow(spec.prompt_field, "wrong type", "expected text, got a list of chat turns (read as text, "
                         "the model would see their JSON)", f"set data.messages_field={spec.prompt_field} to read "
                         f"them as chat turns (a text value there stays a plain prompt{written})")
        prompt = _as_text(value, spec.prompt_field, "prompt", "prompt_field")
    answer = _as_text(field_value(row, spec.answer_field), spec.answer_field, "answer", "answer_field")
    if spec.id_field:
        uid = _as_text(field_value(row, spec.id_field), spec.id_field, "id", "id_field")
    else:
        uid = f"{source_name}:{row_index}"
    used = {c for c, _, _ in spec.used()}
    meta = {k: v for k, v in row.items() if k not in used}
    return PromptRecord(uid=uid, prompt=prompt, messages=messages, answer=answer, meta=meta)


def _as_text(value: Any, field: str, role: str, param: str = "") -> str:
    fix = f"give every row a non-empty text {role} in {field!r}"
    if isinstance(value, dict) and value and param:  # a struct column: name a field inside it
        guess = next((k for k in _FIELD_GUESSES.get(role, ()) if k in value),
                     next((k for k, v in value.items() if isinstance(v, str)), next(iter(value))))
        fix += (f", or read a field inside it with a dotted path, e.g. data.{param}={field}.{guess} (its fields: "
                f"{', '.join(map(str, value))})")
    if value is None:
        raise BadRow(field, "missing", "the value is missing (null or absent)", fix)
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRow(field, "not UTF-8", f"the bytes are not valid UTF-8 ({e.reason} at byte {e.start})",
                         "re-encode the text as UTF-8") from None
    if isinstance(value, bool):
        raise BadRow(field, "wrong type", f"expected text, got a boolean ({value!r})", fix)
    if isinstance(value, numbers.Integral):
        value = str(int(value))
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise BadRow(field, "wrong type", f"expected text, got the number {value!r}", fix)
        if float(value).is_integer() and abs(value) >= 2 ** 53:  # a JSON integer past int64 is read as a float
            raise BadRow(field, "wrong type", f"the number {value!r} is a float too large to hold every digit of an "
                         f"integer (2**53 and above): its text may not be the one written", f"write {field!r} values "
                         f"as strings")
        value = str(float(value))
    elif isinstance(value, decimal.Decimal):  # a parquet decimal column: its exact text ('1.50')
        if not value.is_finite():
            raise BadRow(field, "wrong type", f"expected text, got the number {value!r}", fix)
        value = str(value)
    if not isinstance(value, str):
        raise BadRow(field, "wrong type", f"expected text, got {type(value).__name__} ({_short(value)})", fix)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRow(field, "not UTF-8", "the text holds a lone surrogate, which is not UTF-8",
                     "re-encode the text as UTF-8") from None
    if not value.strip():
        raise BadRow(field, "empty", f"the {role} is empty" + (" (only whitespace)" if value else ""), fix)
    return value


def _as_messages(value: Any, field: str) -> list[dict[str, str]]:
    fix = f"give every row in {field!r} a non-empty list of {{'role': str, 'content': str}} turns"
    if value is None:
        raise BadRow(field, "missing", "the value is missing (null or absent)", fix)
    if not isinstance(value, list):
        raise BadRow(field, "wrong type", f"expected a list of chat turns, got {type(value).__name__}", fix)
    if not value:
        raise BadRow(field, "empty", "the list of chat turns is empty", fix)
    out = []
    for i, m in enumerate(value, start=1):  # turns counted from 1, as a person counts them
        if not isinstance(m, dict):
            raise BadRow(field, "wrong type", f"turn {i} is {type(m).__name__}, not a dict", fix)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise BadRow(field, "wrong type", f"turn {i} needs a string 'role' and 'content', got {_short(m)}", fix)
        if not utf8_encodable(content) or not utf8_encodable(role):
            raise BadRow(field, "not UTF-8", f"turn {i} holds a lone surrogate, which is not UTF-8",
                         "re-encode the text as UTF-8")
        out.append({"role": role, "content": content})  # other keys (tool calls, names) are not used
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
