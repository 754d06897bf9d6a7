"""The builtin functions of the Python sandbox, and the objects the interpreter calls them through.

A builtin is ``fn(interp, args, kwargs)``; ``interp`` offers ``meter`` (steps, memory, size caps), ``call(f,
args, kwargs)`` (a sandbox function, builtin or method), ``write(text)`` (stdout) and ``truth(value)``.
Every iteration goes through :func:`iterate`, which charges one step per element, so ``sum(range(10**12))``
meets the step budget instead of running for hours. Functions that take a key (``sorted``, ``min``, ``max``)
call it through the interpreter: the program's own code never runs outside it.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable, Iterable, Iterator

from .sandbox_ops import binop, is_int
from .sandbox_values import (Meter, MemoryLimitExceeded, SandboxSet, check_unicode, short_int, str_to_int,
                             to_repr, to_str)

__all__ = ["Builtin", "BoundMethod", "LazyIter", "Module", "iterate", "make_builtins", "sort_values",
           "arg_error", "check_args", "new_fraction"]

_VIEW_NAMES = ("dict_keys", "dict_values", "dict_items")


class Builtin:
    """A builtin function (or type) of the sandbox."""
    __slots__ = ("name", "fn", "pytype")

    def __init__(self, name: str, fn: Callable, pytype: Any = None) -> None:
        self.name, self.fn, self.pytype = name, fn, pytype

    @property
    def sandbox_repr(self) -> str:
        return f"<class '{self.name}'>" if self.pytype is not None else f"<built-in function {self.name}>"


class BoundMethod:
    """``obj.name`` for a method of the sandbox's whitelist: ``fn(interp, obj, args, kwargs)``."""
    __slots__ = ("obj", "name", "fn")

    def __init__(self, obj: Any, name: str, fn: Callable) -> None:
        self.obj, self.name, self.fn = obj, name, fn

    @property
    def sandbox_repr(self) -> str:
        return f"<built-in method {self.name} of {type(self.obj).__name__} object>"


class Module:
    """``math`` or ``fractions`` as the sandbox offers them: a fixed table of members."""
    __slots__ = ("name", "members")

    def __init__(self, name: str, members: dict[str, Any]) -> None:
        self.name, self.members = name, members

    @property
    def sandbox_repr(self) -> str:
        return f"<module '{self.name}'>"


MAX_LAZY_CHAIN = 50


class LazyIter:
    """A lazy iterator of the sandbox (generator expressions, map, filter, zip, enumerate, reversed).

    ``sources`` are the values it draws from: a chain of lazy iterators each drawing from the last would
    recurse in CPython when consumed, so a chain longer than MAX_LAZY_CHAIN is refused when it is built."""
    __slots__ = ("name", "it", "chain")

    def __init__(self, name: str, it: Iterator[Any], sources: Iterable[Any] = ()) -> None:
        self.name, self.it = name, it
        self.chain = 1 + max((s.chain for s in sources if type(s) is LazyIter), default=0)
        if self.chain > MAX_LAZY_CHAIN:
            raise MemoryLimitExceeded(f"lazy iterators (generators, map, zip, ...) chained more than "
                                      f"{MAX_LAZY_CHAIN} deep")

    def __iter__(self) -> "LazyIter":
        return self

    def __next__(self) -> Any:
        return next(self.it)

    @property
    def sandbox_repr(self) -> str:
        return f"<{self.name} object>"


_ITERABLE = (str, list, tuple, dict, SandboxSet, range, LazyIter)


# Depth levels a pull from a lazy iterator costs: it resumes the iterator's own generators (up to 4 Python frames
# between two lazy iterators, 3 a level of max_depth), which a chain through a comprehension's inner `for`
# ((x for _ in r for x in g), not counted by MAX_LAZY_CHAIN) nests without bound.
_LAZY_DEPTH = 2


