"""Review fixes of the Python sandbox and the tools: work and memory that escaped the meter, results that depended on
the process (recursion limit, locale), and observations that crashed the tokenizer or hid a MemoryError."""
import locale
import sys
import tracemalloc

import pytest

from rlrepro.envs import SandboxLimits, Tool, execute_calls, make_tool_format, make_tools, python_tool, run_python
from rlrepro.envs import sandbox_builtins


def out(code, **limits):
    return run_python(code, SandboxLimits(**limits) if limits else None).observation()


def peak_bytes(code):
    tracemalloc.start()
    try:
        result = out(code)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def with_recursion_limit(limit, code):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        return out(code)
    finally:
        sys.setrecursionlimit(old)


def test_set_operators_on_dict_views_are_metered_sandbox_sets():
    # CPython builds a C set of any size (uncharged: {}.keys() | range(10**9) took all the memory, & range(10**12)
    # ran for days); now the operand is checked against the caps before anything is built
    assert out("{}.keys() | range(1_500_000)") == \
        "Error: memory limit: a set of 1500000 elements exceeds the cap of 1000000 (line 1)"
    assert out("{}.keys() & range(10 ** 7)") == \
        "Error: memory limit: a set of 10000000 elements exceeds the cap of 1000000 (line 1)"
    # the result is the sandbox's set (insertion order, printable), as CPython's semantics allow
    assert out("d = {1: 2, 3: 4}\nprint(d.keys() | [5, 1], d.keys() & {3}, {9} | d.keys(), d.items() - {(1, 2)}, "
               "[0] | d.keys(), d.values() | d.keys())") == "{1, 3, 5} {3} {9, 1, 3} {(3, 4)} {0, 1, 3} {2, 4, 1, 3}"
    assert out("{1: 2}.values() | {1}") == \
        "Error: TypeError: unsupported operand type(s) for |: 'dict_values' and 'set' (line 1)"
    # an item's value is scanned before it is hashed (hashing a deep tuple recursed in C and crashed the process)
    deep = "t = ()\nfor i in range(150):\n    t = (t,)\nd = {1: t}\n"
    assert out(deep + "d.items() & d.items()") == \
        "Error: a value nested more than 100 levels deep cannot be compared or used as a key (line 5)"


def test_dict_view_comparisons_are_charged_and_scanned():
    base = run_python("d = {i: i for i in range(6400)}\ne = d.keys()").steps
    assert run_python("d = {i: i for i in range(6400)}\ne = d.keys()\ne <= e").steps - base >= 2 * 6400 // 64
    # equal deep values compared in C: RecursionError or True depending on sys.getrecursionlimit(); now refused
    code = "x = []\ny = []\nfor i in range(1500):\n    x = [x]\n    y = [y]\n{1: x}.items() == {1: y}.items()"
    expected = "Error: a value nested more than 100 levels deep cannot be compared or used as a key (line 6)"
    assert with_recursion_limit(1000, code) == with_recursion_limit(5000, code) == expected


def test_power_with_an_integral_fraction_exponent_is_checked_before_it_is_computed():
    # 2 ** Fraction(10**10) is int ** 10**10: it ran for minutes and took gigabytes before the size check
    head = "from fractions import Fraction\n"
    assert out(head + "2 ** Fraction(10 ** 6)") == \
        "Error: memory limit: 2 ** 1000000 has more than 65536 bits (max_int_bits) (line 2)"
    assert out(head + "Fraction(3, 2) ** Fraction(10 ** 6)") == \
        "Error: memory limit: 3 ** 1000000 has more than 65536 bits (max_int_bits) (line 2)"
    assert out(head + "2 ** Fraction(-10 ** 6)") == \
        "Error: memory limit: 2 ** 1000000 has more than 65536 bits (max_int_bits) (line 2)"
    assert out(head + "print(2 ** Fraction(-3), Fraction(2, 3) ** Fraction(2), 2 ** Fraction(1, 2), "
                      "Fraction(-2, 3) ** Fraction(-3), 2.0 ** Fraction(3))") == \
        "1/8 4/9 1.4142135623730951 -27/8 8.0"


def test_lazy_iterator_chains_nest_within_max_depth_whatever_the_recursion_limit():
    # a chain through a comprehension's inner for escapes MAX_LAZY_CHAIN; it ended in CPython's RecursionError,
    # which depends on sys.getrecursionlimit() (torch's inductor raises it to 2000)
    code = ("def wrap(h):\n    return (x for _ in [0] for x in h)\ng = (x for x in [1, 2])\n"
            "for i in range(300):\n    g = wrap(g)\nlist(g)")
    expected = "Error: RecursionError: calls, blocks and expressions nested more than max_depth=200 levels (line 6)"
    assert with_recursion_limit(1000, code) == with_recursion_limit(5000, code) == expected
    assert out(code.replace("300", "40")) == "[1, 2]"


