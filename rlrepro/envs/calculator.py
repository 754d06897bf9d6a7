"""The calculator tool: exact arithmetic on integers, fractions and decimals, by a small evaluator over
:mod:`ast` (never ``eval``), with a deterministic cost bound.

Grammar: numbers (``12``, ``-3``, ``0.25``, ``1e3``; a decimal literal is the exact rational it spells, so
``0.1 + 0.2`` is ``0.3``), ``+ - * / // % **``, unary ``+ -`` and parentheses. ``/`` is exact division (a
fraction). ``**`` needs an integer exponent. Every intermediate numerator and denominator is limited to
``max_digits`` decimal digits (a power is refused before it is computed when its size surely exceeds that) and
every exponent to ``max_exponent``; the expression to ``max_chars`` characters and ``max_nodes`` syntax nodes.
So the work is bounded by the expression's text, never by a clock.

The result is an integer (``408``), an exact decimal when the denominator divides a power of ten (``0.375``), or
``p/q`` otherwise (``1/3``). Errors (bad syntax, division by zero, a limit) come back as
:class:`CalculatorError` whose message the tool shows to the model.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from rlrepro.checks import Checker

from .sandbox_values import int_to_str

__all__ = ["CalculatorLimits", "CalculatorError", "calculate", "evaluate", "format_number"]

_NUMBER = re.compile(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass
class CalculatorLimits:
    """Limits of the calculator tool (the run schema's ``env.calculator`` section)."""
    SECTION: ClassVar[str] = "env.calculator"

    max_chars: int = 256
    max_nodes: int = 200
    max_digits: int = 1000
    max_exponent: int = 1000

    def __post_init__(self) -> None:
        c = Checker(self)
        c.positive_int("max_chars", "max_nodes", "max_digits", "max_exponent")
        # CPython's parser recurses on nesting; at most 1000 characters stay far below its limits at any depth
        c.require(self.max_chars <= 1000, "max_chars", "must be at most 1000")


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the message says why (shown to the model as the tool result)."""


def _digits(n: int) -> int:
    """The decimal digits of ``n``: from its bit length (exact or one too many), corrected by one comparison."""
    est = (abs(n).bit_length() * 30103) // 100000 + 1
    return est - 1 if est > 1 and abs(n) < 10 ** (est - 1) else est


def _check(x: Fraction, limits: CalculatorLimits) -> Fraction:
    if max(_digits(x.numerator), _digits(x.denominator)) > limits.max_digits:
        raise CalculatorError(f"a result has more than {limits.max_digits} digits")
    return x


def _literal(text: str, limits: CalculatorLimits) -> Fraction:
    m = _NUMBER.fullmatch(text)
    if m is None:
        raise CalculatorError(f"not a number: {text!r}")
    if len(m.group(1)) > limits.max_digits:
        raise CalculatorError(f"a number has more than {limits.max_digits} digits")
    if m.group(2) and abs(int(m.group(2)[1:])) > limits.max_digits:
        raise CalculatorError(f"an exponent in {text!r} is larger than {limits.max_digits}")
    return _check(Fraction(text), limits)


def _pow(base: Fraction, exp: Fraction, limits: CalculatorLimits) -> Fraction:
    if exp.denominator != 1:
        raise CalculatorError("the exponent must be an integer (the calculator is exact)")
    e = exp.numerator
    if abs(e) > limits.max_exponent:
        raise CalculatorError(f"the exponent {int_to_str(e)} is larger than {limits.max_exponent}")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length()) - 1
    if bits * abs(e) * 30103 // 100000 > limits.max_digits:
        raise CalculatorError(f"the result has more than {limits.max_digits} digits")
    return _check(base ** e, limits)


def _binop(op: ast.operator, a: Fraction, b: Fraction, limits: CalculatorLimits) -> Fraction:
    if isinstance(op, ast.Pow):
        return _pow(a, b, limits)
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
        raise CalculatorError("division by zero")
    if isinstance(op, ast.Add):
        return _check(a + b, limits)
    if isinstance(op, ast.Sub):
        return _check(a - b, limits)
    if isinstance(op, ast.Mult):
        return _check(a * b, limits)
    if isinstance(op, ast.Div):
        return _check(a / b, limits)
    if isinstance(op, ast.FloorDiv):
        return _check(Fraction(a // b), limits)
    if isinstance(op, ast.Mod):
        return _check(a % b, limits)
    raise CalculatorError(f"the operator {type(op).__name__} is not supported (use + - * / // % **)")


def evaluate(expression: str, limits: CalculatorLimits | None = None) -> Fraction:
    """The exact value of ``expression``; raises :class:`CalculatorError`."""
    limits = limits if limits is not None else CalculatorLimits()
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > limits.max_chars:
        raise CalculatorError(f"the expression is longer than {limits.max_chars} characters")
    if not expression.strip():
        raise CalculatorError("the expression is empty")
    if "_" in expression:
        raise CalculatorError("'_' is not allowed in numbers")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression.strip()!r}") from None
    except (RecursionError, MemoryError):  # not reached within max_chars <= 1000
        raise CalculatorError("the expression is nested too deeply") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > limits.max_nodes:
        raise CalculatorError(f"the expression has more than {limits.max_nodes} parts")
    source = expression.strip()
    lines = source.splitlines() or [""]

    def segment(node: ast.expr) -> str:
        if node.lineno != node.end_lineno:
            raise CalculatorError("a number must be on one line")
        return lines[node.lineno - 1][node.col_offset:node.end_col_offset]

    # explicit stack instead of recursion: evaluation order is the tree's, post-order
    stack: list[tuple[ast.expr, bool]] = [(tree.body, False)]
    values: list[Fraction] = []
    while stack:
        node, expanded = stack.pop()
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise CalculatorError(f"not a number: {segment(node)!r}")
            values.append(_literal(segment(node), limits))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            if not expanded:
                stack += [(node, True), (node.operand, False)]
            else:
                values.append(-values.pop() if isinstance(node.op, ast.USub) else values.pop())
        elif isinstance(node, ast.BinOp):
            if not expanded:
                stack += [(node, True), (node.right, False), (node.left, False)]
            else:
                b, a = values.pop(), values.pop()
                values.append(_binop(node.op, a, b, limits))
        else:
            raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not "
                                  f"{segment(node)!r}" if hasattr(node, "lineno") else "unsupported syntax")
    return values[0]


def format_number(x: Fraction) -> str:
    """``408``, ``-0.375`` (exact decimal when the denominator divides a power of ten) or ``1/3``."""
    if x.denominator == 1:
        return int_to_str(x.numerator)
    d, twos, fives = x.denominator, 0, 0
    while d % 2 == 0:
        d //= 2
        twos += 1
    while d % 5 == 0:
        d //= 5
        fives += 1
    if d != 1:
        return f"{int_to_str(x.numerator)}/{int_to_str(x.denominator)}"
    places = max(twos, fives)
    scaled = abs(x.numerator) * (10 ** places // x.denominator)
    whole, frac = divmod(scaled, 10 ** places)
    sign = "-" if x < 0 else ""
    return f"{sign}{int_to_str(whole)}.{int_to_str(frac).zfill(places)}"


def calculate(expression: str, limits: CalculatorLimits | None = None) -> str:
    """The calculator tool: the formatted value, or ``Error: <why>``."""
    try:
        return format_number(evaluate(expression, limits))
    except CalculatorError as e:
        return f"Error: {e}"
