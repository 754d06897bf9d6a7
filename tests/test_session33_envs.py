"""Session 33: the compact tool format (``env.tool_format=compact``).

1. A compact tool with two required arguments could not be called: ``[add: 1, 2]`` passed the whole text to the
   first required argument and every call came back ``bad arguments ... missing required argument 'b'``. A call
   carries one text argument by design (no quotes or braces in the tiny alphabet to delimit more), so such a tool
   (or one whose required argument takes no string, or one with no required argument) is now refused when the
   environment is made, naming the tool, its required arguments and the fix.
2. A truncated compact result put the truncation note inside its brackets (``[error: ... [truncated: ...)]``, the
   note's ``]`` turned into ``)``); the note now follows the result, as in the JSON format's observations.
3. Episode/ToolEnv messages name ``env.key=value`` and the fix.
"""
from __future__ import annotations

import pytest

from rlrepro.data import SYNTHETIC_CHARSET, PromptRecord
from rlrepro.envs import (CompactToolFormat, EnvConfig, Episode, Qwen3ToolFormat, Tool, ToolEnv, calculator_tool,
                          execute_calls, load_env, make_tool_format, python_tool, replay, run_episode,
                          transcript_digest)

REC = PromptRecord(uid="u33", prompt="1+2=", answer="3")


def _reward(text, record):
    return float(text.strip() == record.answer)


def _tool(name, props, required, fn):
    return Tool(name, f"the {name} tool", {"type": "object", "properties": props, "required": required}, fn)


ADD = _tool("add", {"a": {"type": "string"}, "b": {"type": "string"}}, ["a", "b"], lambda a, b: str(int(a) + int(b)))
BIG = _tool("big", {"x": {"type": "string"}}, ["x"], lambda x: "Y" * 50)
BAD = _tool("bad", {"x": {"type": "string"}}, ["x"], lambda x: "Error: " + "z" * 50)


def _env(tools, fmt, **kw):
    return ToolEnv(REC, tools=tools, tool_format=fmt, reward_fn=_reward, **kw)


# ---------------------------------------------------------------------- 1. two required arguments, compact

ADD_REFUSAL = ("tool 'add' has 2 required arguments ['a', 'b'] (a: string, b: string); env.tool_format=compact "
               "passes one text argument per call ([add: text] -> the tool's one required argument), so the model "
               "could never call it correctly. Fix: env.tool_format=qwen3 (JSON arguments, any number of them), or "
               "give the tool exactly one required argument of type string (parse the parts in its fn), the others "
               "optional")


def test_a_compact_tool_with_two_required_arguments_is_refused_when_the_env_is_made():
    # before: the env was made, its prompt listed nothing (compact shows no schemas), and the call the docs teach,
    # [add: 1, 2], became {"a": "1, 2"} -> "[error: bad arguments for add: missing required argument 'b']"
    with pytest.raises(ValueError) as e:
        _env([calculator_tool(), ADD], CompactToolFormat())
    assert str(e.value) == ADD_REFUSAL
    with pytest.raises(ValueError) as e:  # a custom environment calling execute_calls directly is refused too
        execute_calls("[add: 1, 2]", [ADD], CompactToolFormat(), max_calls=4, max_observation_chars=100)
    assert str(e.value) == ADD_REFUSAL


def test_the_refusal_reaches_a_run_through_the_factory():
    cfg = EnvConfig(name="calculator_task", tool_format="compact", max_turns=2)

    def factory(record, seed, *, config, reward_fn):
        return ToolEnv(record, tools=[ADD], tool_format=make_tool_format(config.tool_format), reward_fn=reward_fn)
    spec = load_env(cfg, _reward)
    spec = type(spec)(name="adder", factory=factory, config=cfg, reward_fn=_reward)
    with pytest.raises(ValueError) as e:
        spec.make(REC, 0)
    assert str(e.value) == f"environment factory 'adder' (record 'u33'): {ADD_REFUSAL}"


def test_other_tools_a_text_argument_cannot_call_are_refused():
    count = _tool("count", {"n": {"type": "integer"}}, ["n"], lambda n: "x" * n)
    with pytest.raises(ValueError) as e:
        _env([count], CompactToolFormat())
    assert str(e.value) == (
        "tool 'count' has the required argument n: integer, which a text argument never fits; env.tool_format="
        "compact passes one text argument per call ([count: text] -> the tool's one required argument), so the "
        "model could never call it correctly. Fix: env.tool_format=qwen3 (JSON arguments, any number of them), or "
        "give the tool exactly one required argument of type string (parse the parts in its fn), the others "
        "optional")
    none = _tool("now", {}, [], lambda: "noon")
    with pytest.raises(ValueError, match=r"^tool 'now' has 0 required arguments \[\] \(none\); env\.tool_format="
                                         r"compact passes one text argument"):
        _env([none], CompactToolFormat())


def test_tools_a_compact_call_can_call_still_work():
    # one required string (or untyped, or string|null) argument, optional others: unchanged
    pair = _tool("pair", {"ab": {"type": ["string", "null"]}, "sep": {"type": "string"}}, ["ab"],
                 lambda ab, sep=",": str(sum(int(v) for v in ab.split(sep))))
    loose = _tool("loose", {"v": {}}, ["v"], lambda v: v[::-1])
    env = _env([calculator_tool(), python_tool(), pair, loose], CompactToolFormat())
    assert env.reset().tools == []
    assert env.step("[pair: 1,2][loose: abc][calc: 6*7]").messages == [
        {"role": "tool", "content": "[= 3]"}, {"role": "tool", "content": "[= cba]"},
        {"role": "tool", "content": "[= 42]"}]
    # the JSON format takes the two-argument tool, and the call lands
    env = _env([ADD], Qwen3ToolFormat())
    call = Qwen3ToolFormat().render_call("add", {"a": "1", "b": "2"})
    assert env.step(call).messages == [{"role": "tool", "content": "3"}]