def test_slice_assignment_is_capped_before_the_list_is_built():
    result, peak = peak_bytes("a = []\na[:] = range(2_000_000)")
    assert result == "Error: memory limit: a list of 2000000 elements exceeds the cap of 1000000 (line 2)"
    assert peak < 8 * 2 ** 20  # list(range(2_000_000)) alone is 16 MB of pointers and 56 MB of ints
    assert out("a = [1, 2, 3]\na[1:2] = range(3)\na[::2] = 'xyz'\nprint(a)") == "['x', 0, 'y', 2, 'z']"


def test_print_line_is_capped_before_it_is_joined():
    code = "s = 'x' * 900_000\nprint(*range(30), sep=s)"
    result, peak = peak_bytes(code)
    assert result == "Error: memory limit: a str of 26100051 elements exceeds the cap of 1000000 (line 2)"
    assert peak < 8 * 2 ** 20
    assert out("print(1, 2, sep=None, end=None)\nprint('a', 'b', sep='-', end='!')") == "1 2\na-b!"


def test_set_difference_is_charged_like_the_other_set_operators():
    base = run_python("a = set(range(6400))").steps
    assert run_python("a = set(range(6400))\na - a").steps - base >= 2 * 6400 // 64


def test_format_type_n_is_refused_it_follows_the_locale():
    assert out("f'{1234567:n}'") == \
        "Error: the format type 'n' is not supported (it follows the process's locale); use ',' or 'd' (line 1)"
    assert out("print(f'{1234567:,} {\"n\":n>3}')") == "1,234,567 nnn"
    try:  # where a locale that groups digits is installed, show that the result no longer depends on it
        old = locale.setlocale(locale.LC_NUMERIC)
        locale.setlocale(locale.LC_NUMERIC, "de_DE.utf8")
    except locale.Error:
        return
    try:
        assert out("f'{1234567:n}'").startswith("Error: the format type 'n' is not supported")
    finally:
        locale.setlocale(locale.LC_NUMERIC, old)


def test_tool_observations_never_hold_lone_surrogates():
    # the tokenizer cannot encode a lone surrogate: one in an observation crashed the run
    tools = make_tools(["calculator", "python"])
    text = '<tool_call>{"name": "python", "arguments": {"code": "assert 0, chr(55296)"}}</tool_call>'
    messages, malformed, _ = execute_calls(text, tools, make_tool_format("qwen3"), max_calls=4,
                                           max_observation_chars=4096)
    assert messages == [{"role": "tool", "content": "Error: AssertionError: \\ud800 (line 1)"}]
    assert run_python("assert 0, chr(55296)").error == "AssertionError: \\ud800 (line 1)"
    schema = {"type": "object", "properties": {}}
    assert Tool("t", "", schema, fn=lambda: "a" + chr(0xdc80)).run({}).text == "a\\udc80"

    def raising():
        raise ValueError(chr(0xd800))
    assert Tool("t", "", schema, fn=raising).run({}).text == "Error: t raised ValueError: \\ud800"


def test_memory_error_is_not_an_observation(monkeypatch):
    # MemoryError depends on the machine's free memory: as text it would make the transcript differ between runs
    def oom(interp, args, kwargs):
        raise MemoryError()
    monkeypatch.setattr(sandbox_builtins, "_len", oom)
    with pytest.raises(MemoryError):
        run_python("len([])")
    with pytest.raises(MemoryError):
        python_tool().run({"code": "len([])"})


def test_set_methods_scan_their_argument_before_hashing_it():
    # s.union([t]) hashed a deep tuple in C without the scan set([t]) does: 10**6 levels crashed the process
    deep = "t = ()\nfor i in range(150):\n    t = (t,)\ns = set()\n"
    for method in ("union", "intersection", "difference", "issubset"):
        assert out(deep + f"s.{method}([t])") == \
            "Error: a value nested more than 100 levels deep cannot be compared or used as a key (line 5)", method
    assert out(deep + "set([t])") == \
        "Error: a value nested more than 100 levels deep cannot be compared or used as a key (line 5)"
    assert out("print({1, 2}.union([3, (4, 5)]), {1, 2}.issubset(range(3)))") == "{1, 2, 3, (4, 5)} True"


@pytest.mark.parametrize("code", [
    "x = " + "-" * 5000 + "1",
    "import os\nx = " + "not " * 4000 + "1",
    "import os\nx = " + "-" * 300 + "1",
    "x = " + "-" * 19000 + "1",
], ids=["unary-5000", "import-then-not-4000", "import-then-unary-300", "unary-19000"])
def test_a_program_too_deep_to_parse_gets_the_observation_of_a_tree_too_deep(code):
    # ast.parse builds the tree to 3 x sys.getrecursionlimit() levels: the observation depended on that setting
    expected = "Error: the program nests more than max_depth=200 levels"
    assert with_recursion_limit(1000, code) == with_recursion_limit(3000, code) == expected
