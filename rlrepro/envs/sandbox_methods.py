"""Attributes of sandbox values: the whitelisted methods of str, list, dict, set, tuple, int, float and Fraction,
and the ``math`` and ``fractions`` modules. Any other attribute does not exist for the program, and a name that
starts with ``_`` is refused (no ``__class__``, ``__globals__``, ``__subclasses__``: the usual ways out).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable

from .sandbox_builtins import Builtin, BoundMethod, Module, check_args, iterate, new_fraction, sort_values
from .sandbox_ops import binop, is_int
from .sandbox_values import Refused, SandboxSet, check_unicode

__all__ = ["get_attribute", "make_module", "MODULES"]

MODULES = ("math", "fractions")


def _linear(name: str) -> Callable:
    """A str method whose work and result are linear in the string: charged by length, result checked."""
    def fn(interp: Any, obj: Any, args: list, kwargs: dict) -> Any:
        interp.meter.bulk(len(obj))
        check_unicode(obj, name)  # upper(), isalpha(), ... read Unicode properties that differ by version
        if name in _STRIPS and args and type(args[0]) is str:
            # CPython strips a char at a time, finding it in `chars` linearly: s.strip(c) with two 1 MB strings
            # is 10**12 char tests for one step per 64 characters
            interp.meter.bulk(len(obj) * len(args[0]))
        if name in ("startswith", "endswith") and args and type(args[0]) is tuple:
            # each prefix of the tuple is compared in turn (a memcmp of up to len(obj) bytes)
            interp.meter.bulk(sum(min(len(p), len(obj)) for p in args[0] if type(p) is str))
        result = getattr(obj, name)(*args, **kwargs)
        if type(result) in (list, tuple):
            interp.meter.alloc(56 * len(result))  # the parts are new string objects
        return interp.meter.value(result)
    return fn


_STRIPS = ("strip", "lstrip", "rstrip")


def _width(name: str) -> Callable:
    """zfill / ljust / rjust / center: the width is checked against the string cap first."""
    def fn(interp: Any, obj: Any, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, 1, 2)
        if not is_int(args[0]):
            raise TypeError(f"'{type(args[0]).__name__}' object cannot be interpreted as an integer")
        interp.meter.length(int(args[0]), "str")
        interp.meter.bulk(max(int(args[0]), len(obj)))
        return interp.meter.value(getattr(obj, name)(*args))
    return fn


def _str_replace(interp: Any, obj: str, args: list, kwargs: dict) -> str:
    check_args("replace", args, kwargs, 2, 3)
    old, new = args[0], args[1]
    if type(old) is not str or type(new) is not str:
        raise TypeError("replace() arguments must be str")
    count = args[2] if len(args) > 2 else -1
    n = obj.count(old) if old else len(obj) + 1
    if is_int(count) and count >= 0:
        n = min(n, count)
    size = len(obj) + n * (len(new) - len(old))
    interp.meter.length(size, "str")
    interp.meter.bulk(len(obj) + size)
    return interp.meter.value(obj.replace(*args))


def _str_join(interp: Any, obj: str, args: list, kwargs: dict) -> str:
    check_args("join", args, kwargs, 1, 1)
    parts = list(iterate(interp.meter, args[0]))
    for i, p in enumerate(parts):
        if type(p) is not str:
            raise TypeError(f"sequence item {i}: expected str instance, {type(p).__name__} found")
    size = sum(len(p) for p in parts) + len(obj) * max(len(parts) - 1, 0)
    interp.meter.length(size, "str")
    interp.meter.bulk(size)
    return interp.meter.value(obj.join(parts))


_STR_LINEAR = ("upper", "lower", "strip", "lstrip", "rstrip", "title", "capitalize", "swapcase", "split",
               "rsplit", "splitlines", "partition", "rpartition", "startswith", "endswith", "find", "rfind",
               "index", "rindex", "count", "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper",
               "isnumeric", "isdecimal")


def _list_append(interp: Any, obj: list, args: list, kwargs: dict) -> None:
    check_args("append", args, kwargs, 1, 1)
    interp.meter.length(len(obj) + 1, "list")
    interp.meter.alloc(8)
    obj.append(args[0])


def _list_extend(interp: Any, obj: list, args: list, kwargs: dict) -> None:
    check_args("extend", args, kwargs, 1, 1)
    items = list(iterate(interp.meter, args[0]))
    interp.meter.length(len(obj) + len(items), "list")
    interp.meter.alloc(8 * len(items))
    obj.extend(items)


def _list_insert(interp: Any, obj: list, args: list, kwargs: dict) -> None:
    check_args("insert", args, kwargs, 2, 2)
    interp.meter.length(len(obj) + 1, "list")
    interp.meter.bulk(len(obj))
    interp.meter.alloc(8)
    obj.insert(*args)


def _scan(name: str) -> Callable:
    """list/tuple methods that compare the argument with elements (index, count, remove). A value not found is
    CPython's ValueError with a fixed text (its list.index names the value by repr, which for a sandbox object
    without a safe one holds a memory address: the observation would differ from run to run)."""
    def fn(interp: Any, obj: Any, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, 1, 3)
        interp.meter.nesting(args[0])
        interp.meter.nesting(obj)
        try:
            return getattr(obj, name)(*args)
        except ValueError:
            kind = type(obj).__name__
            raise ValueError(f"{kind}.{name}(x): x not in {kind}") from None
    return fn


def _plain(name: str, low: int = 0, high: int = 0) -> Callable:
    """A method that does at most linear work over the object (charged) and builds nothing larger."""
    def fn(interp: Any, obj: Any, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, low, high)
        interp.meter.bulk(len(obj) if hasattr(obj, "__len__") else 1)
        return interp.meter.value(getattr(obj, name)(*args))
    return fn


def _list_sort(interp: Any, obj: list, args: list, kwargs: dict) -> None:
    check_args("sort", args, kwargs, 0, 0, ("key", "reverse"))
    obj[:] = sort_values(interp, list(obj), kwargs.get("key"), kwargs.get("reverse", False))


def _keyed(name: str, low: int, high: int) -> Callable:
    """dict / set methods that hash their first argument (nested keys scanned first)."""
    def fn(interp: Any, obj: Any, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, low, high)
        if args:
            interp.meter.nesting(args[0])
        result = getattr(obj, name)(*args)
        interp.meter.length(len(obj), type(obj).__name__)
        if name in ("add", "setdefault"):
            interp.meter.alloc(64)
        return result
    return fn


def _dict_update(interp: Any, obj: dict, args: list, kwargs: dict) -> None:
    check_args("update", args, kwargs, 0, 1, kwargs.keys())
    if args:
        src = args[0]
        for pair in iterate(interp.meter, src.items() if type(src) is dict else src):
            if type(pair) not in (tuple, list) or len(pair) != 2:
                raise ValueError("dictionary update sequence element has the wrong length or type")
            interp.meter.nesting(pair[0])
            obj[pair[0]] = pair[1]
            interp.meter.length(len(obj), "dict")
    obj.update(kwargs)


def _set_op(name: str) -> Callable:
    def fn(interp: Any, obj: SandboxSet, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, 1, 1)
        if type(args[0]) is SandboxSet:
            other = args[0]
        else:  # each element scanned before it is hashed (a deep tuple recursed in C: a crash), as set(...) does
            items = list(iterate(interp.meter, args[0]))
            for x in items:
                interp.meter.nesting(x)
            other = SandboxSet(items)
        interp.meter.bulk(len(obj) + len(other))
        return interp.meter.value(getattr(obj, name)(other))
    return fn


def _limit_denominator(interp: Any, obj: Fraction, args: list, kwargs: dict) -> Fraction:
    check_args("limit_denominator", args, kwargs, 0, 1, ("max_denominator",))
    interp.meter.quad(obj.numerator.bit_length(), obj.denominator.bit_length())
    return interp.meter.value(obj.limit_denominator(*args, **kwargs))


_METHODS: dict[type, dict[str, Callable]] = {
    str: {**{n: _linear(n) for n in _STR_LINEAR}, "replace": _str_replace, "join": _str_join,
          **{n: _width(n) for n in ("zfill", "ljust", "rjust", "center")}},
    list: {"append": _list_append, "extend": _list_extend, "insert": _list_insert, "pop": _plain("pop", 0, 1),
           "remove": _scan("remove"), "index": _scan("index"), "count": _scan("count"), "sort": _list_sort,
           "reverse": _plain("reverse"), "copy": _plain("copy"), "clear": _plain("clear")},
    tuple: {"index": _scan("index"), "count": _scan("count")},
    dict: {"get": _keyed("get", 1, 2), "pop": _keyed("pop", 1, 2), "setdefault": _keyed("setdefault", 1, 2),
           "keys": _plain("keys"), "values": _plain("values"), "items": _plain("items"), "update": _dict_update,
           "copy": _plain("copy"), "clear": _plain("clear")},
    SandboxSet: {"add": _keyed("add", 1, 1), "discard": _keyed("discard", 1, 1), "remove": _keyed("remove", 1, 1),
                 "pop": _plain("pop"), "clear": _plain("clear"), "copy": _plain("copy"), "union": _set_op("union"),
                 "intersection": _set_op("intersection"), "difference": _set_op("difference"),
                 "issubset": _set_op("issubset")},
    int: {"bit_length": _plain("bit_length")},
    float: {"is_integer": _plain("is_integer")},
    Fraction: {"limit_denominator": _limit_denominator},
}
_METHODS[bool] = _METHODS[int]


def get_attribute(obj: Any, name: str) -> Any:
    """``obj.name`` in the sandbox: a member of a module, Fraction's numerator/denominator, or a bound method of
    the whitelist. Names starting with ``_`` are refused."""
    if name.startswith("_"):
        raise Refused(f"access to the attribute {name!r} is not allowed in the sandbox")
    t = type(obj)
    if t is Module:
        if name not in obj.members:
            raise AttributeError(f"module '{obj.name}' has no attribute '{name}' in the sandbox")
        return obj.members[name]
    if t is Fraction and name in ("numerator", "denominator"):
        return getattr(obj, name)
    table = _METHODS.get(t, {})
    if name in table:
        return BoundMethod(obj, name, table[name])
    raise AttributeError(f"'{t.__name__}' object has no attribute '{name}' in the sandbox")


# ------------------------------------------------------------------------------------------------ modules

_FLOAT_FUNCS = ("sqrt", "exp", "log", "log2", "log10", "log1p", "expm1", "sin", "cos", "tan", "asin", "acos",
                "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "hypot", "fabs", "degrees",
                "radians", "isfinite", "isinf", "isnan", "isclose", "copysign", "fmod", "modf", "remainder",
                "erf", "erfc", "gamma", "lgamma", "floor", "ceil", "trunc", "pow")


def _numeric_args(name: str, args: list, kwargs: dict) -> None:
    for a in list(args) + list(kwargs.values()):
        if type(a) not in (int, bool, float, Fraction):
            raise TypeError(f"math.{name}() needs numbers, got {type(a).__name__}")


def _float_fn(name: str) -> Callable:
    f = getattr(math, name)

    def fn(interp: Any, args: list, kwargs: dict) -> Any:
        _numeric_args(name, args, kwargs)
        return interp.meter.value(f(*args, **kwargs))
    return fn


def _int_args(name: str, args: list, low: int, high: int) -> list[int]:
    check_args(f"math.{name}", args, {}, low, high)
    for a in args:
        if not is_int(a):
            raise TypeError(f"math.{name}() needs integers, got {type(a).__name__}")
    return [int(a) for a in args]


def _factorial(interp: Any, args: list, kwargs: dict) -> int:
    (n,) = _int_args("factorial", args, 1, 1)
    if n < 0:
        raise ValueError("factorial() not defined for negative values")
    est = n * max(n.bit_length() - 1, 1)  # >= log2(n!) for every n
    interp.meter.int_bits(est)
    interp.meter.convert(est)  # a product tree: about as costly as a decimal conversion of the result
    return interp.meter.value(math.factorial(n))


def _comb_perm(name: str) -> Callable:
    def fn(interp: Any, args: list, kwargs: dict) -> int:
        values = _int_args(name, args, 1 if name == "perm" else 2, 2)
        n, k = values[0], (values[1] if len(values) > 1 else values[0])
        if n < 0 or k < 0:
            raise ValueError(f"{name}() needs non-negative integers")
        small = min(k, n - k) if name == "comb" and k <= n else k
        est = min(n, small * n.bit_length()) if name == "comb" else min(k, n) * n.bit_length()
        interp.meter.int_bits(est)
        interp.meter.convert(est)
        return interp.meter.value(getattr(math, name)(*values))
    return fn


def _gcd_lcm(name: str) -> Callable:
    def fn(interp: Any, args: list, kwargs: dict) -> int:
        values = _int_args(name, args, 0, 1 << 30)
        total = sum(v.bit_length() for v in values)
        if name == "lcm":
            interp.meter.int_bits(total)
        interp.meter.quad(total, total)
        return interp.meter.value(getattr(math, name)(*values))
    return fn


def _isqrt(interp: Any, args: list, kwargs: dict) -> int:
    (n,) = _int_args("isqrt", args, 1, 1)
    interp.meter.quad(n.bit_length(), n.bit_length())
    return math.isqrt(n)


def _prod(interp: Any, args: list, kwargs: dict) -> Any:
    check_args("math.prod", args, kwargs, 1, 1, ("start",))
    total = kwargs.get("start", 1)
    for x in iterate(interp.meter, args[0]):
        total = binop(interp.meter, "Mult", total, x)
    return total


def _fsum(interp: Any, args: list, kwargs: dict) -> float:
    check_args("math.fsum", args, kwargs, 1, 1)
    items = list(iterate(interp.meter, args[0]))
    _numeric_args("fsum", items, {})
    return math.fsum(items)


def _fraction(interp: Any, args: list, kwargs: dict) -> Fraction:
    return new_fraction(interp.meter, args, kwargs)


def make_module(name: str) -> Module:
    """A fresh ``math`` or ``fractions`` module of the sandbox; any other name is refused."""
    if name == "math":
        members: dict[str, Any] = {n: Builtin(f"math.{n}", _float_fn(n)) for n in _FLOAT_FUNCS}
        members.update({
            "factorial": Builtin("math.factorial", _factorial), "comb": Builtin("math.comb", _comb_perm("comb")),
            "perm": Builtin("math.perm", _comb_perm("perm")), "gcd": Builtin("math.gcd", _gcd_lcm("gcd")),
            "lcm": Builtin("math.lcm", _gcd_lcm("lcm")), "isqrt": Builtin("math.isqrt", _isqrt),
            "prod": Builtin("math.prod", _prod), "fsum": Builtin("math.fsum", _fsum),
            "pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan,
        })
        return Module("math", members)
    if name == "fractions":
        return Module("fractions", {"Fraction": Builtin("Fraction", _fraction, Fraction)})
    raise Refused(f"import of module {name!r} is not allowed (the sandbox offers only {', '.join(MODULES)})")
