"""Messages of the data layer, as a command-line user reads them (issue 21): each names the config key of the
fix (``data.allow_hub=true``, ``data.on_bad_row=skip``, ``data.prompt_field=question``, ``reward.fn=...``,
``data.template=...``) and places a row where a person finds it in the file (``line N`` in JSON lines, ``row N``
counted from 1 in parquet, JSON arrays and hub data sets). Loading a local file prints nothing."""
import json
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlrepro.data import PromptRecord, check_template, load_records, load_reward_fn, render_prompt

DATA_DIR = Path(__file__).resolve().parents[1] / "rlrepro" / "data"


def write_lines(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines),
                    encoding="utf-8")
    return path


def good(i):
    return {"prompt": f"p{i}", "answer": str(i)}


def test_sixth_line_is_line_6_not_row_5(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [good(i) for i in range(5)] + [{"prompt": "p5"}])
    with pytest.raises(ValueError) as e:
        load_records(str(f))
    assert str(e.value).startswith(f"{f}: line 6: field 'answer': the value is missing")
    assert "data.on_bad_row=skip" in str(e.value) and "row 5" not in str(e.value)
    recs, stats = load_records(str(f), on_bad_row="skip")
    assert [r.uid for r in recs] == [f"d.jsonl:{i}" for i in range(5)]  # uids keep the 0-based row index
    (s,) = stats.skipped
    assert (s.row_index, s.position) == (5, "line 6") and s.detail.startswith(f"{f}: line 6: field 'answer'")


def test_blank_lines_count_as_lines(tmp_path):
    # datasets skips blank lines (they are no rows); an editor still counts them
    f = write_lines(tmp_path / "d.jsonl", [good(0), "", "   ", good(1), {"prompt": ""}, good(2)])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(f))}: line 5: field 'prompt': the prompt is empty"):
        load_records(str(f))
    recs, stats = load_records(str(f), on_bad_row="skip")
    assert [r.uid for r in recs] == ["d.jsonl:0", "d.jsonl:1", "d.jsonl:3"]
    assert [(s.row_index, s.position) for s in stats.skipped] == [(2, "line 5")]


def test_unparseable_line_is_named_by_its_line_only(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [good(0), "", '{"prompt": "x", "answer": ', good(1)])
    with pytest.raises(ValueError) as e:
        load_records(str(f))
    msg = str(e.value)
    assert msg.startswith(f"{f}: line 3: the line is not valid JSON") and "row" not in msg.split("Fix")[0]
    assert "at column 27" in msg and "line 1 column" not in msg  # json's position within the line: the column
    assert "data.on_bad_row=skip" in msg
    recs, stats = load_records(str(f), on_bad_row="skip")
    assert [(s.row_index, s.position) for s in stats.skipped] == [(1, "line 3")]
    assert stats.skipped[0].detail.startswith(f"{f}: line 3: the line is not valid JSON")


def test_json_lines_in_a_json_file_are_lines_and_an_array_has_rows(tmp_path):
    f = write_lines(tmp_path / "lines.json", [good(0), good(1), {"prompt": None, "answer": "2"}])
    with pytest.raises(ValueError, match=r"lines.json: line 3: field 'prompt'"):
        load_records(str(f))
    a = tmp_path / "array.json"
    a.write_text(json.dumps([good(0), {"prompt": "p1", "answer": ""}, good(2)], indent=2))
    with pytest.raises(ValueError, match=r"array.json: row 2: field 'answer': the answer is empty"):
        load_records(str(a))


def test_parquet_rows_count_from_one(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "answer": ["1", "2", "3"]}), p)
    with pytest.raises(ValueError, match=r"d.parquet: row 3: field 'prompt': the value is missing"):
        load_records(str(p))
    _, stats = load_records(str(p), on_bad_row="skip")
    assert [(s.row_index, s.position) for s in stats.skipped] == [(2, "row 3")]
    pq.write_table(pa.table({"id": ["x", "y", "x"], "prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}), p)
    with pytest.raises(ValueError, match=rf"duplicate uid 'x' at {re.escape(str(p))} row 3 and at "
                                         rf"{re.escape(str(p))} row 1\. .*data.id_field=null"):
        load_records(str(p), id_field="id")


def test_hub_rows_count_from_one(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(
        [{"question": "q", "answer": "a"}, {"question": "q2", "answer": None}]))
    with pytest.raises(ValueError, match=r"^org/set \(split train\): row 2: field 'answer'.*data.on_bad_row=skip"):
        load_records("org/set", allow_hub=True, prompt_field="question")


def test_hub_needs_data_allow_hub(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_records("openai/gsm8k")
    assert "set data.allow_hub=true" in str(e.value) and "pass allow_hub" not in str(e.value)


def test_missing_fields_name_the_key_with_an_example(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [{"question": "q", "solution": "1", "uid": "a", "chat": []}])
    with pytest.raises(ValueError, match=r"Fix: set data.prompt_field=<one of those>, e.g. data.prompt_field=question"
                                         r"\.$"):
        load_records(str(f))
    with pytest.raises(ValueError, match=r"the answer field 'answer' .* e.g. data.answer_field=solution"):
        load_records(str(f), prompt_field="question")
    with pytest.raises(ValueError, match=r"the id field 'id' .* e.g. data.id_field=uid"):
        load_records(str(f), prompt_field="question", answer_field="solution", id_field="id")
    with pytest.raises(ValueError, match=r"the messages field 'messages' .* e.g. data.messages_field=chat"):
        load_records(str(f), messages_field="messages", answer_field="solution")


def test_chat_turns_count_from_one(tmp_path):
    f = write_lines(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "u"}, "bye"], "answer": "1"}])
    with pytest.raises(ValueError, match=r"c.jsonl: line 1: field 'messages': turn 2 is str, not a dict"):
        load_records(str(f), messages_field="messages")


