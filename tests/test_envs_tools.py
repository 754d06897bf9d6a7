"""Tool calls in the model's own format (Qwen3 JSON, and the compact syntax of the tiny model): the parsers'
edge cases, the tools' argument checks and failures, the calculator's exactness and limits, rendering with the
chat template (a transcript grown turn by turn equals the template's rendering of the whole conversation), and
the calculator_task environment played by a scripted oracle."""
import json

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlrepro.checks import ConfigError
from rlrepro.data import SYNTHETIC_CHARSET, exact_match_reward
from rlrepro.envs import (CalculatorLimits, CompactToolFormat, EnvConfig, MalformedCall, Qwen3ToolFormat, Tool,
                          ToolCall, calculate, calculator_tool, continuation_text, execute_calls, load_env,
                          make_calculator_records, make_tools, render_chat, run_episode)
from rlrepro.envs.tools import truncate_text

# The tool-calling parts of Qwen3's chat template (tokenizer_config.json of the Qwen3 models), verbatim in
# structure: tools in the system turn, tool messages as <tool_response> blocks inside one user turn, the
# reasoning of assistant turns after the last real user query kept.
QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not("
    "message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n        {%- set content = message.content %}\n"
    "    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n"
    "    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


def qwen3_apply(messages, add_generation_prompt=True, **kwargs):
    """apply_chat_template as transformers renders it: its jinja settings and its tojson (keys in order, no
    HTML escaping)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(QWEN3_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)


CALC = {"calculator": calculator_tool()}


# ------------------------------------------------------------------------------------------ qwen3 parser

def parse(text, tools=CALC):
    return Qwen3ToolFormat().parse(text, tools)


def test_qwen3_parses_every_call_in_order():
    text = ('<think>\nneed both\n</think>\n\nLet me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "12*34"}}\n</tool_call>\n<tool_call>{"name":"python","arguments":{"code":"print(1)"}}'
            '</tool_call>')
    calls = parse(text)
    assert calls == [ToolCall("calculator", {"expression": "12*34"}, text[text.index("<tool_call>"):
                                                                          text.index("</tool_call>") + 12]),
                     ToolCall("python", {"code": "print(1)"}, text[text.rindex("<tool_call>"):])]
    assert parse("The answer is 408.") == []


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "<tool_call> is not closed"),
    ('oops</tool_call>', "</tool_call> without an opening <tool_call>"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}</tool_call>', "invalid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1",}}</tool_call>', "invalid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"x": NaN}}</tool_call>', "NaN is not valid JSON"),
    ('<tool_call>{"name": "a", "name": "b", "arguments": {}}</tool_call>', "duplicate key 'name'"),
    ('<tool_call>["calculator", {}]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name" string'),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', 'no "name" string'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": "not json"}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "parameters": {}}</tool_call>', "unexpected key 'parameters'"),
    ('<tool_call>{"name": "c", "arguments": {"n": ' + "9" * 500 + '}}</tool_call>', "more than 400 digits"),
    ('<tool_call>' + "[" * 5000 + "]" * 5000 + '</tool_call>', "nests more than 32 levels"),
    ('<tool_call>' + " " * 70000 + '{}</tool_call>', None),
])
def test_qwen3_malformed_calls_are_reported_not_raised(text, error):
    (call,) = parse(text)
    assert isinstance(call, MalformedCall)
    if error is not None:
        assert error in call.error, call.error


def test_qwen3_accepts_arguments_as_a_json_string_and_missing_arguments():
    (call,) = parse('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>')
    assert call == ToolCall("calculator", {"expression": "2+2"}, call.text)
    (call,) = parse('<tool_call>{"name": "calculator"}</tool_call>')
    assert call.arguments == {}


def test_qwen3_an_unclosed_call_before_a_good_one():
    calls = parse('<tool_call>{"name": "x"\n<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'
                  '</tool_call>')
    assert isinstance(calls[0], MalformedCall) and calls[1].arguments == {"expression": "1"}


# ---------------------------------------------------------------------------------------- compact parser

def test_compact_calls_and_near_misses():
    fmt = CompactToolFormat()
    assert fmt.parse("[calc: 12*34]", CALC) == [ToolCall("calculator", {"expression": "12*34"}, "[calc: 12*34]")]
    assert fmt.parse("x [calculator:1+1] y [calc: 2 ]", CALC)[1].arguments == {"expression": "2"}
    assert fmt.parse("408 [= 408] [abc] (ok)", CALC) == []
    (bad,) = fmt.parse("[calc 12*34]", CALC)
    assert bad == MalformedCall("[calc", "missing ':' after [calc")
    (bad,) = fmt.parse("[calc: 12*34", CALC)
    assert bad == MalformedCall("[calc: 12*34", "[calc: is not closed")
    first, second = fmt.parse("[calc: 1+[calc: 2]", CALC)
    assert isinstance(first, MalformedCall) and second.arguments == {"expression": "2"}
    (unknown,) = fmt.parse("[foo: 1]", CALC)
    assert unknown == ToolCall("foo", {"input": "1"}, "[foo: 1]")


def test_compact_results_stay_in_the_tiny_alphabet():
    fmt = CompactToolFormat(charset=SYNTHETIC_CHARSET)
    msgs, malformed, _ = execute_calls("[calc: 1/0][calc: 12*34][foo: 1][calc x]", list(CALC.values()), fmt,
                                       max_calls=4, max_observation_chars=100)
    assert [m["content"] for m in msgs] == ["[error: division by zero]", "[= 408]",
                                            "[error: unknown tool 'foo'; available: calculator]",
                                            "[error: missing ':' after [calc]"]
    assert malformed == 2 and all(m["role"] == "tool" for m in msgs)
    for m in msgs:
        assert set(m["content"]) <= set(SYNTHETIC_CHARSET)
    (msg,) = execute_calls("[calc: 1/3]", list(CALC.values()), fmt, max_calls=1, max_observation_chars=100)[0]
    assert msg["content"] == "[= 1?3]"  # '/' is not in the tiny alphabet


# ------------------------------------------------------------------------------------------------ tools

def test_execute_calls_turns_every_failure_into_a_result():
    def boom(x):
        raise RuntimeError("kaput")
    tools = [calculator_tool(), Tool("boom", "raises", {"type": "object", "properties": {"x": {"type": "integer"}},
                                                        "required": ["x"]}, boom),
             Tool("big", "long output", {"type": "object", "properties": {}}, lambda: "y" * 50)]
    calls = "".join('<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % c for c in [
        ("calculator", '{"expression": "2**10"}'), ("calculator", '{}'), ("calculator", '{"expression": 5}'),
        ("calculator", '{"expression": "1", "extra": 1}'), ("nope", '{}'), ("boom", '{"x": 1}'),
        ("boom", '{"x": true}'), ("big", '{}'), ("calculator", '{"expression": "1"}')])
    full, malformed, info = execute_calls(calls, tools, Qwen3ToolFormat(), max_calls=8,
                                          max_observation_chars=1000)
    assert [m["content"] for m in full] == [
        "1024",
        "Error: bad arguments for calculator: missing required argument 'expression'",
        "Error: bad arguments for calculator: argument 'expression' must be of type string, got int",
        "Error: bad arguments for calculator: unknown argument 'extra' (expected expression)",
        "Error: unknown tool 'nope'; available: big, boom, calculator",
        "Error: boom raised RuntimeError: kaput",
        "Error: bad arguments for boom: argument 'x' must be of type integer, got bool",
        "y" * 50,
        "Error: more than 8 tool calls in one turn; this one was not run",
    ]
    assert all(m["role"] == "tool" for m in full)
    assert malformed == 5
    assert [i.get("malformed") for i in info] == [False, True, True, True, True, False, True, False, None]
    cut, _, _ = execute_calls(calls, tools, Qwen3ToolFormat(), max_calls=8, max_observation_chars=20)
    assert [m["content"] for m in cut] == [truncate_text(m["content"], 20) for m in full]
    assert cut[7]["content"] == "y" * 20 + "\n[truncated: 50 characters, the first 20 are shown]"


def test_tool_schema_and_builtin_tools():
    assert calculator_tool().schema() == {"type": "function", "function": {
        "name": "calculator", "description": calculator_tool().description,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                       "description": "the expression, e.g. 123*456"}},
                       "required": ["expression"]}}}
    assert [t.name for t in make_tools(["python", "calculator"])] == ["python", "calculator"]
    with pytest.raises(ValueError, match="unknown tool 'web'"):
        make_tools(["web"])


# ------------------------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expr, expected", [
    ("12*34", "408"), ("0.1 + 0.2", "0.3"), ("1/3", "1/3"), ("3/8", "0.375"), ("-3/8", "-0.375"),
    ("2**-2", "0.25"), ("2**3**2", "512"), ("-2**2", "-4"), ("(1+2)*3", "9"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("1e3 + 1.5e-3", "1000.0015"), ("---1", "-1"), ("10/4", "2.5"), ("123456789*987654321", "121932631112635269"),
    ("2**1000 - 2**1000", "0"), ("1/7*7", "1"),
])
def test_calculator_is_exact(expr, expected):
    assert calculate(expr) == expected


@pytest.mark.parametrize("expr, error", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0**-1", "division by zero"),
    ("(1+2", "cannot parse"), ("abs(3)", "only numbers"), ("x + 1", "only numbers"), ("'a'*3", "not a number"),
    ("2**0.5", "the exponent must be an integer"), ("2**1001", "the exponent 1001 is larger than 1000"),
    ("9**9**9", "larger than 1000"), ("99**1000", "more than 1000 digits"),
    ("10**999 * 10**999 / 10**999", "a result has more than 1000 digits"), ("0x10", "not a number"),
    ("1_000", "'_' is not allowed"), ("", "empty"), ("1+" * 200 + "1", "longer than 256 characters"),
    ("1" * 300, "longer than 256"), ("(1+1)*" * 40 + "1", "more than 200 parts"), ("1 < 2", "only numbers"),
])
def test_calculator_errors_and_limits(expr, error):
    text = calculate(expr)
    assert text.startswith("Error: ") and error in text, text


def test_calculator_limits_are_configurable_and_checked():
    assert calculate("2**20", CalculatorLimits(max_digits=5)) == "Error: the result has more than 5 digits"
    assert calculate("2**16", CalculatorLimits(max_digits=5)) == "65536"
    assert calculate("2**17", CalculatorLimits(max_digits=5)) == "Error: a result has more than 5 digits"
    with pytest.raises(ConfigError, match="env.calculator.max_digits=0"):
        CalculatorLimits(max_digits=0)
    with pytest.raises(ConfigError, match="env.calculator.max_chars=5000"):
        CalculatorLimits(max_chars=5000)


# --------------------------------------------------------------------------------------------- rendering

def test_qwen3_template_renders_the_tool_schemas():
    schema = calculator_tool().schema()
    text = render_chat(qwen3_apply, [{"role": "user", "content": "12*34=?"}], tools=[schema])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + json.dumps(schema, ensure_ascii=False) + "\n</tools>" in text
    assert text.endswith("<|im_end|>\n<|im_start|>user\n12*34=?<|im_end|>\n<|im_start|>assistant\n")


def test_continuation_text_is_the_observation_between_two_assistant_turns():
    obs = [{"role": "tool", "content": "408"}]
    assert continuation_text(qwen3_apply, obs) == \
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    two = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert continuation_text(qwen3_apply, two) == ("\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
                                                   "<tool_response>\n2\n</tool_response><|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="end_of_turn"):
        continuation_text(qwen3_apply, obs, end_of_turn="</s>")


def test_continuation_text_with_the_tiny_models_chatml_template():
    from rlrepro.model.tiny import CHAT_TEMPLATE

    def tiny_apply(messages, add_generation_prompt=True, **kwargs):  # as rlrepro.model.Tokenizer renders it
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert continuation_text(tiny_apply, [{"role": "tool", "content": "[= 408]"}]) == \
        "\n<|im_start|>tool\n[= 408]<|im_end|>\n<|im_start|>assistant\n"


def test_a_transcript_grown_turn_by_turn_equals_the_template_rendering_of_the_conversation():
    """The engine's next request is prompt + generated text + observation text; that must be what the chat
    template makes of the whole conversation (here with reasoning in the template's own layout)."""
    tools = [calculator_tool().schema()]
    user = [{"role": "user", "content": "What is 123*456?"}]
    turns = ['<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
             '"123*456"}}\n</tool_call>', "<think>\nthe tool said 56088\n</think>\n\nThe answer is 56088."]
    grown = render_chat(qwen3_apply, user, tools=tools)
    fmt, messages = Qwen3ToolFormat(), list(user)
    for i, turn in enumerate(turns):
        grown += turn + "<|im_end|>"  # the generated tokens end with the end-of-turn token
        messages.append({"role": "assistant", "content": turn})
        if i + 1 < len(turns):
            obs, _, _ = execute_calls(turn, make_tools(["calculator"]), fmt, max_calls=4, max_observation_chars=99)
            assert obs == [{"role": "tool", "content": "56088"}]
            grown += continuation_text(qwen3_apply, obs, tools=tools)
            messages.extend(obs)
    assert grown + "\n" == render_chat(qwen3_apply, messages, tools=tools, add_generation_prompt=False)


# ---------------------------------------------------------------------------------------- calculator_task

def test_calculator_records():
    recs = make_calculator_records(50, seed=3)
    assert recs[:10] == make_calculator_records(10, seed=3)
    assert recs != make_calculator_records(50, seed=4)
    for r in recs:
        a, b = r.meta["a"], r.meta["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999 and r.prompt == f"{a}*{b}=" and r.answer == str(a * b)
        assert set(r.prompt + r.answer) <= set(SYNTHETIC_CHARSET)
    assert [r.uid for r in recs[:2]] == ["calculator_task-s3:0", "calculator_task-s3:1"]
    assert (recs[0].prompt, recs[0].answer) == ("108*152=", "16416")  # pinned: sha256-derived, version-proof


def compact_oracle(transcript):
    """Plays calculator_task perfectly in the compact syntax: call the calculator, then say its result."""
    last = transcript[-1]["content"]
    if transcript[-1]["role"] == "user":
        return f"[calc: {last.rstrip('=')}]"
    assert last.startswith("[= ") and last.endswith("]")
    return last[3:-1]


def test_the_oracle_gets_reward_1_with_the_expected_transcript():
    spec = load_env(EnvConfig(name="calculator_task", tool_format="compact", max_turns=3), exact_match_reward)
    rec = make_calculator_records(1, seed=0)[0]
    a, b = rec.meta["a"], rec.meta["b"]
    ep = run_episode(spec.make(rec, 0), compact_oracle, max_turns=3, uid=rec.uid)
    assert ep.transcript == [{"role": "user", "content": f"{a}*{b}="},
                             {"role": "assistant", "content": f"[calc: {a}*{b}]"},
                             {"role": "tool", "content": f"[= {a * b}]"},
                             {"role": "assistant", "content": str(a * b)}]
    o = ep.outcome
    assert (o.reward, o.finish_reason, o.penalties, o.num_turns, o.total_reward) == (1.0, "done", [0.0, 0.0], 2, 1.0)
    text = "".join(m["content"] for m in ep.transcript)
    assert set(text) <= set(SYNTHETIC_CHARSET)
    assert o.num_tokens == len(text)  # characters are the tiny model's tokens


def test_the_tiny_tokenizer_knows_every_character_of_a_compact_episode():
    from rlrepro.model.tiny import build_char_tokenizer
    tok = build_char_tokenizer()
    unk = tok.token_to_id("<unk>")
    for rec in make_calculator_records(20, seed=1):
        text = f"{rec.prompt}[calc: {rec.prompt[:-1]}][= {rec.answer}]{rec.answer}[error: division by zero]"
        ids = tok.encode(text).ids
        assert unk not in ids and len(ids) == len(text)


def test_the_qwen3_format_oracle():
    spec = load_env(EnvConfig(name="calculator_task", max_turns=3), exact_match_reward)
    rec = make_calculator_records(1, seed=0)[0]
    start = spec.make(rec, 0).reset()
    assert start.tools == [calculator_tool().schema()] and start.prompt == rec.prompt

    def oracle(transcript):
        if transcript[-1]["role"] == "user":
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % \
                rec.prompt[:-1]
        return transcript[-1]["content"]
    ep = run_episode(spec.make(rec, 0), oracle, max_turns=3)
    assert ep.transcript[2] == {"role": "tool", "content": rec.answer}
    assert (ep.outcome.reward, ep.outcome.finish_reason) == (1.0, "done")


def test_a_malformed_call_is_an_observation_and_costs_its_penalty():
    rec = make_calculator_records(1, seed=0)[0]
    cfg = EnvConfig(name="calculator_task", tool_format="compact", max_turns=4, malformed_penalty=0.25)
    moves = iter([f"[calc {rec.prompt[:-1]}]", f"[calc: {rec.prompt[:-1]}]", rec.answer])
    ep = run_episode(load_env(cfg, exact_match_reward).make(rec, 0), lambda t: next(moves), max_turns=4)
    assert ep.transcript[2] == {"role": "tool", "content": "[error: missing ':' after [calc]"}
    assert ep.transcript[4] == {"role": "tool", "content": f"[= {rec.answer}]"}
    o = ep.outcome
    assert (o.reward, o.finish_reason, o.penalties, o.total_reward) == (1.0, "done", [0.25, 0.0, 0.0], 0.75)
    # env.on_malformed=end stops at the malformed turn
    cfg = EnvConfig(name="calculator_task", tool_format="compact", max_turns=4, on_malformed="end")
    ep = run_episode(load_env(cfg, exact_match_reward).make(rec, 0), lambda t: "[calc: 1+", max_turns=4)
    assert (ep.outcome.reward, ep.outcome.finish_reason, ep.outcome.num_turns) == (0.0, "malformed", 1)


def test_the_reward_reads_the_answer_after_the_reasoning():
    rec = make_calculator_records(1, seed=0)[0]
    env = load_env(EnvConfig(name="calculator_task", max_turns=2), exact_match_reward).make(rec, 0)
    env.reset()
    assert env.step(f"<think>\nit is 1 or {rec.answer}\n</think>\n\n{rec.answer}").reward == 1.0
    assert env.step(f"<think>\n{rec.answer}\n</think>\n\n1").reward == 0.0


def test_wrong_answers_max_turns_and_the_token_budget():
    rec = make_calculator_records(1, seed=0)[0]
    spec = load_env(EnvConfig(name="calculator_task", tool_format="compact", max_turns=3), exact_match_reward)
    ep = run_episode(spec.make(rec, 0), lambda t: "12", max_turns=3)
    assert (ep.outcome.reward, ep.outcome.finish_reason, ep.outcome.num_turns) == (0.0, "done", 1)
    ep = run_episode(spec.make(rec, 0), lambda t: "[calc: 1+1]", max_turns=3)
    assert (ep.outcome.reward, ep.outcome.finish_reason, ep.outcome.num_turns) == (0.0, "max_turns", 3)
    assert [m["role"] for m in ep.transcript] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    # prompt 8 + call 15 + observation 9 = 32 tokens; a budget of 30 ends it after the call
    ep = run_episode(spec.make(rec, 0), compact_oracle, max_turns=3, max_episode_tokens=30)
    assert (ep.outcome.finish_reason, ep.outcome.num_turns, ep.outcome.reward) == ("token_budget", 1, 0.0)
    ep = run_episode(spec.make(rec, 0), compact_oracle, max_turns=3, max_episode_tokens=39)
    assert (ep.outcome.finish_reason, ep.outcome.reward, ep.outcome.num_tokens) == ("done", 1.0, 39)
