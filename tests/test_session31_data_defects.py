"""Session 31 data defects: a file in a split folder whose name starts with another split was read into both
splits (a train/test leak); a lone surrogate crashed hash_reward, records_digest and jsonl_bytes with
UnicodeEncodeError; and what the review of rlrepro/data found after them."""
import hashlib
import json
import re

import pytest

from rlrepro.data.loading import load_records
from rlrepro.data.records import PromptRecord, jsonl_bytes, records_digest
from rlrepro.data.rewards import BUILTIN_REWARDS, hash_reward


def _write(path, *prompts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "answer": "a"}) + "\n" for p in prompts))


# ------------------------------------------------------------------------------------- 1. split of a file


def test_a_split_folder_wins_over_the_file_name_prefix_no_train_test_leak(tmp_path):
    d = tmp_path / "ds"
    _write(d / "train" / "test_cases.jsonl", "in train")
    _write(d / "test.jsonl", "in test")
    train = [r.prompt for r in load_records(str(d), split="train")[0]]
    test = [r.prompt for r in load_records(str(d), split="test")[0]]
    assert train == ["in train"] and test == ["in test"]


def test_a_file_under_a_split_folder_is_in_no_other_split(tmp_path):
    d = tmp_path / "ds"
    _write(d / "test" / "train_part.jsonl", "t")
    with pytest.raises(ValueError, match=r"no files for split 'train'; splits found: \['test'\]"):
        load_records(str(d), split="train")
    assert [r.prompt for r in load_records(str(d), split="test")[0]] == ["t"]


def test_a_file_under_two_split_folders_is_refused_naming_it_and_the_fix(tmp_path):
    d = tmp_path / "ds"
    _write(d / "train" / "a.jsonl", "ok")
    _write(d / "train" / "test" / "b.jsonl", "both")
    for split in ("train", "test"):
        with pytest.raises(ValueError) as e:
            load_records(str(d), split=split)
        msg = str(e.value)
        assert "'train/test/b.jsonl'" in msg and "['test', 'train']" in msg and "Fix: move it" in msg


def test_the_longest_split_name_a_file_name_starts_with_wins(tmp_path):
    d = tmp_path / "ds"
    _write(d / "train.jsonl", "plain")
    _write(d / "train_hard.jsonl", "hard")
    assert [r.prompt for r in load_records(str(d), split="train_hard")[0]] == ["hard"]
    assert [r.prompt for r in load_records(str(d), split="train")[0]] == ["plain", "hard"]  # as before


def test_split_layouts_that_worked_still_work(tmp_path):
    d = tmp_path / "ds"
    _write(d / "train-00000-of-00002.jsonl", "t0")
    _write(d / "train-00001-of-00002.jsonl", "t1")
    _write(d / "validation" / "part.jsonl", "v")
    _write(d / "data" / "test" / "x.jsonl", "e")
    assert [r.prompt for r in load_records(str(d), split="train")[0]] == ["t0", "t1"]
    assert [r.prompt for r in load_records(str(d), split="validation")[0]] == ["v"]
    assert [r.prompt for r in load_records(str(d), split="test")[0]] == ["e"]


@pytest.mark.parametrize("split", [None, "", 3, "a/b"])
def test_a_split_that_is_not_a_name_is_refused_naming_it(tmp_path, split):
    _write(tmp_path / "ds" / "train.jsonl", "p")
    with pytest.raises(ValueError, match=r"data.split=" + re.escape(repr(split)) + " is not a split name"):
        load_records(str(tmp_path / "ds"), split=split)


# --------------------------------------------------------------------------------- 2. lone surrogates


REC = PromptRecord(uid="ds/train.jsonl:3", prompt="p", answer="42")


@pytest.mark.parametrize("completion", ["", "42", "the answer is \\boxed{42}", "h\u00e9llo \U0001F600 \u4e2d"])
def test_hash_reward_keeps_its_recorded_values_for_text_without_surrogates(completion):
    digest = hashlib.sha256((REC.uid + "\x00" + completion).encode("utf-8")).digest()
    assert hash_reward(completion, REC) == int.from_bytes(digest[:4], "little") / 0xFFFFFFFF


@pytest.mark.parametrize("completion", ["\ud800", "x\udfff 42", "\\boxed{42}\ud800", "\udc80\udcff"])
def test_hash_reward_of_a_lone_surrogate_is_a_deterministic_value(completion):
    value = hash_reward(completion, REC)
    assert 0.0 <= value <= 1.0 and value == hash_reward(completion, REC)
    assert value != hash_reward(completion.replace("\ud800", "?"), REC) or "\ud800" not in completion


@pytest.mark.parametrize("name", ["exact_match", "prefix_match", "math"])
def test_the_other_builtin_rewards_score_a_lone_surrogate(name):
    fn = BUILTIN_REWARDS[name]
    for completion in ("\ud800", "\\boxed{\ud800}", "\\boxed{42}\ud800"):
        value = fn(completion, REC)
        assert 0.0 <= value <= 1.0 and value == fn(completion, REC)


def test_records_digest_of_a_lone_surrogate_is_deterministic_and_others_keep_their_digest():
    plain = [REC, PromptRecord(uid="u\u00e9", messages=[{"role": "user", "content": "\U0001F600"}], answer="b")]
    h = hashlib.sha256()
    for r in plain:
        item = [r.uid, r.prompt, r.messages, r.answer]
        h.update(json.dumps(item, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n")
    assert records_digest(plain) == h.hexdigest()
    lone = [PromptRecord(uid="u", prompt="p\ud800", answer="a")]
    assert records_digest(lone) == records_digest(list(lone)) != records_digest(plain)


def test_jsonl_bytes_of_a_lone_surrogate_is_a_clear_error_naming_the_record_and_column():
    rec = PromptRecord(uid="r7", prompt="p", answer="a\ud800")
    with pytest.raises(ValueError) as e:
        jsonl_bytes([REC, rec])
    msg = str(e.value)
    assert "'r7'" in msg and "'answer'" in msg and "lone surrogate" in msg and "Fix:" in msg
    assert jsonl_bytes([REC]) == (json.dumps(REC.to_json_dict(), ensure_ascii=False) + "\n").encode("utf-8")


# ------------------------------------------------------------------------------------------- 3. review


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1.5, 0, -0.5])
def test_eval_pass_threshold_that_makes_pass_at_k_a_constant_is_refused(value):
    from rlrepro.checks import ConfigError
    from rlrepro.data.config import EvalConfig

    with pytest.raises(ConfigError, match=r"eval.pass_threshold=.* must be a number in \(0, 1\]"):
        EvalConfig(pass_threshold=value)
    assert EvalConfig(pass_threshold=0.5).pass_threshold == 0.5


@pytest.mark.parametrize("section,kw,key", [
    ("data", {"split": 2024}, "data.split=2024"), ("data", {"prompt_field": ""}, "data.prompt_field=''"),
    ("data", {"id_field": 3}, "data.id_field=3"), ("eval", {"split": 7}, "eval.split=7"),
    ("synthetic", {"seed": -1}, "data.synthetic.seed=-1"), ("synthetic", {"kwargs": "max_len=3"},
     "data.synthetic.kwargs"),
])
def test_data_config_names_and_synthetic_options_are_checked_naming_the_key(section, kw, key):
    from rlrepro.checks import ConfigError
    from rlrepro.data.config import DataConfig, EvalConfig, SyntheticConfig

    cls = {"data": DataConfig, "eval": EvalConfig, "synthetic": SyntheticConfig}[section]
    with pytest.raises(ConfigError, match=re.escape(key)):
        cls(**kw)
    cls()  # the defaults pass
