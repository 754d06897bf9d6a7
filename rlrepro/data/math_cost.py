"""The deterministic cost rule of the ``math`` reward: what the parser and sympy may work on, decided by the
answer's text and structure, never by a clock.

math-verify bounds its work by ``signal.alarm`` timeouts; rlrepro switches them off (a timeout must never decide
a reward) and applies this rule instead. It has three parts, all pure functions of the answer and the limits
(the fields of ``rewards.MathReward``):

1. **The LaTeX rule** (``check_latex``) on every string math-verify hands to its LaTeX parser (after its own
   normalisation), before the parser runs: the length (``max_answer_chars``); the nesting of brackets and braces
   (``max_latex_depth``: the ANTLR parser's prediction grows exponentially with it: 20 nested braces took 87 s);
   a structure weight (``max_latex_weight``: every opening bracket weighs its depth, every ``^``/``_`` twice its
   depth plus one, every ``|`` four times: power towers and side-by-side bars are the parser's slowest inputs);
   commands that denote an unbounded computation or that latex2sympy evaluates while it parses
   (``REFUSED_COMMANDS``: sums, products, integrals, limits, ``\\det``, ``\\gcd``, matrix functions, evaluation
   bars ``|_{x=1}``); literals of more than ``len(str(max_function_arg))`` digits beside a binomial or Gamma
   (computed while parsing). All strings parsed for one answer (math-verify tries candidate after candidate)
   together get twice the length and weight limits.
2. **The number limits while converting**: latex2sympy compares interval ends (``[a, b]``) as it builds them, and
   sympy evaluates such a comparison numerically; every subexpression it converts first gets the number limits
   of part 3 (``9^{9^{9^{9}}}`` or ``(10^7)!!`` there ran for minutes).
3. **The expression rule** (``check_parsed``) on the parsed sympy objects before ``verify``: tree size and depth
   (``max_nodes``, ``max_depth``); no ``Integral``, ``Limit``, ``Derivative``, ``Sum``, ``Subs`` or other
   unevaluated operator; a bound on log2 of every number the expression denotes (``max_number_bits``: powers,
   products, ``exp``, factorials); arguments of factorial-like functions (``max_function_arg``); the terms a full
   expansion would have (``max_expansion_terms``; a negative power of a sum counts 8 times: simplify's rational
   functions cost more); trigonometric, hyperbolic, exp and log factors over the expanded terms
   (``max_function_factors``; a trigonometric one weighs its largest integer multiple, ``\\sin(64x)`` 64, a
   hyperbolic one twice that even of a number, ``\\sinh(64)`` 128: simplify expands them by multiple-angle
   formulae for seconds); the degree in the symbols of an equation or inequality, and of any expression that
   holds a function (``max_degree``: verify solves the former, simplify factors the latter).

An answer outside the rule raises ``TooCostly``: ``MathReward`` scores such a prediction 0.0 and refuses such a
gold answer. The rule bounds the blow-ups found by fuzzing (``tests/test_reward_fuzz.py``); it is not a proof
that every accepted expression is fast, and one that still is slow stalls the step (visible) rather than being
scored by the clock (silent).
"""
from __future__ import annotations

import contextvars
import math
import re
import threading
from typing import Any

__all__ = ["TooCostly", "check_latex", "check_parsed", "parse_guarded", "REFUSED_COMMANDS"]


class TooCostly(BaseException):
    """An answer is outside the cost rule. A ``BaseException`` so that math-verify's ``except Exception``
    handlers cannot turn it into "try the next candidate": the whole parse stops and the caller decides."""


# commands that denote an unbounded computation (sums, products, integrals, limits: latex2sympy compares interval
# ends while parsing, and sympy's evalf of a product computes it exactly), or that latex2sympy evaluates while
# parsing (det, gcd/lcm through nsimplify, matrix functions, eval-at bars)
REFUSED_COMMANDS = ("sum", "prod", "coprod", "int", "iint", "iiint", "iiiint", "oint", "idotsint", "lim", "limsup",
                    "liminf", "det", "gcd", "lcm", "partial", "nabla")
_OPERATORNAMES = ("eye", "rank", "trace", "tr", "rref", "nullspace", "norm", "cols", "rows", "eig", "eigen",
                  "diagonalize", "eigenvals", "eigenvalues", "eigenvects", "eigenvectors", "svd", "SVD", "gcd",
                  "lcm", "det", "lim")
