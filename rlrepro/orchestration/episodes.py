"""Multi-turn episodes on one engine: the engine continues each episode's transcript turn after turn.

:func:`run_episodes` takes :class:`EpisodeRequest` objects (the key, the prompt record, its prompt tokens, the
episode's SamplingParams with its seed, the environment seed), creates one :class:`rlrepro.envs.Episode` each
(``EnvSpec.episode(record, env_seed)``) and adds every episode's first request to the engine. It then steps the
engine (continuous batching); when a request finishes, that episode's environment step runs on a small thread
pool (``tool_threads``) while the other episodes keep decoding. If the episode goes on, its next request is the
whole transcript so far: the request's tokens, the turn's generated tokens (plus the end-of-turn token when the
generation was cut by length), and the tokenized observation (``rlrepro.envs.continuation_text``), with the same
SamplingParams (the same seed: the sampler's noise is a function of (seed, position, token), so every turn of an
episode draws from one stream) and ``max_tokens = min(per-turn max, the episode's tokens_left, the room left in
the context)``.

Why nothing but (weights, request, environment) decides a result: each turn's tokens are the engine's output for
that transcript and seed, which no batching, chunking, caching or arrival order changes (docs/ENGINE.md); the
environment is a pure function of (record, env seed, the turns so far) (docs/ENVS.md); and each episode's state
is touched by one turn at a time and put back by key. So the order in which turns or tools finish changes which
requests share a step, never a token. Wall-clock figures (tool seconds) and prefix-cache hits depend on timing
and scheduling: they go to :attr:`EpisodeResult.metrics`, which ``==`` ignores and no fingerprint reads.

The completion of an episode is everything after its initial prompt: policy turns (sampled, ``loss_mask`` 1,
the engine's logprobs) and tool turns (the added end-of-turn token and the observation's tokens: context,
``loss_mask`` 0, logprob 0.0). An observation that no turn answers (the token budget ended the episode right
after it) is left out: a completion always ends with a policy turn.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from rlrepro.envs import FINISH_REASONS, continuation_text
from rlrepro.samples import Sample, Turn

if TYPE_CHECKING:
    from rlrepro.data import PromptRecord
    from rlrepro.envs import EnvReset, EnvSpec, Episode, StepResult
    from rlrepro.rollout import Engine, RequestOutput, SamplingParams

__all__ = ["EpisodeRequest", "EpisodeResult", "run_episodes", "episode_metrics", "TurnTokenizer",
           "turn_stop_token_ids"]


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode: ``key`` = (prompt uid, sample index) orders results and never influences the numbers;
    ``params.seed`` (required) is the sampling seed of all its turns, ``env_seed`` the environment's
    (``rlrepro.envs.episode_seed``). ``prompt_token_ids``: the rendered prompt of the episode's start."""
    key: tuple[str, int]
    record: "PromptRecord"
    prompt_token_ids: list[int]
    params: "SamplingParams"
    env_seed: int


@dataclass
class EpisodeResult:
    """One finished episode. ``completion_token_ids`` is every token after the initial prompt (the turns'
    tokens concatenated); ``rollout_logprobs`` and ``loss_mask`` have one entry per completion token (the engine's
    logprob and 1 on policy tokens, 0.0 and 0 on context tokens). ``finish_reason``, ``reward`` (the outcome
    reward), ``penalties`` (one per assistant turn), ``num_turns`` and ``num_tokens`` are the episode's
    :class:`rlrepro.envs.Outcome`; ``turn_finish_reasons`` the engine's ("stop" | "length") per policy turn;
    ``infos`` each environment result's ``info``. ``metrics`` (prefix-cache hits, tool wall seconds) depend on
    timing and scheduling: ``==`` ignores them."""
    key: tuple[str, int]
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    turns: list[Turn]
    finish_reason: str
    reward: float
    penalties: list[float]
    num_turns: int
    num_tokens: int
    turn_finish_reasons: list[str]
    infos: list[dict]
    weight_version: int
    seed: int
    metrics: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def total_reward(self) -> float:
        return self.reward - sum(self.penalties) + 0.0

    def to_sample(self, decode) -> Sample:
        """The trainer's record of this episode: ``loss_mask`` and ``turns`` set, ``reward`` the episode's
        ``total_reward`` (the environment scores a multi-turn episode; the completion text holds observations,
        so ``reward.fn`` must not score it again), ``finish_reason`` the episode's; ``decode`` is the tokenizer's
        (prompt and completion texts)."""
        return Sample(prompt_uid=self.key[0], sample_index=self.key[1], prompt_token_ids=list(self.prompt_token_ids),
                      completion_token_ids=list(self.completion_token_ids),
                      rollout_logprobs=list(self.rollout_logprobs), finish_reason=self.finish_reason, seed=self.seed,
                      weight_version=self.weight_version, prompt_text=decode(self.prompt_token_ids),
                      completion_text=decode(self.completion_token_ids), reward=self.total_reward,
                      loss_mask=list(self.loss_mask),
                      turns=[Turn(t.role, list(t.token_ids), t.text) for t in self.turns])


