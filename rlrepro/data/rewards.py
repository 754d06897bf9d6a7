"""Reward functions: one interface, a few built-ins, a loader for custom ones, and one exception policy.

Interface::

    RewardFn = Callable[[str, PromptRecord], float]   # (completion text, record) -> reward in [0, 1]

Purity rule: a reward must be a pure function of (completion, record): no clock, no randomness, no network,
no state carried between calls. Two runs of a recipe must score the same completion the same way; the
reward enters the advantages, so one differing reward changes every weight after it. In particular no
wall-clock timeout may decide a reward: math-verify's timeouts are disabled here and replaced by
deterministic size limits (see ``MathReward``).

Exception policy (``compute_rewards``): ``"raise"`` (default) stops with a ``RewardError`` naming the record
uid and the exception; ``"zero"`` scores 0.0 and counts the error. A returned value that is not a real
number (bools included), is NaN, or lies outside [0, 1] is an error under the same policy.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from .records import PromptRecord

__all__ = [
    "RewardFn", "RewardError", "exact_match_reward", "prefix_match_reward", "math_reward", "MathReward",
    "extract_last_boxed", "hash_reward", "load_reward_fn", "compute_rewards", "BUILTIN_REWARDS", "overlong_penalty",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, PromptRecord], float]


class RewardError(RuntimeError):
    """A reward function raised, or returned an invalid value, under policy ``"raise"``."""


# ------------------------------------------------------------------------------------------ string rewards


def exact_match_reward(completion: str, record: PromptRecord) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace from both, else 0.0."""
    return 1.0 if completion.strip() == record.answer.strip() else 0.0


def prefix_match_reward(completion: str, record: PromptRecord) -> float:
    """Partial credit: ``len(common prefix) / max(len(answer), len(completion))`` on the stripped strings.

    The common prefix is counted position by position from the start and stops at the first mismatch.
    An exact match scores 1.0; extra trailing characters lower the score (``"abcd"`` for ``"abc"`` gives 0.75),
    so the best policy is still the exact answer. Two empty strings score 1.0.
    """
    answer, text = record.answer.strip(), completion.strip()
    longest = max(len(answer), len(text))
    if longest == 0:
        return 1.0
    matched = 0
    for a, b in zip(answer, text):
        if a != b:
            break
        matched += 1
    return matched / longest


# -------------------------------------------------------------------------------------------- math reward

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if there is
    none or the last one is not closed (a truncated completion). ``\\{`` and ``\\}`` do not count as braces."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


class _TooCostly(Exception):
    pass


# Functions whose value is no larger than their arguments' (or bounded): they do not blow numbers up.
_TAME_FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "asec", "acsc", "atan2",
    "sinh", "cosh", "tanh", "coth", "sech", "csch", "asinh", "acosh", "atanh", "acoth", "asech", "acsch",
    "log", "ln", "Abs", "sign", "floor", "ceiling", "frac", "re", "im", "arg", "conjugate", "Min", "Max",
    "Mod", "gcd", "lcm", "Piecewise", "Heaviside",
})


