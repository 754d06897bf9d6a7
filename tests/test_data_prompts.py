"""build_prompts (records -> prompt token ids, the length limit, uid checks; what the driver ran inline) and the
unknown-token policy data.on_unknown_token: text outside a character tokenizer's vocabulary (uppercase, accents)
becomes <unk>, which is counted and reported instead of vanishing silently."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from rlrepro.data import Prompt, PromptRecord, PromptStats, build_prompts, tokenize_prompt

BOXED = "{prompt}\nanswer:"


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """The tokenizer of the grpo_tiny model, written and loaded the way a run does."""
    from rlrepro.model import load_tokenizer, write_tiny_checkpoint

    return load_tokenizer(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m"))


def rec(uid, prompt, answer="a"):
    return PromptRecord(uid=uid, prompt=prompt, answer=answer)


class CharTokenizer:
    """Duck-typed: one id per character, no unknown token."""

    def encode(self, text):
        return [ord(c) for c in text]


class UnkCountingTokenizer:
    """Duck-typed: lowercase letters only, everything else -> id 0; no offsets to recover the text."""

    unk_token_id = 0

    def encode(self, text):
        return [ord(c) if c.islower() else 0 for c in text]


def reference_driver_loop(records, tokenizer, max_prompt_tokens, on_bad_row, **render):
    """What rlrepro/orchestration/driver.py's load_prompts did with the loaded records (before build_prompts)."""
    prompts, skipped = [], []
    for r in records:
        ids = tokenize_prompt(r, tokenizer, **render)
        if len(ids) > max_prompt_tokens:
            if on_bad_row != "skip":
                raise ValueError("too long")
            skipped.append(r.uid)
            continue
        prompts.append((r.uid, ids, r))
    return prompts, skipped


def test_tiny_tokenizer_names_its_unknown_token(tiny_tok, tmp_path):
    assert tiny_tok.unk_token == "<unk>" and tiny_tok.unk_token_id == tiny_tok.token_to_id("<unk>")
    ids, offsets = tiny_tok.encode_offsets("aB\n")
    assert ids == tiny_tok.encode("aB\n") and ids[1] == tiny_tok.unk_token_id and offsets[1] == (1, 2)
    # a byte-level BPE without an unknown token (Qwen's kind): None, nothing to count
    from tokenizers import Tokenizer, models

    from rlrepro.model import load_tokenizer

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    tok = load_tokenizer(tmp_path)
    assert tok.unk_token is None and tok.unk_token_id is None


def test_unknown_characters_warn_in_one_line(tiny_tok, capsys):
    records = [rec("u:0", "copy: ab="), rec("u:1", "copy: AB="), rec("u:2", "reverse: xé="), rec("u:3", "Copy: B=")]
    prompts, stats = build_prompts(records, tiny_tok, max_prompt_tokens=64)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlrepro: data.on_unknown_token=warn: ")
    assert "3 of 4 prompts hold 5 unknown tokens '<unk>'" in err
    assert "(first: 'u:1')" in err and "'A', 'B', 'é', 'C'" in err and "data.on_unknown_token=error" in err
    assert stats.unknown_by_uid == {"u:1": 2, "u:2": 1, "u:3": 2}
    assert stats.unknown_pieces == {"A": 1, "B": 2, "é": 1, "C": 1}
    assert (stats.num_unknown_prompts, stats.num_unknown_tokens, stats.first_unknown_uid) == (3, 5, "u:1")
    assert stats.warnings == [err.rstrip("\n")]
    # counting changes nothing: the same prompts and ids as without it
    assert [(p.uid, p.token_ids) for p in prompts] == [(r.uid, tiny_tok.encode(r.prompt)) for r in records]


def test_unknown_characters_error_names_the_first_prompt_and_the_fix(tiny_tok):
    records = [rec("u:0", "copy: ab="), rec("u:1", "copy: AB="), rec("u:2", "Zz")]
    with pytest.raises(ValueError) as e:
        build_prompts(records, tiny_tok, max_prompt_tokens=64, on_unknown_token="error")
    msg = str(e.value)
    assert msg.startswith("prompt 'u:1' has 2 unknown token(s): 2 of 3 prompts hold 3 unknown tokens '<unk>'")
    assert "'A', 'B', 'Z'" in msg and "data.on_unknown_token=warn" in msg and "tokenizer that covers the text" in msg