_REFUSED = re.compile(
    r"\\(?:" + "|".join(REFUSED_COMMANDS) + r")(?![a-zA-Z])"
    r"|\\operatorname\s*\{\s*(?:" + "|".join(_OPERATORNAMES) + r")\s*\}"
    r"|\\begin\s*\{\s*[vV]matrix\s*\}"
    r"|\|\s*_|\|\s*\^\s*\{[^{}]*="  # an evaluation bar: \left. f \right|_{x=1}, f|^{x=2} (not |x|^2)
)
_EVALUATED_AT_PARSE = re.compile(r"\\(?:[dt]?binom|choose|Gamma|gamma)(?![a-zA-Z])")
_DIGIT_RUN = re.compile(r"\d+")
_OPEN = re.compile(r"\\left\s*(?:\\[a-zA-Z]+|\\?.)|\\[{\[]|[{(\[]")
_CLOSE = re.compile(r"\\right\s*(?:\\[a-zA-Z]+|\\?.)|\\[}\]]|[})\]]")
_STRUCTURE = re.compile(_OPEN.pattern + "|" + _CLOSE.pattern + r"|[\^_|]")


def check_latex(text: str, limits: Any) -> int:
    """The LaTeX rule on one string about to be parsed; raises ``TooCostly`` naming the limit, else returns the
    string's structure weight."""
    if len(text) > limits.max_answer_chars:
        raise TooCostly(f"longer than max_answer_chars={limits.max_answer_chars}")
    m = _REFUSED.search(text)
    if m:
        raise TooCostly(f"{m.group(0).strip()} is never evaluated")
    depth = deepest = weight = 0
    for m in _STRUCTURE.finditer(text):
        token = m.group(0)
        if token == "|":  # absolute-value bars: the parser cannot tell opening from closing ones
            weight += 4 * (depth + 1)
        elif token in "^_":  # scripts: power towers are the parser's slowest construct
            weight += 2 * (depth + 1)
        elif _OPEN.fullmatch(token):
            depth += 1
            weight += depth
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    if deepest > limits.max_latex_depth:
        raise TooCostly(f"brackets nested {deepest} deep > max_latex_depth={limits.max_latex_depth}")
    if weight > limits.max_latex_weight:
        raise TooCostly(f"structure weight {weight} > max_latex_weight={limits.max_latex_weight}")
    if _EVALUATED_AT_PARSE.search(text):
        digits = len(str(limits.max_function_arg))
        if any(len(run) > digits for run in _DIGIT_RUN.findall(text)):
            raise TooCostly(f"a binomial or Gamma with a literal of more than {digits} digits")
    return weight


# ------------------------------------------------------------------------------------------ parsing, guarded

class _Budget:
    """What one answer may hand to the parser in all: math-verify tries candidate after candidate until one parses
    (a completion without ``\\boxed`` can hold hundreds), so the strings of one answer together get twice the
    limits of a single one."""

    def __init__(self, limits: Any):
        self.limits, self.chars, self.weight = limits, 0, 0

    def charge(self, text: str, weight: int) -> None:
        self.chars += len(text)
        self.weight += weight
        if self.chars > 2 * self.limits.max_answer_chars or self.weight > 2 * self.limits.max_latex_weight:
            raise TooCostly("the candidate answers together exceed twice max_answer_chars or max_latex_weight")


_ACTIVE: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("rlrepro_math_cost", default=None)


_INSTALL_LOCK = threading.Lock()
_installed = False


def _install_hooks() -> None:
    """Route math-verify's LaTeX and expression parsers through the LaTeX rule while ``parse_guarded`` runs.
    Outside it (no budget in the context) the wrapped functions behave exactly as math-verify's own.
    Installed once per process, under a lock: two threads scoring their first answers at once must not both wrap
    the parsers (each string would be charged twice to the budget, and rewards would change for the process)."""
    global _installed
    if _installed:
        return
    with _INSTALL_LOCK:
        if not _installed:
            _wrap_parsers()
            _installed = True


