"""Session 39: an integer past int64 inside a struct of a JSON array file. pyarrow refused the whole file ("Value is
too big"), so a verl-style data set holding a 128-bit id in ``extra_info`` (or such a ``ground_truth``) could not be
read at all as ``.json``, though the same rows loaded as ``.jsonl``. Now such an array is read from a JSON-lines copy
of its rows, and every digit comes back from the file."""
import json

import pytest

from rlrepro.data.loading import load_records

BIG = 2**70 + 1  # past int64 and past float64's integers: a float would give ...424, not ...425
ROWS = [{"prompt": "a", "rm": {"ground_truth": 3}, "extra_info": {"id": 3, "ids": [], "split": "train"}},
        {"prompt": "b", "rm": {"ground_truth": BIG}, "extra_info": {"id": BIG, "ids": [4], "split": "train"}},
        {"prompt": "c", "rm": {"ground_truth": 2.5}, "extra_info": {"id": 5, "ids": [1, BIG], "split": "test"}}]


def test_an_array_with_a_huge_struct_integer_loads_every_digit(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS, indent=2))  # rows over several lines each, as json.dump(indent=...) writes
    records, stats = load_records(str(path), answer_field="rm.ground_truth")
    assert [r.answer for r in records] == ["3", str(BIG), "2.5"]
    assert [r.meta["extra_info"] for r in records] == [row["extra_info"] for row in ROWS]
    assert type(records[0].meta["extra_info"]["id"]) is int
    assert stats.num_rows == 3 and stats.files[0]["num_rows"] == 3 and not stats.skipped


def test_the_same_rows_as_lines_and_as_an_array_are_the_same_records(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "b" / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    from_array, _ = load_records(str(tmp_path / "a" / "d.json"), answer_field="rm.ground_truth")
    from_lines, _ = load_records(str(tmp_path / "b" / "d.jsonl"), answer_field="rm.ground_truth")
    assert [(r.prompt, r.answer, r.meta) for r in from_array] == [(r.prompt, r.answer, r.meta) for r in from_lines]


def test_a_bad_row_beside_a_huge_integer_is_skipped_and_named(tmp_path):
    """The array's clean copy (without its bad row) is read as lines too; a skipped row keeps its number."""
    path = tmp_path / "d.json"
    rows = [json.dumps(r) for r in ROWS]
    path.write_text("[" + rows[0] + ', {"prompt": "\\ud800"},' + ",".join(rows[1:]) + "]")
    with pytest.raises(ValueError, match=r"d.json: row 2: .*lone surrogate"):
        load_records(str(path), answer_field="rm.ground_truth")
    records, stats = load_records(str(path), answer_field="rm.ground_truth", on_bad_row="skip")
    assert [r.answer for r in records] == ["3", str(BIG), "2.5"]
    assert [(s.row_index, s.position) for s in stats.skipped] == [(1, "row 2")] and stats.num_rows == 4
    assert records[1].meta["extra_info"]["id"] == BIG


def test_an_array_that_cannot_be_read_still_says_why(tmp_path):
    """A row that is no object fails the array and its lines alike: the error names that row (before, it said
    only that datasets could not read the file), and under skip the other rows load."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROWS[1], 7]))
    with pytest.raises(ValueError, match=r"d.json: row 2: the row is a JSON int, not an object"):
        load_records(str(path), answer_field="rm.ground_truth")
    records, stats = load_records(str(path), answer_field="rm.ground_truth", on_bad_row="skip")
    assert [r.answer for r in records] == [str(BIG)] and [s.position for s in stats.skipped] == ["row 2"]
    assert stats.skipped[0].reason == "invalid JSON" and stats.num_rows == 2