def test_render_call_with_two_arguments_names_the_fix():
    with pytest.raises(ValueError) as e:
        CompactToolFormat().render_call("add", {"a": "1", "b": "2"})
    assert str(e.value) == ("env.tool_format=compact writes one argument per call ([add: text]); the call of 'add' "
                            "has the arguments ['a', 'b']. Fix: env.tool_format=qwen3 (JSON arguments), or a tool "
                            "with one required string argument")


# ---------------------------------------------------------------------------- 2. the truncation note, compact

def _observe(fmt, text, max_chars=20):
    msgs, _, _ = execute_calls(text, [BIG, BAD, calculator_tool()], fmt, max_calls=4, max_observation_chars=max_chars)
    return [m["content"] for m in msgs]


def test_the_json_format_puts_the_note_after_the_result():  # the reference, unchanged
    fmt = Qwen3ToolFormat()
    text = "".join(fmt.render_call(n, {"x": "1"}) for n in ("big", "bad"))
    assert _observe(fmt, text) == ["Y" * 20 + "\n[truncated: 50 characters, the first 20 are shown]",
                                   "Error: " + "z" * 13 + "\n[truncated: 57 characters, the first 20 are shown]"]


def test_a_truncated_compact_result_has_the_note_after_its_brackets():
    # before: '[= yyyyyyyyyyyyyyyyyyyy [truncated: 50 characters, the first 20 are shown)]' and
    # '[error: zzzzzzzzzzzzz [truncated: 57 characters, the first 20 are shown)]'
    fmt = CompactToolFormat(charset=SYNTHETIC_CHARSET)
    assert _observe(fmt, "[big: 1][bad: 1][calc: 1/0]") == [
        "[= " + "y" * 20 + "][truncated: 50 characters, the first 20 are shown]",
        "[error: " + "z" * 20 + "][truncated: 50 characters, the first 20 are shown]",
        "[error: division by zero]"]  # 'division by zero' (16) fits: the 'Error: ' prefix is not counted
    assert _observe(CompactToolFormat(), "[big: 1][bad: 1]", 5) == [
        "[= YYYYY][truncated: 50 characters, the first 5 are shown]",
        "[error: zzzzz][truncated: 50 characters, the first 5 are shown]"]
    for obs in _observe(fmt, "[big: 1][bad: 1]", 3):
        assert set(obs) <= set(SYNTHETIC_CHARSET)


def test_an_untruncated_compact_result_is_unchanged():
    fmt = CompactToolFormat(charset=SYNTHETIC_CHARSET)
    assert _observe(fmt, "[big: 1][bad: 1][calc: 12*34]", 50) == ["[= " + "y" * 50 + "]", "[error: " + "z" * 50 + "]",
                                                                  "[= 408]"]
    assert fmt.observation_message(BIG.run({"x": "1"}), 50) == fmt.result_message(BIG.run({"x": "1"}))


def test_a_compact_episode_with_a_truncated_result_replays_bit_for_bit():
    cfg = EnvConfig(name="calculator_task", tool_format="compact", max_turns=3, max_observation_chars=4)
    spec = load_env(cfg, _reward)
    rec = PromptRecord(uid="c", prompt="123*456=", answer="56088")
    turns = iter(["[calc: 123*456]", "56088"])
    ep = run_episode(spec.make(rec, 0), lambda t: next(turns), max_turns=3)
    assert ep.transcript[2] == {"role": "tool", "content": "[= 5608][truncated: 5 characters, the first 4 are shown]"}
    assert ep.outcome.reward == 1.0
    first = transcript_digest(*replay(spec.make(rec, 0), ["[calc: 123*456]", "56088"]))
    assert first == transcript_digest(*replay(spec.make(rec, 0), ["[calc: 123*456]", "56088"]))


# ----------------------------------------------------------------------------------- 3. key=value messages

def test_episode_and_tool_env_messages_name_key_value_and_the_fix():
    with pytest.raises(ValueError) as e:
        Episode(_env([calculator_tool()], Qwen3ToolFormat()), max_turns=0)
    assert str(e.value) == ("env.max_turns=0 (Episode max_turns) must be a positive integer. Fix: env.max_turns=N, "
                            "the assistant turns per episode (1 or more)")
    with pytest.raises(ValueError) as e:
        Episode(_env([calculator_tool()], Qwen3ToolFormat()), max_turns=1, max_episode_tokens=-3)
    assert str(e.value) == ("env.max_episode_tokens=-3 (Episode max_episode_tokens) must be a positive integer or "
                            "null. Fix: env.max_episode_tokens=N (transcript tokens per episode), or null for no "
                            "budget")
    with pytest.raises(ValueError) as e:
        _env([calculator_tool()], Qwen3ToolFormat(), on_malformed="stop")
    assert str(e.value) == ("env.on_malformed='stop' (ToolEnv on_malformed) is not allowed. Fix: env.on_malformed="
                            "observe (the error is the call's result) or end (finish malformed)")
