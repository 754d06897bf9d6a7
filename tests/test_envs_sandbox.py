"""The deterministic Python sandbox (rlrepro.envs.sandbox): what programs do, every limit (steps, memory, output,
nesting), every refusal (imports, open, dunders), and that a result is the same bytes in every run and process,
whatever the caller's stack depth, PYTHONHASHSEED, int_max_str_digits or clock."""
import json
import os
import subprocess
import sys
import time

import pytest

from rlrepro.checks import ConfigError
from rlrepro.envs import SandboxLimits, python_tool, run_python
from rlrepro.envs.sandbox_values import int_to_str, str_to_int


def out(code, **limits):
    return run_python(code, SandboxLimits(**limits) if limits else None).observation()


def record(r):
    return {"stdout": r.stdout, "error": r.error, "steps": r.steps, "memory": r.memory, "bytes": r.output_bytes}


# -------------------------------------------------------------------------------------------- programs

@pytest.mark.parametrize("code, expected", [
    ("print(1 + 2 * 3, 7 // 2, 7 % 3, 2 ** 10, 7 / 2)", "7 3 1 1024 3.5"),
    ("x = [i * i for i in range(6)]\nprint(sum(x), x[1:4], x[::-2])", "55 [1, 4, 9] [25, 9, 1]"),
    ("def f(n):\n    return 1 if n < 2 else n * f(n - 1)\nprint(f(25))", "15511210043330985984000000"),
    ("def g(a, b=10):\n    return a - b\nprint(g(1), g(1, b=2), g(b=3, a=4))", "-9 -1 1"),
    ("def outer():\n    k = 3\n    return lambda v: v * k\nprint(outer()(5))", "15"),
    ("n = 0\ndef bump():\n    global n\n    n += 1\nbump(); bump()\nprint(n)", "2"),
    ("from fractions import Fraction\nprint(Fraction(1, 3) + Fraction(1, 6), Fraction('0.25'))", "1/2 1/4"),
    ("import math\nprint(math.factorial(20), math.gcd(84, 36), math.isqrt(99), math.comb(10, 3))",
     "2432902008176640000 12 9 120"),
    ("import math as m\nprint(round(m.sqrt(2), 6), m.pi > 3)", "1.414214 True"),
    ("s = {'pear', 'apple', 'fig'}\ns.add('kiwi')\nprint(s, len(s), 'fig' in s)",
     "{'pear', 'apple', 'fig', 'kiwi'} 4 True"),
    ("d = {'b': 1}\nd['a'] = 2\nprint(d, list(d.items()), d.get('z', 0))", "{'b': 1, 'a': 2} [('b', 1), ('a', 2)] 0"),
    ("x = 3.14159\nprint(f'{x:.2f}|{42:>5}|{\"q\"!r}|{x}')", "3.14|   42|'q'|3.14159"),
    ("a, (b, c) = 1, [2, 3]\nprint(a + b + c)", "6"),
    ("i = 0\nwhile True:\n    i += 1\n    if i % 2:\n        continue\n    if i > 6:\n        break\nprint(i)", "8"),
    ("for i in range(3):\n    pass\nelse:\n    print('done', i)", "done 2"),
    ("print(sorted([3, 1, 2], reverse=True), max('abc', key=ord), min([4, 2, 8]))", "[3, 2, 1] c 2"),
    ("print(list(zip('ab', range(5))), list(enumerate('xy', 1)), list(map(int, '123')))",
     "[('a', 0), ('b', 1)] [(1, 'x'), (2, 'y')] [1, 2, 3]"),
    ("print(sum(int(c) for c in str(2 ** 100)), any(x > 2 for x in [1, 3]), all([]))", "115 True True"),
    ("print(' '.join(['a', 'b']), 'a,b'.split(','), 'Hi'.lower().upper(), 'abc'.replace('b', 'xx'))",
     "a b ['a', 'b'] HI axxc"),
    ("x = 41\nx + 1", "42"),
    ("x = 41", "(no output)"),
    ("a = [1]\na.append(a)\nprint(a)", "[1, [...]]"),
    ("print(divmod(17, 5), pow(3, 200, 1000), abs(-2.5), int('  42 '), float('1.5'), str(None))",
     "(3, 2) 1 2.5 42 1.5 None"),
    ("print(isinstance(3, int), isinstance('s', (int, str)), isinstance(True, int))", "True True True"),
    ("g = (i for i in range(3))\nprint(g, list(g), list(g))", "<generator object> [0, 1, 2] []"),
    ("print(print, len, (lambda: 0))", "<built-in function print> <built-in function len> <function <lambda>>"),
    ("print(7 ** 600 % 1000, len(str(7 ** 3000)))", "1 2536"),
])
def test_programs_print_what_python_prints(code, expected):
    assert out(code) == expected


