"""A step's samples: the GRPO driver's generation phase, a mixin of
:class:`~rlrepro.orchestration.driver.GRPODriver` (it reads the driver's ``cfg``, ``prompts``, ``order``,
``tokenizer``, ``reward_fn``, ``env_spec``, ``stop_token_ids``, ``model_config``, ``actors`` and ``log``; for
episodes ``end_of_turn`` and ``turn_stop_token_ids``, from ``preflight.check_end_of_turn``).

* :meth:`GenerationSteps.collect`: the rounds of a step (one, or DAPO's dynamic sampling), each generated and
  scored: single-turn requests (:meth:`~GenerationSteps.generate`, rewards from ``reward.fn``) or multi-turn
  episodes (``env.*``: :meth:`~GenerationSteps.generate_episodes`, samples with loss masks and turns, scored by the
  environment);
* the demonstration warm start (``warm_start.target=demonstration``).

Keys and seeds are the single-turn path's: episode ``(prompt uid, sample index)`` samples every turn with
``request_seed(run.seed, step, uid, index)`` and its environment gets ``episode_seed`` of the same key, so the
episodes of a step are pure functions of the data order, the seeds and the weights (docs/ENVS.md).
"""
from __future__ import annotations

import dataclasses
import time

from rlrepro.samples import Sample

from .config import ConfigError, RunSchema
from .workers import Request

__all__ = ["GenerationSteps", "shaped_penalties", "PhaseTimer"]


def shaped_penalties(lengths: list[int], cfg: RunSchema) -> list[float] | None:
    """The per-sample reward shaping of ``cfg.reward`` (DAPO's overlong punishment over completion ``lengths``,
    in tokens), or None when it is off."""
    from rlrepro.data import overlong_penalty

    buffer = cfg.reward.overlong_buffer
    if not buffer:
        return None
    return [overlong_penalty(n, cfg.rollout.max_tokens, buffer, cfg.reward.overlong_penalty_factor) for n in lengths]



def episode_runner(run_episodes, cfg: RunSchema, end_of_turn: str | None):
    """``requests -> [EpisodeResult]``: ``run_episodes`` (``ActorGroup.run_episodes``, or one
    ``RolloutWorker.run_episodes``: the same signature) called with the run's env.*, reward and chat-template
    keys and ``end_of_turn`` (``preflight.check_end_of_turn``). Training, evaluation during training and
    ``rlrepro eval`` all run their episodes through it, so they run them alike."""
    from .import_path import module_dirs

    def run(requests: list) -> list:
        return run_episodes(requests, cfg.env, cfg.reward.fn, use_chat_template=cfg.data.use_chat_template,
                            tool_threads=cfg.env.tool_threads, reward_on_error=cfg.reward.on_error,
                            import_dirs=module_dirs([cfg.reward.fn, cfg.env.fn]), end_of_turn=end_of_turn)
    return run


