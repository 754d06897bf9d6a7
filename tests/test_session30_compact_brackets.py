"""The compact tool format closes a call at the ``]`` that balances its argument's brackets (session 30): it cut
``[py: print([1, 2])]`` at the first ``]``, passing ``print([1, 2`` and leaving ``)]`` as text. A known call opened
inside an argument still leaves the outer one unclosed, as before."""
from __future__ import annotations

from rlrepro.envs import calculator_tool, python_tool
from rlrepro.envs.tool_calls import CompactToolFormat, MalformedCall, ToolCall

TOOLS = {t.name: t for t in (calculator_tool(), python_tool())}


def test_brackets_inside_an_argument_stay_in_it():
    fmt = CompactToolFormat()
    text = "[py: print([1, 2][0])] then [calc: 2*(3+4)]"
    assert fmt.parse(text, TOOLS) == [ToolCall("python", {"code": "print([1, 2][0])"}, "[py: print([1, 2][0])]"),
                                      ToolCall("calculator", {"expression": "2*(3+4)"}, "[calc: 2*(3+4)]")]
    (call,) = fmt.parse("[py: x = [[1], [2, [3]]]]", TOOLS)
    assert call.arguments == {"code": "x = [[1], [2, [3]]]"}
    assert fmt.parse("[py: a[0]]", TOOLS)[0].arguments == {"code": "a[0]"}
    assert fmt.parse("[py: a[b] [x]] [calc: 1]", TOOLS)[1] == ToolCall("calculator", {"expression": "1"}, "[calc: 1]")


def test_an_unbalanced_or_interrupted_argument_is_malformed():
    fmt = CompactToolFormat()
    (bad,) = fmt.parse("[py: print([1, 2)", TOOLS)
    assert bad == MalformedCall("[py: print([1, 2)", "[py: is not closed")
    first, second = fmt.parse("[py: f([calc: 3]", TOOLS)  # a known call opens inside: the outer one never closed
    assert first == MalformedCall("[py: f(", "[py: is not closed")
    assert second == ToolCall("calculator", {"expression": "3"}, "[calc: 3]")
    assert fmt.parse("[py: ]]", TOOLS)[0] == ToolCall("python", {"code": ""}, "[py: ]")  # a stray ] after is text
