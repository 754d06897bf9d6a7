"""JSON-lines files read in chunks, never a whole line or file at a time: which lines are rows, which are over a
byte limit, and copies with some lines emptied.

Internal to ``rlrepro.data.loading`` (and ``rows.RowPositions``). A 50 MB line once took 248 s and 19.4 GB
through ``datasets`` and the tokenizer before it was refused; scanned here in 1 MiB chunks it is refused with its
line number in milliseconds, holding about one chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"


@dataclass
class Lines:
    """What one pass over a JSON-lines file found. ``array``: the file is a JSON array (first non-blank byte
    ``[``), whose rows are not lines; nothing else is filled in then."""

    num_rows: int = 0  # non-blank lines: datasets makes each one a row
    long: list[tuple[int, int, int]] = field(default_factory=list)  # (row index, line number, bytes) over the limit
    numbers: list[int] | None = None  # 1-based line number of each row, when asked for
    array: bool = False

    @property
    def blank(self) -> bool:
        """Nothing but whitespace (and a byte-order mark)."""
        return not self.array and self.num_rows == 0

    def _end_line(self, line_no: int, size: int, has_text: bool, limit: int | None) -> None:
        if not has_text:
            return
        if limit is not None and size > limit:
            self.long.append((self.num_rows, line_no, size))
        if self.numbers is not None:
            self.numbers.append(line_no)
        self.num_rows += 1


def scan_lines(file: Path, max_line_bytes: int | None = None, numbers: bool = False) -> Lines:
    """One pass over ``file``: its rows, the lines longer than ``max_line_bytes`` bytes (the newline not counted;
    None: no limit) and, with ``numbers``, each row's line number. Blank lines are no rows, as in ``datasets``."""
    out = Lines(numbers=[] if numbers else None)
    line_no, size, has_text, first = 1, 0, False, True
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            if first:
                first = False
                chunk = chunk[len(_BOM):] if chunk.startswith(_BOM) else chunk
                if chunk.lstrip().startswith(b"["):
                    out.array, out.numbers = True, None
                    return out
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end]
                size += len(piece)
                has_text = has_text or bool(piece.strip())
                if end < 0:
                    break
                out._end_line(line_no, size, has_text, max_line_bytes)
                line_no, size, has_text, start = line_no + 1, 0, False, end + 1
    out._end_line(line_no, size, has_text, max_line_bytes)
    return out


def empty_array(file: Path) -> bool:
    """Whether ``file`` is a JSON array without rows: ``[]``, whitespace and a byte-order mark allowed (``datasets``
    cannot load one: it has no columns)."""
    with open(file, "rb") as f:
        data = f.read(CHUNK + 1)
    if len(data) > CHUNK:
        return False
    data = data[len(_BOM):] if data.startswith(_BOM) else data
    body = data.strip()
    return body.startswith(b"[") and body.endswith(b"]") and not body[1:-1].strip()


def blank_lines(file: Path, dest: Path, line_numbers: set[int]) -> Path:
    """Copy ``file`` to ``dest`` with the given lines emptied (their newlines kept, so that every other line keeps
    its number), streamed in chunks."""
    line_no = 1
    with open(file, "rb") as f, open(dest, "wb") as out:
        while chunk := f.read(CHUNK):
            start = 0
            while start < len(chunk):
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end + 1]
                if line_no not in line_numbers:
                    out.write(piece)
                elif end >= 0:
                    out.write(b"\n")
                if end < 0:
                    break
                line_no, start = line_no + 1, end + 1
    return dest


def kept_rows(removed: list[int], count: int) -> list[int]:
    """The first ``count`` row indices of a file that are not in ``removed``: row ``i`` of a copy without those
    rows is row ``kept_rows(...)[i]`` of the file."""
    gone, out, row = set(removed), [], 0
    while len(out) < count:
        if row not in gone:
            out.append(row)
        row += 1
    return out
