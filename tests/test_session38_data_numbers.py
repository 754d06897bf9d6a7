"""Session 38: numbers inside struct and list columns of a JSON data file keep the text the file writes. pyarrow
reads a struct field that mixes ``3`` and ``2.5`` as float64, so a verl-style ``reward_model.ground_truth`` of 3
became the answer text ``'3.0'`` (an exact-match reward then never matches ``3``), silently; the top-level columns
were repaired already. Now the file's numbers are put back at any depth (answer, id and meta alike), and a float
field reached by a dotted path is named in a warning as a top-level float column is."""
import json

import pytest

from rlrepro.data.loading import load_records

ROWS = [{"prompt": "What is 1+2?", "reward_model": {"ground_truth": 3, "style": "rule", "w": 0.5},
         "extra": [3, 0.5], "info": {"k": [7, 0.25]}},
        {"prompt": "Half of 5?", "reward_model": {"ground_truth": 2.5, "style": "rule", "w": 1},
         "extra": [1, 2.25], "info": {"k": [0.5]}},
        {"prompt": "Big?", "reward_model": {"ground_truth": 9007199254740993, "style": "rule", "w": 0.25},
         "extra": [2, 0.75], "info": {"k": []}}]


def _write(path, array):
    if array:
        path.write_text(json.dumps(ROWS))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.mark.parametrize("array", [False, True], ids=["jsonl", "json-array"])
def test_struct_ground_truth_keeps_the_files_text(tmp_path, array):
    path = _write(tmp_path / ("d.json" if array else "d.jsonl"), array)
    records, stats = load_records(str(path), answer_field="reward_model.ground_truth")
    # 2**53 + 1: float64 cannot hold it (pyarrow's double gives ...992); the file's digits come back
    assert [r.answer for r in records] == ["3", "2.5", "9007199254740993"]
    assert records[0].meta["reward_model"] == {"ground_truth": 3, "style": "rule", "w": 0.5}
    assert type(records[1].meta["reward_model"]["w"]) is int
    assert [r.meta["extra"] for r in records] == [row["extra"] for row in ROWS]
    assert [r.meta["info"] for r in records] == [row["info"] for row in ROWS]
    assert all(type(a) is type(b) for r, row in zip(records, ROWS) for a, b in zip(r.meta["extra"], row["extra"]))
    assert any("'reward_model.ground_truth' has type" in w and "str()" in w for w in stats.warnings), stats.warnings


def test_parquet_struct_floats_are_named_in_a_warning(tmp_path):
    """A parquet file's struct field is float64 in the file itself: 3.0 is its value, str() gives '3.0', and the
    warning names the field path and the fix (before, no word was said)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["a", "b"], "rm": [{"ground_truth": 3.0}, {"ground_truth": 2.5}]})
    pq.write_table(table, tmp_path / "d.parquet")
    records, stats = load_records(str(tmp_path / "d.parquet"), answer_field="rm.ground_truth")
    assert [r.answer for r in records] == ["3.0", "2.5"]
    assert any("'rm.ground_truth' has type double" in w or "'rm.ground_truth' has type float64" in w
               for w in stats.warnings), stats.warnings


def test_a_string_ground_truth_is_untouched(tmp_path):
    rows = [{"prompt": "p", "rm": {"ground_truth": "007", "w": 1}}, {"prompt": "q", "rm": {"ground_truth": "3.0",
                                                                                              "w": 0.5}}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, stats = load_records(str(tmp_path / "d.jsonl"), answer_field="rm.ground_truth")
    assert [r.answer for r in records] == ["007", "3.0"]
    assert [r.meta["rm"]["w"] for r in records] == [1, 0.5]
    assert not any("ground_truth" in w for w in stats.warnings)
