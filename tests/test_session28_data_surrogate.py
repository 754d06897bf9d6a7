"""A lone surrogate escape (``\\ud800``) in a JSON-lines row is refused naming the line, also when another column
mixes value types (an ``answer`` that is a string in one row and a number in another). Found by CI's hypothesis run
of tests/test_bad_input_run.py on 2026-12-06: with a mixed column, datasets read the file another way and the
escape vanished from the prompt (``"copy: \\ud800="`` loaded as ``"copy: ="``)."""
import pytest

from rlrepro.data.loading import load_records

OK = b'{"prompt": "copy: ab=", "answer": "ab"}'
NUMBER = b'{"prompt": "copy: 12=", "answer": 12}'
LONE = b'{"prompt": "copy: \\ud800=", "answer": "ab"}'
PAIR = b'{"prompt": "smile \\ud83d\\ude00=", "answer": "ab"}'


@pytest.mark.parametrize("lines", [[OK, NUMBER, LONE], [OK, LONE], [NUMBER, LONE, OK]])
def test_a_lone_surrogate_is_refused_naming_its_line(tmp_path, lines):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    line = lines.index(LONE) + 1
    with pytest.raises(ValueError) as e:
        load_records(str(path))
    assert f"line {line}:" in str(e.value) and "UTF-8" in str(e.value) and "on_bad_row=skip" in str(e.value)
    records, stats = load_records(str(path), on_bad_row="skip")
    assert [s.reason for s in stats.skipped] == ["not UTF-8"]
    assert len(records) == len(lines) - 1 and all("copy: =" != r.prompt for r in records)


def test_a_surrogate_pair_is_text(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([PAIR, NUMBER]) + b"\n")
    records, stats = load_records(str(path))
    assert [r.prompt for r in records] == ["smile \U0001F600=", "copy: 12="] and not stats.skipped
