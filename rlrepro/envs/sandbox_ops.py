"""Operators of the Python sandbox: arithmetic, comparisons, subscripts and f-string fields, each checked
against the limits (:class:`~rlrepro.envs.sandbox_values.Meter`) before CPython does the work.

The operands are only ever sandbox values (None, bool, int, float, str, list, tuple, dict, the sandbox's set,
Fraction, range, functions and lazy iterators): no class statement exists, so no operator can reach code the
program wrote except through the interpreter.
"""
from __future__ import annotations

import operator
from fractions import Fraction
from typing import Any

from .sandbox_values import Meter, MemoryLimitExceeded, Refused, SandboxSet, check_format_spec, to_repr, to_str

__all__ = ["binop", "unaryop", "compare", "get_item", "set_item", "del_item", "format_field", "is_int",
           "CONTAINERS"]

CONTAINERS = (list, tuple, dict, SandboxSet)

_BINOPS = {
    "Add": operator.add, "Sub": operator.sub, "Mult": operator.mul, "Div": operator.truediv,
    "FloorDiv": operator.floordiv, "Mod": operator.mod, "Pow": operator.pow, "LShift": operator.lshift,
    "RShift": operator.rshift, "BitOr": operator.or_, "BitXor": operator.xor, "BitAnd": operator.and_,
    "MatMult": operator.matmul,
}
_SYMBOL = {"Add": "+", "Sub": "-", "Mult": "*", "Div": "/", "FloorDiv": "//", "Mod": "%", "Pow": "**",
           "LShift": "<<", "RShift": ">>", "BitOr": "|", "BitXor": "^", "BitAnd": "&", "MatMult": "@"}
_COMPARES = {
    "Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
    "GtE": operator.ge, "Is": operator.is_, "IsNot": operator.is_not,
}
_SEQUENCES = (str, list, tuple)
_VIEWS = ("dict_keys", "dict_values", "dict_items")
_SET_OPS = ("BitOr", "BitAnd", "BitXor", "Sub")


def is_int(x: Any) -> bool:
    return type(x) is int or type(x) is bool


def _bits(x: Any) -> int:
    if is_int(x):
        return int(x).bit_length()
    if type(x) is Fraction:
        return x.numerator.bit_length() + x.denominator.bit_length()
    return 64


def _kind(x: Any) -> str:
    return type(x).__name__


def _as_set(meter: Meter, op: str, x: Any, other: Any) -> SandboxSet:
    """An operand of a set operator with a dict view (``d.keys() | range(9)``) as the sandbox's set: CPython would
    build a hash-ordered ``set`` in C, its size and work uncharged and its elements hashed unchecked."""
    if type(x) is SandboxSet:
        return x
    if type(x) not in (str, list, tuple, dict, range) and type(x).__name__ not in _VIEWS:
        raise TypeError(f"unsupported operand type(s) for {_SYMBOL[op]}: '{_kind(x)}' and '{_kind(other)}'")
    meter.length(len(x), "set")
    meter.alloc(64 * len(x) + 64)
    items = list(x)
    for item in items:
        meter.nesting(item)
    return SandboxSet(items)


def binop(meter: Meter, op: str, a: Any, b: Any) -> Any:
    """``a <op> b`` for the ast operator name ``op`` (``"Add"``, ``"Pow"``, ...)."""
    ta, tb = type(a), type(b)
    if op in _SET_OPS and (ta.__name__ in _VIEWS[::2] or tb.__name__ in _VIEWS[::2]):  # keys, items: set-like
        a, b = _as_set(meter, op, a, b), _as_set(meter, op, b, a)
        ta = tb = SandboxSet
    if op == "Mult":
        if ta in _SEQUENCES and is_int(b) or tb in _SEQUENCES and is_int(a):
            seq, n = (a, b) if ta in _SEQUENCES else (b, a)
            size = len(seq) * max(int(n), 0)
            meter.length(size, type(seq).__name__)
            meter.bulk(size)
        elif is_int(a) and is_int(b) or Fraction in (ta, tb):
            if is_int(a) and is_int(b):
                meter.int_bits(_bits(a) + _bits(b) - 1)
            meter.quad(_bits(a), _bits(b))
    elif op == "Pow":
        # x ** Fraction(n) is x ** n (a Fraction when n < 0): the same sizes as an int exponent
        e = b.numerator if tb is Fraction and b.denominator == 1 and (is_int(a) or ta is Fraction) else b
        if is_int(a) and is_int(e) and (e >= 0 or tb is Fraction) or ta is Fraction and is_int(e):
            num = a.numerator if ta is Fraction else a
            den = a.denominator if ta is Fraction else 1
            meter.pow_bits(num, abs(int(e)))
            meter.pow_bits(den, abs(int(e)))
            est = max(_bits(a) * abs(int(e)), 1) if abs(int(e)) < meter.limits.max_int_bits else 1
            meter.quad(est, est)
    elif op == "LShift":
        if is_int(a) and is_int(b) and b > 0 and a != 0:
            meter.int_bits(int(a).bit_length() + int(b))
    elif op == "Add" and ta in _SEQUENCES and ta is tb:
        meter.length(len(a) + len(b), ta.__name__)
        meter.bulk(len(a) + len(b))
    elif op == "Mod" and ta is str:
        raise Refused("'%' formatting of strings is not supported; use an f-string")
    elif op in _SET_OPS and ta is SandboxSet:  # before Sub's arithmetic branch: a - b of sets was uncharged
        meter.bulk(len(a) + (len(b) if tb is SandboxSet else 0))
    elif op in ("FloorDiv", "Mod", "Div", "Add", "Sub"):
        if (is_int(a) or ta is Fraction) and (is_int(b) or tb is Fraction):
            meter.quad(_bits(a), _bits(b))
    fn = _BINOPS.get(op)
    if fn is None:
        raise Refused(f"the operator {op} is not supported")
    if op in _SET_OPS and (ta is SandboxSet or tb is SandboxSet) and ta is not tb:
        raise TypeError(f"unsupported operand type(s) for {_SYMBOL[op]}: '{_kind(a)}' and '{_kind(b)}'")
    result = fn(a, b)
    if type(result) is float and result != result and a == a and b == b:
        # a NaN made from numbers (inf - inf, 0 * inf, divmod(inf, 1.0)) is the CPU's default NaN, negative on x86
        # and positive on ARM: math.copysign(1, inf - inf) would differ between machines. Made positive here.
        result = abs(result)
    return meter.value(result)


