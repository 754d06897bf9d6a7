"""A lone surrogate escape (``\\ud800``) in a row of a JSON ARRAY file is refused naming its row and field, or
skipped under ``on_bad_row="skip"`` with the other rows loaded exactly. The JSON-lines case was fixed in session 28
(tests/test_session28_data_surrogate.py); an array file still lost the escape silently: ``datasets`` re-encodes an
array's rows, and ``"copy: \\ud800="`` loaded as ``"copy: ="`` (with or without a column of mixed types)."""
import pytest

import rlrepro.data.loading as loading
from rlrepro.data.loading import load_records

OK = b'{"prompt": "copy: ab=", "answer": "ab"}'
NUMBER = b'{"prompt": "copy: 12=", "answer": 12}'  # the answer column mixes strings and numbers
LONE = b'{"prompt": "copy: \\ud800=", "answer": "ab"}'
PAIR = b'{"prompt": "smile \\ud83d\\ude00=", "answer": "ab"}'
EXPECTED = {OK: ("copy: ab=", "ab"), NUMBER: ("copy: 12=", "12"), PAIR: ("smile \U0001F600=", "ab")}


def _array(path, rows, pretty=False):
    sep = b",\n  " if pretty else b", "
    path.write_bytes((b"[\n  " if pretty else b"[") + sep.join(rows) + (b"\n]\n" if pretty else b"]"))
    return str(path)


CASES = [([OK, NUMBER, LONE], False), ([OK, LONE], False), ([NUMBER, LONE, OK], False), ([NUMBER, OK, LONE], True)]


@pytest.mark.parametrize("rows,pretty", CASES)
def test_a_lone_surrogate_in_an_array_is_refused_naming_its_row(tmp_path, rows, pretty):
    path = _array(tmp_path / "rows.json", rows, pretty)
    with pytest.raises(ValueError) as e:
        load_records(path)
    text = str(e.value)
    assert text.startswith(f"{path}: row {rows.index(LONE) + 1}: field 'prompt': ")
    assert "lone surrogate" in text and "UTF-8" in text and "on_bad_row=skip" in text


@pytest.mark.parametrize("rows,pretty", CASES)
def test_skip_leaves_out_that_row_and_keeps_the_others_exactly(tmp_path, rows, pretty):
    records, stats = load_records(_array(tmp_path / "rows.json", rows, pretty), on_bad_row="skip")
    kept = [(i, row) for i, row in enumerate(rows) if row is not LONE]
    assert [(r.prompt, r.answer) for r in records] == [EXPECTED[row] for _, row in kept]
    assert [r.uid for r in records] == [f"rows.json:{i}" for i, _ in kept]  # uids keep the file's row indices
    [skipped] = stats.skipped
    bad = rows.index(LONE)
    assert (skipped.row_index, skipped.position, skipped.reason) == (bad, f"row {bad + 1}", "not UTF-8")
    assert "field 'prompt'" in skipped.detail
    assert stats.num_rows == len(rows) and stats.files[0]["num_rows"] == len(rows)


def test_a_surrogate_pair_in_an_array_is_text(tmp_path):
    records, stats = load_records(_array(tmp_path / "pair.json", [PAIR, NUMBER]))
    assert [(r.prompt, r.answer) for r in records] == [EXPECTED[PAIR], EXPECTED[NUMBER]] and not stats.skipped
    # beside a lone surrogate, the pair is kept as the emoji and only the lone one is left out
    records, stats = load_records(_array(tmp_path / "both.json", [PAIR, NUMBER, LONE], pretty=True),
                                  on_bad_row="skip")
    assert [(r.prompt, r.answer) for r in records] == [EXPECTED[PAIR], EXPECTED[NUMBER]]
    assert [s.position for s in stats.skipped] == ["row 3"]


def test_an_array_without_surrogate_escapes_loads_unchanged_and_unparsed(tmp_path, monkeypatch):
    """Without a surrogate escape in its bytes an array file takes the old path: no parse by the surrogate scan."""
    scanned = []
    real = loading.array_bad_rows
    monkeypatch.setattr(loading, "array_bad_rows", lambda file: scanned.append(file) or real(file))
    rows = [OK, NUMBER, b'{"prompt": "caf\\u00e9 \xc3\xa9=", "answer": "007", "level": 3}']
    records, stats = load_records(_array(tmp_path / "plain.json", rows, pretty=True))
    assert [(r.prompt, r.answer) for r in records] == [EXPECTED[OK], EXPECTED[NUMBER], ("caf\u00e9 \u00e9=", "007")]
    assert [r.meta for r in records] == [{"level": None}, {"level": None}, {"level": 3}] and not stats.skipped
    assert scanned == []
    load_records(_array(tmp_path / "lone.json", [OK, LONE]), on_bad_row="skip")  # the scan runs where it must
    assert scanned and all(f.name == "lone.json" for f in scanned)
