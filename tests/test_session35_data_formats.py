"""Data sets prepared for other RL frameworks load with a few ``data.*`` keys (docs/DATA.md, "Data sets of other
frameworks"): verl's preprocessed parquet (chat list + nested ``reward_model.ground_truth``), slime's jsonl (a
prompt column of text or chat turns), and AReaL/OpenRLHF gsm8k jsonl (a rationale ending in ``#### 72``).

Each is loaded as a run loads it (``load_records`` then ``build_prompts`` with the driver's keys), compared
exactly, and loaded twice for the same records digest.
"""
from __future__ import annotations

import json

import pytest

from rlrepro.data import PromptRecord, build_prompts, load_records, load_reward_fn

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

VERL_INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from rlrepro.model import load_tokenizer, write_tiny_checkpoint

    return load_tokenizer(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m"))


def load_as_a_run(source, tokenizer, **keys):
    """What ``Driver._load_prompts`` does with the ``data.*`` keys (defaults of the schema)."""
    render = {k: keys.pop(k) for k in ("template", "use_chat_template") if k in keys}
    records, stats = load_records(str(source), split="train", on_bad_row="error", allow_hub=False, limit=None,
                                  revision=None, **keys)
    prompts, _ = build_prompts(records, tokenizer, system_prompt=None, max_prompt_tokens=512, on_bad_row="error",
                               on_unknown_token="warn", source=str(source), **{"use_chat_template": True, **render})
    return records, stats, prompts


def verl_parquet(path):
    """The layout of verl's examples/data_preprocess/gsm8k.py output."""
    rows = []
    for i, (q, rationale, a) in enumerate([("what is 2+3?", "2+3 = <<2+3=5>>5", "5"),
                                           ("what is 9*8?", "9*8 = <<9*8=72>>72", "72")]):
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q + VERL_INSTRUCTION}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
                     "extra_info": {"split": "train", "index": i, "answer": f"{rationale}\n#### {a}", "question": q}})
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_verl_parquet_loads_with_a_nested_answer_field(tmp_path, tiny_tok):
    f = verl_parquet(tmp_path / "train.parquet")
    keys = dict(messages_field="prompt", answer_field="reward_model.ground_truth")
    records, stats, prompts = load_as_a_run(f, tiny_tok, **keys)
    assert [(r.uid, r.messages, r.prompt, r.answer) for r in records] == [
        ("train.parquet:0", [{"role": "user", "content": "what is 2+3?" + VERL_INSTRUCTION}], None, "5"),
        ("train.parquet:1", [{"role": "user", "content": "what is 9*8?" + VERL_INSTRUCTION}], None, "72")]
    # the struct a nested field reads from stays whole in meta (a reward can read extra_info too)
    assert records[1].meta == {"data_source": "openai/gsm8k", "ability": "math",
                               "reward_model": {"style": "rule", "ground_truth": "72"},
                               "extra_info": {"split": "train", "index": 1, "answer": "9*8 = <<9*8=72>>72\n#### 72",
                                              "question": "what is 9*8?"}}
    assert [p.uid for p in prompts] == ["train.parquet:0", "train.parquet:1"]
    assert prompts[1].token_ids == tiny_tok.encode(tiny_tok.apply_chat_template(
        records[1].messages, add_generation_prompt=True, tokenize=False))
    again, stats2, _ = load_as_a_run(f, tiny_tok, **keys)
    assert again == records and stats2.records_digest == stats.records_digest
    # a nested integer as the id: extra_info.index
    by_id, _ = load_records(str(f), id_field="extra_info.index", **keys)
    assert [r.uid for r in by_id] == ["0", "1"] and [r.answer for r in by_id] == ["5", "72"]


def test_a_missing_nested_field_names_the_nested_columns(tmp_path):
    f = verl_parquet(tmp_path / "train.parquet")
    with pytest.raises(ValueError) as e:
        load_records(str(f), messages_field="prompt", answer_field="reward_model.truth")
    msg = str(e.value)
    assert "the answer field 'reward_model.truth' is not in the data set" in msg
    assert "'reward_model.ground_truth'" in msg and "'extra_info.answer'" in msg
    assert "Fix: set data.answer_field=<one of those>" in msg
    # a struct column holds no text: the message points at its fields
    with pytest.raises(ValueError, match=r"field 'reward_model': expected text, got dict .*"
                                         r"data.answer_field=reward_model.ground_truth"):
        load_records(str(f), messages_field="prompt", answer_field="reward_model")


def test_a_column_whose_name_has_a_dot_wins_over_a_path(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "p", "a.b": "flat", "a": {"b": "nested"}}) + "\n")
    recs, _ = load_records(str(f), answer_field="a.b")
    assert recs[0].answer == "flat"


def test_nested_json_answer(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"q": f"q{i}", "label": {"gt": f"{i}", "style": "rule"}}) + "\n"
                         for i in range(2)))
    recs, _ = load_records(str(f), prompt_field="q", answer_field="label.gt")
    assert [(r.prompt, r.answer) for r in recs] == [("q0", "0"), ("q1", "1")]