def test_covered_text_prints_nothing(tiny_tok, capsys):
    prompts, stats = build_prompts([rec("u:0", "copy: ab="), rec("u:1", "12+7=")], tiny_tok, max_prompt_tokens=64,
                                   on_unknown_token="error")
    assert len(prompts) == 2 and stats.unknown_by_uid == {} and stats.warnings == []
    assert capsys.readouterr().err == ""


def test_chat_template_special_tokens_are_not_unknown(tiny_tok, capsys):
    prompts, stats = build_prompts([rec("u:0", "copy: ab="), rec("u:1", "Hi")], tiny_tok, use_chat_template=True,
                                   system_prompt="be brief", max_prompt_tokens=128)
    assert stats.unknown_by_uid == {"u:1": 1} and stats.unknown_pieces == {"H": 1}
    assert "<|im_start|>" not in stats.unknown_pieces and "(first: 'u:1')" in capsys.readouterr().err


def test_answers_are_not_tokenized(tiny_tok, capsys):
    _, stats = build_prompts([rec("u:0", "copy: ab=", answer="UPPER")], tiny_tok, max_prompt_tokens=64)
    assert stats.unknown_by_uid == {} and capsys.readouterr().err == ""


def test_tokenizers_without_unk_or_offsets(capsys):
    _, stats = build_prompts([rec("u:0", "ABC")], CharTokenizer())
    assert stats.unknown_token_id is None and stats.unknown_by_uid == {} and capsys.readouterr().err == ""
    _, stats = build_prompts([rec("u:0", "aBc"), rec("u:1", "abc")], UnkCountingTokenizer())
    assert stats.unknown_by_uid == {"u:0": 1} and stats.unknown_pieces == {}
    err = capsys.readouterr().err
    assert "1 of 2 prompts hold 1 unknown tokens id 0" in err and "became it" not in err


def test_same_prompts_as_the_driver_loop(tiny_tok):
    records = [rec(f"r:{i}", "copy: " + "ab" * i + "=") for i in range(8)]
    for max_tokens, policy in ((64, "error"), (20, "skip")):  # 15 + 2 i tokens
        prompts, stats = build_prompts(records, tiny_tok, template=BOXED, max_prompt_tokens=max_tokens,
                                       on_bad_row=policy)
        ref, skipped = reference_driver_loop(records, tiny_tok, max_tokens, policy, template=BOXED)
        assert [(p.uid, p.token_ids, p.record) for p in prompts] == ref and stats.skipped == skipped
        assert all(isinstance(p, Prompt) for p in prompts) and isinstance(stats, PromptStats)
        assert (stats.num_records, stats.num_prompts) == (8, len(ref))
    assert stats.skipped == [f"r:{i}" for i in range(3, 8)]


def test_length_limit_messages(tiny_tok, capsys):
    records = [rec("r:0", "copy: ab="), rec("r:1", "copy: abababab=")]
    with pytest.raises(ValueError, match=r"^prompt 'r:1' has 15 tokens > data.max_prompt_tokens=10; raise the "
                                         r"limit, filter the data set, or set data.on_bad_row=skip to leave such "
                                         r"prompts out$"):
        build_prompts(records, tiny_tok, max_prompt_tokens=10)
    prompts, stats = build_prompts(records, tiny_tok, max_prompt_tokens=10, on_bad_row="skip")
    assert [p.uid for p in prompts] == ["r:0"] and stats.skipped == ["r:1"]
    assert capsys.readouterr().err == ("rlrepro: data.on_bad_row=skip: left out 1 prompt(s) that are empty or longer "
                                       "than data.max_prompt_tokens=10 (first: 'r:1')\n")
    with pytest.raises(ValueError, match=r"^no prompt of d.jsonl is left after leaving out 2 empty or too long ones; "
                                         r"raise data.max_prompt_tokens$"):
        build_prompts(records, tiny_tok, max_prompt_tokens=5, on_bad_row="skip", source="d.jsonl")


def test_argument_errors_name_keys(tiny_tok):
    r = [rec("r:0", "ab"), rec("r:0", "cd")]
    with pytest.raises(ValueError, match=r"prompt uids are not unique \('r:0' twice\); set data.id_field"):
        build_prompts(r, tiny_tok)
    with pytest.raises(ValueError, match=r"data.on_unknown_token='.*' is not a choice: it must be warn or error"):
        build_prompts(r[:1], tiny_tok, on_unknown_token="ignore")
    with pytest.raises(ValueError, match=r"data.on_bad_row='.*' is not a choice: it must be error or skip"):
        build_prompts(r[:1], tiny_tok, on_bad_row="drop")
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens=.* is not a positive integer"):
        build_prompts(r[:1], tiny_tok, max_prompt_tokens=0)
