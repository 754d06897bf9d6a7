"""rlrepro.envs: multi-turn environments and tools, as pure functions of (record, seed, transcript).

A layer beside ``rlrepro.data``: it imports ``data``, ``checks`` and ``samples`` and the standard library only
(never rollout, trainer, orchestration, ray or torch; an import-linter contract checks it). See docs/ENVS.md.

    spec = load_env(EnvConfig(name="calculator_task", tool_format="compact", max_turns=3), reward_fn)
    ep = spec.episode(record, seed=episode_seed(run_seed, step, record.uid, sample_index))
    start = ep.reset()                          # prompt or messages, and tool schemas for the chat template
    ep.add_context_tokens(len(prompt_ids))
    while not ep.done:
        out = generate(ids, max_tokens=min(rollout_max_tokens, ep.tokens_left or rollout_max_tokens))
        result = ep.step(text_of(out), len(out.token_ids))
        if not result.done:
            ids += out.token_ids + tokenize(continuation_text(tok.apply_chat_template, result.messages))
            ep.add_context_tokens(...)
    ep.outcome.reward, ep.outcome.finish_reason, ep.outcome.penalties
"""
from .api import FINISH_REASONS, EnvError, EnvReset, Environment, Message, StepResult, check_messages
from .calculator import CalculatorError, CalculatorLimits, calculate, evaluate, format_number
from .calculator_task import make_calculator_records, make_calculator_task_env
from .config import MALFORMED_POLICIES, EnvConfig
from .episode import Episode, Outcome, episode_seed, replay, run_episode, transcript_digest
from .registry import BUILTIN_ENVS, EnvFactory, EnvSpec, load_env, load_env_factory, register_env
from .rendering import continuation_text, end_of_turn_token, render_chat
from .sandbox import FORBIDDEN_NAMES, SandboxResult, run_python
from .sandbox_values import SandboxLimits
from .tool_calls import (TOOL_FORMATS, CompactToolFormat, MalformedCall, ParsedCall, Qwen3ToolFormat, ToolCall,
                         ToolCallFormat, make_tool_format, tool_message)
from .tool_env import SingleTurnEnv, ToolEnv, execute_calls
from .tools import BUILTIN_TOOLS, Tool, ToolResult, calculator_tool, check_arguments, make_tools, python_tool

__all__ = [
    "Environment", "EnvReset", "StepResult", "EnvError", "Message", "FINISH_REASONS", "check_messages",
    "EnvConfig", "MALFORMED_POLICIES",
    "Episode", "Outcome", "run_episode", "replay", "episode_seed", "transcript_digest",
    "EnvFactory", "EnvSpec", "BUILTIN_ENVS", "register_env", "load_env_factory", "load_env",
    "SingleTurnEnv", "ToolEnv", "execute_calls",
    "make_calculator_records", "make_calculator_task_env",
    "Tool", "ToolResult", "BUILTIN_TOOLS", "calculator_tool", "python_tool", "make_tools", "check_arguments",
    "ToolCall", "MalformedCall", "ParsedCall", "ToolCallFormat", "Qwen3ToolFormat", "CompactToolFormat",
    "TOOL_FORMATS", "make_tool_format", "tool_message",
    "render_chat", "continuation_text", "end_of_turn_token",
    "CalculatorLimits", "CalculatorError", "calculate", "evaluate", "format_number",
    "SandboxLimits", "SandboxResult", "run_python", "FORBIDDEN_NAMES",
]