@pytest.mark.parametrize("code, expected", [
    ("1 / 0", "Error: ZeroDivisionError: division by zero (line 1)"),
    ("x = 1\ny = x + undefined", "Error: NameError: name 'undefined' is not defined (line 2)"),
    ("print('a')\n[1, 2][5]", "a\nError: IndexError: list index out of range (line 2)"),
    ("{'a': 1}['b']", "Error: KeyError: 'b' (line 1)"),
    ("'a' + 1", 'Error: TypeError: can only concatenate str (not "int") to str (line 1)'),
    ("def f(:\n  pass", "Error: SyntaxError: invalid syntax (line 1)"),
    ("x = 1\ndef f():\n    print(x)\n    x = 2\nf()",
     "Error: UnboundLocalError: cannot access local variable 'x' where it is not associated with a value (line 3)"),
    ("assert 1 == 2, 'no'", "Error: AssertionError: no (line 1)"),
    ("a, b = [1, 2, 3]", "Error: ValueError: too many values to unpack (expected 2) (line 1)"),
    ("return 5", "Error: SyntaxError: 'return' outside function (line 1)"),
    ("'%d' % 5", "Error: '%' formatting of strings is not supported; use an f-string (line 1)"),
    # after a call returns, an error in the calling statement names the caller's line (it named the callee's)
    ("def f():\n    pass\nf()()", "Error: TypeError: 'NoneType' object is not callable (line 3)"),
    ("def f():\n    return 1 / 0\nf()", "Error: ZeroDivisionError: division by zero (line 2)"),
    # a value not found: fixed texts (CPython's list.index shows its repr, for a function one with an address)
    ("def f(): pass\n[1].index(f)", "Error: ValueError: list.index(x): x not in list (line 2)"),
    ("[1].index({2})", "Error: ValueError: list.index(x): x not in list (line 1)"),
    ("(1,).index(print)", "Error: ValueError: tuple.index(x): x not in tuple (line 1)"),
])
def test_errors_come_back_as_observations(code, expected):
    assert out(code) == expected


def test_state_does_not_persist_between_runs():
    assert out("secret = 42") == "(no output)"
    assert out("print(secret)") == "Error: NameError: name 'secret' is not defined (line 1)"


# ----------------------------------------------------------------------------------------------- limits

def test_an_infinite_loop_meets_the_step_budget_at_the_same_step():
    r = run_python("i = 0\nwhile True:\n    i += 1")
    assert r.observation() == "Error: step budget of 100000 exceeded (line 3)"
    assert r.steps == 100001
    r2 = run_python("i = 0\nwhile True:\n    i += 1\n    print(i)", SandboxLimits(max_steps=500))
    r3 = run_python("i = 0\nwhile True:\n    i += 1\n    print(i)", SandboxLimits(max_steps=500))
    assert record(r2) == record(r3)
    assert r2.error.startswith("step budget of 500 exceeded")
    assert r2.stdout.splitlines()[-1] == "49"  # the budget always stops it at the same iteration


@pytest.mark.parametrize("code", [
    "sum(range(10 ** 12))", "sorted(range(10 ** 7))", "x = 0\nfor i in range(10 ** 9):\n    x += i",
    "def f(n):\n    return f(n - 1) + f(n - 1) if n else 1\nf(20)", "list(range(10 ** 6))",
])
def test_bulk_and_hidden_work_is_charged(code):
    assert "step budget of 100000 exceeded" in out(code)


@pytest.mark.parametrize("code, needle", [
    ("x = [0] * 10 ** 9", "memory limit: a list of 1000000000 elements exceeds the cap of 1000000"),
    ("s = 'ab' * 10 ** 9", "memory limit: a str of 2000000000 elements"),
    ("x = 2 ** 10 ** 10", "has more than 65536 bits"),
    ("x = 3 << 10 ** 6", "memory limit: an integer of about 1000002 bits"),
    ("x = 10 ** 20000\ny = x * x", "memory limit: an integer of about"),
    ("import math\nmath.factorial(10 ** 6)", "memory limit: an integer of about"),
    ("import math\nmath.comb(10 ** 6, 500000)", "memory limit"),
    ("from fractions import Fraction\nFraction('1e999999')", "memory limit"),
    ("round(5, -10 ** 9)", "memory limit: round() to"),
    ("'x'.zfill(10 ** 9)", "memory limit: a str of 1000000000"),
    ("f'{1:999999999}'", "format width or precision 999999999"),
    ("s = 'a'\nwhile True:\n    s = s + s", "memory limit: a str of 1048576 elements"),
])
def test_huge_allocations_become_memory_observations(code, needle):
    text = out(code)
    assert text.startswith("Error: ") and needle in text, text