def slime_jsonl(path):
    rows = [{"prompt": "what is 2+3?", "label": "5", "metadata": {"k": 1}},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 9*8?"}],
             "label": "72"},
            {"prompt": "007 agents?", "label": "7"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_slime_prompts_of_text_or_chat_turns(tmp_path, tiny_tok):
    f = slime_jsonl(tmp_path / "train.jsonl")
    keys = dict(messages_field="prompt", answer_field="label")
    records, stats, prompts = load_as_a_run(f, tiny_tok, **keys)
    assert records == [
        PromptRecord(uid="train.jsonl:0", prompt="what is 2+3?", answer="5", meta={"metadata": {"k": 1}}),
        PromptRecord(uid="train.jsonl:1", messages=[{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "what is 9*8?"}],
                     answer="72", meta={"metadata": None}),
        PromptRecord(uid="train.jsonl:2", prompt="007 agents?", answer="7", meta={"metadata": None})]
    # a text prompt is one user turn under the chat template, as slime's apply_chat_template makes it
    assert prompts[0].token_ids == tiny_tok.encode(tiny_tok.apply_chat_template(
        [{"role": "user", "content": "what is 2+3?"}], add_generation_prompt=True, tokenize=False))
    again, stats2, _ = load_as_a_run(f, tiny_tok, **keys)
    assert again == records and stats2.records_digest == stats.records_digest


def test_slime_text_prompts_only(tmp_path, tiny_tok):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"prompt": "what is 2+3?", "label": "5"}) + "\n")
    for keys in (dict(answer_field="label"), dict(messages_field="prompt", answer_field="label")):
        records, _, _ = load_as_a_run(f, tiny_tok, **keys)
        assert records == [PromptRecord(uid="train.jsonl:0", prompt="what is 2+3?", answer="5")]


def test_chat_turns_read_as_text_are_refused(tmp_path):
    """prompt_field on a column holding chat lists would train on their JSON text: refused, naming the key."""
    f = slime_jsonl(tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match=r"line 2: field 'prompt': .*chat turns.* data.messages_field=prompt"):
        load_records(str(f), answer_field="label")


GSM8K = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                      "May. How many clips did Natalia sell altogether in April and May?",
          "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                    "altogether in April and May.\n#### 72"},
         {"question": "He pays for 2 things at 1000 each. How much?",
          "answer": "He pays 2*1000=<<2*1000=2000>>2000\n#### 2,000"}]


def test_gsm8k_jsonl_and_the_math_reward(tmp_path, tiny_tok):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    records, stats, _ = load_as_a_run(f, tiny_tok, prompt_field="question", use_chat_template=False)
    assert [(r.prompt, r.answer) for r in records] == [(r["question"], r["answer"]) for r in GSM8K]
    again, stats2, _ = load_as_a_run(f, tiny_tok, prompt_field="question", use_chat_template=False)
    assert stats2.records_digest == stats.records_digest
    math = load_reward_fn("math")
    assert [math(c, records[0]) for c in (r"so \boxed{72}", "The answer is 72", r"\boxed{24}")] == [1.0, 1.0, 0.0]
    # math-verify's extraction finds the final answer of the rationale (a thousands separator too)
    assert [math(c, records[1]) for c in (r"\boxed{2000}", r"\boxed{2,000}", r"\boxed{1000}")] == [1.0, 1.0, 0.0]


def test_gsm8k_rationale_answers_with_a_string_reward_are_said_once():
    """exact_match on '... #### 72' golds scores ~every completion 0 and nothing failed: the run now says so, naming
    reward.fn=math; not with reward.fn=math, nor for plain answers."""
    from types import SimpleNamespace

    from rlrepro.cli import compose_config
    from rlrepro.orchestration.config import validate
    from rlrepro.orchestration.preflight import warn_rationale_answers

    def prompts(answers):
        return [SimpleNamespace(record=SimpleNamespace(answer=a)) for a in answers]
    golds = prompts(["She sold 48/2 = 24 clips.\n#### 72", "Weng earns 12/60 = $0.2 per minute.\n#### 10"])
    said = []
    cfg = validate(compose_config(["recipe=grpo_tiny", "reward.fn=exact_match"]))
    assert warn_rationale_answers(cfg, golds, say=said.append) is True
    assert said == ["warning: 2 of the first 2 gold answers are worked solutions ending in '#### <answer>' (GSM8K "
                    "style), which reward.fn=exact_match compares whole: a completion scores only when it repeats the "
                    "whole solution. Set reward.fn=math to score the final answer (docs/DATA.md)"]
    assert warn_rationale_answers(cfg, prompts(["72", "10"]), say=said.append) is False
    assert warn_rationale_answers(cfg, prompts(["#### 72", "10"]), say=said.append) is False  # no rationale
    math_cfg = validate(compose_config(["recipe=grpo_tiny", "reward.fn=math"]))
    assert warn_rationale_answers(math_cfg, golds, say=said.append) is False and len(said) == 1