def unaryop(meter: Meter, op: str, a: Any) -> Any:
    if op == "Not":
        return not a
    if op == "USub":
        return meter.value(-a)
    if op == "UAdd":
        return meter.value(+a)
    if op == "Invert":
        if type(a) is bool or not is_int(a):
            raise TypeError(f"bad operand type for unary ~: '{_kind(a)}'")
        return ~a
    raise Refused(f"the operator {op} is not supported")


def compare(meter: Meter, op: str, a: Any, b: Any) -> bool:
    """One link of a comparison chain; nested containers are scanned first (CPython compares them in C)."""
    if op in ("In", "NotIn"):
        tb = type(b)
        if tb in (list, tuple):
            meter.nesting(a)
            meter.nesting(b)
        elif tb is str:
            if type(a) is not str:
                raise TypeError(f"'in <string>' requires string as left operand, not {_kind(a)}")
            meter.bulk(len(b))
        elif tb in (dict, SandboxSet):
            meter.nesting(a)
        elif tb is range or tb.__name__ in ("dict_keys", "dict_values", "dict_items"):
            meter.nesting(a)
            meter.bulk(len(b) if tb.__name__ == "dict_values" else 1)
        else:
            raise TypeError(f"argument of type '{_kind(b)}' is not iterable")
        found = a in b
        return found if op == "In" else not found
    if op not in ("Is", "IsNot"):
        for x in (a, b):
            name = type(x).__name__
            if name in _VIEWS:  # compared in C element by element: charged, and an item's value scanned first
                meter.bulk(len(x))
                if name == "dict_items":
                    meter.nesting(list(x))
        meter.nesting(a)
        meter.nesting(b)
        if type(a) is str and type(b) is str:
            meter.bulk(min(len(a), len(b)))
    fn = _COMPARES.get(op)
    if fn is None:
        raise Refused(f"the comparison {op} is not supported")
    return fn(a, b)


def _key(meter: Meter, key: Any) -> Any:
    if type(key) in CONTAINERS:
        meter.nesting(key)
    return key


def get_item(meter: Meter, obj: Any, index: Any) -> Any:
    t = type(obj)
    if t is dict:
        return obj[_key(meter, index)]
    if t in (list, tuple, str, range):
        if type(index) is slice:
            result = obj[index]
            meter.bulk(len(result))
            return meter.value(result)
        if not is_int(index):
            raise TypeError(f"{t.__name__} indices must be integers or slices, not {_kind(index)}")
        return obj[index]
    raise TypeError(f"'{_kind(obj)}' object is not subscriptable")


def set_item(meter: Meter, obj: Any, index: Any, value: Any) -> None:
    t = type(obj)
    if t is dict:
        obj[_key(meter, index)] = value
        meter.length(len(obj), "dict")
        meter.alloc(64)
        return
    if t is list:
        if type(index) is slice:
            if type(value) not in (list, tuple, str, range):
                raise TypeError("can only assign a list, tuple, str or range to a slice")
            meter.length(len(obj) + len(value), "list")  # before list(range(10**9)) is built
            meter.alloc(8 * len(value))
            obj[index] = list(value)
            return
        if not is_int(index):
            raise TypeError(f"list indices must be integers or slices, not {_kind(index)}")
        obj[index] = value
        return
    raise TypeError(f"'{_kind(obj)}' object does not support item assignment")


def del_item(meter: Meter, obj: Any, index: Any) -> None:
    t = type(obj)
    if t is dict:
        del obj[_key(meter, index)]
    elif t is list and (is_int(index) or type(index) is slice):
        meter.bulk(len(obj))
        del obj[index]
    else:
        raise TypeError(f"'{_kind(obj)}' object does not support item deletion")


def format_field(meter: Meter, value: Any, conversion: int, spec: str) -> str:
    """One ``{value!conversion:spec}`` field of an f-string."""
    if conversion in (ord("r"), ord("a")):
        value = to_repr(value, meter)
    elif conversion == ord("s"):
        value = to_str(value, meter)
    if not spec:
        return to_str(value, meter)
    check_format_spec(spec, meter)
    t = type(value)
    if is_int(value) and int(value).bit_length() > 1600:
        raise MemoryLimitExceeded("formatting an integer above 2**1600 with a format spec is not supported; "
                                  "print it without one")
    if t not in (int, bool, float, str):
        raise TypeError(f"unsupported format string passed to {_kind(value)}.__format__")
    if spec.endswith("n") and t is not str:  # the type 'n' (a fill character is never last)
        raise Refused("the format type 'n' is not supported (it follows the process's locale); use ',' or 'd'")
    return meter.value(format(value, spec))
