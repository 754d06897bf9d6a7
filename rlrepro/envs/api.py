"""The environment API: what an environment returns at the start of an episode (:class:`EnvReset`) and after each
assistant turn (:class:`StepResult`), and the base class :class:`Environment`.

An environment is created per episode from a prompt record and an integer seed, and must be a pure function of
(record, seed, the assistant turns so far): no clock, no randomness other than from the seed, no network, no
state shared with other episodes. Then an episode re-run from its key (after a worker restart, or by ``rlrepro
verify``) replays the same observations and reward, and the order in which episodes finish changes nothing.
:func:`rlrepro.envs.replay` re-creates an environment and feeds it a transcript; tests compare its outputs.
"""
from __future__ import annotations

import copy
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

from rlrepro.data import PromptRecord

__all__ = ["Message", "EnvReset", "StepResult", "Environment", "EnvError", "FINISH_REASONS", "check_messages"]

Message = dict[str, str]

# Why an episode ended. "done": the environment ended it (an answer, or a reason of its own); "malformed": the
# environment ended it because of a malformed tool call (env.on_malformed=end); "max_turns" / "token_budget":
# the episode runner cut it (env.max_turns assistant turns, env.max_episode_tokens transcript tokens).
FINISH_REASONS = ("done", "malformed", "max_turns", "token_budget")


class EnvError(RuntimeError):
    """An environment broke its contract (raised, returned a bad result): a bug in the environment, named with
    the record uid and the turn. Tools do not raise this: their failures are observations."""


def check_messages(messages: Any, what: str) -> list[Message]:
    """``messages`` as a list of ``{"role": str, "content": str}`` dicts (copied), or ValueError naming ``what``."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{what} must be a list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{what}[{i}] must be a dict with string 'role' and 'content', got {m!r}")
        if set(m) - {"role", "content"}:
            raise ValueError(f"{what}[{i}] has keys {sorted(m)}; a message has only 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


@dataclass(frozen=True)
class EnvReset:
    """The start of an episode: the prompt, as a record's is (exactly one of ``prompt``, plain text, and
    ``messages``, chat turns), and ``tools``, the JSON schemas a chat template renders (``tools=`` of
    ``apply_chat_template``; empty when the model learns the call syntax without a description).

    The prompt goes through the run's ``data.template`` / ``data.system_prompt`` like any record's
    (:meth:`prompt_record` gives the record to render), so a single-turn environment's prompt tokens are the
    ones a run without environments has.
    """
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    tools: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("EnvReset needs exactly one of prompt (text) and messages (chat turns)")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"EnvReset.prompt must be a string, got {type(self.prompt).__name__}")
        if self.messages is not None:
            object.__setattr__(self, "messages", check_messages(self.messages, "EnvReset.messages"))
        if not isinstance(self.tools, list) or not all(isinstance(t, dict) for t in self.tools):
            raise ValueError("EnvReset.tools must be a list of JSON-schema dicts")

    def prompt_record(self, record: PromptRecord) -> PromptRecord:
        """``record`` with this prompt (uid, answer and meta kept): what ``rlrepro.data.render_prompt`` renders."""
        return PromptRecord(uid=record.uid, answer=record.answer, prompt=self.prompt,
                            messages=None if self.messages is None else [dict(m) for m in self.messages],
                            meta=dict(record.meta))

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "messages": self.messages, "tools": self.tools}


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one assistant turn.

    Not done: ``messages`` (at least one) are the observations to append (tool results, role ``"tool"``, or a
    user turn), and the episode continues. Done: no ``messages`` (refused: nothing would read them; final
    feedback goes in ``info``), ``reward`` (a finite number; the outcome reward, in [0, 1] for
    the built-in environments) and ``finish_reason`` (one of :data:`FINISH_REASONS` or a reason of the
    environment's own). ``penalty`` (>= 0) is this turn's per-turn penalty (a malformed call, an exceeded tool
    budget); the episode's total reward is ``reward - sum(penalties)``. ``info`` is a JSON-serialisable dict of
    detail for the rollout records (calls made, errors), never read by the runner; it is copied (deeply) here, so
    an environment may reuse and mutate one dict without changing earlier turns' results.
    """
    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: Optional[float] = None
    finish_reason: Optional[str] = None
    penalty: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", check_messages(self.messages, "StepResult.messages"))
        if not isinstance(self.done, bool):
            raise ValueError(f"StepResult.done must be a bool, got {self.done!r}")
        if self.done:
            if self.messages:  # nothing would read them: the episode ends at this assistant turn
                raise ValueError(
                    f"a done StepResult has no messages, got {len(self.messages)}: the episode ends at this "
                    f"assistant turn, so no model turn would read them and they would not be in the transcript. "
                    f"Fix: put final feedback in info (e.g. info={{'feedback': ...}}), or return the messages "
                    f"with done=False and end the episode at the next turn")
            if not _finite(self.reward):
                raise ValueError(f"a done StepResult needs a finite reward, got {self.reward!r}")
            object.__setattr__(self, "reward", float(self.reward) + 0.0)  # type: ignore[arg-type]
            reason = "done" if self.finish_reason is None else self.finish_reason
            if not isinstance(reason, str) or not reason:
                raise ValueError(f"StepResult.finish_reason must be a non-empty string, got {reason!r}")
            object.__setattr__(self, "finish_reason", reason)
        else:
            if self.reward is not None or self.finish_reason is not None:
                raise ValueError("a StepResult that is not done has no reward or finish_reason")
            if not self.messages:
                raise ValueError("a StepResult that is not done needs at least one observation message")
        if not _finite(self.penalty) or self.penalty < 0:
            raise ValueError(f"StepResult.penalty must be a finite number >= 0, got {self.penalty!r}")
        object.__setattr__(self, "penalty", float(self.penalty) + 0.0)
        if not isinstance(self.info, dict):
            raise ValueError(f"StepResult.info must be a dict (JSON detail for the records), got "
                             f"{type(self.info).__name__}")
        # a copy: an environment that keeps one info dict and mutates it each turn must not rewrite the info of
        # results already recorded (deep: JSON detail is plain containers; mutating a nested list leaks too)
        object.__setattr__(self, "info", copy.deepcopy(self.info))
        try:
            json.dumps(self.info, allow_nan=False, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"StepResult.info must be JSON-serialisable: {e}") from None

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "done": self.done, "reward": self.reward,
                "finish_reason": self.finish_reason, "penalty": self.penalty, "info": self.info}


def _finite(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


class Environment:
    """One episode's environment. Subclasses implement :meth:`reset` and :meth:`step`; it is created by a factory
    ``factory(record, seed, *, config, reward_fn)`` (see :mod:`rlrepro.envs.registry`) and used for one episode.

    The instance may keep state between calls (the turns so far), but only state computed from (record, seed,
    the assistant texts it was given): replaying the same texts into a fresh instance must give the same
    results, byte for byte.
    """

    def reset(self) -> EnvReset:
        """The prompt and tools of the episode (called once, first)."""
        raise NotImplementedError

    def step(self, text: str) -> StepResult:
        """React to one assistant turn (its decoded text, as generated)."""
        raise NotImplementedError

    def truncated_reward(self, finish_reason: str) -> float:
        """The outcome reward of an episode the runner cut (``"max_turns"``, ``"token_budget"``): 0.0 unless the
        environment scores unfinished work."""
        return 0.0
