"""Red-team findings of session 31 against the Python sandbox: C-level work a step did not pay for.

Each program below ran for seconds to minutes of CPU on one core within the default step budget before the fix
(measured at the sizes in the comments); after it the step budget stops it at once. The inputs here are small
versions that, on the old code, finished *inside* the budget; the tests assert that they now meet it (or cost
far more steps), and that each takes well under a second.
"""
import time

from rlrepro.envs.sandbox import SandboxLimits, run_python


def _run(code: str, steps: int = 100_000):
    t = time.perf_counter()
    r = run_python(code, SandboxLimits(max_steps=steps))
    assert time.perf_counter() - t < 2.0
    return r


def test_strip_with_long_chars_is_charged_by_product():
    # 'a' * 10**6 stripped of 'b' * 999999 + 'a' took 8.6 s in 68k steps: each char found in `chars` linearly
    code = "s = 'a' * 20000\nc = 'b' * 19999 + 'a'\nt = s.rstrip(c)\nprint(len(t))"
    r = _run(code)
    assert r.error is not None and "step budget" in r.error
    # a short `chars` (the usual use) costs about what it did
    assert _run("s = 'a' * 20000\nprint(len(s.strip(' a')))").error is None


def test_membership_of_long_equal_strings_is_charged():
    # t in [s] * 10**6 with s, t two equal-length 1 MB strings: 21 s in 99,640 steps (a memcmp per element)
    code = "s = 'a' * 20000\nt = 'a' * 19999 + 'b'\nl = [s] * 2000\nprint(t in l)"
    r = _run(code)
    assert r.error is not None and "step budget" in r.error
    for expr in ("l.count(t)", "[t] * 2000 == l", "(t,) * 2000 < tuple(l)"):
        r = _run(code.replace("t in l", expr))
        assert r.error is not None and "step budget" in r.error, expr


def test_plain_membership_costs_unchanged():
    base = _run("l = list(range(1000))\nw = ['ab', 'cd'] * 500").steps
    assert _run("l = list(range(1000))\nw = ['ab', 'cd'] * 500\n5 in l\n'cd' in w").steps - base < 100


def test_sorting_big_fractions_is_charged_by_limb_products():
    # sorted([f, g] * 20000) of ~31k-bit Fractions: 7.9 s in 54k steps (each < multiplies big ints in Python)
    code = ("from fractions import Fraction\nf = Fraction(3**4000, 2**6000 + 1)\ng = Fraction(3**4000 + 1, "
            "2**6000 + 1)\nl = [f, g] * 1000\nprint(len(sorted(l)))")
    r = _run(code)
    assert r.error is not None and "step budget" in r.error
    for expr in ("max(l)", "min(l)"):  # 2000 comparisons of ~6k-bit limb products: charged once a key
        assert _run(code.replace("len(sorted(l))", expr)).steps > 15_000, expr
    # small Fractions sort as before
    assert _run("from fractions import Fraction\nprint(sorted([Fraction(i, 7) for i in range(300)])[0])").stdout \
        == "0\n"


def test_sorting_lists_of_long_strings_is_charged():
    # sort keys that are lists holding long strings: the strings' lengths were not counted (only bare str keys)
    code = "s = 'a' * 20000\nt = 'a' * 19999 + 'b'\nl = [[s], [t]] * 200\nprint(len(sorted(l)))"
    r = _run(code)
    assert r.error is not None and "step budget" in r.error


def test_comparing_big_fractions_in_a_loop_is_charged():
    code = ("from fractions import Fraction\nf = Fraction(3**4000, 2**6000 + 1)\ng = f + 1\nn = 0\n"
            "for i in range(200):\n    n += f < g\nprint(n)")
    assert _run(code).steps > _run(code.replace("f < g", "1 < 2")).steps + 1000


def test_nan_made_by_arithmetic_has_the_same_sign_on_every_cpu():
    # inf - inf is the CPU's default NaN: sign bit set on x86-64, clear on ARM; copysign read it (-1.0 on x86)
    code = ("import math\nx = math.inf - math.inf\ny = 0.0 * math.inf\nz = divmod(math.inf, 1.0)[1]\n"
            "print(math.copysign(1.0, x), math.copysign(1.0, y), math.copysign(1.0, z))")
    assert _run(code).stdout == "1.0 1.0 1.0\n"
    # a NaN's own sign still travels through arithmetic and negation, as in CPython
    assert _run("import math\nx = -math.nan\nprint(math.copysign(1.0, x))").stdout == "-1.0\n"


def test_printing_a_deep_value_counts_against_max_depth_not_the_recursion_limit():
    # a 99-deep list printed at the bottom of a recursion: before, the repr's own recursion was uncounted, so the
    # result depended on sys.getrecursionlimit() (a process-wide setting): printed at 1000, RecursionError at 700
    import sys
    code = ("a = 0\nfor i in range(99):\n    a = [a]\ndef f(n):\n    if n == 0:\n        return repr(a)\n"
            "    return f(n - 1)\nprint(len(f(60)))")
    limits = SandboxLimits(max_depth=250)
    old = sys.getrecursionlimit()
    try:
        results = []
        for limit in (1000, 700):
            sys.setrecursionlimit(limit)
            r = run_python(code, limits)
            results.append((r.stdout, r.error))
    finally:
        sys.setrecursionlimit(old)
    assert results[0] == results[1]
    assert "max_depth=250" in results[0][1]
    # printed from the top level, a 99-deep value still prints
    assert run_python(code.replace("f(60)", "f(0)"), limits).stdout == "199\n"


def test_startswith_a_tuple_of_long_prefixes_is_charged():
    # 1 MB s, a tuple of 10**6 refs to a 1 MB prefix differing in the middle: a memcmp of 0.5 MB each (~13 s)
    code = "s = 'a' * 20000\np = 'a' * 9999 + 'b' + 'a' * 10000\nt = (p,) * 2000\nprint(s.startswith(t))"
    r = _run(code)
    assert r.error is not None and "step budget" in r.error
    assert _run(code.replace("startswith", "endswith")).error is not None
    assert _run("print('abc'.startswith(('x', 'ab')))").stdout == "True\n"
