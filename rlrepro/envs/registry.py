"""Which environment a run uses: the built-ins by name (``env.name``), a user factory (``env.fn``), and
:class:`EnvSpec`, what the driver keeps to create one environment per episode.

A factory is ``factory(record, seed, *, config, reward_fn) -> Environment``: ``config`` is the run's
:class:`~rlrepro.envs.config.EnvConfig` (``env.kwargs`` holds the factory's own options) and ``reward_fn`` the
run's ``reward.fn``. ``env.fn=pkg.module:factory`` imports ``pkg.module`` from the working directory or the
installed packages, so its top-level code runs in every process that creates environments (the driver and
every rollout worker), as a recipe's reward module's does: use only code you trust.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from rlrepro.data import PromptRecord, RewardFn
from rlrepro.data.specs import SpecError, import_spec, spec_shape_problem

from .api import EnvError, Environment
from .calculator_task import make_calculator_task_env
from .config import EnvConfig
from .episode import Episode
from .tool_calls import make_tool_format
from .tool_env import SingleTurnEnv, ToolEnv
from .tools import make_tools

__all__ = ["EnvFactory", "BUILTIN_ENVS", "register_env", "load_env_factory", "load_env", "EnvSpec"]

EnvFactory = Callable[..., Environment]


def _single_turn(record: PromptRecord, seed: int, *, config: EnvConfig, reward_fn: RewardFn) -> SingleTurnEnv:
    if config.kwargs:
        raise ValueError(f"env.kwargs={config.kwargs!r}: single_turn takes no options. Fix: remove them")
    return SingleTurnEnv(record, reward_fn)


def _tool(record: PromptRecord, seed: int, *, config: EnvConfig, reward_fn: RewardFn) -> ToolEnv:
    prompt = config.kwargs.get("prompt")
    unknown = sorted(set(config.kwargs) - {"prompt"})
    if unknown:
        raise ValueError(f"env.kwargs has {unknown}; the tool environment takes only 'prompt'. Fix: remove them")
    tools = ["python"] if config.tools is None else config.tools  # [] is refused by EnvConfig
    return ToolEnv(record, tools=make_tools(tools, calculator=config.calculator, python=config.python),
                   tool_format=make_tool_format(config.tool_format), reward_fn=reward_fn,
                   max_calls_per_turn=config.max_calls_per_turn, max_observation_chars=config.max_observation_chars,
                   on_malformed=config.on_malformed, malformed_penalty=config.malformed_penalty, prompt=prompt)


BUILTIN_ENVS: dict[str, EnvFactory] = {
    "single_turn": _single_turn,
    "tool": _tool,
    "calculator_task": make_calculator_task_env,
}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: make ``factory`` available as ``env.name=<name>`` (in the processes that import its module)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"an environment name must be a non-empty string without ':', got {name!r}")

    def decorate(factory: EnvFactory) -> EnvFactory:
        if name in BUILTIN_ENVS and BUILTIN_ENVS[name] is not factory:
            raise ValueError(f"environment {name!r} is registered already")
        BUILTIN_ENVS[name] = factory
        return factory
    return decorate


def _check_factory(spec: str, obj: Any) -> None:
    if not callable(obj):
        raise ValueError(f"env.fn={spec!r} names a {type(obj).__name__}, not a factory. Fix: point env.fn at a "
                         f"function (record, seed, *, config, reward_fn) -> Environment")
    try:
        inspect.signature(obj).bind(None, 0, config=None, reward_fn=None)
    except TypeError:
        raise ValueError(f"env.fn={spec!r}: a factory must accept (record, seed, *, config, reward_fn); its "
                         f"signature is {inspect.signature(obj)}. Fix: add the parameters (**kwargs works)") from None
    except ValueError:
        pass  # no signature to inspect: trust it


def _spec_problem(spec: str, e: SpecError) -> str:
    """The message of an ``env.name`` / ``env.fn`` that does not resolve (``e``: what :func:`import_spec` found)."""
    shape = spec_shape_problem("env.fn", spec, e, "factory")
    if shape is not None:
        return shape
    if e.problem == "no_path":
        return (f"unknown environment {spec!r}; built-in: {sorted(BUILTIN_ENVS)}. Fix: set env.name to one of "
                f"those, or env.fn=pkg.module:factory")
    if e.problem == "malformed":
        return f"env.fn={spec!r} must look like env.fn=pkg.module:factory"
    if e.problem == "import":
        cause = e.__cause__
        return (f"env.fn={spec!r}: cannot import module {e.module_name!r} ({type(cause).__name__}: {cause}). Fix: "
                f"install the package or put its directory on PYTHONPATH (on every worker)")
    return (f"env.fn={spec!r}: {e.owner_name!r} has no attribute {e.attr!r}. Fix: check the name after ':' in "
            f"env.fn")


def load_env_factory(spec: str) -> EnvFactory:
    """A built-in name (``single_turn``, ``tool``, ``calculator_task``) or ``pkg.module:factory`` /
    ``pkg.module.factory``. Importing the module runs its top-level code."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"env.name / env.fn must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    try:
        obj = import_spec(spec)
    except SpecError as e:
        raise ValueError(_spec_problem(spec, e)) from e.__cause__
    _check_factory(spec, obj)
    return obj