@dataclass(frozen=True)
class MathReward:
    """Math answer reward on math-verify, with deterministic limits instead of wall-clock timeouts.

    Extraction: the content of the last ``\\boxed{...}`` in the completion; a completion with no ``\\boxed``
    is handed (its last ``max_completion_chars`` characters) to math-verify's own extraction ("final answer
    is ...", last expression). If a ``\\boxed`` is present but the last one is unclosed, there is no answer.
    The gold answer is parsed the same way (``$answer$``, or as is when it holds a ``\\boxed``).
    ``math_verify.verify(gold, prediction)`` decides: 1.0 or 0.0.

    math-verify guards parse and verify with ``signal.alarm`` timeouts (5 s by default), so a slow machine or
    a busy step could score the same completion differently; they are disabled (``parsing_timeout=None``,
    ``timeout_seconds=None``). What the timeouts protected against, sympy working on an expression for
    minutes (``9^{9^{9}}``, ``100!!!``, ``(x+y+z+w)^{100}``), is prevented by limits on the text and the
    parsed expression, checked before verify; an answer over a limit scores 0.0, the same in every run:

    - ``max_answer_chars``: length of the extracted answer text;
    - ``max_number_bits``: bound on log2 of any number the expression denotes (powers, products, exp);
    - ``max_expansion_terms``: terms a polynomial power/product would expand to (``(x+1)^{300}`` has 301);
    - ``max_function_arg``: arguments of factorial-like functions (factorial, binomial, gamma, ...).

    A gold answer over a limit raises ``ValueError`` (a data problem, handled by the reward policy).
    The checks bound the known sympy blow-ups; they are not a proof that every accepted expression is fast,
    and an expression that still takes long stalls the step rather than being scored by the clock.
    """

    max_completion_chars: int = 4096
    max_answer_chars: int = 256
    max_number_bits: int = 65536
    max_expansion_terms: int = 256
    max_function_arg: int = 1000

    def __post_init__(self) -> None:
        for name in ("max_completion_chars", "max_answer_chars", "max_number_bits", "max_expansion_terms",
                     "max_function_arg"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MathReward.{name} must be a positive integer, got {value!r}")

    def __call__(self, completion: str, record: PromptRecord) -> float:
        from math_verify import verify

        gold = _parse_gold(record.answer)
        if not gold:
            raise ValueError(f"math_reward: the gold answer {record.answer!r} of record {record.uid!r} does not "
                             f"parse. Fix: correct the answer in the data set (the data.answer_field column), or "
                             f"choose another reward.fn")
        try:
            self._check_cost(gold)
        except _TooCostly as e:
            raise ValueError(f"math_reward: the gold answer {record.answer!r} of record {record.uid!r} exceeds "
                             f"the deterministic limits ({e}). Fix: correct the answer in the data set, or raise "
                             f"the limits: reward.fn=pkg.module:name naming a MathReward(...) with larger ones"
                             ) from None

        boxed = extract_last_boxed(completion)
        if boxed is not None:
            if len(boxed) > self.max_answer_chars:
                return 0.0
            pred = _parse(f"${boxed}$")
        elif _BOXED.search(completion):
            return 0.0  # the last \boxed is unclosed: truncated, no answer
        else:
            pred = _parse(completion[-self.max_completion_chars:])
        if not pred:
            return 0.0
        if any(isinstance(p, str) and len(p) > self.max_answer_chars for p in pred):
            return 0.0
        try:
            self._check_cost(pred)
        except _TooCostly:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0

    # --- deterministic cost limits ---------------------------------------------------------------------

    def _check_cost(self, parsed: list[Any]) -> None:
        for item in parsed:
            if isinstance(item, str):
                continue
            self._log2_magnitude(item)
            if self._expansion_terms(item) > self.max_expansion_terms:
                raise _TooCostly(f"expands to more than {self.max_expansion_terms} terms")

    def _log2_magnitude(self, e: Any) -> float:
        """Upper bound on log2(|value|) of every numeric subexpression of ``e``; raises _TooCostly above the limit."""
        import sympy

        if isinstance(e, sympy.MatrixBase):
            return max((self._log2_magnitude(x) for x in e), default=0.0)
        if not isinstance(e, sympy.Basic):
            return 0.0
        if e.is_Integer:
            bound = math.log2(max(abs(int(e)), 1))
        elif e.is_Rational:
            bound = math.log2(max(abs(int(e.p)), abs(int(e.q)), 1))
        elif e.is_Float:
            _, man, exp, bc = e._mpf_
            bound = float(abs(exp) + abs(bc))
        elif not e.args:
            bound = 2.0  # symbols, pi, E, I, oo
        elif e.is_Pow:
            base, expo = self._log2_magnitude(e.base), self._log2_magnitude(e.exp)
            if e.exp.free_symbols:
                bound = max(base, expo)
            else:
                if expo > 62:
                    raise _TooCostly("an exponent above 2^62")
                bound = base * 2.0 ** expo
        elif e.is_Mul:
            bound = sum(self._log2_magnitude(a) for a in e.args)
        elif e.is_Add:
            bound = max(self._log2_magnitude(a) for a in e.args) + math.log2(len(e.args))
        elif isinstance(e, sympy.exp):
            arg = self._log2_magnitude(e.args[0])
            if arg > 62:
                raise _TooCostly("exp of a number above 2^62")
            bound = 1.4427 * 2.0 ** arg
        elif isinstance(e, sympy.Function) and type(e).__name__ not in _TAME_FUNCTIONS:
            # factorial, binomial, gamma, fibonacci, ...: sympy evaluates them exactly, so bound the arguments
            args = [self._log2_magnitude(a) for a in e.args]
            limit = math.log2(self.max_function_arg)
            if any(a > limit for a, x in zip(args, e.args) if not x.free_symbols):
                raise _TooCostly(f"{type(e).__name__} of an argument above {self.max_function_arg}")
            n = 2.0 ** max(args, default=0.0)
            bound = n * max(math.log2(max(n, 2.0)), 1.0)
        else:
            args = [self._log2_magnitude(a) for a in e.args]
            bound = max(args, default=0.0) + math.log2(max(len(args), 1))
        if bound > self.max_number_bits:
            raise _TooCostly(f"a number above 2^{self.max_number_bits}")
        return bound

    def _expansion_terms(self, e: Any) -> int:
        """Terms of ``e`` fully expanded, capped just above the limit (only symbolic subexpressions count)."""
        import sympy

        cap = self.max_expansion_terms + 1
        if isinstance(e, sympy.MatrixBase):
            return min(sum(self._expansion_terms(x) for x in e), cap)
        if not isinstance(e, sympy.Basic) or not e.args or not e.free_symbols:
            return 1
        if e.is_Add:
            return min(sum(self._expansion_terms(a) for a in e.args), cap)
        if e.is_Mul:
            total = 1
            for a in e.args:
                total = min(total * self._expansion_terms(a), cap)
            return total
        if e.is_Pow:
            base = self._expansion_terms(e.base)
            if e.exp.free_symbols or not e.exp.is_Rational or base == 1:
                return base
            n = abs(int(e.exp.p)) // int(e.exp.q)
            if n >= cap:
                return cap
            return min(math.comb(n + base - 1, base - 1), cap)
        return min(sum(self._expansion_terms(a) for a in e.args), cap)


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold_cached(answer: str) -> tuple[Any, ...]:
    text = answer if _BOXED.search(answer) else f"${answer}$"
    return tuple(_parse(text))


def _parse_gold(answer: str) -> list[Any]:
    # cached: a prompt's gold answer is parsed once, not once per sample; sympy objects are immutable
    return list(_parse_gold_cached(answer))


_DEFAULT_MATH_REWARD = MathReward()


def math_reward(completion: str, record: PromptRecord) -> float:
    """``MathReward()`` with the default limits: 1.0 when the last ``\\boxed{}`` (or final answer) of the
    completion is mathematically equal to ``record.answer`` by math-verify, else 0.0. No timeouts."""
    return _DEFAULT_MATH_REWARD(completion, record)


def hash_reward(completion: str, record: PromptRecord) -> float:
    """For systems tests on random weights only (``reward.fn=hash``): a deterministic pseudo-random value in
    [0, 1] from the prompt uid and the completion text (sha256), so advantages and gradients are non-zero and
    every part of a step runs. It teaches nothing."""
    import hashlib

    digest = hashlib.sha256(f"{record.uid}\x00{completion}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 0xFFFFFFFF


# ------------------------------------------------------------------------------------------------ loading

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward,
    "prefix_match": prefix_match_reward,
    "math": math_reward,
    "hash": hash_reward,
}


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name (``exact_match``, ``prefix_match``, ``math``) or a dotted path to a callable:
    ``"pkg.module:function"`` or ``"pkg.module.function"`` (``"pkg.module:Class.attr"`` also works).
    The callable must take ``(completion, record)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward.fn must be a non-empty string, got {spec!r}. Fix: set reward.fn to one of the "
                         f"built-ins {sorted(BUILTIN_REWARDS)} (e.g. reward.fn=exact_match) or to "
                         f"reward.fn=pkg.module:function")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    elif "." in spec:
        module_name, _, attr_path = spec.rpartition(".")
    else:
        raise ValueError(f"unknown reward {spec!r} (reward.fn={spec}). Fix: set reward.fn to one of the built-ins "
                         f"{sorted(BUILTIN_REWARDS)} (e.g. reward.fn=exact_match), or to the dotted path of your "
                         f"function, reward.fn=pkg.module:function.")
    if not module_name or not attr_path:
        raise ValueError(f"reward.fn={spec!r} must look like reward.fn=pkg.module:function or "
                         f"reward.fn=pkg.module.function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"reward.fn={spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}). "
                         f"Fix: install the package or put its directory on PYTHONPATH (on every worker), "
                         f"and check the spelling in reward.fn.") from e
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise ValueError(f"reward.fn={spec!r}: {getattr(obj, '__name__', module_name)!r} has no attribute "
                             f"{part!r}; callables there: {names[:20]}. Fix: set reward.fn={module_name}:<one of "
                             f"those>.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward.fn={spec!r} names a {type(obj).__name__}, not a function. Fix: point reward.fn "
                         f"at a function (completion, record) -> float.")
    try:
        inspect.signature(obj).bind("completion", "record")
    except TypeError:
        raise ValueError(f"reward.fn={spec!r}: the function must accept (completion: str, record: PromptRecord); "
                         f"its signature is {inspect.signature(obj)}. Fix: change the function, or point reward.fn "
                         f"at one that takes those two arguments.") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return obj