@dataclass
class _Live:
    """An episode in progress (touched by one thread at a time: the main loop, or the pool during its turn)."""
    request: EpisodeRequest
    episode: "Episode"
    start: "EnvReset"
    ids: list[int]  # the transcript: the next request's prompt
    turns: list[Turn] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    weight_version: Optional[int] = None
    turn_prompt_tokens: list[int] = field(default_factory=list)
    turn_cached_tokens: list[int] = field(default_factory=list)
    tool_seconds: float = 0.0


class TurnTokenizer:
    """How a transcript goes on after a turn, in tokens: what :func:`run_episodes` uses between turns and what the
    driver uses to replay a demonstration the same way (``GenerationSteps.demonstration_examples``).

    ``end_of_turn``: the chat template's end-of-turn token (Qwen's ``'<|im_end|>'``;
    :func:`rlrepro.envs.end_of_turn_token` finds it, the driver at set-up), which must encode to one token, or
    None without a chat template (an observation's text then follows the turn as is). ``max_model_len``: the
    context the transcript must fit in."""

    def __init__(self, tokenizer, end_of_turn: Optional[str], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn
        self.max_model_len = max_model_len
        self.end_of_turn_id: Optional[int] = None
        if end_of_turn is not None:
            ids = tokenizer.encode(end_of_turn)
            if len(ids) != 1:
                raise ValueError(f"end_of_turn={end_of_turn!r} must be one token of the tokenizer, it encodes to "
                                 f"{ids}; pass the chat template's end-of-turn token (Qwen's '<|im_end|>')")
            self.end_of_turn_id = ids[0]

    def observation(self, tools, generated: list[int], result: "StepResult") -> tuple[list[int], str]:
        """The context tokens, and their text, after a turn that generated ``generated`` and that the episode
        answers with ``result.messages``; ``tools``: the episode's (``EnvReset.tools``), for the chat template.
        A turn cut by length (not ending in the end-of-turn token) is closed by one first."""
        if self.end_of_turn is None:  # no chat template: the observation's text follows the turn as is
            text = "".join(m["content"] for m in result.messages)
            return self.tokenizer.encode(text), text
        cont = continuation_text(self.tokenizer.apply_chat_template, result.messages, tools=tools,
                                 end_of_turn=self.end_of_turn)
        ids = self.tokenizer.encode(cont)
        if generated and generated[-1] == self.end_of_turn_id:
            return ids, cont
        return [self.end_of_turn_id] + ids, self.end_of_turn + cont  # cut by length: close the turn first


def turn_stop_token_ids(tokenizer, stop_token_ids, end_of_turn: Optional[str]) -> list[int]:
    """The stop ids of an episode's turns: ``stop_token_ids`` (the EOS) and the end-of-turn token's id when it is
    not among them (a template whose turns end with another token than the EOS: Qwen3-*-Base's ``<|im_end|>``),
    so that a turn stops where the template closes it. ``end_of_turn`` None or the EOS: ``stop_token_ids``, as
    they were."""
    stops = list(stop_token_ids)
    if end_of_turn is not None:
        ids = tokenizer.encode(end_of_turn)
        if len(ids) == 1 and ids[0] not in stops:
            stops.append(ids[0])
    return stops


def _env_turn(turns: TurnTokenizer, live: _Live, out: "RequestOutput") -> tuple[str, "StepResult", Optional[tuple]]:
    """Run on the pool: the environment's answer to one turn, and the observation (tokens, text) or None."""
    t0 = time.perf_counter()
    try:
        text = turns.tokenizer.decode(out.token_ids)
        result = live.episode.step(text, len(out.token_ids))
        obs = None
        if not live.episode.done:
            obs = turns.observation(live.start.tools, out.token_ids, result)
            live.episode.add_context_tokens(len(obs[0]))
        return text, result, obs
    finally:
        live.tool_seconds += time.perf_counter() - t0


def _start(request: EpisodeRequest, env_spec: "EnvSpec", context: int) -> _Live:
    ep = env_spec.episode(request.record, request.env_seed)
    if ep.max_episode_tokens is None or ep.max_episode_tokens > context:
        # the engine's context bounds the transcript: filling it ends the episode "token_budget", as a budget does
        # (without this the next turn had no room and the run failed; the limits of every earlier turn are the same)
        ep.max_episode_tokens = context
    start = ep.reset()
    live = _Live(request, ep, start, list(request.prompt_token_ids))
    ep.add_context_tokens(len(live.ids))
    return live


def _check(requests: list[EpisodeRequest]) -> list[EpisodeRequest]:
    for r in requests:
        if not isinstance(r, EpisodeRequest):
            raise TypeError(f"run_episodes takes EpisodeRequest objects, got {type(r).__name__}")
        if r.params.seed is None:
            raise ValueError(f"episode {r.key}: SamplingParams.seed is None; every turn of an episode samples "
                             "with one explicit seed (rlrepro.rollout.request_seed)")
        if not r.prompt_token_ids:
            raise ValueError(f"episode {r.key}: the prompt is empty")
    ordered = sorted(requests, key=lambda r: r.key)
    for a, b in zip(ordered, ordered[1:]):
        if a.key == b.key:
            raise ValueError(f"two episodes have the key {a.key}; keys must be unique")
    return ordered


def run_episodes(engine: "Engine", requests: list[EpisodeRequest], env_spec: "EnvSpec", tokenizer, *,
                 max_tokens: Optional[int] = None, end_of_turn: Optional[str] = None,
                 tool_threads: int = 2) -> list[EpisodeResult]:
    """Run every episode to its end on ``engine``; results in key order.

    ``tokenizer``: ``encode``, ``decode`` (a turn's text is ``decode(turn tokens)``, special tokens skipped, as the
    driver decodes completions) and ``apply_chat_template``. ``end_of_turn``: the chat template's end-of-turn
    token text (one token; :func:`rlrepro.envs.end_of_turn_token`, the tokenizer's EOS where the template closes
    a turn with it; the requests' stop ids must hold its id, :func:`turn_stop_token_ids`); None when prompts are
    plain text (no chat template): then an observation's text (its messages' contents joined) follows the turn as
    is. ``max_tokens``: the per-turn generation limit (None: each request's ``params.max_tokens``).
    ``tool_threads``: environment steps run concurrently (>= 1). An environment that breaks raises
    :class:`rlrepro.envs.EnvError` (naming the record uid and the turn); on any error the engine's requests are
    aborted and the engine stays usable."""
    if isinstance(tool_threads, bool) or not isinstance(tool_threads, int) or tool_threads < 1:
        raise ValueError(f"tool_threads must be an integer >= 1, got {tool_threads!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be None or an integer >= 1, got {max_tokens!r}")
    if engine.has_unfinished():
        raise RuntimeError("run_episodes needs an engine with no unfinished requests")
    ordered = _check(list(requests))
    turns = TurnTokenizer(tokenizer, end_of_turn, engine.max_model_len)
    lives = [_start(r, env_spec, engine.max_model_len) for r in ordered]
    running: dict[int, _Live] = {}  # engine request id -> episode
    stepping: dict[Future, _Live] = {}  # environment steps on the pool

    def submit(live: _Live) -> None:
        per_turn = max_tokens if max_tokens is not None else live.request.params.max_tokens
        left = live.episode.tokens_left
        room = engine.max_model_len - len(live.ids)
        if room < 1:
            raise ValueError(f"episode {live.request.key} (record {live.request.record.uid!r}): the transcript has "
                             f"{len(live.ids)} tokens after turn {live.episode.num_turns}, no room left in "
                             f"max_model_len={engine.max_model_len}; set env.max_episode_tokens <= max_model_len")
        limit = min(per_turn, room, left if left is not None else per_turn)
        params = dataclasses.replace(live.request.params, max_tokens=limit)
        live.turn_prompt_tokens.append(len(live.ids))
        running[engine.add_request(live.ids, params)] = live

    def finish(live: _Live, fut: Future) -> None:
        text, result, obs = fut.result()
        live.turns[-1].text = text  # the policy turn this step answered: its text as the environment read it
        if obs is not None:
            obs_ids, obs_text = obs
            live.turns.append(Turn("tool", obs_ids, obs_text))
            live.logprobs.extend([0.0] * len(obs_ids))
            live.ids = live.ids + obs_ids
        if not live.episode.done:
            submit(live)

    pool = ThreadPoolExecutor(max_workers=tool_threads, thread_name_prefix="rlrepro-env")
    try:
        for live in lives:
            if not live.episode.done:  # a prompt at or over the token budget ends the episode before any turn
                submit(live)
        while running or stepping:
            if running:
                for out in engine.step():
                    live = running.pop(out.request_id)
                    live.turns.append(Turn("policy", list(out.token_ids), None))
                    live.logprobs.extend(out.logprobs)
                    live.finish_reasons.append(out.finish_reason)
                    live.weight_version = out.weight_version
                    live.turn_cached_tokens.append(out.num_cached_tokens)
                    live.ids = list(out.prompt_token_ids) + list(out.token_ids)
                    stepping[pool.submit(_env_turn, turns, live, out)] = live
                done = [f for f in stepping if f.done()]
            else:
                done = list(wait(list(stepping), return_when=FIRST_COMPLETED).done)
            errors = [stepping[f] for f in done if f.exception() is not None]
            if errors:  # the first episode by key among those that failed by now
                first = min(errors, key=lambda live: live.request.key)
                raise next(f for f in done if stepping[f] is first).exception()
            for f in sorted(done, key=lambda f: stepping[f].request.key):
                finish(stepping.pop(f), f)
        while engine.has_unfinished():  # a step launched ahead (overlapped read-back) of requests now finished
            if engine.step():
                raise RuntimeError("the engine returned a request run_episodes did not add")
    except BaseException:
        if engine.has_unfinished():  # an error inside engine.step() has aborted everything already
            for rid in running:
                engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [_result(live, engine.weight_version) for live in lives]


def _result(live: _Live, weight_version: int) -> EpisodeResult:
    outcome = live.episode.outcome
    turns = live.turns
    while turns and turns[-1].role != "policy":  # an observation no turn answers (the budget ended it)
        turns = turns[:-1]
    completion = [t for turn in turns for t in turn.token_ids]
    mask = [int(turn.role == "policy") for turn in turns for _ in turn.token_ids]
    cached, prompt = sum(live.turn_cached_tokens), sum(live.turn_prompt_tokens)
    metrics = {"tool_seconds": live.tool_seconds, "turn_prompt_tokens": list(live.turn_prompt_tokens),
               "turn_cached_tokens": list(live.turn_cached_tokens), "prompt_tokens": prompt, "cached_tokens": cached}
    return EpisodeResult(
        key=live.request.key, prompt_token_ids=list(live.request.prompt_token_ids), completion_token_ids=completion,
        rollout_logprobs=live.logprobs[:len(completion)], loss_mask=mask, turns=turns,
        finish_reason=outcome.finish_reason, reward=outcome.reward, penalties=list(outcome.penalties),
        num_turns=outcome.num_turns, num_tokens=outcome.num_tokens, turn_finish_reasons=list(live.finish_reasons),
        infos=[dict(r.info) for r in live.episode.results],
        weight_version=live.weight_version if live.weight_version is not None else weight_version,
        seed=live.request.params.seed, metrics=metrics)


def finish_fractions(results: list, prefix: str) -> dict[str, float]:
    """``{prefix}finish_<reason>_frac`` for every built-in reason (:data:`rlrepro.envs.FINISH_REASONS`, 0.0 when
    none finished so: a dashboard's keys do not come and go between steps) and any other reason an environment
    gave, the share of ``results`` (anything with a ``finish_reason``) that finished so."""
    n = max(len(results), 1)
    reasons = sorted(set(FINISH_REASONS) | {r.finish_reason for r in results})
    return {f"{prefix}finish_{reason}_frac": sum(r.finish_reason == reason for r in results) / n
            for reason in reasons}


def episode_metrics(results: list[EpisodeResult]) -> dict[str, float]:
    """Batch figures for the run log (timing and scheduling dependent, never fingerprinted): turns per episode,
    the prefix-cache hit rate of every request and of the requests of turns >= 2 (cached prompt tokens over
    prompt tokens), tool wall seconds."""
    n = max(len(results), 1)
    later_prompt = sum(sum(r.metrics.get("turn_prompt_tokens", [])[1:]) for r in results)
    later_cached = sum(sum(r.metrics.get("turn_cached_tokens", [])[1:]) for r in results)
    prompt = sum(r.metrics.get("prompt_tokens", 0) for r in results)
    cached = sum(r.metrics.get("cached_tokens", 0) for r in results)
    return {"episodes/turns_mean": sum(r.num_turns for r in results) / n,
            "perf/prefix_hit_rate": cached / prompt if prompt else 0.0,
            "perf/prefix_hit_rate_later_turns": later_cached / later_prompt if later_prompt else 0.0,
            "perf/tool_seconds": sum(r.metrics.get("tool_seconds", 0.0) for r in results)}
