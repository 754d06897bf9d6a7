"""Bad input named before any work: ``env.tools=[]``, a data file of empty rows, a class as ``reward.fn``."""
import re
import sys

import pytest

from rlrepro.checks import ConfigError
from rlrepro.data import PromptRecord, load_records, load_reward_fn
from rlrepro.envs import load_env
from rlrepro.envs.config import EnvConfig


# ------------------------------------------------------------------------------------------ env.tools=[]
@pytest.mark.parametrize("name", ["tool", "calculator_task"])
def test_an_empty_tool_list_is_a_config_error_not_the_default_tools(name):
    with pytest.raises(ConfigError, match=r"env\.tools=\[\] is an empty list.*Fix: drop env\.tools.*single_turn"):
        EnvConfig(name=name, tools=[])
    # null still means the environment's own tools, and a named list is used as given
    rec = PromptRecord(uid="u", prompt="1*2=", answer="2")
    default = {"tool": ["python"], "calculator_task": ["calculator"]}[name]
    for tools, want in ((None, default), (["python", "calculator"], ["python", "calculator"])):
        env = load_env(EnvConfig(name=name, tools=tools), lambda c, r: 0.0).make(rec, 0)
        assert [t.name for t in env.tools] == want


def test_an_empty_tool_list_fails_when_the_config_is_composed():
    from rlrepro.cli import compose_config

    with pytest.raises(ConfigError, match=r"env\.tools=\[\] is an empty list"):
        compose_config(["recipe=grpo_tiny", "env.name=tool", "env.max_turns=3", "env.tools=[]"])


# ------------------------------------------------------------------------------------------ rows without columns
@pytest.mark.parametrize("name, text", [("rows.jsonl", "{}\n{}\n"), ("blank.jsonl", "{}\n\n{}"),
                                        ("rows.json", "[{}, {}]")])
def test_a_file_of_empty_objects_says_the_rows_have_no_columns(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_records(str(path))
    msg = str(e.value)
    assert "the rows have no columns" in msg and "the prompt field 'prompt' (data.prompt_field)" in msg, msg
    assert "the answer field 'answer' (data.answer_field)" in msg and "one JSON object per line" not in msg, msg
    with pytest.raises(ValueError, match=r"the id field 'qid' \(data\.id_field\)"):
        load_records(str(path), id_field="qid")


def test_unreadable_json_keeps_its_message(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"prompt": "a", "answer": "b"}, {"prompt": ')   # not empty rows: the generic message
    with pytest.raises(ValueError, match="one JSON object per line") as e:
        load_records(str(path))
    assert "no columns" not in str(e.value)


# ------------------------------------------------------------------------------------------ reward.fn=Class
@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "gaps_reward_mod.py").write_text(
        "class TwoArgs:\n"
        "    def __init__(self, completion, record):\n"
        "        self.completion = completion\n"
        "class Callable:\n"
        "    def __call__(self, completion, record):\n"
        "        return 1.0\n"
        "score = Callable()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "gaps_reward_mod"
    sys.modules.pop("gaps_reward_mod", None)


@pytest.mark.parametrize("attr", ["TwoArgs", "Callable"])
def test_a_class_as_reward_fn_is_refused_at_load(reward_module, attr):
    spec = f"{reward_module}:{attr}"
    with pytest.raises(ValueError, match=rf"reward\.fn={re.escape(repr(spec))} names a class \({attr}\).*Fix: "
                                         r"point reward\.fn at a function"):
        load_reward_fn(spec)


def test_an_instance_with_call_is_still_a_reward(reward_module):
    fn = load_reward_fn(f"{reward_module}:score")
    assert fn("x", PromptRecord(uid="u", prompt="p", answer="x")) == 1.0
