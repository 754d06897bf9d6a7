"""Running an episode: :class:`Episode` keeps the turn count and the token budget around one environment and
decides how the episode ends; :func:`run_episode` is the reference loop (a policy callable in place of the
engine) and :func:`replay` re-creates an environment and feeds it a recorded transcript.

The caller counts tokens (it owns the tokenizer): it reports the prompt's and every observation's tokens with
:meth:`Episode.add_context_tokens` and each assistant turn's with :meth:`Episode.step`, and asks
:attr:`Episode.tokens_left` for the next generation's ``max_tokens``. Decisions are pure functions of those
counts and of the environment's answers, so an episode ends the same way in every run.

Precedence after an assistant turn: the environment's own ``done`` first (a single-turn episode is scored even
when its turn used the whole budget), then ``max_turns``, then ``token_budget``.
"""
from __future__ import annotations

import hashlib
import json
import numbers
from dataclasses import dataclass, field
from typing import Callable, Optional

from .api import EnvError, EnvReset, Environment, Message, StepResult

__all__ = ["Episode", "Outcome", "run_episode", "replay", "episode_seed", "transcript_digest"]


def episode_seed(run_seed: int, step: int, prompt_uid: int | str, sample_index: int) -> int:
    """The environment seed of one episode: 63 bits of sha256 over the key, a stream apart from the sampling seed
    of the same key (``rlrepro.rollout.seeds.request_seed``), so an environment's draws never correlate with
    the model's sampling noise. A pure function of its arguments."""
    key = json.dumps(["rlrepro.env", _key_int("run_seed", run_seed), _key_int("step", step),
                      _key_int("prompt_uid", prompt_uid, allow_str=True), _key_int("sample_index", sample_index)],
                     separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def _key_int(name: str, value: object, allow_str: bool = False) -> int | str:
    """A seed key as JSON encodes it: a Python int, a numpy integer as the int it holds (as
    ``rlrepro.rollout.request_seed`` takes it, so ``np.int64(5)`` and ``5`` give the same seed) or, where allowed,
    a str; bools (numpy's too) and floats are refused."""
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        return value
    elif isinstance(value, numbers.Integral):  # numpy integers; np.bool_ is not Integral
        return int(value)
    elif allow_str and isinstance(value, str):
        return str(value)
    kinds = "an int or a str" if allow_str else "an int"
    raise ValueError(f"{name} must be {kinds}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Outcome:
    """How an episode ended: the outcome ``reward``, ``finish_reason``, the per-turn ``penalties`` (one per
    assistant turn), and the counts. ``total_reward = reward - sum(penalties)``."""
    reward: float
    finish_reason: str
    penalties: list[float]
    num_turns: int
    num_tokens: int

    @property
    def total_reward(self) -> float:
        return self.reward - sum(self.penalties) + 0.0


@dataclass
class Episode:
    """One episode of ``env`` under ``max_turns`` assistant turns and ``max_episode_tokens`` transcript tokens
    (None: no budget). ``uid`` names the episode in errors.

    Use: ``reset()``; ``add_context_tokens(len(prompt_ids))``; then while not ``done``: generate at most
    ``tokens_left`` tokens, ``step(text, num_tokens)``, and if it returned observations,
    ``add_context_tokens(len(observation_ids))``. ``transcript`` holds every message; ``outcome`` the end.
    """
    env: Environment
    max_turns: int
    max_episode_tokens: Optional[int] = None
    uid: str = "?"
    transcript: list[Message] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)
    num_tokens: int = 0
    num_turns: int = 0
    outcome: Optional[Outcome] = None
    _start: Optional[EnvReset] = None

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"env.max_turns={self.max_turns!r} (Episode max_turns) must be a positive integer. "
                             f"Fix: env.max_turns=N, the assistant turns per episode (1 or more)")
        budget = self.max_episode_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"env.max_episode_tokens={budget!r} (Episode max_episode_tokens) must be a positive "
                             f"integer or null. Fix: env.max_episode_tokens=N (transcript tokens per episode), or "
                             f"null for no budget")

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def tokens_left(self) -> Optional[int]:
        """Tokens the transcript may still grow by (None: no budget); the next turn's generation limit."""
        if self.max_episode_tokens is None:
            return None
        return max(self.max_episode_tokens - self.num_tokens, 0)

    def reset(self) -> EnvReset:
        if self._start is not None:
            raise EnvError(f"episode {self.uid}: reset() called twice")
        try:
            start = self.env.reset()
        except Exception as e:
            raise EnvError(f"environment {type(self.env).__name__} raised in reset() for record {self.uid!r}: "
                           f"{type(e).__name__}: {e}") from e
        if not isinstance(start, EnvReset):
            raise EnvError(f"environment {type(self.env).__name__}.reset() returned {type(start).__name__}, "
                           f"not an EnvReset (record {self.uid!r})")
        self._start = start
        self.transcript = list(start.messages) if start.messages is not None else \
            [{"role": "user", "content": start.prompt}]  # type: ignore[dict-item]
        return start

    def _finish(self, reason: str) -> StepResult:
        try:
            reward = self.env.truncated_reward(reason)
        except Exception as e:
            raise EnvError(f"environment {type(self.env).__name__} raised in truncated_reward({reason!r}) for "
                           f"record {self.uid!r}: {type(e).__name__}: {e}") from e
        # the runner's own final result: its penalty is 0 (each turn's penalty is in the env's results already)
        try:
            result = StepResult(done=True, reward=reward, finish_reason=reason, info={"ended_by": "runner"})
        except ValueError as e:  # NaN, inf, None, a str: the environment's bug, named like its other bugs
            raise EnvError(f"environment {type(self.env).__name__}.truncated_reward({reason!r}) returned "
                           f"{reward!r} for record {self.uid!r}; it must return a finite number ({e})") from e
        self._end(result)
        return result

    def _end(self, result: StepResult) -> None:
        self.outcome = Outcome(reward=result.reward, finish_reason=result.finish_reason,  # type: ignore[arg-type]
                               penalties=[r.penalty for r in self.results], num_turns=self.num_turns,
                               num_tokens=self.num_tokens)

    def _over_budget(self) -> bool:
        return self.max_episode_tokens is not None and self.num_tokens >= self.max_episode_tokens

    def add_context_tokens(self, num_tokens: int) -> Optional[StepResult]:
        """Count the prompt's or an observation's tokens; when the transcript reaches the budget (no room left for
        a generated token) the episode ends ``token_budget`` and that final result is returned."""
        self._check_open("add_context_tokens")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        self.num_tokens += num_tokens
        return self._finish("token_budget") if self._over_budget() else None

    def _check_open(self, what: str) -> None:
        if self._start is None:
            raise EnvError(f"episode {self.uid}: {what}() before reset()")
        if self.done:
            raise EnvError(f"episode {self.uid}: {what}() after the episode ended "
                           f"({self.outcome.finish_reason})")  # type: ignore[union-attr]

    def step(self, text: str, num_tokens: int) -> StepResult:
        """One assistant turn (``text`` as decoded, ``num_tokens`` generated). Returns the environment's result,
        or the runner's final one when the turn count or the budget ends the episode (its observation dropped)."""
        self._check_open("step")
        if not isinstance(text, str):
            raise TypeError(f"the assistant turn must be text, got {type(text).__name__}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        self.num_turns += 1
        self.num_tokens += num_tokens
        self.transcript.append({"role": "assistant", "content": text})
        try:
            result = self.env.step(text)
        except Exception as e:
            raise EnvError(f"environment {type(self.env).__name__} raised in step() for record {self.uid!r} at "
                           f"turn {self.num_turns}: {type(e).__name__}: {e}") from e
        if not isinstance(result, StepResult):
            raise EnvError(f"environment {type(self.env).__name__}.step() returned {type(result).__name__}, not a "
                           f"StepResult (record {self.uid!r}, turn {self.num_turns})")
        self.results.append(result)
        if result.done:
            self._end(result)
            return result
        if self.num_turns >= self.max_turns:
            return self._finish("max_turns")
        if self._over_budget():
            return self._finish("token_budget")
        self.transcript.extend(result.messages)
        return result


def run_episode(env: Environment, policy: Callable[[list[Message]], str], *, max_turns: int,
                max_episode_tokens: Optional[int] = None, count_tokens: Callable[[str], int] = len,
                render_observation: Callable[[list[Message]], str] | None = None, uid: str = "?") -> Episode:
    """The reference episode loop, with ``policy(transcript) -> assistant text`` in place of the engine.

    Tokens are ``count_tokens(text)`` (characters by default: the tiny model's tokenizer), the prompt's counted
    from its text (or the messages' contents), an observation's from ``render_observation(messages)`` (the
    contents joined by default). Each turn is cut to ``tokens_left`` tokens of text when a budget is set, as the
    engine's ``max_tokens`` would cut it (exact for a character tokenizer)."""
    ep = Episode(env, max_turns=max_turns, max_episode_tokens=max_episode_tokens, uid=uid)
    start = ep.reset()
    prompt = start.prompt if start.prompt is not None else "".join(m["content"] for m in start.messages or [])
    render = render_observation or (lambda msgs: "".join(m["content"] for m in msgs))
    if ep.add_context_tokens(count_tokens(prompt)) is not None:
        return ep
    while not ep.done:
        text = policy(list(ep.transcript))
        left = ep.tokens_left
        if left is not None and count_tokens(text) > left:
            text = text[:left]
        result = ep.step(text, count_tokens(text))
        if not result.done:
            ep.add_context_tokens(count_tokens(render(result.messages)))
    return ep


def replay(env: Environment, turns: list[str]) -> tuple[EnvReset, list[StepResult]]:
    """Feed ``turns`` (assistant texts) to a fresh environment, stopping at its ``done``: the outputs a re-run of
    the episode gives. No runner limits apply (this checks the environment alone)."""
    start = env.reset()
    results = []
    for text in turns:
        results.append(env.step(text))
        if results[-1].done:
            break
    return start, results


def transcript_digest(start: EnvReset, results: list[StepResult]) -> str:
    """sha256 hex digest of an episode's environment outputs, in order (canonical JSON): equal digests, equal
    observations, rewards, penalties and finish reasons."""
    h = hashlib.sha256()
    for item in [start.to_json()] + [r.to_json() for r in results]:
        h.update(json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                            allow_nan=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()
