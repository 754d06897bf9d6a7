"""Session 36: the python tool's results depend on the code alone, not on the Python version (3.11 here, 3.12 on
the GPU machines), the process's int_max_str_digits, warnings filters or PYTHONHASHSEED (docs/ENVS.md section 5)."""
from __future__ import annotations

import ast
import glob
import json
import os
import subprocess
import sys
import warnings

import pytest

from rlrepro.envs.sandbox import run_python
from rlrepro.envs.sandbox_compat import _old_fstring_ok


def obs(code: str) -> str:
    return run_python(code).observation()


# ---- ints in limit messages: never converted to text in full

HUGE = ["print(round(1.5, 10**5000))", "print(2 ** (10**5000))", "print('a' * 10**5000)", "print([0] * 10**5000)",
        "print(1 << 10**5000)", "print('abc'.zfill(10**5000))"]


def test_limit_messages_do_not_depend_on_int_max_str_digits():
    old = sys.get_int_max_str_digits()
    seen = []
    try:
        for digits in (old, 0, 640):
            sys.set_int_max_str_digits(digits)
            seen.append([obs(code) for code in HUGE])
    finally:
        sys.set_int_max_str_digits(old)
    assert seen[0] == seen[1] == seen[2]
    assert seen[0][1] == "Error: memory limit: 2 ** <int of 16610 bits> has more than 65536 bits (max_int_bits) " \
                         "(line 1)"
    assert seen[0][2] == "Error: memory limit: a str of <int of 16610 bits> elements exceeds the cap of 1000000 " \
                         "(line 1)"
    assert all(len(o) < 200 for o in seen[0])


# ---- syntax errors: one fixed text, and 3.12-only syntax rejected as 3.11 rejects it

SYNTAX = {
    "def f(a=1, b):\n    pass": 1,  # 3.11 and 3.12 word this one differently
    'f"{}"': 1, 'f"{x!z}"': 1, "import": 1, "print(1 2)": 1, "x = 1\nprint(1))": 2, "x = (1,\n     2,\n": 1,
    "print(1)\0": 1,  # 3.11: ValueError from ast.parse, 3.12: SyntaxError
    # accepted by 3.12+ only (PEP 701 f-strings, PEP 695), rejected by 3.11
    "xs = ['a']\nprint(f\"{'\\n'.join(xs)}\")": 2, "d = {'a': 1}\nprint(f\"{d[\"a\"]}\")": 2,
    "print(f'{1 # c\n}')": 1, "x = w = p = 1\nprint(f'{x:{w:{p}}}')": 2, "print(f'{f'{1}'}')": 1,
    "def f[T](x):\n    return x": 1, "type X = int": 1, "print(f'{\"\\N{BULLET}\"}')": 1,
    "x\u200d = 1": 1,  # an identifier character since Unicode 15.1 only
    "print('\\N{KAWI LETTER A}')": 1,  # a character name since Unicode 15.0 only
}


@pytest.mark.parametrize("code", list(SYNTAX))
def test_syntax_errors_are_one_fixed_text_on_every_version(code):
    assert obs(code) == f"Error: SyntaxError: invalid syntax (line {SYNTAX[code]})"


# (f-string, accepted by Python 3.11): all of them are accepted by 3.12
FSTRINGS = [("f'{x}'", True), ("f'{x!r:>{w}}'", True), ("f'{x:{w}.{p}}'", True), ("f'{x=}'", True),
            ("f'{x != 1}'", True), ("f'{{}} {x}'", True), ("f'a\\n{x}'", True), ("f'{\"a\"}'", True),
            ("f'''{'a'}'''", True), ("f'{(lambda: 1)()}'", True), ("f'{ {1: 2}[1] }'", True),
            ("rf'\\d{x}'", True), ("f\"{f'{x}'}\"", True), ("f'{x:{w:{p}}}'", False), ("f'{\"\\n\"}'", False),
            ("f'{'a'}'", False), ("f'{x # c\n}'", False), ("f'{x:\\n}'", True), ("f'{(x\n)}'", False),
            ("f'''{(x\n)}'''", True), ("f'{x:{\"a\"}}'", True)]


@pytest.mark.parametrize("text,accepted", FSTRINGS)
def test_311_fstring_rules(text, accepted):
    assert _old_fstring_ok(text) is accepted
    if sys.version_info[:2] == (3, 11):  # the table itself, against the real 3.11 parser
        try:
            ast.parse(text)
            parsed = True
        except SyntaxError:
            parsed = False
        assert parsed is accepted


def test_parse_ignores_the_process_warning_filters():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error, or a test runner's filterwarnings=error
        assert obs("x = '\\d'\nprint(x)") == "\\d"
        assert obs("print(1if 1 else 2)") == "1"