def test_directory_split_and_argument_errors_name_keys(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    write_lines(d / "train.jsonl", [good(0)])
    with pytest.raises(ValueError, match=r"no files for split 'test'.*set data.split=<one of the splits found>"):
        load_records(str(d), split="test")
    with pytest.raises(ValueError, match=r"data.limit=0 is not a positive integer"):
        load_records(str(d), limit=0)
    with pytest.raises(ValueError, match=r"data.prompt_field='' is not a column name"):
        load_records(str(d), prompt_field="")


def test_templates_name_data_keys():
    rec = PromptRecord(uid="r:0", prompt="1+1", answer="2")
    with pytest.raises(ValueError, match=r"data.template='\{answer\}' uses the fields"):
        check_template("{answer}")
    with pytest.raises(ValueError, match=r"data.template='no field' has no \{prompt\} field"):
        check_template("no field")
    with pytest.raises(ValueError, match=r"data.template='\{prompt' is not a valid format string"):
        check_template("{prompt")
    with pytest.raises(ValueError, match=r"data.system_prompt needs data.use_chat_template=true"):
        render_prompt(rec, None, system_prompt="be brief")
    with pytest.raises(ValueError, match=r"Fix: set data.use_chat_template=false and use data.template"):
        render_prompt(rec, object(), use_chat_template=True)
    chat = PromptRecord(uid="r:1", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                        answer="2")
    with pytest.raises(ValueError, match=r"Fix: set data.system_prompt=null"):
        render_prompt(chat, None, system_prompt="x", use_chat_template=True)


def test_reward_loading_names_reward_fn():
    with pytest.raises(ValueError, match=r"\(reward.fn=nope\)\. Fix: set reward.fn to one of the built-ins"):
        load_reward_fn("nope")
    with pytest.raises(ValueError, match=r"^reward.fn='json:nothing_here': .*Fix: set reward.fn=json:<one of those>"):
        load_reward_fn("json:nothing_here")
    with pytest.raises(ValueError, match=r"^reward.fn='json:decoder' names a module, not a function"):
        load_reward_fn("json:decoder")


def test_order_and_synthetic_name_their_keys():
    from rlrepro.data import EpochOrder, make_synthetic_records

    with pytest.raises(ValueError, match=r"run.seed must be an integer >= 0"):
        EpochOrder(3, seed=-1)
    with pytest.raises(ValueError, match=r"data.shuffle='yes' is not a bool"):
        EpochOrder(3, seed=0, shuffle="yes")
    with pytest.raises(ValueError, match=r"data.synthetic.task\); known: .*Fix: set data.synthetic.task="):
        make_synthetic_records("sort", 3, 0)
    with pytest.raises(ValueError, match=r"data.synthetic.kwargs.min_len \(3\) must not exceed"):
        make_synthetic_records("copy", 3, 0, min_len=3, max_len=2)


def test_no_message_tells_a_user_to_pass_a_python_argument():
    """A command-line user cannot 'pass allow_hub=True'; the messages name data.allow_hub=true and the like."""
    offenders = []
    PASS_ARGUMENT = r"""["'].*\bpass (allow_hub|on_bad_row|\w+_field|template|system_prompt|use_chat_template)"""
    for path in sorted(DATA_DIR.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(PASS_ARGUMENT, line):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert offenders == []


# --------------------------------------------------------------------------------------------- quiet loading

def test_loading_local_files_prints_nothing(tmp_path, capfd):
    import datasets

    f = write_lines(tmp_path / "d.jsonl", [good(0), good(1)])
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"]}), p)
    bad = write_lines(tmp_path / "bad.jsonl", [good(0), '{"prompt": ', good(1)])  # the per-line scan path
    capfd.readouterr()
    before = datasets.are_progress_bars_disabled()
    load_records(str(f))
    load_records(str(p))
    load_records(str(bad), on_bad_row="skip")
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out, err)
    assert datasets.are_progress_bars_disabled() == before  # scoped to the load


def test_quiet_loading_keeps_real_errors_and_restores_progress_bars(tmp_path, capfd):
    import datasets

    p = tmp_path / "broken.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    before = datasets.are_progress_bars_disabled()
    with pytest.raises(ValueError, match=r"broken.parquet: datasets could not read this parquet file"):
        load_records(str(p))
    assert datasets.are_progress_bars_disabled() == before
