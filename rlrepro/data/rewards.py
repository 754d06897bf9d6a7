"""Reward functions: one interface, a few built-ins, a loader for custom ones, and one exception policy.

Interface::

    RewardFn = Callable[[str, PromptRecord], float]   # (completion text, record) -> reward in [0, 1]

Purity rule: a reward must be a pure function of (completion, record): no clock, no randomness, no network,
no state carried between calls. Two runs of a recipe must score the same completion the same way; the
reward enters the advantages, so one differing reward changes every weight after it. In particular no
wall-clock timeout may decide a reward: math-verify's timeouts are disabled here and replaced by a
deterministic cost rule (``MathReward``, ``rlrepro.data.math_cost``).

Exception policy (``compute_rewards``): ``"raise"`` (default) stops with a ``RewardError`` naming the record
uid and the exception (any ``BaseException`` but ``KeyboardInterrupt``: ``sys.exit`` in a reward too);
``"zero"`` scores 0.0 and counts the error. A returned value that is not a real number (bools included), is
NaN, lies outside [0, 1] or cannot be converted by ``float()`` (``10**400``) is an error under the same policy.
An interrupt while a reward runs names the sample on stderr and propagates.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import numbers
import sys
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from .records import PromptRecord
from .specs import SpecError, import_spec, spec_shape_problem

__all__ = [
    "RewardFn", "RewardError", "exact_match_reward", "prefix_match_reward", "math_reward", "MathReward",
    "extract_last_boxed", "hash_reward", "load_reward_fn", "compute_rewards", "BUILTIN_REWARDS", "overlong_penalty",
    "reward_with_policy",
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


_LIMITS = ("max_completion_chars", "max_answer_chars", "max_number_bits", "max_expansion_terms",
           "max_function_arg", "max_latex_depth", "max_latex_weight", "max_nodes", "max_depth",
           "max_function_factors", "max_degree")


@dataclass(frozen=True)
class MathReward:
    """Math answer reward on math-verify, with a deterministic cost rule instead of wall-clock timeouts.

    Extraction: the content of the last ``\\boxed{...}`` in the completion; a completion with no ``\\boxed``
    is handed (its last ``max_completion_chars`` characters) to math-verify's own extraction ("final answer
    is ...", last expression). If a ``\\boxed`` is present but the last one is unclosed, there is no answer.
    The gold answer is parsed the same way (``$answer$``, or as is when it holds a ``\\boxed``).
    ``math_verify.verify(gold, prediction)`` decides: 1.0 or 0.0.

    math-verify guards parse and verify with ``signal.alarm`` timeouts (5 s by default), so a slow machine or
    a busy step could score the same completion differently; they are disabled (``parsing_timeout=None``,
    ``timeout_seconds=None``). What the timeouts protected against, the parser or sympy working on an answer
    for minutes (``9^{9^{9}}``, ``100!!!``, ``\\sum_{n=1}^{10^{7}} \\frac{1}{n}``, ``\\int e^{x^{7}} dx``,
    twenty nested braces), is prevented by the cost rule of ``rlrepro.data.math_cost``: limits on the LaTeX
    text checked before each parse, and on the parsed expression checked before verify. An answer outside the
    rule scores 0.0, the same in every run:

    - ``max_answer_chars``: length of the extracted answer and of every LaTeX string parsed;
    - ``max_latex_depth``: nesting of brackets and braces; ``max_latex_weight``: every opening bracket weighs its
      depth, every ``^``/``_`` twice its depth plus one, every ``|`` four times (the parser's work grows with them);
    - commands never evaluated (``math_cost.REFUSED_COMMANDS``: sums, products, integrals, limits, ``\\det``, ...);
    - ``max_nodes`` / ``max_depth``: size and depth of the parsed expression;
    - ``max_number_bits``: bound on log2 of any number the expression denotes (powers, products, exp, ...);
    - ``max_expansion_terms``: terms a polynomial power/product would expand to (``(x+1)^{200}`` has 201; a
      negative power of a sum counts 8 times);
    - ``max_function_arg``: arguments of factorial-like functions (factorial, binomial, gamma, ...);
    - ``max_function_factors``: trigonometric, hyperbolic, exp and log factors over the expanded terms, a
      trigonometric one weighing its largest integer multiple (``\\sin(8x)``: 8), a hyperbolic one twice that;
    - ``max_degree``: degree in the symbols of an equation or inequality (verify solves them) and of an
      expression beside a function (simplify factors it).

    A gold answer outside the rule raises ``ValueError`` (a data problem, handled by the reward policy).
    The rule bounds the blow-ups fuzzing found (``tests/test_reward_fuzz.py``); it is not a proof that every
    accepted expression is fast, and an expression that still takes long stalls the step rather than being
    scored by the clock.
    """

    max_completion_chars: int = 4096
    max_answer_chars: int = 256
    max_number_bits: int = 65536
    max_expansion_terms: int = 128
    max_function_arg: int = 1000
    max_latex_depth: int = 6
    max_latex_weight: int = 48
    max_nodes: int = 200
    max_depth: int = 24
    max_function_factors: int = 16
    max_degree: int = 8

    def __post_init__(self) -> None:
        for name in _LIMITS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MathReward.{name} must be a positive integer, got {value!r}")

    def __call__(self, completion: str, record: PromptRecord) -> float:
        from math_verify import verify

        from .math_cost import TooCostly

        try:
            gold = _parse_gold(record.answer, self)
        except TooCostly as e:
            raise ValueError(f"math_reward: the gold answer {record.answer!r} of record {record.uid!r} exceeds "
                             f"the deterministic limits ({e}). Fix: correct the answer in the data set, or raise "
                             f"the limits: reward.fn=pkg.module:name naming a MathReward(...) with larger ones"
                             ) from None
        if not gold:
            raise ValueError(f"math_reward: the gold answer {record.answer!r} of record {record.uid!r} does not "
                             f"parse. Fix: correct the answer in the data set (the data.answer_field column), or "
                             f"choose another reward.fn")
        boxed = extract_last_boxed(completion)
        if boxed is not None:
            if len(boxed) > self.max_answer_chars:
                return 0.0
            text = f"${boxed}$"
        elif _BOXED.search(completion):
            return 0.0  # the last \boxed is unclosed: truncated, no answer
        else:
            text = completion[-self.max_completion_chars:]
        try:
            pred = self._parse_checked(text)
        except TooCostly:
            return 0.0
        if not pred or any(isinstance(p, str) and len(p) > self.max_answer_chars for p in pred):
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0

    def _parse_checked(self, text: str) -> list[Any]:
        from .math_cost import check_parsed, parse_guarded

        parsed = parse_guarded(text, self)
        check_parsed(parsed, self)
        return parsed


@functools.lru_cache(maxsize=4096)
def _parse_gold_cached(answer: str, limits: MathReward) -> tuple[Any, ...]:
    # keyed on the limits too: a gold answer one MathReward admits another may refuse (TooCostly is not cached)
    return tuple(limits._parse_checked(answer if _BOXED.search(answer) else f"${answer}$"))


def _parse_gold(answer: str, limits: MathReward) -> list[Any]:
    # cached: a prompt's gold answer is parsed once, not once per sample; sympy objects are immutable.
    # A gold answer is data: its length is not limited (max_answer_chars bounds what a completion gives).
    return list(_parse_gold_cached(answer, dataclasses.replace(limits, max_answer_chars=sys.maxsize)))


_DEFAULT_MATH_REWARD = MathReward()


def math_reward(completion: str, record: PromptRecord) -> float:
    """``MathReward()`` with the default limits: 1.0 when the last ``\\boxed{}`` (or final answer) of the
    completion is mathematically equal to ``record.answer`` by math-verify, else 0.0. No timeouts."""
    return _DEFAULT_MATH_REWARD(completion, record)


def hash_reward(completion: str, record: PromptRecord) -> float:
    """For systems tests on random weights only (``reward.fn=hash``): a deterministic pseudo-random value in
    [0, 1] from the prompt uid and the completion text (sha256), so advantages and gradients are non-zero and
    every part of a step runs. It teaches nothing. A lone surrogate (``"\\ud800"``, which a decoder can leave in a
    completion) is hashed as its surrogatepass bytes: other text keeps the UTF-8 bytes, and so the values, it had."""
    import hashlib

    digest = hashlib.sha256(f"{record.uid}\x00{completion}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "little") / 0xFFFFFFFF


# ------------------------------------------------------------------------------------------------ loading

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward,
    "prefix_match": prefix_match_reward,
    "math": math_reward,
    "hash": hash_reward,
}


def _spec_problem(spec: str, e: SpecError) -> str:
    """The message of a ``reward.fn`` that does not resolve (``e``: what :func:`import_spec` found)."""
    shape = spec_shape_problem("reward.fn", spec, e, "function")
    if shape is not None:
        return shape
    if e.problem == "no_path":
        return (f"unknown reward {spec!r} (reward.fn={spec}). Fix: set reward.fn to one of the built-ins "
                f"{sorted(BUILTIN_REWARDS)} (e.g. reward.fn=exact_match), or to the dotted path of your "
                f"function, reward.fn=pkg.module:function.")
    if e.problem == "malformed":
        return f"reward.fn={spec!r} must look like reward.fn=pkg.module:function or reward.fn=pkg.module.function"
    if e.problem == "import":
        cause = e.__cause__
        return (f"reward.fn={spec!r}: cannot import module {e.module_name!r} ({type(cause).__name__}: {cause}). "
                f"Fix: install the package or put its directory on PYTHONPATH (on every worker), "
                f"and check the spelling in reward.fn.")
    names = sorted(n for n in dir(e.owner) if not n.startswith("_") and callable(getattr(e.owner, n, None)))
    return (f"reward.fn={spec!r}: {e.owner_name!r} has no attribute {e.attr!r}; callables there: {names[:20]}. "
            f"Fix: set reward.fn={e.module_name}:<one of those>.")


def _deferred_kind(obj: Any) -> str | None:
    """``"async"`` or ``"generator"`` when calling ``obj`` gives a coroutine or generator, not a value; else None."""
    for fn in (obj, getattr(obj, "__call__", None)):
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            return "async"
        if inspect.isgeneratorfunction(fn):
            return "generator"
    return None


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
    try:
        obj = import_spec(spec)
    except SpecError as e:
        raise ValueError(_spec_problem(spec, e)) from e.__cause__
    if not callable(obj):
        raise ValueError(f"reward.fn={spec!r} names a {type(obj).__name__}, not a function. Fix: point reward.fn "
                         f"at a function (completion, record) -> float.")
    if inspect.isclass(obj):
        # calling a class builds an instance, not a reward: every reward would be an error, found only at the
        # first call (a class whose __init__ takes (completion, record) passes the signature check below)
        raise ValueError(f"reward.fn={spec!r} names a class ({obj.__name__}); rlrepro calls reward.fn(completion, "
                         f"record) for a number, and calling a class makes an instance. Fix: point reward.fn at a "
                         f"function (completion, record) -> float, or at an instance of the class with a "
                         f"__call__(self, completion, record) (e.g. reward = {obj.__name__}(...) in the module, "
                         f"then reward.fn=pkg.module:reward).")
    kind = _deferred_kind(obj)
    if kind is not None:
        # it would return a coroutine or generator, not a number: every reward an error (all 0.0 under zero)
        raise ValueError(f"reward.fn={spec!r} is {'an' if kind == 'async' else 'a'} {kind} function; rlrepro calls "
                         f"a reward synchronously and needs the number itself. Fix: make it a plain def that "
                         f"returns a float (run async code inside it, e.g. with asyncio.run).")
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


def _describe(value: Any) -> str:
    """A short, safe description of a returned value: its repr (at most 80 characters), or its size for an int
    too long to print; never an exception of its own."""
    try:
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
            return f"an int of {math.floor(value.bit_length() * math.log10(2)) + 1} digits (int)"
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        return f"{text} ({type(value).__name__})" if not isinstance(value, float) else text
    except BaseException as e:  # noqa: BLE001 - a hostile __repr__ must not escape the policy either
        if isinstance(e, KeyboardInterrupt):
            raise
        return f"a {type(value).__name__} whose repr raised {type(e).__name__}"


def _checked_value(value: Any) -> tuple[float | None, str | None]:
    """``(reward, None)`` for a real number in [0, 1], else ``(None, problem)``. Every conversion of the value
    happens here, inside the error policy: ``float(10**400)`` raises OverflowError, a ``__float__`` may raise
    anything."""
    try:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None, f"returned {_describe(value)}, not a real number (return a float)"
        v = float(value)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, f"returned {_describe(value)}, which is not a float in [0, 1] (float() raised " \
                     f"{type(e).__name__}: {e})"
    if not isinstance(v, float):
        return None, f"returned {_describe(value)}, whose float() is not a float"
    if math.isnan(v):
        return None, "returned NaN"
    if not 0.0 <= v <= 1.0:
        return None, f"returned {_describe(value)}, outside [0, 1]"
    return v + 0.0, None  # + 0.0 turns -0.0 into 0.0, so digests of equal rewards agree


def _reward_name(fn: Any) -> str:
    """``fn`` as a person would write it in ``reward.fn``: a built-in's name, else module:qualname."""
    for name, builtin in BUILTIN_REWARDS.items():
        if fn is builtin:
            return name
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}:{qualname}" if module else qualname