# ------------------------------------------------------------------------------------------------- policy


def _invalid_value(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"returned {value!r} ({type(value).__name__}), not a real number (return a float)"
    v = float(value)
    if math.isnan(v):
        return "returned NaN"
    if not 0.0 <= v <= 1.0:
        return f"returned {v!r}, outside [0, 1]"
    return None


def compute_rewards(fn: RewardFn, completions: Sequence[str], records: Sequence[PromptRecord],
                    policy: Literal["raise", "zero"] = "raise") -> tuple[list[float], int]:
    """Score ``completions[i]`` against ``records[i]``; return the rewards (Python floats) and the error count.

    ``policy="raise"``: an exception in ``fn`` or an invalid value raises ``RewardError`` naming the record uid
    (the original exception is chained). ``policy="zero"``: that item scores 0.0, is counted and logged.
    """
    if policy not in ("raise", "zero"):
        raise ValueError(f"reward.on_error (policy) must be raise or zero, got {policy!r}")
    if len(completions) != len(records):
        raise ValueError(f"{len(completions)} completions but {len(records)} records; they must pair up one to one")
    name = getattr(fn, "__qualname__", None) or repr(fn)
    rewards: list[float] = []
    num_errors = 0
    for i, (completion, record) in enumerate(zip(completions, records)):
        if not isinstance(completion, str):
            raise TypeError(f"completion {i} (record {record.uid!r}) is {type(completion).__name__}, not str")
        try:
            value = fn(completion, record)
        except Exception as e:
            message = f"reward {name} raised on record uid={record.uid!r} (item {i}): {type(e).__name__}: {e}"
            if policy == "raise":
                raise RewardError(message) from e
            logger.warning("%s; scored 0.0 (reward.on_error=zero)", message)
            rewards.append(0.0)
            num_errors += 1
            continue
        problem = _invalid_value(value)
        if problem is not None:
            message = f"reward {name} on record uid={record.uid!r} (item {i}) {problem}"
            if policy == "raise":
                raise RewardError(message)
            logger.warning("%s; scored 0.0 (reward.on_error=zero)", message)
            rewards.append(0.0)
            num_errors += 1
            continue
        rewards.append(float(value) + 0.0)  # + 0.0 turns -0.0 into 0.0, so digests of equal rewards agree
    return rewards, num_errors


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", §3.4, eq. 13), added to a completion's reward:
    0 up to ``max_tokens - buffer`` tokens, then falling linearly to ``-factor`` at ``max_tokens`` (a completion
    cut by the length limit gets the whole ``-factor``). ``buffer=0`` disables it. Pure Python float arithmetic
    on integers: the same value in every run."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"overlong_penalty: length must be an int >= 0, got {length!r}")
    if not 0 <= buffer < max_tokens:
        raise ValueError(f"overlong_penalty: reward.overlong_buffer={buffer} (buffer) must lie in "
                         f"[0, rollout.max_tokens={max_tokens})")
    if buffer == 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -factor * (min(length, max_tokens) - start) / buffer + 0.0
