"""Session 32: a user's custom tool environment, written from docs/ENVS.md (a tool with JSON arguments, one that
raises, one with a long output, an environment that ends early and scores the whole conversation), and the
defects it found: a user's broken factory or tool must fail loudly with one line naming it and the fix, and a
tool schema or function that no call could use must be refused when the Tool is made."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlrepro.data import PromptRecord
from rlrepro.envs import (EnvConfig, EnvError, Environment, EnvReset, StepResult, Tool, ToolEnv, episode_seed,
                          execute_calls, load_env, make_tool_format, register_env, replay, run_episode,
                          transcript_digest)
from rlrepro.envs.registry import BUILTIN_ENVS

REC = PromptRecord(uid="u1", prompt="What is a?", answer="apple")
DOC = Path(__file__).resolve().parents[1] / "docs" / "ENVS.md"


def exact(text, record):
    return float(text.strip() == record.answer)


def _lookup(key, n):
    return json.dumps({"key": key, "value": {"a": "apple", "b": "banana"}[key] * n})


def _boom(msg):
    raise RuntimeError(f"kaboom {msg}")


LOOKUP = Tool("lookup", "look up a key", {"type": "object", "properties": {
    "key": {"type": "string", "enum": ["a", "b", "c"]}, "n": {"type": "integer"}}, "required": ["key", "n"]}, _lookup)
BOOM = Tool("boom", "raises", {"type": "object", "properties": {"msg": {"type": "string"}}, "required": ["msg"]},
            _boom)
LONG = Tool("long", "long output", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            lambda n: "x" * n)


class ConvEnv(Environment):
    """Ends early on STOP (a reason of its own); else reward = exact answer + share of turns with an ok call."""

    def __init__(self, record, seed, config, reward_fn):
        self.record, self.seed, self.reward_fn = record, seed, reward_fn
        self.fmt, self.max_obs = make_tool_format(config.tool_format), config.max_observation_chars
        self.turns, self.ok_calls = 0, 0

    def reset(self):
        return EnvReset(prompt=f"{self.record.prompt} (variant {self.seed % 7})",
                        tools=self.fmt.tool_schemas([LOOKUP, BOOM, LONG]))

    def step(self, text):
        self.turns += 1
        if "STOP" in text:
            return StepResult(done=True, reward=0.25, finish_reason="gave_up")
        msgs, malformed, info = execute_calls(text, [LOOKUP, BOOM, LONG], self.fmt, max_calls=4,
                                              max_observation_chars=self.max_obs)
        self.ok_calls += sum(1 for c in info if c.get("ok"))
        if not msgs:
            return StepResult(done=True, reward=self.reward_fn(text, self.record) + self.ok_calls / self.turns)
        return StepResult(messages=msgs, penalty=0.1 * malformed, info={"calls": info})


def make_conv(record, seed, *, config, reward_fn):
    return ConvEnv(record, seed, config, reward_fn)


def call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


TURNS = [
    call("lookup", {"key": "a", "n": 2}) + call("lookup", {"key": "c", "n": 1}) + call("boom", {"msg": "hi"}),
    "<tool_call>{bad json</tool_call>" + call("nope", {}) + call("lookup", {"key": "a", "n": "2"})
    + call("lookup", {"key": "a", "n": 2.5}),
    call("long", {"n": 10 ** 5}) + '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"b\\", \\"n\\": 1}"}'
    '</tool_call>',
    call("lookup", {"key": "a", "n": True}) + "<tool_call>[1,2]</tool_call></tool_call><tool_call>",
    "apple",
]


def _play(spec, seed):
    it = iter(TURNS)
    return run_episode(spec.make(REC, seed), lambda transcript: next(it), max_turns=6, uid=REC.uid)


def test_a_custom_tool_env_runs_and_every_model_mistake_is_an_observation():
    spec = load_env(EnvConfig(fn=f"{__name__}:make_conv", max_turns=6), exact)
    ep = _play(spec, episode_seed(0, 0, REC.uid, 0))
    obs = [m["content"] for m in ep.transcript if m["role"] == "tool"]
    assert obs[0] == '{"key": "a", "value": "appleapple"}'
    assert obs[1] == "Error: lookup raised KeyError: 'c'"
    assert obs[2] == "Error: boom raised RuntimeError: kaboom hi"
    assert obs[3].startswith("Error: invalid JSON in the tool call:")
    assert obs[4] == "Error: unknown tool 'nope'; available: boom, long, lookup"
    assert obs[5] == "Error: bad arguments for lookup: argument 'n' must be of type integer, got str"
    assert obs[6] == "Error: bad arguments for lookup: argument 'n' must be of type integer, got float"
    assert obs[7] == "x" * 4096 + "\n[truncated: 100000 characters, the first 4096 are shown]"
    assert obs[8] == '{"key": "b", "value": "banana"}'
    assert obs[9] == "Error: bad arguments for lookup: argument 'n' must be of type integer, got bool"
    assert len(obs) == 13
    assert ep.outcome.finish_reason == "done" and ep.outcome.penalties == [0.0, 0.4, 0.0, 0.4, 0.0]
    assert ep.outcome.reward == 1.0 + 3 / 5
    # the same (record, seed, turns): the same bytes; an early end has its own reason
    seed = episode_seed(0, 0, REC.uid, 0)
    a, b = replay(spec.make(REC, seed), TURNS), replay(spec.make(REC, seed), TURNS)
    assert transcript_digest(*a) == transcript_digest(*b)
    stop = spec.episode(REC, seed)
    stop.reset()
    assert stop.step("STOP", 1).finish_reason == "gave_up" and stop.outcome.reward == 0.25


def test_a_factory_that_raises_is_an_env_error_naming_it_the_record_and_the_fix():
    def broken(record, seed, *, config, reward_fn):
        return {"x": 1}[record.meta["missing"]]
    register_env("s32_broken")(broken)
    try:
        spec = load_env(EnvConfig(name="s32_broken"), exact)
        with pytest.raises(EnvError) as err:
            spec.make(REC, 3)
        msg = str(err.value)
        assert "\n" not in msg
        assert "'s32_broken'" in msg and "'u1'" in msg and "KeyError" in msg and "Fix" in msg
        with pytest.raises(EnvError, match="'s32_broken' raised"):
            spec.episode(REC, 3)
    finally:
        BUILTIN_ENVS.pop("s32_broken")
    # a factory's ValueError (bad env.kwargs) stays a ValueError, named
    with pytest.raises(ValueError, match="factory 'calculator_task'.*calculator_task takes no options"):
        load_env(EnvConfig(name="calculator_task", kwargs={"x": 1}), exact).make(REC, 0)


def test_a_tool_returning_no_text_is_the_users_bug_not_an_observation():
    forgot = Tool("forgot", "forgot return", {"type": "object", "properties": {}}, lambda: None)
    with pytest.raises(TypeError, match=r"tool 'forgot' returned NoneType, not a str\. Fix: .*return"):
        forgot.run({})

    async def slow():
        return "late"
    coro = Tool("slow", "async", {"type": "object", "properties": {}}, slow)
    with pytest.raises(TypeError, match="tool 'slow'.*async.*not supported"):
        coro.run({})
    # inside an episode it is the environment's EnvError, naming the record and the turn
    fmt = make_tool_format("qwen3")

    class Env(Environment):
        def reset(self):
            return EnvReset(prompt="p")

        def step(self, text):
            msgs, _, _ = execute_calls(text, [forgot], fmt, max_calls=4, max_observation_chars=100)
            return StepResult(messages=msgs)
    spec = load_env(EnvConfig(fn=f"{__name__}:make_conv"), exact)
    ep = spec.episode(REC, 0)
    ep.env = Env()
    ep.reset()
    with pytest.raises(EnvError, match="turn 1: TypeError: tool 'forgot' returned NoneType"):
        ep.step(call("forgot", {}), 1)


@pytest.mark.parametrize("params, fn, match", [
    ({"type": "object", "properties": {"x": {"type": "string"}}}, lambda y: "", "cannot be called with"),
    ({"type": "object", "properties": {"x": {"type": "string"}}}, lambda: "", "cannot be called with"),
    ({"type": "object", "properties": {}}, lambda x: "", "cannot be called with"),
    ({"type": "object", "properties": {"x": {"type": "string", "enum": 5}}}, lambda x: x, "enum"),
])
def test_a_tool_no_call_could_use_is_refused_when_made(params, fn, match):
    with pytest.raises(ValueError, match=match) as err:
        Tool("t", "d", params, fn)
    assert "tool 't'" in str(err.value) and "\n" not in str(err.value)


def test_tools_whose_signature_fits_are_accepted():
    opt = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"}}, "required": ["x"]}
    for fn in (lambda x, y=0: f"{x}{y}", lambda **kw: f"{kw['x']}{kw.get('y', 0)}",
               lambda x, **kw: f"{x}{kw.get('y', 0)}"):
        tool = Tool("t", "d", opt, fn)  # made without refusal, and callable with the schema's arguments
        assert tool.run({"x": "a"}).text == "a0" and tool.run({"x": "a", "y": 2}).text == "a2"


def _doc_example() -> str:
    text = DOC.read_text()
    m = re.search(r"## 9\. Writing your own environment.*?```python\n(.*?)```", text, re.S)
    assert m, "docs/ENVS.md section 9 has a python example"
    return m.group(1)


def test_the_docs_custom_environment_example_runs_as_written(tmp_path):
    (tmp_path / "my_tools_env.py").write_text(_doc_example())
    code = ("import json, my_tools_env\n"
            "from rlrepro.data import PromptRecord\n"
            "from rlrepro.envs import EnvConfig, load_env, run_episode\n"
            "spec = load_env(EnvConfig(fn='my_tools_env:make_env', max_turns=3), lambda t, r: float(t == r.answer))\n"
            "rec = PromptRecord(uid='r0', prompt='How long is apple?', answer='5')\n"
            "turns = iter(['<tool_call>{\"name\": \"word_length\", \"arguments\": {\"word\": \"apple\"}}</tool_call>',"
            " '5'])\n"
            "ep = run_episode(spec.make(rec, 1), lambda tr: next(turns), max_turns=3)\n"
            "print(json.dumps([ep.transcript, ep.outcome.reward, ep.outcome.finish_reason]))\n"
            "g = iter(['9', '0', '3'])\n"
            "ep = run_episode(my_tools_env.make_guess_env(rec, 13, config=None, reward_fn=None), lambda tr: next(g),"
            " max_turns=5)\n"
            "print(json.dumps([[m['content'] for m in ep.transcript], ep.outcome.reward]))\n")
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[1]}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    transcript, reward, reason = json.loads(first)
    assert json.loads(second) == [["Guess my digit.", "9", "lower", "0", "higher", "3"], 1 / 3]
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert transcript[2]["content"] == "5" and reward == 1.0 and reason == "done"


def test_two_tools_with_one_name_are_refused():
    a = Tool("t", "one", {"type": "object", "properties": {}}, lambda: "first")
    b = Tool("t", "two", {"type": "object", "properties": {}}, lambda: "second")
    with pytest.raises(ValueError, match="two tools are named 't'. Fix"):
        ToolEnv(REC, tools=[a, b], tool_format=make_tool_format("qwen3"), reward_fn=exact)
    with pytest.raises(ValueError, match="two tools are named 't'"):
        execute_calls(call("t", {}), [a, b], make_tool_format("qwen3"), max_calls=4, max_observation_chars=99)
