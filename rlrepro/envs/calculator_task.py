"""``calculator_task``: multiply two 3-digit numbers (more than a tiny model can do in its head) with a calculator
tool, for the CPU recipe ``grpo_tiny_tool``.

Records (:func:`make_calculator_records`): prompt ``123*456=``, answer ``56088``; every character is in the
tiny tokenizer's alphabet (``SYNTHETIC_CHARSET``). The environment is a :class:`~rlrepro.envs.tool_env.ToolEnv`
with the ``calculator`` tool. With ``env.tool_format=compact`` (the tiny model) a perfect episode reads::

    123*456=            prompt
    [calc: 123*456]     assistant turn 1: a call
    [= 56088]           observation (role "tool")
    56088               assistant turn 2: the answer -> done, reward = reward.fn(turn 2, record) = 1.0

and with the default ``qwen3`` format the call is ``<tool_call>{"name": "calculator", "arguments":
{"expression": "123*456"}}</tool_call>``. Results in the compact format are kept to the tiny alphabet.
"""
from __future__ import annotations

import hashlib
from typing import Any

from rlrepro.data import SYNTHETIC_CHARSET, PromptRecord, RewardFn

from .config import EnvConfig
from .tool_calls import make_tool_format
from .tool_env import ToolEnv
from .tools import make_tools

__all__ = ["make_calculator_records", "make_calculator_task_env", "CalculatorTaskEnv", "CALCULATOR_TASK_OPTIONS"]

# env.kwargs of calculator_task (the records' options live in make_calculator_records)
CALCULATOR_TASK_OPTIONS: dict[str, Any] = {}


def _operand(seed: int, index: int, which: int, digits: int) -> int:
    """A ``digits``-digit number from sha256 of (seed, index, which): the same in every Python and NumPy version."""
    digest = hashlib.sha256(f"rlrepro.calculator_task:{seed}:{index}:{which}".encode()).digest()
    low = 10 ** (digits - 1)
    return low + int.from_bytes(digest[:8], "big") % (9 * low)


def make_calculator_records(num: int, seed: int, *, digits: int = 3) -> list[PromptRecord]:
    """``num`` records ``a*b=`` -> ``a*b`` with ``digits``-digit operands; uids ``calculator_task-s{seed}:{i}``.
    A pure function of (seed, digits) and the first ``k`` records do not depend on ``num``."""
    for name, value in (("num", num), ("digits", digits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    records = []
    for i in range(num):
        a, b = _operand(seed, i, 0, digits), _operand(seed, i, 1, digits)
        records.append(PromptRecord(uid=f"calculator_task-s{seed}:{i}", prompt=f"{a}*{b}=", answer=str(a * b),
                                    meta={"kind": "calculator_task", "a": a, "b": b}))
    return records


class CalculatorTaskEnv(ToolEnv):
    """A :class:`ToolEnv` that can also show a perfect episode (``warm_start.target=demonstration``)."""

    def demonstration(self) -> list[str]:
        """The assistant turns of a correct episode: the call ``a*b`` (the record's prompt before ``=``) in the
        episode's tool format, then the answer."""
        expression = self.record.prompt.rstrip().removesuffix("=")
        return [self.format.render_call("calculator", {"expression": expression}), self.record.answer]


def make_calculator_task_env(record: PromptRecord, seed: int, *, config: EnvConfig,
                             reward_fn: RewardFn) -> CalculatorTaskEnv:
    """The ``calculator_task`` factory: the ``calculator`` tool (or ``env.tools``), ``env.tool_format`` with the
    tiny alphabet for ``compact``, the run's reward on the final turn. The seed is not used (the task is the
    record)."""
    unknown = sorted(set(config.kwargs) - set(CALCULATOR_TASK_OPTIONS))
    if unknown:
        raise ValueError(f"env.kwargs has {unknown}; calculator_task takes no options. Fix: remove them")
    names = ["calculator"] if config.tools is None else config.tools  # [] is refused by EnvConfig
    tools = make_tools(names, calculator=config.calculator, python=config.python)
    charset = SYNTHETIC_CHARSET if config.tool_format == "compact" else None
    return CalculatorTaskEnv(record, tools=tools, tool_format=make_tool_format(config.tool_format, charset=charset),
                   reward_fn=reward_fn, max_calls_per_turn=config.max_calls_per_turn,
                   max_observation_chars=config.max_observation_chars, on_malformed=config.on_malformed,
                   malformed_penalty=config.malformed_penalty)