def reward_with_policy(fn: RewardFn, policy: Literal["raise", "zero"] = "raise") -> RewardFn:
    """``fn`` with :func:`compute_rewards`' checks and ``reward.on_error`` policy, one item at a time: what an
    environment (rlrepro.envs) calls to score an episode's final turn, so a multi-turn run treats a raising or
    out-of-range reward exactly as a single-turn run does (``RewardError`` naming the record, or 0.0).
    ``scored.errors()``: how many items have scored 0.0 by the ``zero`` policy so far (environments step on several
    threads: counted under a lock)."""
    import threading

    lock, count = threading.Lock(), [0]

    def scored(completion: str, record: PromptRecord) -> float:
        rewards, errors = compute_rewards(fn, [completion], [record], policy)
        if errors:
            with lock:
                count[0] += errors
        return rewards[0]

    def errors() -> int:
        with lock:
            return count[0]

    scored.__name__ = _reward_name(fn)
    scored.errors = errors
    return scored


def compute_rewards(fn: RewardFn, completions: Sequence[str], records: Sequence[PromptRecord],
                    policy: Literal["raise", "zero"] = "raise", *,
                    sample_indices: Sequence[int] | None = None) -> tuple[list[float], int]:
    """Score ``completions[i]`` against ``records[i]``; return the rewards (Python floats) and the error count.

    ``policy="raise"``: an exception in ``fn`` (any ``BaseException`` but ``KeyboardInterrupt``: ``SystemExit``
    too) or an invalid value (not a real number, NaN, outside [0, 1], one that ``float()`` cannot convert)
    raises ``RewardError`` naming the record uid and the value (the original exception is chained).
    ``policy="zero"``: that item scores 0.0, is counted and logged.

    Ctrl-C or SIGTERM while ``fn`` runs (``KeyboardInterrupt``) prints which sample it was scoring to stderr and
    propagates. ``sample_indices[i]`` is the sample index of item ``i``; without it, the number of earlier items
    of the same record (the sample index when a prompt's samples come in order, as the driver passes them).
    """
    if policy not in ("raise", "zero"):
        raise ValueError(f"reward.on_error (policy) must be raise or zero, got {policy!r}")
    if len(completions) != len(records):
        raise ValueError(f"{len(completions)} completions but {len(records)} records; they must pair up one to one")
    if sample_indices is not None and len(sample_indices) != len(records):
        raise ValueError(f"{len(sample_indices)} sample indices but {len(records)} records")
    name = _reward_name(fn)
    rewards: list[float] = []
    num_errors = 0
    seen: dict[str, int] = {}
    for i, (completion, record) in enumerate(zip(completions, records)):
        index = seen.get(record.uid, 0) if sample_indices is None else sample_indices[i]
        seen[record.uid] = seen.get(record.uid, 0) + 1
        if not isinstance(completion, str):
            raise TypeError(f"completion {i} (record {record.uid!r}) is {type(completion).__name__}, not str")
        try:
            value = fn(completion, record)
            reward, problem = _checked_value(value)
        except KeyboardInterrupt:
            print(f"rlrepro: interrupted while scoring sample {record.uid}/{index} (item {i} of "
                  f"{len(records)}) with reward.fn={name}", file=sys.stderr, flush=True)
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit and friends in a reward are reward errors
            kind = type(e).__name__
            if isinstance(e, SystemExit):
                kind = f"SystemExit (code {e.code!r}; a reward must return a number, not exit)"
            detail = f": {e}" if str(e) and not isinstance(e, SystemExit) else ""
            message = f"reward {name} raised on record uid={record.uid!r} (item {i}): {kind}{detail}"
            if policy == "raise":
                raise RewardError(message) from e
            logger.warning("%s; scored 0.0 (reward.on_error=zero)", message)
            rewards.append(0.0)
            num_errors += 1
            continue
        if problem is not None:
            message = f"reward {name} on record uid={record.uid!r} (item {i}) {problem}"
            if policy == "raise":
                raise RewardError(message)
            logger.warning("%s; scored 0.0 (reward.on_error=zero)", message)
            rewards.append(0.0)
            num_errors += 1
            continue
        rewards.append(reward)
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
