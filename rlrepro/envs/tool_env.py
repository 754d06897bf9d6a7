"""The built-in environments: :class:`SingleTurnEnv` (today's single-turn tasks, as the one-turn case of the
API) and :class:`ToolEnv` (the model calls tools until it answers without a call, and the answer is scored).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

from rlrepro.data import PromptRecord, RewardFn

from .api import EnvReset, Environment, StepResult
from .config import EnvConfig
from .tool_calls import MalformedCall, ToolCallFormat
from .tools import Tool, ToolResult

__all__ = ["SingleTurnEnv", "ToolEnv", "execute_calls"]


class SingleTurnEnv(Environment):
    """One assistant turn, then done with ``reward = reward_fn(completion, record)``: the record's own prompt
    (plain or chat) and no tools, so the prompt tokens and the reward are those of a run without environments.
    The reward function's exceptions propagate (the caller's reward policy, ``reward.on_error``, applies)."""

    def __init__(self, record: PromptRecord, reward_fn: RewardFn) -> None:
        self.record, self.reward_fn = record, reward_fn

    def reset(self) -> EnvReset:
        return EnvReset(prompt=self.record.prompt, messages=self.record.messages)

    def step(self, text: str) -> StepResult:
        return StepResult(done=True, reward=self.reward_fn(text, self.record))


def _tool_table(tools: Sequence[Tool], fmt: ToolCallFormat) -> dict[str, Tool]:
    """``{name: tool}``, or ValueError when two tools share a name (the model would be shown both schemas and
    every call would reach the last one) or ``fmt`` cannot call one (``fmt.check_tools``: the compact format and
    a tool with two required arguments)."""
    table: dict[str, Tool] = {}
    for t in tools:
        if not isinstance(t, Tool):
            raise TypeError(f"tools must be rlrepro.envs.Tool objects, got {type(t).__name__}")
        if t.name in table:
            raise ValueError(f"two tools are named {t.name!r}. Fix: give each Tool of an environment its own name")
        table[t.name] = t
    fmt.check_tools(list(table.values()))
    return table


def _positive_int(key: str, where: str, value: Any) -> int:
    """``value`` as the positive int that ``env.<key>`` holds, or ValueError naming the key and the fix (a caller
    building a ToolEnv or calling execute_calls directly skips EnvConfig's checks)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"env.{key}={value!r} ({where}) must be a positive integer. Fix: pass an int >= 1 "
                         f"(EnvConfig's default is {EnvConfig.__dataclass_fields__[key].default})")
    return int(value)



def execute_calls(text: str, tools: Sequence[Tool], fmt: ToolCallFormat, *, max_calls: int,
                  max_observation_chars: int) -> tuple[list[dict[str, str]], int, list[dict[str, Any]]]:
    """Parse every call in an assistant turn and run it: (result messages in call order, number of malformed
    calls, per-call info for the records). Unknown tools and bad arguments are malformed; a call beyond
    ``max_calls`` is not run and gets an error result (not counted as malformed). Calls that cannot be read
    (:class:`MalformedCall`) are not calls of a tool and do not count towards ``max_calls``. A result longer than
    ``max_observation_chars`` is cut with a note after it (``fmt.observation_message``)."""
    max_calls = _positive_int("max_calls_per_turn", "execute_calls max_calls", max_calls)
    max_observation_chars = _positive_int("max_observation_chars", "execute_calls max_observation_chars",
                                          max_observation_chars)
    table = _tool_table(tools, fmt)
    messages, info = [], []
    malformed = calls = 0
    for call in fmt.parse(text, table):
        if isinstance(call, MalformedCall):
            result = ToolResult(f"Error: {call.error}", ok=False, malformed=True)
            entry: dict[str, Any] = {"tool": None, "malformed": True}
        elif (calls := calls + 1) > max_calls:
            result = ToolResult(f"Error: more than {max_calls} tool calls in one turn; this one was not run",
                                ok=False)
            entry = {"tool": call.name, "skipped": True}
        elif call.name not in table:
            result = ToolResult(f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(table))}",
                                ok=False, malformed=True)
            entry = {"tool": call.name, "malformed": True}
        else:
            result = table[call.name].run(call.arguments)
            entry = {"tool": call.name, "malformed": result.malformed, "ok": result.ok}
        malformed += result.malformed
        messages.append(fmt.observation_message(result, max_observation_chars))
        info.append(entry)
    return messages, malformed, info