def iterate(meter: Meter, obj: Any) -> Iterator[Any]:
    """Iterate a sandbox value, one step per element."""
    t = type(obj)
    if t not in _ITERABLE and t.__name__ not in _VIEW_NAMES:
        raise TypeError(f"'{t.__name__}' object is not iterable")
    if t is LazyIter:
        while True:
            meter.enter(_LAZY_DEPTH)
            try:
                x = next(obj.it)
            except StopIteration:
                return
            finally:
                meter.depth -= _LAZY_DEPTH
            meter.step()
            yield x
    for x in obj:
        meter.step()
        yield x


def arg_error(name: str, message: str) -> TypeError:
    return TypeError(f"{name}() {message}")


def check_args(name: str, args: list, kwargs: dict, low: int, high: int, keywords: Iterable[str] = ()) -> None:
    if not low <= len(args) <= high:
        expect = f"{low}" if low == high else f"from {low} to {high}"
        raise arg_error(name, f"takes {expect} positional arguments but {len(args)} were given")
    bad = sorted(set(kwargs) - set(keywords))
    if bad:
        raise arg_error(name, f"got an unexpected keyword argument '{bad[0]}'")


def _number(x: Any) -> bool:
    return type(x) in (int, bool, float, Fraction)


def sort_values(interp: Any, items: list, key: Any, reverse: Any) -> list:
    """``sorted(items, key=key, reverse=reverse)``: keys computed through the interpreter, then CPython's
    stable sort on them (nested keys scanned first); n log n of bulk work charged."""
    meter = interp.meter
    keys = items if key is None else [interp.call(key, [x], {}) for x in items]
    # comparing keys costs their weight (strings by length, Fractions by limb products, nested ones too), and
    # each key takes part in about log n comparisons
    heavy = sum(meter.nesting(k) for k in keys)
    n = len(items)
    meter.bulk((n + heavy) * max(n.bit_length(), 1))
    order = sorted(range(n), key=keys.__getitem__, reverse=bool(reverse))
    return [items[i] for i in order]