def _wrap_parsers() -> None:
    from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
    from math_verify import parser

    latex_parse, expr_parse = parser.parse_latex_cached, parser.parse_expr_cached

    def guarded_latex(latex: str):
        budget = _ACTIVE.get()
        if budget is not None:
            budget.charge(latex, check_latex(latex, budget.limits))
        return latex_parse(latex)

    def guarded_expr(expr: str):
        budget = _ACTIVE.get()
        if budget is not None:
            if len(expr) > budget.limits.max_answer_chars:
                raise TooCostly(f"longer than max_answer_chars={budget.limits.max_answer_chars}")
            budget.charge(expr, 0)
        return expr_parse(expr)

    parser.parse_latex_cached, parser.parse_expr_cached = guarded_latex, guarded_expr

    # latex2sympy compares interval ends (``[a, b]``) while it converts, and sympy's comparison evaluates them
    # numerically: 9^{9^{9^{9}}} or (10^7)!! there would run for minutes. Every converted subexpression gets the
    # number limits before anything can compare it.
    convert_expr = _Latex2Sympy.convert_expr

    def guarded_convert(self, expr):
        result = convert_expr(self, expr)
        budget = _ACTIVE.get()
        if budget is not None:
            _Walk(budget.limits).numbers(result)
        return result

    _Latex2Sympy.convert_expr = guarded_convert


def parse_guarded(text: str, limits: Any) -> list[Any]:
    """``math_verify.parse(text)`` without timeouts, with the LaTeX rule applied to every string it parses.
    The rule runs in front of math-verify's parse caches, so a cached parse is one the rule admits: the result
    never depends on what was parsed before."""
    from math_verify import parse

    _install_hooks()
    token = _ACTIVE.set(_Budget(limits))
    try:
        return parse(text, parsing_timeout=None)
    finally:
        _ACTIVE.reset(token)


# ---------------------------------------------------------------------------------------- the expression rule

# Functions whose value is no larger than their arguments' (or bounded): they do not blow numbers up.
_TAME_FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "asec", "acsc", "atan2",
    "sinh", "cosh", "tanh", "coth", "sech", "csch", "asinh", "acosh", "atanh", "acoth", "asech", "acsch",
    "log", "ln", "Abs", "sign", "floor", "ceiling", "frac", "re", "im", "arg", "conjugate", "Min", "Max",
    "Mod", "gcd", "lcm", "Piecewise", "Heaviside",
})
# trigonometric, hyperbolic, exponential and logarithmic functions: simplify (trigsimp, exptrigsimp, logcombine)
# works hard on every factor of them
_FACTOR_FUNCTIONS = frozenset({n for n in _TAME_FUNCTIONS if n.rstrip("h").lstrip("a") in
                               {"sin", "cos", "tan", "cot", "sec", "csc", "tan2"}} | {"exp", "log"})
# operators sympy evaluates by an unbounded algorithm (doit): never handed to verify
_UNEVALUATED = frozenset({"Integral", "Limit", "Derivative", "Subs", "Order", "RootSum", "Lambda", "Determinant",
                          "Trace", "Inverse", "Adjoint", "MatrixExpr", "FunctionMatrix", "Sum", "Product"})


def _pow2(x: float) -> float:
    return math.inf if x > 1000 else 2.0 ** x


def check_parsed(parsed: list[Any], limits: Any) -> None:
    """The expression rule on math-verify's parse result (sympy objects and strings); raises ``TooCostly``."""
    for item in parsed:
        if not isinstance(item, str):
            _Walk(limits).check(item)