class PhaseTimer:
    """Wall seconds per phase of a step: ``t("phase")`` records the time since the previous call (or since the
    timer was made) as ``phase`` in :attr:`times`, which go to the step's timing metrics (``perf/*``) only."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._t = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[phase] = now - self._t
        self._t = now

    def add(self, phase: str, seconds: float) -> None:
        """Record ``seconds`` measured elsewhere as ``phase``; the next phase starts now."""
        self.times[phase] = self.times.get(phase, 0.0) + seconds
        self._t = time.perf_counter()


class GenerationSteps:
    def collect(self, step: int, t) -> tuple[list[Sample], list[float] | None, int, dict]:
        """The step's scored samples, in (prompt uid, sample index) order, with their reward-shaping penalties,
        the number of reward errors and the dynamic-sampling metrics ({} when it is off).

        ``rollout.dynamic_sampling`` (DAPO, Yu et al. 2025, section 3.2): round after round, the next
        ``prompts_per_round`` prompts of the data order are generated and scored; a group whose rewards are all
        equal (no learning signal under a group baseline) is dropped, the others are kept in draw order until
        ``prompts_per_step`` groups are kept; what is drawn beyond that in the last round is discarded. At the
        ``max_generation_rounds`` cap ``rollout.on_round_cap`` decides: ``fill`` tops the batch up with dropped
        groups (draw order), ``partial`` trains on the kept groups alone (on the dropped ones when none was kept),
        ``error`` stops the run. Every prompt drawn advances the data cursor, and the rounds depend on rewards
        only, so the kept batch is a pure function of the data order and the seeds (the checkpointed cursor makes
        a resumed run draw what the uninterrupted one draws)."""
        r = self.cfg.rollout
        per_step = r.prompts_per_step
        occurrences: dict = {}  # a prompt drawn twice in a step (an epoch boundary) gets other sample indices

        def draw(n: int) -> tuple[list, list[int]]:
            batch = [self.prompts[i] for i in self.order.next_batch(n)]
            bases = []
            for p in batch:
                k = occurrences.get(p.uid, 0)
                occurrences[p.uid] = k + 1
                bases.append(k * r.group_size)
            return batch, bases

        gen_s = reward_s = 0.0
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        penalty_of: dict = {}
        num_errors = drawn = rounds = 0
        episode_results: list = []  # every round's episodes (the metrics describe all that was generated)
        while True:
            rounds += 1
            t0 = time.perf_counter()
            batch, bases = draw(per_step if not r.dynamic_sampling else r.prompts_per_round or per_step)
            drawn += len(batch)
            if self.env_spec is not None:  # the environment scored each episode (outcome reward - penalties)
                samples = self.generate_episodes(step, batch, bases)
                episode_results += self._episode_results
                t1 = time.perf_counter()
                penalties, errors = None, self._episode_reward_errors
            else:
                samples = self.generate(step, batch, bases)
                t1 = time.perf_counter()
                penalties, errors = self.score(samples, {p.uid: p.record for p in batch})
            reward_s += time.perf_counter() - t1
            gen_s += t1 - t0
            num_errors += errors
            if penalties is not None:
                penalty_of.update((s.key, pen) for s, pen in zip(samples, penalties))
            if not r.dynamic_sampling:
                kept = [samples]
                break
            groups = {}
            for s in samples:
                groups.setdefault((s.prompt_uid, s.sample_index // r.group_size), []).append(s)
            for p, base in zip(batch, bases):  # draw order
                group = groups[(p.uid, base // r.group_size)]
                informative = any(s.reward != group[0].reward for s in group)
                if informative and len(kept) < per_step:
                    kept.append(group)
                elif not informative:
                    dropped.append(group)
            if len(kept) >= per_step or rounds >= r.max_generation_rounds:
                break
        t.add("rollout", gen_s)
        t.add("reward", reward_s)
        metrics = self.episode_batch_metrics(episode_results) if self.env_spec is not None else {}
        if r.dynamic_sampling:
            metrics.update({"rollout/groups_kept": len(kept), "rollout/groups_dropped": len(dropped),
                            "rollout/generation_rounds": rounds, "rollout/prompts_drawn": drawn})
            if len(kept) < per_step:
                metrics["rollout/round_cap_hit"] = 1.0
                if r.on_round_cap == "error":
                    raise RuntimeError(
                        f"dynamic sampling kept {len(kept)} of rollout.prompts_per_step={per_step} groups after "
                        f"rollout.max_generation_rounds={r.max_generation_rounds} rounds ({drawn} prompts drawn; "
                        f"{len(dropped)} groups had equal rewards). Fix: raise rollout.max_generation_rounds or "
                        f"rollout.prompts_per_round, or set rollout.on_round_cap=fill|partial")
                if r.on_round_cap == "fill" or not kept:
                    kept = kept + dropped[:per_step - len(kept)]
                self.log.line(f"step {step}: dynamic sampling kept {metrics['rollout/groups_kept']}/{per_step} "
                              f"groups in {rounds} rounds (rollout.on_round_cap={r.on_round_cap})")
        samples = sorted((s for g in kept for s in g), key=lambda s: s.key)
        penalties = [penalty_of[s.key] for s in samples] if penalty_of else None
        return samples, penalties, num_errors, metrics

    def generate(self, step: int, batch: list, bases: list[int] | None = None) -> list[Sample]:
        """``group_size`` samples of every prompt, in (prompt uid, sample index) order; a lost worker is replaced
        and its part re-run. ``bases[i]`` is the first sample index of ``batch[i]`` (0; a multiple of group_size
        for a prompt drawn again in the same step)."""
        from rlrepro.rollout import request_seed

        sampling = self.cfg.rollout.sampling
        bases = [0] * len(batch) if bases is None else bases
        requests = [Request((p.uid, b + j), p.token_ids, sampling.params(
                    seed=request_seed(self.cfg.run.seed, step, p.uid, b + j), stop_token_ids=self.turn_stop_token_ids))
                    for p, b in zip(batch, bases) for j in range(self.cfg.rollout.group_size)]
        prompt_of = {p.uid: p for p in batch}
        results = sorted(self.actors.generate(requests), key=lambda kv: kv[0])  # arrival order never matters
        decode = self.tokenizer.decode
        return [Sample(prompt_uid=uid, sample_index=j, prompt_token_ids=prompt_of[uid].token_ids,
                       completion_token_ids=list(out.token_ids), rollout_logprobs=list(out.logprobs),
                       finish_reason=out.finish_reason, seed=out.seed, weight_version=out.weight_version,
                       prompt_text=decode(prompt_of[uid].token_ids), completion_text=decode(out.token_ids))
                for (uid, j), out in results]

    def score(self, samples: list[Sample], records: dict) -> tuple[list[float] | None, int]:
        """Rewards (plus DAPO's overlong shaping when on) into ``sample.reward``; returns the penalties and the
        number of reward errors scored 0 under reward.on_error=zero."""
        from rlrepro.data import compute_rewards

        rewards, num_errors = compute_rewards(self.reward_fn, [s.completion_text for s in samples],
                                              [records[s.prompt_uid] for s in samples],
                                              policy=self.cfg.reward.on_error)
        penalties = shaped_penalties([len(s.completion_token_ids) for s in samples], self.cfg)
        if penalties is not None:  # part of the reward the advantages see
            rewards = [r + p for r, p in zip(rewards, penalties)]
        for s, r in zip(samples, rewards):
            s.reward = r
        return penalties, num_errors

    def load_environment(self):
        """The run's :class:`~rlrepro.envs.EnvSpec` (env.*, with reward.fn and reward.on_error), checked at set-up:
        env.kwargs and the factory are tried on the longest prompt, whose episode prompt (with the tools' schemas
        the chat template renders) must leave room for a generated token. Raises ConfigError."""
        from rlrepro.checks import ConfigError
        from rlrepro.data import reward_with_policy
        from rlrepro.envs import load_env

        from . import preflight

        cfg = self.cfg
        try:
            spec = load_env(cfg.env, reward_with_policy(self.reward_fn, cfg.reward.on_error))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        longest = max(self.prompts, key=lambda p: len(p.token_ids))
        try:
            start = spec.make(longest.record, 0).reset()
        except Exception as e:  # noqa: BLE001 - whatever the environment raises, before any work
            raise ConfigError(f"the environment {cfg.env.env_name!r} could not be created for prompt "
                              f"{longest.uid!r}: {type(e).__name__}: {e}. Fix env.* (env.kwargs, env.fn) before "
                              "starting the run") from None
        try:
            ids = self.episode_prompt(longest, start)
        except ValueError as e:  # e.g. tools without the chat template
            raise ConfigError(f"env {cfg.env.env_name!r}: {e}") from None
        if start.tools and cfg.env.tool_format == "qwen3" and ids == self.episode_prompt(
                longest, dataclasses.replace(start, tools=[])):
            raise ConfigError(f"env {cfg.env.env_name!r}: the model's chat template ignores tools= (it renders the "
                              f"same prompt with and without the {len(start.tools)} tool schema(s)), so with "
                              "env.tool_format=qwen3 the model would never be told its tools. Fix: use a model whose "
                              "chat template renders tools (Qwen3's does), or env.tool_format=compact")
        preflight.check_episode_prompt(cfg, longest.uid, len(ids), self.model_config)
        return spec

    def episode_prompt(self, prompt, start) -> list[int]:
        """The token ids an episode starts from: the prompt's own when the environment's start is the record
        itself without tools (single_turn: the same bits as the single-turn path), else ``start`` rendered
        with the data.* template keys and the tools' schemas for the chat template."""
        from rlrepro.data import tokenize_prompt

        record = start.prompt_record(prompt.record)
        if not start.tools and record == prompt.record:
            return prompt.token_ids
        d = self.cfg.data
        return tokenize_prompt(record, self.tokenizer, template=d.template, system_prompt=d.system_prompt,
                               use_chat_template=d.use_chat_template, tools=start.tools or None)

    def episode_requests(self, step: int, batch: list, bases: list[int]) -> list:
        """One :class:`~.episodes.EpisodeRequest` per (prompt, sample index): the sampling seed
        ``request_seed(run.seed, step, uid, index)`` (every turn's), the environment's ``episode_seed`` of the
        same key; the stop ids ``turn_stop_token_ids`` (the EOS, and the chat template's end-of-turn token where
        it is another one)."""
        from rlrepro.envs import episode_seed
        from rlrepro.rollout import request_seed

        from .episodes import EpisodeRequest

        sampling, seed = self.cfg.rollout.sampling, self.cfg.run.seed
        out = []
        for p, b in zip(batch, bases):
            for j in range(b, b + self.cfg.rollout.group_size):
                env_seed = episode_seed(seed, step, p.uid, j)
                ids = self.episode_prompt(p, self.env_spec.make(p.record, env_seed).reset())
                out.append(EpisodeRequest((p.uid, j), p.record, ids, sampling.params(
                    seed=request_seed(seed, step, p.uid, j), stop_token_ids=self.turn_stop_token_ids), env_seed))
        return out

    def generate_episodes(self, step: int, batch: list, bases: list[int]) -> list[Sample]:
        """``group_size`` episodes of every prompt on the rollout workers (``ActorGroup.run_episodes``), as
        samples in key order with ``loss_mask``, ``turns`` and the episode's reward; the batch's episode metrics
        (turns, finish reasons, prefix-cache hit rate across turns, tool seconds) from ``_episode_results``
        (:meth:`episode_batch_metrics`), and the rewards that ``reward.on_error=zero`` made 0.0 in
        ``_episode_reward_errors``."""
        run_episodes = episode_runner(self.actors.run_episodes, self.cfg, self.end_of_turn)
        results = run_episodes(self.episode_requests(step, batch, bases))
        self._episode_results = results
        self._episode_reward_errors = sum(r.metrics.get("reward_errors", 0) for r in results)
        samples = [r.to_sample(self.tokenizer.decode) for r in results]
        if self.env_spec.is_single_turn:  # the single-turn path's record: the engine's stop | length, no mask
            for smp, r in zip(samples, results):  # (all ones) and no turn structure (one policy turn)
                smp.finish_reason = r.turn_finish_reasons[0] if r.turn_finish_reasons else r.finish_reason
                smp.loss_mask = smp.turns = None
        return samples

    @staticmethod
    def episode_batch_metrics(results: list) -> dict:
        """The episode figures of a step's batch (every generation round's episodes): turns, finish reasons,
        prefix-cache hit rate across turns, tool seconds, penalties, outcome rewards, policy tokens."""
        from .episodes import episode_metrics, finish_fractions

        metrics = episode_metrics(results)
        n = max(len(results), 1)
        metrics.update(finish_fractions(results, "episodes/"))
        metrics["episodes/penalty_mean"] = sum(sum(r.penalties) for r in results) / n
        metrics["episodes/outcome_reward_mean"] = sum(r.reward for r in results) / n
        metrics["episodes/policy_tokens_mean"] = sum(sum(r.loss_mask) for r in results) / n
        return metrics

    def turn_close_ids(self) -> list[int]:
        """The token that closes a supervised target (warm start): the chat template's end-of-turn token where it
        is another than the EOS (``end_of_turn``, data.use_chat_template=true: Qwen3-*-Base's ``<|im_end|>``),
        else ``stop_token_ids`` (the EOS)."""
        close = list(self.stop_token_ids)
        if self.cfg.data.use_chat_template and self.end_of_turn is not None:
            ids = self.tokenizer.encode(self.end_of_turn)
            if len(ids) == 1 and ids[0] not in close:
                close = ids
        return close

    def demonstration_examples(self, records: list, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """warm_start.target=demonstration: for each record, the environment's perfect episode
        (``env.demonstration()``: its assistant turns) replayed through the environment; one supervised example
        per turn, the transcript before it (built as the episode runner builds it: the turns, each closed by the
        end-of-turn token, and the observations' continuation text) -> the turn and its end-of-turn token (the
        chat template's, ``end_of_turn``; the EOS without a chat template)."""
        from types import SimpleNamespace

        from .episodes import TurnTokenizer

        cfg, tok = self.cfg, self.tokenizer
        end_of_turn = (self.end_of_turn or tok.eos_token) if cfg.data.use_chat_template else None
        turns = TurnTokenizer(tok, end_of_turn, self.model_config.max_position_embeddings)
        close = self.turn_close_ids()
        examples = []
        for i, record in enumerate(records):
            env = self.env_spec.make(record, cfg.warm_start.seed + i)
            start = env.reset()
            demo = getattr(env, "demonstration", None)
            if demo is None:
                raise ConfigError(f"warm_start.target=demonstration: the environment {cfg.env.env_name!r} has no "
                                  "demonstration() (the assistant turns of a perfect episode); use another "
                                  "warm_start.target")
            ids = self.episode_prompt(SimpleNamespace(record=record, token_ids=list(prompt_ids[i])), start)
            for text in demo():
                target = tok.encode(text) + close
                examples.append((list(ids), target))
                result = env.step(text)
                if result.done:
                    break
                obs_ids, _ = turns.observation(start.tools, target, result)
                ids = ids + target + obs_ids
        return examples

