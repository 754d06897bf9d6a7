"""A huge data line or prompt is refused at once and with little memory (issue 22 item 7): a 50 MB line was
refused only after 248 s and 19.4 GB. JSON-lines files are scanned in chunks (a line over ``max_line_bytes`` is
a bad row, never parsed) and ``build_prompts`` bounds a prompt's characters before tokenizing it."""
import json
import time
import tracemalloc

import pytest

from rlrepro.data import PromptRecord, build_prompts, load_records
from rlrepro.data.loading import MAX_LINE_BYTES

LINE_MB = 40


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """Line 1 a row, line 2 a row of 40 MiB, line 3 blank, line 4 a row, line 5 not JSON, line 6 a row."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    chunk = "a" * (1 << 20)
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "first", "answer": "1"}) + "\n")
        f.write('{"prompt": "')
        for _ in range(LINE_MB):
            f.write(chunk)
        f.write('", "answer": "2"}\n\n')
        f.write(json.dumps({"prompt": "third", "answer": "3"}) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"prompt": "fifth", "answer": "5"}) + "\n")
    return path


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory):
    # datasets imports its JSON builder on the first load: that is not the memory of a load
    path = tmp_path_factory.mktemp("warm") / "w.jsonl"
    path.write_text('{"prompt": "p", "answer": "a"}\n{bad\n')
    load_records(str(path), on_bad_row="skip")


def _measured(fn):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        result = e
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def test_a_huge_line_is_refused_with_its_line_number_quickly(big_file):
    error, seconds, peak = _measured(lambda: load_records(str(big_file)))
    assert isinstance(error, ValueError), error
    assert (f"big.jsonl: line 2: the line is {LINE_MB * (1 << 20) + 29} bytes, over the limit of {MAX_LINE_BYTES} "
            "bytes; it was not parsed. Fix: shorten or remove that line") in str(error)
    assert "data.on_bad_row=skip" in str(error)
    assert seconds < 10, seconds                       # milliseconds in practice; minutes before
    assert peak < 4 << 20, peak                        # about one 1 MiB chunk, not the 40 MiB line


def test_skip_leaves_the_huge_line_out_and_keeps_row_indices(big_file):
    (records, stats), seconds, peak = _measured(lambda: load_records(str(big_file), on_bad_row="skip"))
    assert [r.uid for r in records] == ["big.jsonl:0", "big.jsonl:2", "big.jsonl:4"]
    assert [r.prompt for r in records] == ["first", "third", "fifth"]
    assert [(s.row_index, s.position, s.reason) for s in stats.skipped] == [
        (1, "line 2", "too long"), (3, "line 5", "invalid JSON")]
    assert stats.num_rows == 5 and stats.files[0]["num_rows"] == 5
    assert seconds < 20, seconds
    assert peak < (LINE_MB << 20) // 2, peak          # datasets' own buffers (about 10 MB), not the line


def test_the_limit_is_a_parameter(tmp_path):
    path = tmp_path / "d.jsonl"
    line = json.dumps({"prompt": "q" * 100, "answer": "b"})
    path.write_text('{"prompt": "p", "answer": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"d.jsonl: line 2: the line is {len(line)} bytes, over the limit of 100 "):
        load_records(str(path), max_line_bytes=100)
    assert len(load_records(str(path), max_line_bytes=None)[0]) == 2
    assert len(load_records(str(path), max_line_bytes=len(line))[0]) == 2
    with pytest.raises(ValueError, match="max_line_bytes must be a positive integer or None"):
        load_records(str(path), max_line_bytes=0)


class CharTokenizer:
    """One token per ``width`` characters; refuses to tokenize the huge prompt (it must never be asked to)."""

    def __init__(self, width=1, vocab=None):
        self.width, self.vocab = width, vocab

    def encode(self, text):
        assert len(text) < 10_000_000, "the tokenizer was handed the huge prompt"
        return list(range(1, -(-len(text) // self.width) + 1))

    def get_vocab(self):
        return self.vocab if self.vocab is not None else {"a": 1}


def test_a_huge_prompt_is_refused_before_tokenizing():
    huge = PromptRecord(uid="huge", prompt="a" * (LINE_MB << 20), answer="1")
    ok = PromptRecord(uid="ok", prompt="abc", answer="1")
    error, seconds, peak = _measured(lambda: build_prompts([ok, huge], CharTokenizer(), max_prompt_tokens=512))
    assert isinstance(error, ValueError), error
    assert (f"prompt 'huge' has {LINE_MB << 20} characters > 32768 = data.max_prompt_tokens=512 x 64 characters "
            "per token, so more than 512 tokens (it was not tokenized)") in str(error)
    assert seconds < 5, seconds
    assert peak < 2 * (LINE_MB << 20), peak            # the rendered copy, nothing more
    prompts, stats = build_prompts([ok, huge], CharTokenizer(), max_prompt_tokens=512, on_bad_row="skip")
    assert [p.uid for p in prompts] == ["ok"] and stats.skipped == ["huge"]


def test_the_bound_never_refuses_a_prompt_that_fits():
    # 100 characters per token: a prompt of 512 * 64 + 1 characters is 328 tokens, within 512
    wide = CharTokenizer(width=100, vocab={"x" * 100: 1, "a": 2})
    rec = PromptRecord(uid="wide", prompt="x" * (512 * 64 + 1), answer="1")
    prompts, _ = build_prompts([rec], wide, max_prompt_tokens=512)
    assert len(prompts[0].token_ids) == 328
    # past twice the longest token per allowed token it cannot fit, and is refused without tokenizing
    rec = PromptRecord(uid="wider", prompt="x" * (512 * 200 + 1), answer="1")
    with pytest.raises(ValueError, match=r"> 102400 = data.max_prompt_tokens=512 x 200 characters per token"):
        build_prompts([rec], wide, max_prompt_tokens=512)
