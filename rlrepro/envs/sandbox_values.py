"""Values, costs and size limits of the Python sandbox (:mod:`rlrepro.envs.sandbox`).

Every value a sandboxed program creates goes through :class:`Meter`: it charges *steps* (the instruction count
that bounds the work) and *memory* (a cumulative estimate of the bytes of the values created), and refuses a
single value over its size cap (an int of more than ``max_int_bits`` bits, a string or container longer than its
cap) before the operation that would build it runs. Nothing here reads a clock: the same program meets the same
limit at the same point on any machine.

The conversions of ints to and from text do not depend on ``sys.set_int_max_str_digits`` (a process-wide
setting): long ints are converted in chunks of 500 digits, below any value that setting can take.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Iterable, Iterator

from rlrepro.checks import Checker

from .sandbox_compat import repr_str, unicode_problem

__all__ = ["SandboxLimits", "SandboxError", "StepLimitExceeded", "MemoryLimitExceeded", "Refused", "Meter",
           "SandboxSet", "UserFunction", "int_to_str", "str_to_int", "to_repr", "to_str", "NESTING_LIMIT", "short_int",
           "check_unicode"]

# A value nested deeper than this cannot be compared, hashed or printed (CPython recurses in C for those).
NESTING_LIMIT = 100
_CHUNK_DIGITS = 500           # below the smallest int_max_str_digits CPython allows (640)
_CHUNK_LIMIT = 10 ** _CHUNK_DIGITS
_BULK = 64                    # elements (or bytes) that C-level bulk work processes per step
_QUAD = 1024                  # limb products per step of big-int multiplication / division


@dataclass
class SandboxLimits:
    """The limits of one run of the Python sandbox (the run schema's ``env.python`` section).

    ``max_steps``: instructions (one per statement and expression evaluated, plus bulk work by size);
    ``max_memory_bytes``: cumulative estimate of the bytes of all values created (not the live set: a bound
    that does not depend on the garbage collector); ``max_int_bits`` / ``max_str_len`` / ``max_container_len``:
    the largest single int, string and list/tuple/dict/set; ``max_output_bytes``: stdout kept (UTF-8 bytes, the
    rest counted and cut); ``max_code_chars``: the program's length; ``max_depth``: nesting of calls, blocks
    and expressions while it runs (and of the program's syntax tree).
    """
    SECTION: ClassVar[str] = "env.python"

    max_steps: int = 100_000
    max_memory_bytes: int = 64 * 2 ** 20
    max_int_bits: int = 65_536
    max_str_len: int = 1_000_000
    max_container_len: int = 1_000_000
    max_output_bytes: int = 4096
    max_code_chars: int = 20_000
    max_depth: int = 200

    def __post_init__(self) -> None:
        c = Checker(self)
        c.positive_int("max_steps", "max_memory_bytes", "max_int_bits", "max_str_len", "max_container_len",
                       "max_output_bytes", "max_code_chars", "max_depth")
        # each level of depth costs the interpreter up to 3 Python frames; CPython's default limit is 1000
        c.require(self.max_depth <= 250, "max_depth", "must be at most 250 (the interpreter recurses in Python)")


class SandboxError(Exception):
    """A limit or refusal of the sandbox; its message is the observation text after ``Error: ``.
    Sandboxed code cannot catch it (the sandbox has no try statement)."""


class StepLimitExceeded(SandboxError):
    pass


class MemoryLimitExceeded(SandboxError):
    pass


class Refused(SandboxError):
    """The program uses something the sandbox does not offer (an import, a dunder, open(), a class, ...)."""


def check_unicode(s: str, what: str) -> None:
    """Refuse ``what`` (``upper``, ``isalpha``, ``int``, ...) on a string whose result would differ between Python
    versions (:func:`~rlrepro.envs.sandbox_compat.unicode_problem`)."""
    why = unicode_problem(s, what)
    if why is not None:
        raise Refused(why)


class UserFunction:
    """A function defined by the sandboxed program (``def`` or ``lambda``); called by the interpreter only."""
    __slots__ = ("name", "node", "defaults", "closure", "local_names", "global_names")

    def __init__(self, name: str, node: Any, defaults: list, closure: Any, local_names: frozenset,
                 global_names: frozenset) -> None:
        self.name, self.node, self.defaults, self.closure = name, node, defaults, closure
        self.local_names, self.global_names = local_names, global_names


UserFunction.__name__ = "function"  # what TypeError messages name it


class SandboxSet:
    """``set`` of the sandbox: iteration in insertion order (a dict's keys), so a set of strings prints and
    iterates the same in every process whatever PYTHONHASHSEED is. Elements must be hashable values."""
    __slots__ = ("_d",)

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self._d = dict.fromkeys(items)

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._d)

    def __contains__(self, x: Any) -> bool:
        return x in self._d

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, SandboxSet) and self._d.keys() == other._d.keys()

    __hash__ = None  # type: ignore[assignment]

    def _other(self, other: Any) -> "SandboxSet":
        if not isinstance(other, SandboxSet):
            raise TypeError(f"unsupported operand type for set operation: '{type(other).__name__}'")
        return other

    def __or__(self, other: Any) -> "SandboxSet":
        return SandboxSet(list(self._d) + list(self._other(other)._d))

    def __and__(self, other: Any) -> "SandboxSet":
        o = self._other(other)._d
        return SandboxSet(x for x in self._d if x in o)

    def __sub__(self, other: Any) -> "SandboxSet":
        o = self._other(other)._d
        return SandboxSet(x for x in self._d if x not in o)

    def __xor__(self, other: Any) -> "SandboxSet":
        o = self._other(other)._d
        return SandboxSet([x for x in self._d if x not in o] + [x for x in o if x not in self._d])

    def __le__(self, other: Any) -> bool:
        o = self._other(other)._d
        return all(x in o for x in self._d)

    def __ge__(self, other: Any) -> bool:
        return self._other(other) <= self

    def add(self, x: Any) -> None:
        self._d[x] = None

    def discard(self, x: Any) -> None:
        self._d.pop(x, None)

    def remove(self, x: Any) -> None:
        del self._d[x]

    def pop(self) -> Any:
        if not self._d:
            raise KeyError("pop from an empty set")
        key = next(iter(self._d))
        del self._d[key]
        return key

    def clear(self) -> None:
        self._d.clear()

    def copy(self) -> "SandboxSet":
        return SandboxSet(self._d)

    def union(self, other: Any) -> "SandboxSet":
        return self | other

    def intersection(self, other: Any) -> "SandboxSet":
        return self & other

    def difference(self, other: Any) -> "SandboxSet":
        return self - other

    def issubset(self, other: Any) -> bool:
        return self <= other


SandboxSet.__name__ = "set"
_CONTAINER_TYPES = frozenset({list, tuple, dict, SandboxSet})


# ------------------------------------------------------------------------------------------ int <-> text

def int_to_str(n: int) -> str:
    """``str(n)`` for any int, independent of ``sys.set_int_max_str_digits``."""
    if n < 0:
        return "-" + int_to_str(-n)
    if n < _CHUNK_LIMIT:
        return str(n)
    digits = (n.bit_length() * 30103) // 100000 + 1  # an upper bound on the digit count (> _CHUNK_DIGITS)
    half = max(_CHUNK_DIGITS, (digits // 2 // _CHUNK_DIGITS) * _CHUNK_DIGITS)
    hi, lo = divmod(n, 10 ** half)  # hi >= 1: n >= 10**500 and half < digits
    return int_to_str(hi) + int_to_str(lo).zfill(half)


def str_to_int(s: str) -> int:
    """``int(s)`` for decimal text of any length, independent of ``sys.set_int_max_str_digits``."""
    if len(s) <= _CHUNK_DIGITS:
        return int(s)
    t = s.strip()
    sign = -1 if t[:1] == "-" else 1
    body = t[1:] if t[:1] in "+-" else t
    if not body.isascii() or not body.isdigit():
        raise ValueError(f"invalid literal for int() with base 10: {s[:40]!r}...")
    return sign * _digits_to_int(body)


def _digits_to_int(body: str) -> int:
    if len(body) <= _CHUNK_DIGITS:
        return int(body)
    cut = len(body) // 2
    return _digits_to_int(body[:cut]) * 10 ** (len(body) - cut) + _digits_to_int(body[cut:])


# ---------------------------------------------------------------------------------------------- meter

class Meter:
    """Charges steps and memory for one run and checks every value's size against the limits."""

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.memory = 0
        self.depth = 0  # calls, blocks, expressions and lazy-iterator pulls in progress (see enter)

    def enter(self, n: int = 1) -> None:
        """Go ``n`` levels deeper; the caller undoes it (``meter.depth -= n``) once that work is over. Every
        Python-level recursion of a run is counted here, so a program nests too deeply at the same point whatever
        the process's ``sys.getrecursionlimit()`` is."""
        if self.depth + n > self.limits.max_depth:
            raise SandboxError(f"RecursionError: calls, blocks and expressions nested more than "
                               f"max_depth={self.limits.max_depth} levels")
        self.depth += n

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.max_steps:
            raise StepLimitExceeded(f"step budget of {self.limits.max_steps} exceeded")

    def bulk(self, n: int) -> None:
        """Charge C-level work over ``n`` elements or bytes."""
        self.step(1 + n // _BULK)

    def alloc(self, nbytes: int) -> None:
        self.memory += nbytes
        if self.memory > self.limits.max_memory_bytes:
            raise MemoryLimitExceeded(f"memory budget of {self.limits.max_memory_bytes} bytes exceeded "
                                      f"(values created so far)")
        self.bulk(nbytes // 8)

    # ---- size caps, checked before an operation builds a value (``precheck_*``) and after (``value``)

    def int_bits(self, bits: int) -> None:
        if bits > self.limits.max_int_bits:
            raise MemoryLimitExceeded(f"memory limit: an integer of about {short_int(bits)} bits exceeds max_int_bits="
                                      f"{self.limits.max_int_bits}")

    def length(self, n: int, kind: str) -> None:
        cap = self.limits.max_str_len if kind == "str" else self.limits.max_container_len
        if n > cap:
            raise MemoryLimitExceeded(f"memory limit: a {kind} of {short_int(n)} elements exceeds the cap of {cap}")

    def quad(self, a_bits: int, b_bits: int) -> None:
        """Charge a big-int product or division of operands with these bit lengths."""
        self.step(1 + (a_bits // 64 + 1) * (b_bits // 64 + 1) // _QUAD)

    def convert(self, bits: int) -> None:
        """Charge converting an int of ``bits`` bits to or from decimal text (quadratic in CPython)."""
        limbs = bits // 64 + 1
        self.step(1 + limbs * limbs // 64)

    def value(self, v: Any) -> Any:
        """Check and charge a value just created; return it."""
        t = type(v)
        if t is int:
            bits = v.bit_length()
            if bits > 64:
                self.int_bits(bits)
                self.alloc(bits // 8)
        elif t is str:
            self.length(len(v), "str")
            if len(v) > 64:
                self.alloc(len(v))
        elif t is list or t is tuple:
            self.length(len(v), t.__name__)
            self.alloc(8 * len(v) + 56)
        elif t is dict or t is SandboxSet:  # a hash table: about 64 bytes an entry
            self.length(len(v), "set" if t is SandboxSet else "dict")
            self.alloc(64 * len(v) + 64)
        elif t is Fraction:
            self.int_bits(v.numerator.bit_length() + v.denominator.bit_length())
            self.alloc((v.numerator.bit_length() + v.denominator.bit_length()) // 8 + 56)
        elif t is complex:  # a negative base to a fractional power; the sandbox has no complex numbers
            raise ValueError("the result is a complex number (a negative number raised to a fractional power?), "
                             "which the sandbox does not support")
        return v

    def nesting(self, v: Any) -> int:
        """Refuse a value nested more than NESTING_LIMIT levels deep, or holding itself, before CPython compares
        or hashes it in C (where deep nesting recurses without bound); charges one bulk unit per element, plus
        the value's *weight* (see :func:`weight`: what comparing its strings, big ints and Fractions costs in C,
        uncounted otherwise: ``t in [s] * 10**6`` with two equal 1 MB strings memcmps a terabyte). Returns the
        weight, for callers that compare the value many times (a sort)."""
        if type(v) not in _CONTAINER_TYPES:
            w = weight(v)
            self.step(w // _BULK)  # a small scalar costs nothing extra: step counts of plain programs unchanged
            return w
        stack: list[tuple[Any, int]] = [(v, 1)]
        on_path: set[int] = set()
        visited = 0
        total = 0
        while stack:
            item, depth = stack.pop()
            if depth < 0:
                on_path.discard(-depth)  # marker: leaving this container
                continue
            if depth > NESTING_LIMIT:
                raise MemoryLimitExceeded(f"a value nested more than {NESTING_LIMIT} levels deep cannot be "
                                          f"compared or used as a key")
            if id(item) in on_path:
                raise SandboxError("a value that contains itself cannot be compared or used as a key")
            t = type(item)
            children: Iterable[Any] = item._d if t is SandboxSet else item
            if t is dict:
                children = list(item.keys()) + list(item.values())
            visited += len(item)
            # the element types in C first: a flat container (the common case) costs no Python-level loop
            kinds = set(map(type, children))
            if not _HEAVY.isdisjoint(kinds):
                total += sum(weight(c) for c in children if type(c) in _HEAVY)
            if _CONTAINER_TYPES.isdisjoint(kinds):
                continue
            on_path.add(id(item))
            stack.append((None, -id(item)))
            stack.extend((c, depth + 1) for c in children if type(c) in _CONTAINER_TYPES)
        self.bulk(visited + total)
        return visited + total

    # ---- arithmetic with prechecks

    def pow_bits(self, base: int, exp: int) -> None:
        if exp > 0 and abs(base) > 1:
            low = (abs(base).bit_length() - 1) * exp  # the result has at least this many bits
            if exp > self.limits.max_int_bits or low > self.limits.max_int_bits:
                raise MemoryLimitExceeded(f"memory limit: {short_int(base)} ** {short_int(exp)} has more than "
                                          f"{self.limits.max_int_bits} bits (max_int_bits)")


_HEAVY = frozenset({str, int, Fraction})


def weight(v: Any) -> int:
    """Bulk units (elements or bytes) that one comparison of the scalar ``v`` can cost in C: a string's length
    (memcmp), an int's bytes, a Fraction's limb product (``<`` multiplies numerators by denominators)."""
    t = type(v)
    if t is str:
        return len(v)
    if t is int:
        return v.bit_length() // 8
    if t is Fraction:
        return (v.numerator.bit_length() // 64 + 1) * (v.denominator.bit_length() // 64 + 1) * _BULK // _QUAD
    return 0


def short_int(n: int) -> str:
    """An int for a message: in full below 100 bits, else its size (never a conversion that
    ``sys.set_int_max_str_digits`` could refuse, nor a 5,000-digit message)."""
    return int_to_str(n) if n.bit_length() < 100 else f"<int of {n.bit_length()} bits>"


# -------------------------------------------------------------------------------------------- printing

_SIMPLE_REPR = (bool, float, type(None))


def to_str(v: Any, meter: Meter) -> str:
    """``str(v)`` for a sandbox value (never an address or a hash-dependent order)."""
    if type(v) is str:
        return v
    if type(v) is Fraction:
        meter.convert(v.numerator.bit_length())
        meter.convert(v.denominator.bit_length())
        return f"{int_to_str(v.numerator)}/{int_to_str(v.denominator)}" if v.denominator != 1 else \
            int_to_str(v.numerator)
    return to_repr(v, meter)


def to_repr(v: Any, meter: Meter) -> str:
    """``repr(v)`` for a sandbox value; containers that hold themselves print as ``[...]`` like CPython's."""
    return _Repr(meter).run(v)


class _Repr:
    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.on_path: set[int] = set()
        self.size = 0

    def run(self, v: Any) -> str:
        out = self.repr(v, 0)
        self.meter.value(out)
        return out

    def _emit(self, s: str) -> str:
        self.size += len(s)
        self.meter.length(self.size, "str")
        return s

    def repr(self, v: Any, depth: int) -> str:
        t = type(v)
        if t is int:
            self.meter.convert(v.bit_length())
            return self._emit(int_to_str(v))
        if t is str:
            self.meter.bulk(len(v))
            return self._emit(repr_str(v))
        if t in _SIMPLE_REPR:
            return self._emit(repr(v))
        if t is Fraction:
            self.meter.convert(v.numerator.bit_length())
            self.meter.convert(v.denominator.bit_length())
            return self._emit(f"Fraction({int_to_str(v.numerator)}, {int_to_str(v.denominator)})")
        if t is range:
            step = "" if v.step == 1 else f", {int_to_str(v.step)}"
            return self._emit(f"range({int_to_str(v.start)}, {int_to_str(v.stop)}{step})")
        if t in (list, tuple, dict, SandboxSet) or t.__name__ in ("dict_keys", "dict_values", "dict_items"):
            return self.container(v, depth)
        if t is UserFunction:
            return self._emit(f"<function {v.name}>")
        name = getattr(v, "sandbox_repr", None)
        if isinstance(name, str):
            return self._emit(name)
        return self._emit(f"<{t.__name__} object>")

    def container(self, v: Any, depth: int) -> str:
        t = type(v)
        empty = {list: "[]", tuple: "()", dict: "{}", SandboxSet: "set()"}
        if id(v) in self.on_path:
            return self._emit("[...]" if t is list else "{...}")
        if depth >= NESTING_LIMIT:
            raise MemoryLimitExceeded(f"a value nested more than {NESTING_LIMIT} levels deep cannot be printed")
        if t in empty and len(v) == 0:
            return self._emit(empty[t])
        self.on_path.add(id(v))
        self.meter.bulk(len(v))
        # a level of a nested value is a level of max_depth (two Python frames): printing a 100-deep list from a
        # deep recursion meets max_depth, never CPython's recursion limit (a process-wide setting)
        self.meter.enter()
        try:
            if t is dict or t.__name__ == "dict_items":
                pairs = v.items() if t is dict else v
                parts = [f"{self.repr(k, depth + 1)}: {self.repr(x, depth + 1)}" if t is dict else
                         f"({self.repr(k, depth + 1)}, {self.repr(x, depth + 1)})" for k, x in pairs]
            else:
                parts = [self.repr(x, depth + 1) for x in v]
        finally:
            self.meter.depth -= 1
        self.on_path.discard(id(v))
        body = ", ".join(parts)
        self.size += 2 * len(parts) + 2
        self.meter.length(self.size, "str")
        if t is list:
            return "[" + body + "]"
        if t is tuple:
            return "(" + body + ("," if len(parts) == 1 else "") + ")"
        if t is dict or t is SandboxSet:
            return "{" + body + "}"
        return f"{t.__name__}([{body}])"


def check_format_spec(spec: str, meter: Meter) -> None:
    """Refuse a format spec whose width or precision would build a string over the cap (``f"{x:999999999}"``)."""
    number = ""
    for ch in spec + " ":
        if ch.isdigit():
            number += ch
            continue
        if number:
            n = int(number) if len(number) < 19 else math.inf
            if n > meter.limits.max_str_len:
                raise MemoryLimitExceeded(f"memory limit: format width or precision {number[:20]} exceeds the "
                                          f"string cap of {meter.limits.max_str_len}")
            meter.bulk(int(n))
        number = ""