@dataclass(frozen=True)
class EnvSpec:
    """The run's environment: ``make(record, seed)`` creates one per episode, ``episode(record, seed)`` wraps it
    in an :class:`Episode` with ``env.max_turns`` and ``env.max_episode_tokens``."""
    name: str
    factory: EnvFactory
    config: EnvConfig
    reward_fn: RewardFn

    def make(self, record: PromptRecord, seed: int) -> Environment:
        if not isinstance(record, PromptRecord):
            raise TypeError(f"record must be a PromptRecord, got {type(record).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        try:
            env = self.factory(record, seed, config=self.config, reward_fn=self.reward_fn)
        except MemoryError:  # the machine's, not the factory's doing
            raise
        except ValueError as e:  # the built-in factories' refusals of env.kwargs: a configuration error
            raise ValueError(f"environment factory {self.name!r} (record {record.uid!r}): {e}") from e
        except Exception as e:  # the user's code: one line naming it, as a step() that raises
            raise EnvError(f"environment factory {self.name!r} raised for record {record.uid!r} (seed {seed}): "
                           f"{type(e).__name__}: {e}. Fix: the factory's code (env.name / env.fn)") from e
        if not isinstance(env, Environment):
            raise EnvError(f"environment factory {self.name!r} returned {type(env).__name__}, not an "
                           f"rlrepro.envs.Environment")
        return env

    def episode(self, record: PromptRecord, seed: int) -> Episode:
        return Episode(self.make(record, seed), max_turns=self.config.max_turns,
                       max_episode_tokens=self.config.max_episode_tokens, uid=record.uid)

    @property
    def is_single_turn(self) -> bool:
        """True for the built-in single_turn environment (the driver's path without environments)."""
        return self.factory is _single_turn


def load_env(config: EnvConfig, reward_fn: RewardFn) -> EnvSpec:
    """The :class:`EnvSpec` of ``config`` (``env.fn``, else ``env.name``, else single_turn); raises ValueError
    naming the key when the name or factory does not resolve. Run it once at set-up, before any work."""
    if not isinstance(config, EnvConfig):
        raise TypeError(f"config must be an EnvConfig, got {type(config).__name__}")
    name = config.env_name
    if config.fn is None and name not in BUILTIN_ENVS:
        raise ValueError(f"env.name={name!r} is not a built-in environment; built-in: {sorted(BUILTIN_ENVS)}. Fix: "
                         f"set env.name to one of those, or env.name=null env.fn=pkg.module:factory")
    return EnvSpec(name=name, factory=load_env_factory(name), config=config, reward_fn=reward_fn)
