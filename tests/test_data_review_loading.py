"""Review fixes in data loading (rlrepro/data/loading.py, rows.py, jsonlines.py): each test failed before its fix."""
import decimal
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlrepro.data import load_records


@pytest.mark.parametrize("dtype", [pa.float32(), pa.float16()])
def test_narrow_float_answers_keep_the_written_text(tmp_path, dtype):
    # a float32 0.1 reached Python as 0.10000000149011612 and became that answer text (float16: 0.0999755859375)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": pa.array([0.1, 2.5, 3.0], dtype)}), path)
    recs, stats = load_records(str(path))
    assert [r.answer for r in recs] == ["0.1", "2.5", "3.0"]
    assert "float" in stats.warnings[0]


def test_narrow_float_nan_still_refused(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array([0.5, float("nan")], pa.float32())}), path)
    with pytest.raises(ValueError, match=r"row 2: field 'answer': expected text, got the number nan"):
        load_records(str(path))


def test_decimal_answers_are_their_text(tmp_path):
    # the loader warned that a decimal column is converted with str(), then refused every row as "got Decimal"
    path = tmp_path / "train.parquet"
    values = pa.array([decimal.Decimal("1.50"), decimal.Decimal("-2")], pa.decimal128(10, 2))
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": values}), path)
    recs, stats = load_records(str(path))
    assert [r.answer for r in recs] == ["1.50", "-2.00"]
    assert "decimal128(10, 2)" in stats.warnings[0]


def test_empty_json_array_is_an_empty_file(tmp_path):
    # "[]" was a hard error ("datasets could not read this JSON file ... Fix: write one JSON object per line"),
    # where an empty .jsonl beside it is a warning
    (tmp_path / "train-0.json").write_text("\ufeff[ \n ]\n", encoding="utf-8")
    (tmp_path / "train-1.jsonl").write_text("")
    (tmp_path / "train-2.json").write_text(json.dumps([{"prompt": "q", "answer": "1"}]))
    recs, stats = load_records(str(tmp_path))
    assert [(r.uid, r.answer) for r in recs] == [(f"{tmp_path.name}/train-2.json:0", "1")]
    assert [w.split(": ", 1)[1] for w in stats.warnings] == ["an empty JSON array, no rows", "empty file, no rows"]


def test_only_an_empty_json_array_says_no_records(tmp_path):
    (tmp_path / "train.json").write_text("[]")
    with pytest.raises(ValueError, match=r"^no records loaded from .*: 0 rows read"):
        load_records(str(tmp_path / "train.json"))


def test_integer_past_int64_is_not_silently_rounded(tmp_path):
    # pyarrow reads 12345678901234567890 as a float: the answer became '1.2345678901234567e+19', and the math reward
    # scored the right answer 0.0; a JSON file's numbers are now read as written (session 30: every digit, and 3
    # stays '3'), and a float that large from a parquet column, whose digits are lost, is refused
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "answer": 3}\n{"prompt": "b", "answer": 12345678901234567890}\n')
    recs, stats = load_records(str(path))
    assert [r.answer for r in recs] == ["3", "12345678901234567890"]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [3.0, 12345678901234567890.0]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"row 2: field 'answer': the number 1.2345678901234567e\+19 is a float too "
                                         r"large.*Fix: write 'answer' values as strings"):
        load_records(str(tmp_path / "t.parquet"))
    recs, stats = load_records(str(tmp_path / "t.parquet"), on_bad_row="skip")
    assert [r.answer for r in recs] == ["3.0"] and stats.skipped_by_reason() == {"wrong type": 1}