def test_the_cumulative_memory_budget():
    """Every value created is charged (also by steps: about 512 bytes a step), so with the default step budget
    the memory budget is a second bound; with a larger step budget it stops a program on its own."""
    code = "a = ['x' * 100000 for _ in range(1000)]"
    assert out(code) == "Error: step budget of 100000 exceeded (line 1)"
    assert out(code, max_steps=10 ** 7) == \
        "Error: memory budget of 67108864 bytes exceeded (values created so far) (line 1)"
    assert out(code, max_steps=10 ** 7, max_memory_bytes=10 ** 9) == "(no output)"


def test_nesting_and_recursion_limits():
    assert "RecursionError: calls, blocks and expressions nested more than max_depth=200" in \
        out("def f(n):\n    return f(n + 1)\nf(0)")
    deep = "t = ()\nfor i in range(500):\n    t = (t,)\n"
    assert "nested more than 100 levels deep cannot be compared or used as a key" in out(deep + "d = {t: 1}")
    assert "cannot be printed" in out(deep + "print(t)")
    assert "contains itself cannot be compared" in out("a = []\na.append(a)\nb = []\nb.append(b)\na == b")
    assert "nests more than max_depth=200 levels" in out("x = " + "-" * 300 + "1")
    chain = "g = range(3)\nfor i in range({n}):\n    g = {wrap}\nprint(list(g))"
    for wrap in ("(x for x in g)", "map(abs, g)", "zip(g)", "filter(None, g)", "enumerate(g)"):
        assert "chained more than 50 deep" in out(chain.format(n=60, wrap=wrap)), wrap
    assert out(chain.format(n=49, wrap="map(abs, g)")) == "[0, 1, 2]"


def test_stdout_is_truncated_to_a_byte_limit_deterministically():
    r = run_python("for i in range(1000):\n    print('line', i)", SandboxLimits(max_output_bytes=64))
    assert len(r.stdout.encode()) == 64 and r.stdout == "".join(f"line {i}\n" for i in range(10))[:64]
    assert r.output_bytes == sum(len(f"line {i}\n") for i in range(1000))
    assert r.observation().endswith(f"[output truncated: the program printed {r.output_bytes} bytes, the first 64 "
                                    f"are shown]")
    # a cut inside a multi-byte character drops the partial character
    r = run_python("print('é' * 10)", SandboxLimits(max_output_bytes=5))
    assert r.stdout == "éé" and r.truncated
    # a lone surrogate is printed as its escape (it was dropped, and the output called truncated)
    r = run_python("print(chr(0xd800) + 'abc')")
    assert r.stdout == "\\ud800abc\n" and not r.truncated and r.output_bytes == 10


def test_code_length_and_literal_limits():
    assert "more than max_code_chars=10" in out("x = 1 + 2 + 3", max_code_chars=10)
    assert "more than 600 digits" in out("x = " + "9" * 700)


def test_limits_are_checked():
    with pytest.raises(ConfigError, match="env.python.max_steps=0"):
        SandboxLimits(max_steps=0)
    with pytest.raises(ConfigError, match="env.python.max_depth=500"):
        SandboxLimits(max_depth=500)


# ------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("code, needle", [
    ("import os", "import of module 'os' is not allowed"),
    ("import sys", "import of module 'sys' is not allowed"),
    ("from os import path", "import from module 'os' is not allowed"),
    ("import math, subprocess", "import of module 'subprocess' is not allowed"),
    ("from math import *", "'from math import *' is not supported"),
    ("__import__('os')", "'__import__' is not available"),
    ("open('/etc/passwd').read()", "'open' is not available in the sandbox"),
    ("f = open\nf('x')", "'open' is not available in the sandbox"),
    ("eval('1')", "'eval' is not available"),
    ("exec('x = 1')", "'exec' is not available"),
    ("getattr(1, 'real')", "'getattr' is not available"),
    ("type(1)", "'type' is not available"),
    ("().__class__.__bases__[0].__subclasses__()", "attribute '__subclasses__' is not allowed"),
    ("(lambda: 0).__globals__", "attribute '__globals__' is not allowed"),
    ("x = 'a'\nx._secret", "attribute '_secret' is not allowed"),
    ("__builtins__", "'__builtins__' is not available"),
    ("class A:\n    pass", "class definitions are not supported"),
    ("try:\n    1 / 0\nexcept Exception:\n    pass", "try/except is not supported"),
    ("with x:\n    pass", "with is not supported"),
    ("raise ValueError()", "raise is not supported"),
    ("def g():\n    yield 1", "generators (yield) are not supported"),
    ("def f(*args):\n    pass", "*args, **kwargs"),
    ("b'bytes'", "bytes literals are not supported"),
    ("'abc'.encode()", "'str' object has no attribute 'encode' in the sandbox"),
    ("import math\nmath.sys", "module 'math' has no attribute 'sys' in the sandbox"),
])
def test_refused(code, needle):
    text = out(code)
    assert text.startswith("Error: ") and needle in text, text