class ToolEnv(Environment):
    """Multi-turn with tools. Each assistant turn's calls are parsed and run; their results are the observation
    and the episode continues. A turn without any call is the answer: done with ``reward_fn(answer, record)``,
    the answer being the turn after its last ``</think>`` (:meth:`answer_text`).

    A turn with a malformed call (bad syntax, unknown tool, bad arguments) costs ``malformed_penalty`` and, with
    ``on_malformed="end"``, ends the episode (finish reason ``"malformed"``, reward 0.0); otherwise the error is
    the call's result and the model may retry. ``prompt`` (optional) replaces the record's own prompt text.
    """

    def __init__(self, record: PromptRecord, *, tools: Sequence[Tool], tool_format: ToolCallFormat,
                 reward_fn: RewardFn, max_calls_per_turn: int = 4, max_observation_chars: int = 4096,
                 on_malformed: str = "observe", malformed_penalty: float = 0.0,
                 prompt: Optional[str] = None) -> None:
        if on_malformed not in ("observe", "end"):
            raise ValueError(f"env.on_malformed={on_malformed!r} (ToolEnv on_malformed) is not allowed. Fix: "
                             f"env.on_malformed=observe (the error is the call's result) or end (finish malformed)")
        if isinstance(tools, Tool) or not isinstance(tools, (list, tuple)):
            raise TypeError(f"ToolEnv tools must be a list of rlrepro.envs.Tool objects, got "
                            f"{type(tools).__name__}. Fix: tools=[tool, ...]")
        if not isinstance(tool_format, ToolCallFormat):
            raise TypeError(f"ToolEnv tool_format must be a ToolCallFormat, got {tool_format!r}. Fix: "
                            f"tool_format=make_tool_format(config.tool_format) (qwen3 or compact)")
        if not callable(reward_fn):
            raise TypeError(f"ToolEnv reward_fn must be callable (completion, record) -> float, got "
                            f"{type(reward_fn).__name__}. Fix: pass the factory's reward_fn")
        max_calls_per_turn = _positive_int("max_calls_per_turn", "ToolEnv max_calls_per_turn", max_calls_per_turn)
        max_observation_chars = _positive_int("max_observation_chars", "ToolEnv max_observation_chars",
                                              max_observation_chars)
        if (isinstance(malformed_penalty, bool) or not isinstance(malformed_penalty, numbers.Real)
                or not math.isfinite(malformed_penalty) or malformed_penalty < 0):
            raise ValueError(f"env.malformed_penalty={malformed_penalty!r} (ToolEnv malformed_penalty) must be a "
                             f"finite number >= 0. Fix: pass a float >= 0 (0.0: no penalty)")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"env.kwargs.prompt={prompt!r} (ToolEnv prompt) must be text or None. Fix: pass the "
                             f"prompt as a str, or None for the record's own prompt")
        _tool_table(tools, tool_format)  # a tool the format cannot call is refused here, when the env is made
        self.record, self.tools, self.format, self.reward_fn = record, list(tools), tool_format, reward_fn
        self.max_calls, self.max_observation_chars = max_calls_per_turn, max_observation_chars
        self.on_malformed, self.malformed_penalty, self.prompt = on_malformed, float(malformed_penalty), prompt

    def reset(self) -> EnvReset:
        schemas = self.format.tool_schemas(self.tools)
        if self.prompt is not None:
            return EnvReset(prompt=self.prompt, tools=schemas)
        return EnvReset(prompt=self.record.prompt, messages=self.record.messages, tools=schemas)

    def answer_text(self, text: str) -> str:
        """The part of the final turn the reward reads: what follows the last ``</think>`` (Qwen3's reasoning is
        not the answer), else the whole turn."""
        return text.rpartition("</think>")[2] if "</think>" in text else text

    def step(self, text: str) -> StepResult:
        messages, malformed, calls = execute_calls(text, self.tools, self.format, max_calls=self.max_calls,
                                                   max_observation_chars=self.max_observation_chars)
        if not messages:
            return StepResult(done=True, reward=self.reward_fn(self.answer_text(text), self.record),
                              info={"calls": []})
        penalty = self.malformed_penalty if malformed else 0.0
        info = {"calls": calls, "malformed": malformed}
        if malformed and self.on_malformed == "end":
            return StepResult(done=True, reward=0.0, finish_reason="malformed", penalty=penalty, info=info)
        return StepResult(messages=messages, penalty=penalty, info=info)
