"""Session 29 review of rlrepro.envs: defects found and fixed (each test fails on the code before the fix)."""
from __future__ import annotations

import pytest

from rlrepro.envs.api import EnvError, EnvReset, Environment, StepResult
from rlrepro.envs.episode import Episode
from rlrepro.envs.sandbox import run_python
from rlrepro.envs.tool_calls import MalformedCall, Qwen3ToolFormat
from rlrepro.envs.tool_env import execute_calls
from rlrepro.envs.tools import Tool, make_tools

_COMPLEX = ("Error: ValueError: the result is a complex number (a negative number raised to a fractional power?), "
            "which the sandbox does not support (line {})")


@pytest.mark.parametrize("code, line", [
    ("print((-8) ** (1/3))", 1), ("print(pow(-8, 0.5))", 1), ("x = -2.0\nx **= 0.5\nprint(x)", 2),
    ("from fractions import Fraction\nprint(Fraction(-8) ** 0.5)", 2), ("print((-8.0) ** 0.5 + 1)", 1),
])
def test_sandbox_refuses_complex_results(code, line):
    # was: the program held a complex number (outside the sandbox's closed set of types) and printed
    # '<complex object>' for it, for z, z*z, [z], f'{z}' alike: a meaningless observation, no error
    assert run_python(code).observation() == _COMPLEX.format(line)
    assert run_python("print((-8) ** 2, 8 ** (1/3), (-8) ** -1)").observation() == "64 2.0 -0.125"


def test_qwen3_call_with_an_out_of_range_number_is_malformed():
    # was: 1e400 parsed to float('inf') and reached the tool, though NaN/Infinity are refused as invalid JSON
    fmt = Qwen3ToolFormat()
    text = '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'
    assert fmt.parse(text, {}) == [MalformedCall(
        text, "invalid JSON in the tool call: the number 1e400 is out of range (not a finite float)")]
    tool = Tool("f", "echo", {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
                fn=lambda x: repr(x))
    messages, malformed, _ = execute_calls(text, [tool], fmt, max_calls=4, max_observation_chars=1000)
    assert malformed == 1 and messages[0]["content"].startswith("Error: invalid JSON in the tool call: the number")
    ok = '<tool_call>{"name": "f", "arguments": "{\\"x\\": -1.5e300}"}</tool_call>'
    assert execute_calls(ok, [tool], fmt, max_calls=4, max_observation_chars=1000)[0] == [
        {"role": "tool", "content": "-1.5e+300"}]
    bad_string_args = '<tool_call>{"name": "f", "arguments": "{\\"x\\": -1e999}"}</tool_call>'
    assert execute_calls(bad_string_args, [tool], fmt, max_calls=4, max_observation_chars=1000)[1] == 1


def test_unreadable_calls_do_not_use_up_max_calls_per_turn():
    # env.max_calls_per_turn counts calls run; was: unreadable blocks (bad JSON, a stray tag) counted too, so a
    # well-formed call after them was refused with "more than N tool calls" though none had run
    fmt = Qwen3ToolFormat()
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    text = "<tool_call>oops</tool_call></tool_call>" + good + "<tool_call>{}</tool_call>" + good + good
    messages, malformed, info = execute_calls(text, make_tools(["calculator"]), fmt, max_calls=2,
                                              max_observation_chars=1000)
    assert [m["content"] for m in messages] == [
        "Error: invalid JSON in the tool call: Expecting value: line 1 column 1 (char 0)",
        "Error: </tool_call> without an opening <tool_call>", "2",
        "Error: the tool call has no \"name\" string", "2",
        "Error: more than 2 tool calls in one turn; this one was not run"]
    assert malformed == 3
    assert info[-1] == {"tool": "calculator", "skipped": True}


class _BadTruncation(Environment):
    def __init__(self, value):
        self.value = value

    def reset(self):
        return EnvReset(prompt="p")

    def step(self, text):
        return StepResult(messages=[{"role": "tool", "content": "x"}])

    def truncated_reward(self, finish_reason):
        return self.value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "1"])
def test_a_bad_truncated_reward_is_an_env_error_naming_the_record(value):
    # was: a bare ValueError from StepResult ("a done StepResult needs a finite reward"), naming neither the
    # environment nor the record, unlike every other broken-environment error
    ep = Episode(_BadTruncation(value), max_turns=1, uid="rec-7")
    ep.reset()
    with pytest.raises(EnvError, match=r"_BadTruncation\.truncated_reward\('max_turns'\) returned .* record 'rec-7'"):
        ep.step("a", 1)
    ep = Episode(_BadTruncation(value), max_turns=3, max_episode_tokens=4, uid="rec-8")
    ep.reset()
    with pytest.raises(EnvError, match=r"truncated_reward\('token_budget'\) .* record 'rec-8'"):
        ep.add_context_tokens(4)
    ok = Episode(_BadTruncation(0.25), max_turns=1, uid="r")
    ok.reset()
    assert ok.step("a", 1).reward == 0.25 and ok.outcome.finish_reason == "max_turns"


@pytest.mark.parametrize("params, message", [
    ({"type": "object", "properties": {"x": {"type": "str"}}, "required": ["x"]},
     "tool 'f': argument 'x' has type 'str'; JSON schema types are ['array', 'boolean', 'integer', 'null', "
     "'number', 'object', 'string']"),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x", "y"]},
     "tool 'f': parameters[\"required\"]=['x', 'y'] must list names of parameters[\"properties\"] (['x'])"),
    ({"properties": {"x": {"type": "string"}}},
     "tool 'f': parameters must be a JSON schema of type object, got {'properties': {'x': {'type': 'string'}}}"),
])
def test_a_tool_whose_schema_no_call_can_satisfy_is_refused_when_made(params, message):
    # was: accepted, and then every call the model made was "malformed" (penalised, or ending the episode with
    # env.on_malformed=end), with observations such as "argument 'x' must be of type str, got str"
    with pytest.raises(ValueError) as info:
        Tool("f", "d", params, fn=lambda **kw: "ok")
    assert str(info.value) == message
    fine = Tool("f", "d", {"type": "object", "properties": {"x": {"type": ["string", "null"]}}}, fn=lambda x=None: "ok")
    assert fine.run({"x": None}).text == "ok" and fine.run({}).malformed is False