def test_refusals_happen_before_anything_runs():
    assert out("print('side effect')\nimport os") == \
        "Error: import of module 'os' is not allowed (the sandbox offers only math, fractions) (line 2)"


# ------------------------------------------------------------------------------------------ determinism

PROGRAMS = [
    "s = {'pear', 'apple', 'fig', 'kiwi', 'plum'}\nprint(s, {w: len(w) for w in s})",
    "print(len(str(3 ** 40000)), str(7 ** 9000)[-30:])",
    "i = 0\nwhile True:\n    i += 1\n    print(i)",
    "x = [0] * 10 ** 9",
    "def f(n):\n    return f(n + 1)\nf(0)",
    "import math\nprint([math.sin(k) for k in range(5)], 0.1 + 0.2, 1e300 * 1e10)",
    "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 60)))",
    "g = range(3)\nfor i in range(1500):\n    g = (x for x in g)\nprint(list(g))",
    "print(sorted({('b', 2), ('a', 1)}), {1: 'x', 'k': None})",
]


def test_results_are_identical_run_to_run_and_at_any_stack_depth():
    first = [record(run_python(p)) for p in PROGRAMS]

    def deep(n, p):
        return deep(n - 1, p) if n else record(run_python(p))

    assert [record(run_python(p)) for p in PROGRAMS] == first
    assert [deep(400, p) for p in PROGRAMS] == first


def test_results_are_identical_across_processes_hash_seeds_and_int_digit_limits():
    here = [record(run_python(p)) for p in PROGRAMS]
    script = ("import json, sys\nfrom rlrepro.envs import run_python\nprogs = json.loads(sys.stdin.read())\n"
              "rs = [run_python(p) for p in progs]\n"
              "print(json.dumps([{'stdout': r.stdout, 'error': r.error, 'steps': r.steps, 'memory': r.memory, "
              "'bytes': r.output_bytes} for r in rs]))")
    for hash_seed, digits in (("1", "640"), ("12345", "0")):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONINTMAXSTRDIGITS=digits)
        proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(PROGRAMS), capture_output=True,
                              text=True, env=env, check=True)
        assert json.loads(proc.stdout) == here


def test_no_clock_is_read(monkeypatch):
    def no_clock(*a, **k):
        raise AssertionError("the sandbox read a clock")
    expected = [record(run_python(p)) for p in PROGRAMS[:4]]
    for name in ("time", "monotonic", "perf_counter", "process_time", "time_ns", "monotonic_ns", "perf_counter_ns"):
        monkeypatch.setattr(time, name, no_clock)
    assert [record(run_python(p)) for p in PROGRAMS[:4]] == expected


def test_int_text_conversion_ignores_the_process_digit_limit():
    old = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(0)
        values = [7 ** k * (-1) ** k for k in (1, 500, 1800, 4000, 9000, 20000)]
        texts = [str(v) for v in values]
        sys.set_int_max_str_digits(640)
        assert [int_to_str(v) for v in values] == texts
        assert [str_to_int(t) for t in texts] == values
    finally:
        sys.set_int_max_str_digits(old)


def test_python_tool_wraps_the_sandbox():
    tool = python_tool(SandboxLimits(max_steps=1000))
    assert tool.run({"code": "print(6 * 7)"}).text == "42"
    loop = tool.run({"code": "while True:\n    pass"})
    assert loop.text == "Error: step budget of 1000 exceeded (line 2)" and not loop.ok and not loop.malformed
    assert tool.run({"code": "import os"}).text.startswith("Error: import of module 'os'")
    bad = tool.run({"source": "print(1)"})
    assert bad.malformed and bad.text == "Error: bad arguments for python: missing required argument 'code'"