# ---- Unicode: properties that differ between the Unicode databases of 3.11 (14.0), 3.12 (15.0), 3.13 (15.1)

def test_unicode_version_dependent_operations_are_fixed_or_refused():
    assert obs("print(repr(chr(0x1FAE8)), [chr(0x11F04)])") == "'\\U0001fae8' ['\\U00011f04']"
    assert obs("print(chr(0x11F04).upper())") == (
        "Error: str.upper() on a string holding U+11F04: that character's Unicode properties differ between "
        "Python versions (Unicode 14.0 to 15.1), so the result would too (line 1)")
    assert obs("'两'.isnumeric()").startswith("Error: str.isnumeric() on a string holding U+4E24:")
    assert obs("int(chr(0x11F51))").startswith("Error: int() on a string holding U+11F51:")
    # characters whose properties did not change are untouched, and values holding new ones print as UTF-8
    assert obs("print(['两个', '😀', 'é'.upper()], '两'.upper(), chr(0x11F04) == chr(0x11F04))") == \
        "['两个', '😀', 'É'] 两 True"


# ---- CPython runtime messages worded differently by version

def test_version_dependent_runtime_messages_have_one_text():
    assert obs("1.0 % 0") == "Error: ZeroDivisionError: float modulo by zero (line 1)"  # 3.11/3.12: 'float modulo'
    assert obs("'abc'.find()") == "Error: TypeError: find() takes at least 1 argument(s) (0 given) (line 1)"
    assert obs("'abc'.find(1)") == "Error: TypeError: argument must be str, not int (line 1)"
    assert obs("chr(10**30)") == "Error: ValueError: chr() arg not in range(0x110000) (line 1)"
    # ERANGE's text comes from the C library (glibc and musl word it differently): one text
    assert obs("2.0 ** 2000") == "Error: OverflowError: (34, 'Numerical result out of range') (line 1)"


# ---- the same programs under every Python installed here, with other hash seeds and int_max_str_digits

_RUNNER = """
import json, sys, types
for name, path in (("rlrepro", sys.argv[1] + "/rlrepro"), ("rlrepro.envs", sys.argv[1] + "/rlrepro/envs")):
    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m
from rlrepro.envs.sandbox import run_python
print(json.dumps([run_python(p).observation() for p in json.loads(sys.stdin.read())]))
"""
CROSS = ["print({'pear', 'apple', 'fig'} | set('kiwi'), {'b': 1, 'a': 2}.keys() & {'a'})",
         "s = {'x', 'y'}; print(s.pop(), sorted({'z', 'a'}))", "print(repr(1e16), -0.0, 0.1 + 0.2, 1e-7, 2.5e300)",
         "print(f'{1e16:g} {-0.0:.2f} {float(\"nan\")} {2**70:,} {1/3:.5e}')", "print(str(10**5000)[-3:])",
         "print(2 ** (10**5000))", "1.0 % 0", "'abc'.count()", "chr(10**30)", "def f(a=1, b): pass", "import",
         "print(f\"{'\\n'.join(['a'])}\")", "x = '\\d'", "print(repr(chr(0x1FAE8)))", "print(chr(0x11F04).lower())",
         "print(sorted([3, 1.5, True]), sorted(['b', 'B', 'é']))", "print(1 +)", "int('z', 37)",
         "d = {}\nd[[1]] = 2", "print(sorted([1, 'a']))", "import math\nmath.sqrt(-1)", "[].pop()"]


def _interpreters() -> list[str]:
    found = {sys.executable}
    for pattern in ("/root/.pyenv/versions/3.1[1-9]*/bin/python3", "/usr/bin/python3.1[1-9]"):
        found.update(glob.glob(pattern))
    versions: dict[str, str] = {}
    for exe in sorted(found):
        try:
            v = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                               text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if v:
            versions.setdefault(v, exe)
    return list(versions.values())


def test_same_results_under_every_installed_python_and_hash_seed():
    exes = _interpreters()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    for i, exe in enumerate(exes):
        for seed, digits in (("0", "0"), ("12345", "640")):
            env = dict(os.environ, PYTHONHASHSEED=str(int(seed) + i), PYTHONINTMAXSTRDIGITS=digits)
            out = subprocess.run([exe, "-W", "error", "-c", _RUNNER, root], input=json.dumps(CROSS),
                                 capture_output=True, text=True, env=env, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            results.append((exe, json.loads(out.stdout)))
    for exe, got in results[1:]:
        for code, a, b in zip(CROSS, results[0][1], got):
            assert a == b, (exe, code)
    if len(exes) == 1:
        pytest.skip("only one Python version is installed here: the hash seeds were compared, not the versions")
