"""The environment configuration: the run schema's ``env:`` section (:class:`EnvConfig`), with its tools'
limits in ``env.calculator`` (:class:`~rlrepro.envs.calculator.CalculatorLimits`) and ``env.python``
(:class:`~rlrepro.envs.sandbox_values.SandboxLimits`).

Every key (defaults are today's single-turn behaviour)::

    env.name                  null | single_turn | tool | calculator_task   (null with env.fn null: single_turn)
    env.fn                    null | pkg.module:factory    a user factory (its module's top-level code runs)
    env.max_turns             1      assistant turns per episode; after the last, the episode ends "max_turns"
    env.max_episode_tokens    null   transcript tokens (prompt + every turn + every observation), counted by the
                                     caller; reaching it ends the episode "token_budget"; null = no budget
    env.tools                 null   built-in tools by name (calculator, python); null = the environment's own;
                                     [] is an error (no tools: env.name=single_turn)
    env.tool_format           qwen3  qwen3 (<tool_call> JSON, real models) | compact ([calc: 1+2], tiny model)
    env.max_calls_per_turn    4      calls executed per assistant turn; further calls get an error result
    env.max_observation_chars 4096   a tool result longer than this is cut (with a note)
    env.on_malformed          observe  observe (error result, episode continues) | end (ends "malformed")
    env.malformed_penalty     0.0    per-turn penalty of a turn with a malformed call (>= 0)
    env.kwargs                {}     options of the environment itself (e.g. calculator_task's digits)
    env.calculator.*          max_chars, max_nodes, max_digits, max_exponent
    env.python.*              max_steps, max_memory_bytes, max_int_bits, max_str_len, max_container_len,
                              max_output_bytes, max_code_chars, max_depth

Whether ``env.name`` / ``env.fn`` resolve is checked when the run starts (:func:`rlrepro.envs.load_env`), like
``reward.fn``; the values' types and ranges are checked here, and keys that would change nothing are refused: any
``env.*`` key with ``env.name`` and ``env.fn`` null (the single-turn path), the tool keys (:data:`TOOL_KEYS`) with
``env.name=single_turn`` (one turn, no tools).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import ClassVar, Optional

from rlrepro.checks import Checker

from .calculator import CalculatorLimits
from .sandbox_values import SandboxLimits
from .tool_calls import TOOL_FORMATS
from .tools import BUILTIN_TOOLS

__all__ = ["EnvConfig", "MALFORMED_POLICIES", "TOOL_KEYS"]

MALFORMED_POLICIES = ("observe", "end")
# the keys of tool calls (their limits included), which env.name=single_turn never reads
TOOL_KEYS = ("tools", "tool_format", "max_calls_per_turn", "max_observation_chars", "on_malformed", "malformed_penalty",
             "calculator", "python")


@dataclass
class EnvConfig:
    SECTION: ClassVar[str] = "env"

    name: Optional[str] = None
    fn: Optional[str] = None
    max_turns: int = 1
    max_episode_tokens: Optional[int] = None
    tools: Optional[list[str]] = None
    tool_format: str = "qwen3"
    max_calls_per_turn: int = 4
    max_observation_chars: int = 4096
    on_malformed: str = "observe"
    malformed_penalty: float = 0.0
    kwargs: dict = field(default_factory=dict)
    # environment steps (tool calls) run concurrently per rollout worker while the other episodes decode; cannot
    # change a bit (results are put back by key)
    tool_threads: int = 2
    calculator: CalculatorLimits = field(default_factory=CalculatorLimits)
    python: SandboxLimits = field(default_factory=SandboxLimits)

    def __post_init__(self) -> None:
        c = Checker(self)
        for key in ("name", "fn"):
            value = getattr(self, key)
            c.require(value is None or (isinstance(value, str) and value.strip() != ""), key,
                      "must be a non-empty string or null")
        c.require(self.name is None or self.fn is None, "fn",
                  f"and env.name={self.name!r} are both set; set one of them (env.name=null to use env.fn)")
        c.positive_int("max_turns", "max_calls_per_turn", "max_observation_chars", "tool_threads")
        c.positive_int("max_episode_tokens", optional=True)
        c.choice("tool_format", TOOL_FORMATS)
        c.choice("on_malformed", MALFORMED_POLICIES)
        c.non_negative("malformed_penalty")
        c.require(isinstance(self.kwargs, dict), "kwargs", "must be a mapping of the environment's options")
        if self.tools is not None:
            tools = self.tools
            c.require(isinstance(tools, (list, tuple)) and all(isinstance(t, str) for t in tools), "tools",
                      f"must be a list of tool names ({sorted(BUILTIN_TOOLS)}) or null")
            unknown = [t for t in tools if t not in BUILTIN_TOOLS]
            c.require(not unknown, "tools", f"names unknown tools {unknown}; built-in tools: "
                      f"{sorted(BUILTIN_TOOLS)}")
            c.require(len(set(tools)) == len(tools), "tools", "names a tool twice")
            # [] is not "no tools": null means the environment's own tools, and an environment without tools is
            # env.name=single_turn (or a factory that ignores env.tools)
            c.require(len(tools) > 0, "tools", "is an empty list, which names no tool. Fix: drop env.tools (null: "
                      "the environment's own tools, python for tool, calculator for calculator_task), name at least "
                      f"one of {sorted(BUILTIN_TOOLS)}, or for episodes without tools use env.name=single_turn")
            self.tools = list(tools)
        c.require(isinstance(self.calculator, CalculatorLimits), "calculator", "must be a CalculatorLimits")
        c.require(isinstance(self.python, SandboxLimits), "python", "must be a SandboxLimits")
        if self.name == "single_turn":  # one assistant turn, no tools: a run that asked for tools must not lack them
            ignored = [(k, v) for k, v in _changed_keys(self, _DEFAULTS) if k.split(".")[0] in TOOL_KEYS]
            if ignored:
                from rlrepro.checks import ConfigError

                raise ConfigError(
                    ", ".join(f"env.{k}={v!r}" for k, v in ignored) + " is set but changes nothing with "
                    "env.name=single_turn (one assistant turn, no tools). Fix: env.name=tool (or calculator_task) "
                    "for episodes with tool calls, or drop " + ", ".join(f"env.{k}" for k, _ in ignored))
        if self.name is None and self.fn is None:  # the single-turn path of rollout.*: env.* would change nothing
            changed = _changed_keys(self, _DEFAULTS)
            if changed:
                from rlrepro.checks import ConfigError

                raise ConfigError(
                    ", ".join(f"env.{k}={v!r}" for k, v in changed) + " is set but changes nothing: env.name and "
                    "env.fn are null, so the run is single-turn (rollout.*). Set env.name=tool (or calculator_task, "
                    "single_turn) or env.fn=pkg.module:factory for episodes, or drop "
                    + ", ".join(f"env.{k}" for k, _ in changed))

    @property
    def env_name(self) -> str:
        """What names the environment in records: env.fn, env.name, or single_turn."""
        return self.fn or self.name or "single_turn"


def _changed_keys(cfg: EnvConfig, defaults: dict) -> list[tuple[str, object]]:
    """(dotted key, value) of every episode key that differs from its default (limits key by key)."""
    out = []
    for f in fields(cfg):
        if f.name in ("name", "fn", "tool_threads"):
            continue
        value, default = getattr(cfg, f.name), defaults[f.name]
        if value == default:
            continue
        if is_dataclass(default) and type(value) is type(default):
            out += [(f"{f.name}.{g.name}", getattr(value, g.name)) for g in fields(default)
                    if getattr(value, g.name) != getattr(default, g.name)]
        else:
            out.append((f.name, value))
    return out


_DEFAULTS = {f.name: (f.default_factory() if f.default is MISSING else f.default) for f in fields(EnvConfig)}
