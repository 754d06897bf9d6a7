import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from rlrepro.data import (
    SYNTHETIC_CHARSET,
    SYNTHETIC_KINDS,
    exact_match_reward,
    load_records,
    make_synthetic_records,
    prefix_match_reward,
    records_digest,
    write_jsonl,
)


def test_charset_is_the_tiny_tokenizer_alphabet():
    assert SYNTHETIC_CHARSET == "0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,:;()[]<>!#'\n"
    assert len(set(SYNTHETIC_CHARSET)) == len(SYNTHETIC_CHARSET) == 56


def test_charset_matches_the_tiny_model_tokenizer():
    # read rlrepro/model/tiny.py's CHARS without importing torch
    import ast
    import pathlib

    import rlrepro

    tiny = pathlib.Path(rlrepro.__file__).parent / "model" / "tiny.py"
    if not tiny.is_file():
        pytest.skip("rlrepro/model/tiny.py not present")
    for node in ast.parse(tiny.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["CHARS"]:
            assert "".join(ast.literal_eval(node.value.args[0])) == SYNTHETIC_CHARSET
            return
    pytest.fail("CHARS not found in rlrepro/model/tiny.py")


def test_pinned_records():
    got = {k: [(r.uid, r.prompt, r.answer) for r in make_synthetic_records(k, 3, 7)] for k in SYNTHETIC_KINDS}
    assert got == {
        "copy": [("copy-s7:0", "copy: qrxpu=", "qrxpu"), ("copy-s7:1", "copy: fbhhw=", "fbhhw"),
                 ("copy-s7:2", "copy: amvdu=", "amvdu")],
        "reverse": [("reverse-s7:0", "reverse: uwcge=", "egcwu"), ("reverse-s7:1", "reverse: en=", "ne"),
                    ("reverse-s7:2", "reverse: onw=", "wno")],
        "add": [("add-s7:0", "5+5=", "10"), ("add-s7:1", "3+9=", "12"), ("add-s7:2", "9+19=", "28")],
        "first_letter": [("first_letter-s7:0", "first: znwj=", "z"), ("first_letter-s7:1", "first: ct=", "c"),
                         ("first_letter-s7:2", "first: k=", "k")],
        "multiply": [("multiply-s7:0", "578*284=", "164152"), ("multiply-s7:1", "779*359=", "279661"),
                     ("multiply-s7:2", "695*524=", "364180")],
    }
    assert [(r.prompt, r.answer) for r in make_synthetic_records("multiply", 2, 7, digits=2)] \
        == [("57*28=", "1596"), ("77*35=", "2695")]
    assert [(r.prompt, r.answer) for r in make_synthetic_records("copy", 3, 7, min_len=2, max_len=3, alphabet="xy")] \
        == [("copy: yyy=", "yyy"), ("copy: yyx=", "yyx"), ("copy: xx=", "xx")]
    assert [(r.prompt, r.answer) for r in make_synthetic_records("add", 3, 7, max_value=99)] \
        == [("28+27=", "55"), ("15+44=", "59"), ("42+93=", "135")]


@pytest.mark.parametrize("kind", sorted(SYNTHETIC_KINDS))
def test_tasks_are_correct_pure_and_in_vocabulary(kind):
    options = {} if kind in ("add", "multiply") else {"min_len": 2, "max_len": 6}
    recs = make_synthetic_records(kind, 200, seed=11, **options)
    assert recs == make_synthetic_records(kind, 200, seed=11, **options)
    assert recs[:50] == make_synthetic_records(kind, 50, seed=11, **options)
    assert recs != make_synthetic_records(kind, 200, seed=12, **options)
    assert len({r.uid for r in recs}) == 200
    for r in recs:
        assert set(r.prompt + r.answer) <= set(SYNTHETIC_CHARSET)
        assert r.meta == {"kind": kind}
        body = r.prompt.split(": ", 1)[-1][:-1]
        if kind == "add":
            a, b = map(int, body.split("+"))
            assert 0 <= a <= 20 and 0 <= b <= 20 and r.answer == str(a + b)
        elif kind == "multiply":
            a, b = map(int, body.split("*"))
            assert 100 <= a <= 999 and 100 <= b <= 999 and r.answer == str(a * b)
        else:
            assert 2 <= len(body) <= 6
            assert r.answer == {"copy": body, "reverse": body[::-1], "first_letter": body[0]}[kind]
        assert exact_match_reward(r.answer, r) == 1.0 and prefix_match_reward(r.answer, r) == 1.0


def test_options_errors():
    with pytest.raises(ValueError, match="unknown synthetic kind 'sort'"):
        make_synthetic_records("sort", 3, 0)
    with pytest.raises(ValueError, match=r"takes the options \['max_value'\], not \['max_len'\]"):
        make_synthetic_records("add", 3, 0, max_len=3)
    with pytest.raises(ValueError, match="min_len"):
        make_synthetic_records("copy", 3, 0, min_len=4, max_len=3)
    with pytest.raises(ValueError, match=r"\['=', 'Z'\]"):
        make_synthetic_records("copy", 3, 0, alphabet="ab=Z")
    with pytest.raises(ValueError, match="num"):
        make_synthetic_records("copy", 0, 0)


def test_jsonl_roundtrip_through_datasets(tmp_path):
    recs = make_synthetic_records("reverse", 30, seed=3) + make_synthetic_records("add", 30, seed=3)
    path = write_jsonl(recs, tmp_path / "tiny" / "train.jsonl")
    loaded, stats = load_records(str(path), id_field="id")
    assert loaded == recs
    assert stats.records_digest == records_digest(recs)
    assert stats.num_rows == stats.num_records == 60 and stats.skipped == []
