import hashlib
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrepro.data import PromptRecord, load_records, records_digest


def write_lines(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_basic(tmp_path):
    f = write_lines(tmp_path / "math.jsonl", [
        {"prompt": "1+1?", "answer": "2", "level": 1},
        {"prompt": "2+2?", "answer": "4", "level": 2},
    ])
    recs, stats = load_records(str(f))
    assert recs == [PromptRecord(uid="math.jsonl:0", prompt="1+1?", answer="2", meta={"level": 1}),
                    PromptRecord(uid="math.jsonl:1", prompt="2+2?", answer="4", meta={"level": 2})]
    assert stats.num_rows == stats.num_records == 2
    assert stats.files == [{"path": str(f), "sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "num_rows": 2}]
    assert stats.records_digest == records_digest(recs) and stats.warnings == [] and stats.skipped == []


def test_custom_fields_ids_and_number_answers(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [{"q": "a", "sol": 3, "key": 10}, {"q": "b", "sol": 41, "key": 11}])
    recs, stats = load_records(str(f), prompt_field="q", answer_field="sol", id_field="key")
    assert [(r.uid, r.prompt, r.answer, r.meta) for r in recs] == [("10", "a", "3", {}), ("11", "b", "41", {})]
    assert stats.warnings == []  # integers convert exactly
    f = write_lines(tmp_path / "e.jsonl", [{"prompt": "a", "answer": 0.5}, {"prompt": "b", "answer": 2}])
    recs, stats = load_records(str(f))
    assert [r.answer for r in recs] == ["0.5", "2"]  # each number as written (session 30: '2' was '2.0')
    assert stats.warnings == [f"{f}: column 'answer' has type float64; its values are converted to text with str() "
                              f"(1 written as 1.0 becomes '1.0'). Fix: write the values as strings to control the "
                              f"exact text."]


def test_mixed_type_column_keeps_strings_exact(tmp_path):
    # datasets stores a mixed-type JSON column as JSON text and would decode "007" to 7 and "b" to "b";
    # the loader reads the stored text instead
    f = write_lines(tmp_path / "m.jsonl", [
        {"prompt": "p0", "answer": "007", "id": "x"},
        {"prompt": "p1", "answer": 3, "id": 5},
        {"prompt": "p2", "answer": "b", "id": "y"},
        {"prompt": "p3", "answer": "[1, 2]", "id": "z"},
    ])
    recs, stats = load_records(str(f), id_field="id")
    assert [(r.uid, r.answer) for r in recs] == [("x", "007"), ("5", "3"), ("y", "b"), ("z", "[1, 2]")]
    assert any("column 'answer' mixes value types" in w for w in stats.warnings)


def test_json_array_and_parquet(tmp_path):
    j = tmp_path / "a.json"
    j.write_text(json.dumps([{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}]))
    recs, _ = load_records(str(j))
    assert [(r.uid, r.prompt) for r in recs] == [("a.json:0", "x"), ("a.json:1", "y")]
    p = tmp_path / "b.parquet"
    pq.write_table(pa.table({"prompt": ["u", "v"], "answer": ["1", "2"], "n": [7, 8]}), p)
    recs, _ = load_records(str(p))
    assert [(r.uid, r.prompt, r.meta) for r in recs] == [("b.parquet:0", "u", {"n": 7}), ("b.parquet:1", "v", {"n": 8})]


def test_directory_splits(tmp_path):
    d = tmp_path / "ds"
    write_lines(d / "train-00001.jsonl", [{"prompt": "t1", "answer": "1"}])
    write_lines(d / "train-00000.jsonl", [{"prompt": "t0", "answer": "0"}, {"prompt": "t0b", "answer": "0"}])
    write_lines(d / "test.jsonl", [{"prompt": "e0", "answer": "0"}])
    write_lines(d / "validation" / "part.jsonl", [{"prompt": "v0", "answer": "0"}])
    write_lines(d / ".hidden" / "train.jsonl", [{"prompt": "h", "answer": "0"}])
    recs, stats = load_records(str(d))
    assert [r.uid for r in recs] == ["ds/train-00000.jsonl:0", "ds/train-00000.jsonl:1", "ds/train-00001.jsonl:0"]
    assert len(stats.files) == 2
    assert [r.prompt for r in load_records(str(d), split="test")[0]] == ["e0"]
    assert [r.uid for r in load_records(str(d), split="validation")[0]] == ["ds/validation/part.jsonl:0"]
    with pytest.raises(ValueError, match=r"no files for split 'dev'; splits found: \['test', 'train', 'validation'\]"):
        load_records(str(d), split="dev")


def test_directory_without_split_names_is_train(tmp_path):
    d = tmp_path / "plain"
    write_lines(d / "b.jsonl", [{"prompt": "b", "answer": "1"}])
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"]}), d / "a.parquet")
    assert [r.uid for r in load_records(str(d))[0]] == ["plain/a.parquet:0", "plain/b.jsonl:0"]
    with pytest.raises(ValueError, match="no files for split 'test'"):
        load_records(str(d), split="test")


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist locally .* set data.allow_hub=true \(it needs"):
        load_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="data.allow_hub=true"):
        load_records("openai/gsm8k")
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'"):
        load_records(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no data files in this directory"):
        load_records(str(tmp_path / "empty"))
    f = write_lines(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ValueError, match="data.on_bad_row=error or data.on_bad_row=skip"):
        load_records(str(f), on_bad_row="ignore")
    with pytest.raises(ValueError, match="limit"):
        load_records(str(f), limit=0)


def test_missing_field_lists_existing_fields(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    with pytest.raises(ValueError) as e:
        load_records(str(f), on_bad_row="skip")
    assert str(e.value) == (f"{f}: the prompt field 'prompt' is not in the data set; fields that exist: "
                            f"['question', 'answer']. Fix: set data.prompt_field=<one of those>, e.g. "
                            f"data.prompt_field=question.")
    with pytest.raises(ValueError, match="the id field 'uid' is not in the data set"):
        load_records(str(f), prompt_field="question", id_field="uid")


BAD_ROWS = [
    ({"answer": "1"}, "prompt", "missing", "the value is missing (null or absent)"),
    ({"prompt": None, "answer": "1"}, "prompt", "missing", "the value is missing (null or absent)"),
    ({"prompt": "", "answer": "1"}, "prompt", "empty", "the prompt is empty"),
    ({"prompt": " \n", "answer": "1"}, "prompt", "empty", "the prompt is empty (only whitespace)"),
    ({"prompt": "p"}, "answer", "missing", "the value is missing (null or absent)"),
    ({"prompt": "p", "answer": ""}, "answer", "empty", "the answer is empty"),
]


@pytest.mark.parametrize("row,field,reason,problem", BAD_ROWS)
def test_bad_row_error_and_skip(tmp_path, row, field, reason, problem):
    f = write_lines(tmp_path / "d.jsonl", [{"prompt": "good", "answer": "1"}, row, {"prompt": "ok", "answer": "2"}])
    with pytest.raises(ValueError) as e:
        load_records(str(f))
    assert str(e.value).startswith(f"{f}: line 2: field '{field}': {problem}. Fix: give every row a non-empty text")
    assert str(e.value).endswith("or set data.on_bad_row=skip to leave such rows out (each one is logged).")
    recs, stats = load_records(str(f), on_bad_row="skip")
    assert [r.uid for r in recs] == ["d.jsonl:0", "d.jsonl:2"]
    assert stats.num_rows == 3 and stats.num_records == 2 and stats.skipped_by_reason() == {reason: 1}
    (s,) = stats.skipped
    assert (s.file, s.row_index, s.position, s.field, s.reason) == (str(f), 1, "line 2", field, reason)


def test_wrong_types(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [{"prompt": ["a", "b"], "answer": True}])
    with pytest.raises(ValueError, match=r"line 1: field 'prompt': expected text, got list \(\['a', 'b'\]\)"):
        load_records(str(f))
    f = write_lines(tmp_path / "e.jsonl", [{"prompt": "a", "answer": True}, {"prompt": "b", "answer": False}])
    with pytest.raises(ValueError, match=r"line 1: field 'answer': expected text, got a boolean \(True\)"):
        load_records(str(f))
    f = write_lines(tmp_path / "g.jsonl", [{"prompt": "a", "answer": {"x": 1}}, {"prompt": "b", "answer": {"x": 2}}])
    with pytest.raises(ValueError, match=r"no records loaded .*: 2 rows read, 2 skipped \(2 wrong type\)"):
        load_records(str(f), on_bad_row="skip")


def test_non_utf8_bytes_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "bad \xff", "answer": "2"}\n'
                  b'{"prompt": "fine", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"line 2: field 'prompt': the text is not valid UTF-8 \(invalid start byte "
                                         r"at byte 4\). Fix: re-encode the file as UTF-8"):
        load_records(str(f))
    recs, stats = load_records(str(f), on_bad_row="skip")
    assert [r.uid for r in recs] == ["d.jsonl:0", "d.jsonl:2"] and stats.skipped_by_reason() == {"not UTF-8": 1}


def test_unparseable_lines_are_rows_too(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "ok", "answer": "1"}\n\n{"prompt": "sur \\ud800", "answer": "2"}\n'
                 '{"prompt": "broken", "answer": \n{"prompt": "last", "answer": "4"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"d.jsonl: line 3: a string holds a lone surrogate escape"):
        load_records(str(f))
    recs, stats = load_records(str(f), on_bad_row="skip")
    assert [(r.uid, r.prompt) for r in recs] == [("d.jsonl:0", "ok"), ("d.jsonl:3", "last")]
    assert [(s.row_index, s.position, s.reason) for s in stats.skipped] == [(1, "line 3", "not UTF-8"),
                                                                            (2, "line 4", "invalid JSON")]
    assert stats.num_rows == 4 and stats.files[0]["num_rows"] == 4


def test_parquet_binary_column(tmp_path):
    p = tmp_path / "b.parquet"
    pq.write_table(pa.table({"prompt": pa.array([b"ok", b"bad\xff"], pa.binary()), "answer": ["1", "2"]}), p)
    recs, stats = load_records(str(p), on_bad_row="skip")
    assert [r.prompt for r in recs] == ["ok"]
    assert stats.skipped[0].detail == (f"{p}: row 2: field 'prompt': the bytes are not valid UTF-8 (invalid start "
                                       f"byte at byte 3)")
    assert stats.skipped[0].position == "row 2" and stats.skipped[0].row_index == 1


def test_duplicate_ids_always_raise(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [{"id": "a", "prompt": "x", "answer": "1"},
                                           {"id": "a", "prompt": "y", "answer": "2"}])
    with pytest.raises(ValueError, match=f"duplicate uid 'a' at {f} line 2 and at {f} line 1"):
        load_records(str(f), id_field="id", on_bad_row="skip")


def test_limit(tmp_path):
    rows = [{"prompt": "", "answer": "1"}] + [{"prompt": f"p{i}", "answer": "1"} for i in range(5)]
    f = write_lines(tmp_path / "d.jsonl", rows)
    recs, stats = load_records(str(f), limit=3, on_bad_row="skip")
    assert [r.uid for r in recs] == ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3"] and stats.num_records == 3


def test_messages_field(tmp_path):
    f = write_lines(tmp_path / "c.jsonl", [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "answer": "1"},
        {"messages": [], "answer": "2"},
        {"messages": [{"role": "user", "content": None}], "answer": "3"},
    ])
    recs, stats = load_records(str(f), messages_field="messages", on_bad_row="skip")
    assert recs == [PromptRecord(uid="c.jsonl:0", messages=[{"role": "system", "content": "s"},
                                                            {"role": "user", "content": "u"}], answer="1")]
    assert [(s.row_index, s.reason) for s in stats.skipped] == [(1, "empty"), (2, "wrong type")]


def test_chat_records_roundtrip(tmp_path):
    from rlrepro.data import write_jsonl

    recs = [PromptRecord(uid=f"c{i}", messages=[{"role": "user", "content": f"q{i}"}], answer=str(i), meta={"k": i})
            for i in range(3)]
    loaded, _ = load_records(str(write_jsonl(recs, tmp_path / "c.jsonl")), messages_field="messages", id_field="id")
    assert loaded == recs


def test_rewritten_file_is_not_served_from_a_stale_cache(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [{"prompt": "old", "answer": "1"}])
    st_before = f.stat()
    assert load_records(str(f))[0][0].prompt == "old"
    write_lines(f, [{"prompt": "new", "answer": "1"}])
    os.utime(f, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # same size and mtime as before
    assert load_records(str(f))[0][0].prompt == "new"


def test_hub_loading_only_when_allowed(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, revision=None, **kw):
        calls.append((path, name, split, revision))
        return datasets.Dataset.from_list([{"question": "q", "answer": "a"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    recs, stats = load_records("org/set", allow_hub=True, hub_config="main", revision="abc123", split="test",
                               prompt_field="question")
    assert calls == [("org/set", "main", "test", "abc123")]
    assert [(r.uid, r.prompt, r.answer) for r in recs] == [("org/set/main/test:0", "q", "a")]
    assert stats.files[0]["revision"] == "abc123"


# property: any mix of good and bad rows gives exactly the good ones (skip) or an error at the first bad one
_text = st.text(alphabet="abc xyz+=", min_size=0, max_size=6)
_prompt = st.one_of(_text, st.none(), st.just("<absent>"))
_answer = st.one_of(_text, st.none(), st.just("<absent>"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(_prompt, _answer), min_size=1, max_size=8))
def test_bad_rows_property(tmp_path, rows):
    f = tmp_path / "p.jsonl"
    objs = []
    for p, a in rows:
        obj = {"n": len(objs)}
        if p != "<absent>":
            obj["prompt"] = p
        if a != "<absent>":
            obj["answer"] = a
        objs.append(obj)
    write_lines(f, objs)

    def good(v):
        return isinstance(v, str) and v != "<absent>" and v.strip() != ""

    expected = [(f"p.jsonl:{i}", p, a) for i, (p, a) in enumerate(rows) if good(p) and good(a)]
    bad = [i for i, (p, a) in enumerate(rows) if not (good(p) and good(a))]
    has_prompt = any(p != "<absent>" for p, _ in rows)
    has_answer = any(a != "<absent>" for _, a in rows)
    if not (has_prompt and has_answer):
        with pytest.raises(ValueError, match="is not in the data set; fields that exist"):
            load_records(str(f), on_bad_row="skip")
        return
    if not expected:
        with pytest.raises(ValueError, match="no records loaded"):
            load_records(str(f), on_bad_row="skip")
    else:
        recs, stats = load_records(str(f), on_bad_row="skip")
        assert [(r.uid, r.prompt, r.answer) for r in recs] == expected
        assert [s.row_index for s in stats.skipped] == bad
        assert stats.num_rows == len(rows) and stats.num_records == len(expected)
    if bad:
        first = bad[0]
        p, a = rows[first]
        field = "prompt" if not good(p) else "answer"
        with pytest.raises(ValueError, match=f"^{f}: line {first + 1}: field '{field}': "):  # no blank lines
            load_records(str(f))


def test_a_bad_json_line_gets_one_message_not_the_builders_as_well(tmp_path, capfd):
    # datasets' json builder logged "Failed to load JSON from file ..." before rlrepro's message naming the line
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: the line is not valid JSON"):
        load_records(str(path))
    out, err = capfd.readouterr()
    assert "Failed to load JSON" not in out + err
