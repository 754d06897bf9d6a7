"""JSON numbers in text fields keep the text the file writes (session 30): pyarrow reads a JSON column that mixes
``3`` and ``0.5`` (or holds an integer past int64) as float64, which turned a right answer ``3`` into ``'3.0'`` (exact
match then scored it 0). The loader now takes such a column's numbers from the file itself."""
from __future__ import annotations

import json

from rlrepro.data import load_records


def _answers(path, **kw):
    recs, _ = load_records(str(path), **kw)
    return [r.answer for r in recs]


def test_mixed_int_and_float_column_keeps_each_number_as_written(tmp_path):
    rows = [{"prompt": "a", "answer": 3}, {"prompt": "b", "answer": 0.5}, {"prompt": "c", "answer": -12},
            {"prompt": "d", "answer": 1.0}, {"prompt": "e", "answer": 12345678901234567890}]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = ["3", "0.5", "-12", "1.0", "12345678901234567890"]
    assert _answers(jsonl) == want
    array = tmp_path / "arr" / "train.json"
    array.parent.mkdir()
    array.write_text(json.dumps(rows, indent=1))
    assert _answers(array) == want
    assert _answers(jsonl) == _answers(jsonl)  # two loads, the same text


def test_exact_numbers_with_skipped_and_blank_rows(tmp_path):
    """A bad row skipped (the clean copy is read) and blank lines: the numbers still line up with their rows."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": 3}\n\n{"prompt": "b", "answer": null}\n{"prompt": "c", "answer": 2.5}\n'
                    '{"prompt": "d", "answer": 7}\nnot json\n\n{"prompt": "e", "answer": 40}\n')
    recs, stats = load_records(str(path), on_bad_row="skip")
    assert [(r.prompt, r.answer) for r in recs] == [("a", "3"), ("c", "2.5"), ("d", "7"), ("e", "40")]
    assert stats.num_skipped == 2  # the null answer and the line that is not JSON


def test_all_float_column_is_unchanged(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": 0.1}\n{"prompt": "b", "answer": 2.0}\n')
    assert _answers(path) == ["0.1", "2.0"]


def test_write_jsonl_names_the_record_and_key_json_cannot_hold(tmp_path):
    """A parquet timestamp column becomes meta holding datetimes: write_jsonl's error names the record and key
    (json's own TypeError named neither), and no file is made."""
    import datetime

    import pytest

    from rlrepro.data import PromptRecord, write_jsonl
    recs = [PromptRecord(uid="u1", prompt="p", answer="1", meta={"when": datetime.datetime(2020, 1, 1), "n": 1}),
            PromptRecord(uid="u2", prompt="q", answer="2", meta={"x": float("nan")})]
    with pytest.raises(ValueError, match=r"PromptRecord 'u1': 'when' cannot be written as JSON .*str\(\) of a"):
        write_jsonl(recs[:1], tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match=r"PromptRecord 'u2': 'x' cannot be written as JSON"):
        write_jsonl(recs[1:], tmp_path / "b.jsonl")
    assert not list(tmp_path.iterdir())


def test_two_float_columns_are_both_as_written(tmp_path):
    """The answer and the id column both read as floats: both keep their numbers' text (one parse of the file)."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": 3, "id": 7}\n{"prompt": "b", "answer": 0.5, "id": 8.5}\n')
    recs, _ = load_records(str(path), id_field="id")
    assert [(r.uid, r.answer) for r in recs] == [("7", "3"), ("8.5", "0.5")]