def new_fraction(meter: Meter, args: list, kwargs: dict) -> Fraction:
    """``Fraction(numerator=0, denominator=None)`` with text and size checked first (``Fraction('1e999999')``
    would build a 3-million-bit int)."""
    check_args("Fraction", args, kwargs, 0, 2, ("numerator", "denominator"))
    values = list(args) + [kwargs[k] for k in ("numerator", "denominator") if k in kwargs]
    for v in values:
        if type(v) is str:
            if len(v) > 400:
                raise ValueError(f"Fraction text of {len(v)} characters is longer than the sandbox's 400")
            mantissa, _, exp = v.strip().lower().replace("_", "").partition("e")
            if exp:
                try:
                    e = int(exp)
                except ValueError:
                    raise ValueError(f"Invalid literal for Fraction: {v!r}") from None
                meter.int_bits(abs(e) * 10 // 3)
        elif not _number(v):
            raise TypeError(f"argument should be a string or a Rational instance, not {type(v).__name__}")
    for v in values:
        if type(v) is not str:
            meter.value(v)
    meter.quad(64 * len(values), 64 * len(values))
    return meter.value(Fraction(*values))


# ---------------------------------------------------------------------------------------------- builtins

def _print(interp: Any, args: list, kwargs: dict) -> None:
    check_args("print", [], kwargs, 0, 0, ("sep", "end"))
    sep, end = kwargs.get("sep", " "), kwargs.get("end", "\n")
    for name, v in (("sep", sep), ("end", end)):
        if v is not None and type(v) is not str:
            raise TypeError(f"{name} must be None or a string, not {type(v).__name__}")
    sep, end = " " if sep is None else sep, "\n" if end is None else end
    parts = [to_str(a, interp.meter) for a in args]
    # the line's size before it is built: print(*range(9999), sep='x' * 10**6) would join 10 GB
    interp.meter.length(sum(map(len, parts)) + len(sep) * max(len(parts) - 1, 0) + len(end), "str")
    interp.write(sep.join(parts) + end)


def _range(interp: Any, args: list, kwargs: dict) -> range:
    check_args("range", args, kwargs, 1, 3)
    for a in args:
        if not is_int(a):
            raise TypeError(f"'{type(a).__name__}' object cannot be interpreted as an integer")
    for a in args:
        interp.meter.value(int(a))
    return range(*args)


def _len(interp: Any, args: list, kwargs: dict) -> int:
    check_args("len", args, kwargs, 1, 1)
    x = args[0]
    if type(x) not in (str, list, tuple, dict, SandboxSet, range) and type(x).__name__ not in _VIEW_NAMES:
        raise TypeError(f"object of type '{type(x).__name__}' has no len()")
    return len(x)


def _sum(interp: Any, args: list, kwargs: dict) -> Any:
    check_args("sum", args, kwargs, 1, 2, ("start",))
    total = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if type(total) is str:
        raise TypeError("sum() can't sum strings [use ''.join(seq) instead]")
    for x in iterate(interp.meter, args[0]):
        total = binop(interp.meter, "Add", total, x)
    return total


def _min_max(name: str) -> Callable:
    def fn(interp: Any, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, 1, 1 << 30, ("key", "default"))
        items = list(iterate(interp.meter, args[0])) if len(args) == 1 else list(args)
        if len(args) > 1 and "default" in kwargs:
            raise TypeError(f"Cannot specify a default for {name}() with multiple positional arguments")
        if not items:
            if "default" in kwargs:
                return kwargs["default"]
            raise ValueError(f"{name}() arg is an empty sequence")
        key = kwargs.get("key")
        keys = items if key is None else [interp.call(key, [x], {}) for x in items]
        for k in keys:
            interp.meter.nesting(k)  # charges each key's weight (strings, big ints, Fractions) once
        pick = min if name == "min" else max
        return items[pick(range(len(items)), key=keys.__getitem__)]
    return fn


def _abs(interp: Any, args: list, kwargs: dict) -> Any:
    check_args("abs", args, kwargs, 1, 1)
    if not _number(args[0]):
        raise TypeError(f"bad operand type for abs(): '{type(args[0]).__name__}'")
    return interp.meter.value(abs(args[0]))


def _round(interp: Any, args: list, kwargs: dict) -> Any:
    check_args("round", args, kwargs, 1, 2, ("ndigits",))
    x = args[0]
    ndigits = args[1] if len(args) > 1 else kwargs.get("ndigits")
    if not _number(x):
        raise TypeError(f"type {type(x).__name__} doesn't define __round__ method")
    if ndigits is None:
        return interp.meter.value(round(x))
    if not is_int(ndigits):
        raise TypeError(f"'{type(ndigits).__name__}' object cannot be interpreted as an integer")
    if abs(ndigits) > interp.meter.limits.max_int_bits // 4:
        raise MemoryLimitExceeded(f"memory limit: round() to {short_int(ndigits)} digits needs 10**"
                                  f"{short_int(abs(ndigits))}")
    interp.meter.quad(abs(ndigits) * 4, abs(ndigits) * 4)
    return interp.meter.value(round(x, ndigits))


def _divmod(interp: Any, args: list, kwargs: dict) -> tuple:
    check_args("divmod", args, kwargs, 2, 2)
    a, b = args
    return (binop(interp.meter, "FloorDiv", a, b), binop(interp.meter, "Mod", a, b))


def _pow(interp: Any, args: list, kwargs: dict) -> Any:
    check_args("pow", args, kwargs, 2, 3, ("base", "exp", "mod"))
    values = list(args) + [kwargs[k] for k in ("base", "exp", "mod") if k in kwargs]
    if len(values) == 2 or values[2] is None:
        return binop(interp.meter, "Pow", values[0], values[1])
    base, exp, mod = values
    if not (is_int(base) and is_int(exp) and is_int(mod)):
        raise TypeError("pow() 3rd argument not allowed unless all arguments are integers")
    m = abs(int(mod)).bit_length()
    interp.meter.step(1 + max(abs(int(exp)).bit_length(), 1) * (m // 64 + 1) ** 2 // 4096)
    return interp.meter.value(pow(base, exp, mod))


def _int(interp: Any, args: list, kwargs: dict) -> int:
    check_args("int", args, kwargs, 0, 2, ("base",))
    if not args:
        return 0
    x, base = args[0], (args[1] if len(args) > 1 else kwargs.get("base"))
    if type(x) is str:
        check_unicode(x, "int")  # which characters are digits depends on the Unicode version
        interp.meter.convert(len(x) * 10 // 3)
        if base is None or base == 10:
            return interp.meter.value(str_to_int(x))
        if len(x) > 500:
            raise ValueError(f"int() of a {len(x)}-character string in base {base} is not supported")
        return interp.meter.value(int(x, base))
    if base is not None:
        raise TypeError("int() can't convert non-string with explicit base")
    if not _number(x):
        raise TypeError(f"int() argument must be a string or a real number, not '{type(x).__name__}'")
    return interp.meter.value(int(x))


def _float(interp: Any, args: list, kwargs: dict) -> float:
    check_args("float", args, kwargs, 0, 1)
    if not args:
        return 0.0
    x = args[0]
    if type(x) is str:
        check_unicode(x, "float")
        interp.meter.bulk(len(x))
    elif not _number(x):
        raise TypeError(f"float() argument must be a string or a real number, not '{type(x).__name__}'")
    return float(x)


def _str(interp: Any, args: list, kwargs: dict) -> str:
    check_args("str", args, kwargs, 0, 1)
    return to_str(args[0], interp.meter) if args else ""


def _repr(interp: Any, args: list, kwargs: dict) -> str:
    check_args("repr", args, kwargs, 1, 1)
    return to_repr(args[0], interp.meter)


def _bool(interp: Any, args: list, kwargs: dict) -> bool:
    check_args("bool", args, kwargs, 0, 1)
    return interp.truth(args[0]) if args else False


def _collect(name: str, pytype: Any) -> Callable:
    def fn(interp: Any, args: list, kwargs: dict) -> Any:
        check_args(name, args, kwargs, 0, 1)
        items: list = []
        for x in iterate(interp.meter, args[0]) if args else ():
            items.append(x)
            interp.meter.length(len(items), name)
        if pytype is SandboxSet:
            for x in items:
                interp.meter.nesting(x)
        return interp.meter.value(pytype(items))
    return fn


def _dict(interp: Any, args: list, kwargs: dict) -> dict:
    check_args("dict", args, kwargs, 0, 1, kwargs.keys())
    out: dict = {}
    if args:
        src = args[0]
        pairs = iterate(interp.meter, src.items() if type(src) is dict else src)
        for i, pair in enumerate(pairs):
            if type(pair) not in (tuple, list) or len(pair) != 2:
                raise ValueError(f"dictionary update sequence element #{i} has the wrong length or type")
            interp.meter.nesting(pair[0])
            out[pair[0]] = pair[1]
            interp.meter.length(len(out), "dict")
    out.update(kwargs)
    return interp.meter.value(out)


def _sorted(interp: Any, args: list, kwargs: dict) -> list:
    check_args("sorted", args, kwargs, 1, 1, ("key", "reverse"))
    items = list(iterate(interp.meter, args[0]))
    return interp.meter.value(sort_values(interp, items, kwargs.get("key"), kwargs.get("reverse", False)))


def _charged(meter: Meter, it: Iterable[Any]) -> Iterator[Any]:
    for x in it:
        meter.step()
        yield x


def _reversed(interp: Any, args: list, kwargs: dict) -> LazyIter:
    check_args("reversed", args, kwargs, 1, 1)
    x = args[0]
    if type(x) not in (list, tuple, str, range, dict):
        raise TypeError(f"'{type(x).__name__}' object is not reversible")
    return LazyIter("reversed", _charged(interp.meter, reversed(x)), args)


def _enumerate(interp: Any, args: list, kwargs: dict) -> LazyIter:
    check_args("enumerate", args, kwargs, 1, 2, ("start",))
    start = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if not is_int(start):
        raise TypeError(f"'{type(start).__name__}' object cannot be interpreted as an integer")
    source = iterate(interp.meter, args[0])
    return LazyIter("enumerate", ((start + i, x) for i, x in enumerate(source)), args)


def _zip(interp: Any, args: list, kwargs: dict) -> LazyIter:
    check_args("zip", args, kwargs, 0, 1 << 30)
    return LazyIter("zip", zip(*[iterate(interp.meter, a) for a in args]), args)


def _map(interp: Any, args: list, kwargs: dict) -> LazyIter:
    check_args("map", args, kwargs, 2, 1 << 30)
    fn, sources = args[0], [iterate(interp.meter, a) for a in args[1:]]
    return LazyIter("map", (interp.call(fn, list(xs), {}) for xs in zip(*sources)), args)


def _filter(interp: Any, args: list, kwargs: dict) -> LazyIter:
    check_args("filter", args, kwargs, 2, 2)
    fn, source = args[0], iterate(interp.meter, args[1])
    test = interp.truth if fn is None else (lambda x: interp.truth(interp.call(fn, [x], {})))
    return LazyIter("filter", (x for x in source if test(x)), args)


def _any_all(name: str) -> Callable:
    def fn(interp: Any, args: list, kwargs: dict) -> bool:
        check_args(name, args, kwargs, 1, 1)
        want = name == "any"
        for x in iterate(interp.meter, args[0]):
            if interp.truth(x) == want:
                return want
        return not want
    return fn


def _chr(interp: Any, args: list, kwargs: dict) -> str:
    check_args("chr", args, kwargs, 1, 1)
    if not is_int(args[0]):
        raise TypeError(f"'{type(args[0]).__name__}' object cannot be interpreted as an integer")
    if not 0 <= args[0] < 0x110000:  # checked here: CPython's error for a huge int differs by version
        raise ValueError("chr() arg not in range(0x110000)")
    return chr(args[0])


def _ord(interp: Any, args: list, kwargs: dict) -> int:
    check_args("ord", args, kwargs, 1, 1)
    if type(args[0]) is not str:
        raise TypeError(f"ord() expected string of length 1, but {type(args[0]).__name__} found")
    return ord(args[0])


def _isinstance(interp: Any, args: list, kwargs: dict) -> bool:
    check_args("isinstance", args, kwargs, 2, 2)
    spec = args[1]
    kinds = list(spec) if type(spec) is tuple else [spec]
    types = []
    for k in kinds:
        if type(k) is not Builtin or k.pytype is None:
            raise TypeError("isinstance() arg 2 must be a type or tuple of types")
        types.append(k.pytype)
    return isinstance(args[0], tuple(types))


def make_builtins() -> dict[str, Builtin]:
    """A fresh table of the sandbox's builtins (per run: nothing is shared between runs)."""
    table = {
        "print": _print, "range": _range, "len": _len, "sum": _sum, "min": _min_max("min"),
        "max": _min_max("max"), "abs": _abs, "round": _round, "divmod": _divmod, "pow": _pow, "repr": _repr,
        "sorted": _sorted, "reversed": _reversed, "enumerate": _enumerate, "zip": _zip, "map": _map,
        "filter": _filter, "any": _any_all("any"), "all": _any_all("all"), "chr": _chr, "ord": _ord,
        "isinstance": _isinstance,
    }
    out = {name: Builtin(name, fn) for name, fn in table.items()}
    types = {"int": (_int, int), "float": (_float, float), "str": (_str, str), "bool": (_bool, bool),
             "list": (_collect("list", list), list), "tuple": (_collect("tuple", tuple), tuple),
             "set": (_collect("set", SandboxSet), SandboxSet), "dict": (_dict, dict)}
    for name, (fn, pytype) in types.items():
        out[name] = Builtin(name, fn, pytype)
    return out