class _Walk:
    def __init__(self, limits: Any):
        self.lim = limits
        self.cap = limits.max_expansion_terms + 1
        self.trig_cap = limits.max_function_factors + 1

    def check(self, e: Any) -> None:
        """The whole expression rule. An expression the rule cannot assess (sympy raises on it) is refused."""
        try:
            self._check(e)
        except Exception as err:  # noqa: BLE001 - deterministic: the same expression raises the same way
            raise TooCostly(f"the cost rule cannot assess it ({type(err).__name__})") from None

    def _check(self, e: Any) -> None:
        has_function = self._size(e)
        bits, terms, trig = self.walk(e)
        if has_function and self._degree(e) > self.lim.max_degree:
            # beside a function (sin(17), log(52), ...) simplify factors the polynomial parts: slow at high degree
            raise TooCostly(f"degree above max_degree={self.lim.max_degree} beside a function")
        if terms > self.lim.max_expansion_terms:
            raise TooCostly(f"expands to more than max_expansion_terms={self.lim.max_expansion_terms} terms")
        if trig > self.lim.max_function_factors:
            raise TooCostly(f"more than max_function_factors={self.lim.max_function_factors} function factors")

    def numbers(self, e: Any) -> None:
        """Only size, depth and the number limits (for a subexpression while it is being converted)."""
        try:
            self._size(e)
            self.walk(e)
        except Exception as err:  # noqa: BLE001
            raise TooCostly(f"the cost rule cannot assess it ({type(err).__name__})") from None

    def _size(self, e: Any) -> bool:
        """Nodes and depth, iteratively (a deep tree must not recurse), before anything else looks at ``e``;
        whether it holds a function (sin, log, floor, factorial, ...)."""
        import sympy

        stack, nodes, has_function = [(e, 0)], 0, False
        while stack:
            node, depth = stack.pop()
            nodes += 1
            if nodes > self.lim.max_nodes:
                raise TooCostly(f"more than max_nodes={self.lim.max_nodes} nodes")
            if depth > self.lim.max_depth:
                raise TooCostly(f"nested deeper than max_depth={self.lim.max_depth}")
            if isinstance(node, sympy.MatrixBase):
                if len(node) > self.lim.max_nodes:
                    raise TooCostly(f"a matrix of more than max_nodes={self.lim.max_nodes} entries")
                stack.extend((x, depth + 1) for x in node)
            elif isinstance(node, sympy.Basic):
                has_function = has_function or isinstance(node, sympy.Function)
                stack.extend((x, depth + 1) for x in node.args)
        return has_function

    @staticmethod
    def _free(e: Any) -> bool:
        return bool(getattr(e, "free_symbols", None))

    def walk(self, e: Any) -> tuple[float, int, int]:
        """(bound on log2|value|, terms of the full expansion, function factors over those terms)."""
        import sympy

        if isinstance(e, sympy.MatrixBase):
            parts = [self.walk(x) for x in e]
            return (max((p[0] for p in parts), default=0.0), min(sum(p[1] for p in parts), self.cap),
                    min(sum(p[2] for p in parts), self.trig_cap))
        if not isinstance(e, sympy.Basic):
            return 0.0, 1, 0
        bits, terms, trig = self._node(e)
        if bits > self.lim.max_number_bits:
            raise TooCostly(f"a number above 2^{self.lim.max_number_bits} (max_number_bits)")
        return bits, (terms if self._free(e) else 1), trig

    def _node(self, e: Any) -> tuple[float, int, int]:
        import sympy

        name = type(e).__name__
        if name in _UNEVALUATED or isinstance(e, (sympy.Integral, sympy.Limit, sympy.Derivative, sympy.Subs)):
            raise TooCostly(f"{name} is never evaluated")
        if e.is_Integer:
            return math.log2(max(abs(int(e)), 1)), 1, 0
        if e.is_Rational:
            return math.log2(max(abs(int(e.p)), abs(int(e.q)), 1)), 1, 0
        if e.is_Float:
            _, _, exp, bc = e._mpf_
            return float(abs(exp) + abs(bc)), 1, 0
        if not e.args:
            return 2.0, 1, 0  # symbols, pi, E, I, oo
        if e.is_Pow or isinstance(e, sympy.MatPow):
            return self._pow(e)
        if e.is_Mul:
            parts = [self.walk(a) for a in e.args]
            total = 1
            for p in parts:
                total = min(total * p[1], self.cap)
            trig = sum(p[2] * max(total // max(p[1], 1), 1) for p in parts)
            return sum(p[0] for p in parts), total, min(trig, self.trig_cap)
        if e.is_Add:
            parts = [self.walk(a) for a in e.args]
            return (max(p[0] for p in parts) + math.log2(len(parts)), min(sum(p[1] for p in parts), self.cap),
                    min(sum(p[2] for p in parts), self.trig_cap))
        if isinstance(e, sympy.exp):
            arg, _, trig = self.walk(e.args[0])
            if arg > 62:
                raise TooCostly("exp of a number above 2^62")
            return 1.4427 * _pow2(arg), 1, min(trig + self._free(e), self.trig_cap)
        parts = [self.walk(a) for a in e.args]
        if isinstance(e, sympy.core.relational.Relational):
            self._solve_degree(e)
        trig = min(sum(p[2] for p in parts), self.trig_cap)
        if isinstance(e, sympy.Function) and name not in _TAME_FUNCTIONS:
            # factorial, binomial, gamma, fibonacci, ...: sympy evaluates them exactly, so bound the arguments
            limit = math.log2(self.lim.max_function_arg)
            if any(p[0] > limit for p, x in zip(parts, e.args) if not self._free(x)):
                raise TooCostly(f"{name} of an argument above max_function_arg={self.lim.max_function_arg}")
            n = _pow2(max((p[0] for p in parts), default=0.0))
            return n * max(math.log2(max(n, 2.0)), 1.0), 1, trig
        if name in ("exp", "log"):
            trig = min(trig + self._free(e), self.trig_cap)
        elif name in _FACTOR_FUNCTIONS:
            hyperbolic = name.endswith("h")
            if hyperbolic or self._free(e):
                trig = min(trig + self._multiple(e, hyperbolic), self.trig_cap)
        bits = max((p[0] for p in parts), default=0.0) + math.log2(max(len(parts), 1))
        return bits, min(sum(p[1] for p in parts), self.cap), trig

    def _pow(self, e: Any) -> tuple[float, int, int]:
        import sympy

        base_e, exp_e = e.args
        base, base_terms, base_trig = self.walk(base_e)
        expo, _, exp_trig = self.walk(exp_e)
        matrix = isinstance(base_e, sympy.MatrixBase) or getattr(base_e, "is_Matrix", False)
        if self._free(exp_e):
            if matrix:
                raise TooCostly("a matrix to a symbolic power")
            return max(base, expo), base_terms, min(base_trig + exp_trig, self.trig_cap)
        if expo > 62:
            raise TooCostly("an exponent above 2^62")
        bits = base * _pow2(expo)
        if not (exp_e.is_Rational and exp_e.is_number):
            return bits, base_terms, min(base_trig + exp_trig, self.trig_cap)
        n = abs(int(exp_e.p)) // int(exp_e.q)
        if matrix:
            rows = getattr(base_e, "rows", 1)
            bits = max(n, 1) * (base + math.log2(max(rows, 1)) + 1.0)
            if not self._free(base_e):
                return bits, 1, 0
            terms = self.cap if n + 1 >= 64 else min(base_terms ** (n + 1), self.cap)
            return bits, terms, min(base_trig * max(n, 1), self.trig_cap)
        if base_terms == 1:
            return bits, 1, base_trig
        weight = 8 if exp_e.is_negative else 1  # 1/(x+1)^n: rational simplification costs more than expansion
        terms = self.cap if n >= self.cap else min(weight * math.comb(n + base_terms - 1, base_terms - 1), self.cap)
        trig = min(terms * min(n, base_trig), self.trig_cap) if base_trig else 0
        return bits, terms, trig

    @staticmethod
    def _multiple(e: Any, hyperbolic: bool) -> int:
        """What a trigonometric or hyperbolic factor weighs: its largest integer multiple (at least 1; twice that
        for a hyperbolic one). simplify rewrites sin(64x) and sinh(64) by multiple-angle formulae, for seconds;
        only the terms with symbols count in a trigonometric argument (sin(64) stays cheap), every term in a
        hyperbolic one."""
        import sympy

        weight = 1
        for term in sympy.Add.make_args(e.args[0]):
            coeff, _ = term.as_coeff_Mul()
            if (hyperbolic or term.free_symbols) and coeff.is_Rational:
                weight = max(weight, abs(int(coeff.p)))
        return 2 * weight if hyperbolic else weight  # hyperbolic ones are rewritten as trigonometric ones of i*x

    def _solve_degree(self, rel: Any) -> None:
        """verify solves equations and inequalities in their symbols: bound the degree it would solve for."""
        degree = max(self._degree(side) for side in rel.args)
        if degree > self.lim.max_degree:
            raise TooCostly(f"an equation or inequality of degree above max_degree={self.lim.max_degree}")

    def _degree(self, e: Any) -> float:
        """Degree in the free symbols, counting a function of them as its argument; inf for a symbolic power."""
        import sympy

        if not isinstance(e, sympy.Basic) or not self._free(e):
            return 0
        if not e.args:
            return 1
        if e.is_Pow:
            if self._free(e.exp):
                return math.inf
            n = e.exp
            factor = float(abs(n)) if n.is_Rational else _pow2(self.walk(n)[0])
            return self._degree(e.base) * factor
        if e.is_Mul:
            return sum(self._degree(a) for a in e.args)
        return max(self._degree(a) for a in e.args)
