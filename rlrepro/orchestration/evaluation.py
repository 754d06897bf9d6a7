"""Evaluation on held-out data: during training (``eval.every``) and after it (``rlrepro eval RUN [--step K]``).

After the weight sync of step k (every ``eval.every``-th step and the run's last, ``train.steps``), every prompt
of ``eval.source`` gets ``eval.num_samples`` (k) sampled completions (``eval.temperature``, default
``rollout.temperature``; 0 = greedy) and, with ``eval.greedy=true``, one more at temperature 0. They run on the
rollout engines as keyed requests, like the step's own: the seed of sample j of prompt uid after step k is
``eval_seed(run.seed, k, uid, j)`` (rlrepro.rollout.seeds; another salt than the training seeds), results are
sorted by key, so the numbers are the same whatever the number of workers, their batching or their speed.
Evaluating draws no training seed and changes no weight: a run with eval on has the fingerprints of one without.

Rewards are ``reward.fn``'s (no overlong shaping). The metrics, in that step's ``metrics.jsonl`` line and wandb:

* ``eval/avg@K``: the mean reward over all sampled completions (K is ``eval.num_samples``);
* ``eval/pass@K``: Chen et al. 2021's unbiased estimator ``1 - C(n-c, K) / C(n, K)`` with n = K samples per prompt
  and c of them passing (reward >= ``eval.pass_threshold``, default 1.0: a full score), averaged over prompts; with
  n = K it is the fraction of prompts with at least one passing sample;
* ``eval/greedy_acc``: the fraction of prompts whose greedy completion passes (``eval.greedy=true``);
* ``eval/response_length_mean``: the mean length in tokens of the sampled completions;
* ``eval/num_prompts``;
* ``repro/eval_fingerprint`` (:func:`rlrepro.repro.fingerprint.eval_fingerprint`): a sha256 over every request's
  key, token ids and logprobs (an episode's: and loss mask) in key order, so that ``rlrepro diff`` tells two runs
  whose completions differ even where the numbers above agree. ``rlrepro eval`` checks it too (not printed).

``rlrepro eval RUN [--step K]`` loads the run's checkpoint of step K into an engine built as the run's rollout
workers are (the run's base model, then the checkpoint's weights, as a weight sync loads them) and computes the
same numbers with the same keys and seeds: equal, bit for bit, to what the run logged at step K.

A run with ``env.*`` (multi-turn episodes, tools) is evaluated on the episodes it was trained on: each request is
an episode run by the rollout's own episode runner (``RolloutWorker.run_episodes`` ->
``orchestration.episodes.run_episodes``), every turn sampled with the request's ``eval_seed`` and the environment
seeded with ``episode_seed(eval_seed(...), k, uid, j)`` (:func:`eval_env_seed`: apart from the training episodes'
stream), its start rendered as training renders it (``GenerationSteps.episode_prompt``). The reward is the
episode's (the environment's outcome reward minus its penalties, as training scores it), the length the policy's
own tokens; ``eval/turns_mean``, ``eval/tool_calls_mean``, ``eval/outcome_reward_mean``, ``eval/penalty_mean`` and
``eval/finish_<reason>_frac`` (sampled episodes) come on top. ``rlrepro eval --records FILE`` writes one JSON line
per request (reward, turns, tool calls, text).
"""
from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

from .generation import GenerationSteps, episode_runner
from .workers import Request

__all__ = ["pass_at_k", "eval_metrics", "is_eval_step", "load_eval_prompts", "eval_requests", "run_eval",
           "eval_env_seed", "eval_episode_requests", "run_eval_episodes", "Evaluator", "evaluate_checkpoint",
           "main_eval"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021 (Codex, eq. 1), unbiased: the chance that k of n samples, c of them correct, drawn without
    replacement, hold at least one correct one: ``1 - C(n-c, k) / C(n, k)``, computed as an exact fraction and
    rounded once (no cancellation for large n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def eval_metrics(rewards: list[list[float]], lengths: list[list[int]], greedy: list[float] | None, *,
                 k: int, threshold: float) -> dict:
    """The ``eval/*`` metrics of per-prompt sampled rewards and lengths (each prompt's list in sample order) and
    the greedy rewards (one per prompt, or None)."""
    flat = [r for rs in rewards for r in rs]
    flat_len = [n for ns in lengths for n in ns]
    out = {
        f"eval/avg@{k}": sum(flat) / len(flat),
        f"eval/pass@{k}": sum(pass_at_k(len(rs), sum(r >= threshold for r in rs), k) for rs in rewards) / len(rewards),
        "eval/response_length_mean": sum(flat_len) / len(flat_len),
        "eval/num_prompts": len(rewards),
    }
    if greedy is not None:
        out["eval/greedy_acc"] = sum(r >= threshold for r in greedy) / len(greedy)
    return out


def is_eval_step(cfg, step: int) -> bool:
    """Whether the run evaluates after ``step``: every ``eval.every``-th step and the last (``train.steps``)."""
    every = cfg.eval.every
    return bool(every) and (step % every == 0 or step == cfg.train.steps)


def _field(cfg, name: str) -> Any:
    value = getattr(cfg.eval, name)
    return getattr(cfg.data, name) if value is None else value


def check_eval_source(cfg, run_dir: Any = None, flag: bool = False, command: bool = False) -> str:
    """How messages name the held-out source: ``eval.source=...`` (training's config key), or ``--source ...``
    when ``rlrepro eval``'s option set it (``flag``); ``command``: for ``rlrepro eval``, whose fix is ``--source``.
    Raises ConfigError, in those words, when there is none or it does not exist; returns the name."""
    from rlrepro.checks import ConfigError

    source = cfg.eval.source
    if not source and command:
        raise ConfigError(f"the run {run_dir} has no eval.source (it evaluated nothing). Fix: give the held-out "
                          "data: rlrepro eval RUN --source FILE (a .jsonl/.json/.parquet file or a directory of them)")
    if not source:
        raise ConfigError("the run has no eval.source: set eval.source=/path/to/held_out.jsonl (rlrepro eval: "
                          "--source FILE)")
    said = f"--source {source}" if flag else f"eval.source={source!r}" + (" (the run's)" if command else "")
    if not Path(source).exists():
        fix = "point --source" if flag else "give --source FILE" if command else "point eval.source"
        raise ConfigError(f"{said} does not exist (looked for {Path(source).resolve()}). Fix: {fix} at a local "
                          ".jsonl/.json/.parquet file or a directory of them (the hub is not read for evaluation)")
    return said


def load_eval_prompts(cfg, tokenizer, model_config: Any = None, flag: bool = False) -> tuple[list, list[Path]]:
    """The held-out prompts (rlrepro.data.load_records / build_prompts with the data.* keys, eval.* where set)
    and the files they came from. Raises ConfigError naming the eval key: the data layer's messages (and its log
    lines) name ``eval.<key>`` (``--source`` with ``flag``) where they name a ``data.*`` key eval has its own of
    (rlrepro.data.keys), the fix text as it is."""
    from rlrepro.checks import ConfigError
    from rlrepro.data import build_prompts, eval_key_names, load_records, relabel_keys, relabeled_logs

    e, d = cfg.eval, cfg.data
    said = check_eval_source(cfg, flag=flag)
    path = Path(e.source)
    fields = {name: _field(cfg, name) for name in ("prompt_field", "answer_field", "id_field", "messages_field")}
    keys = eval_key_names(option=flag)  # the data layer's messages name data.*: here eval.* / --source
    try:
        with relabeled_logs(keys):
            records, _ = load_records(str(path), split=_field(cfg, "split"), on_bad_row=d.on_bad_row,
                                      allow_hub=False, limit=e.limit, **fields)
            prompts, _ = build_prompts(records, tokenizer, template=_field(cfg, "template"),
                                       system_prompt=_field(cfg, "system_prompt"),
                                       use_chat_template=d.use_chat_template, max_prompt_tokens=d.max_prompt_tokens,
                                       on_bad_row=d.on_bad_row, on_unknown_token=d.on_unknown_token,
                                       source=str(path))
    except ConfigError:
        raise
    except (ValueError, KeyError) as err:
        raise ConfigError(f"{said}: {relabel_keys(str(err), keys)}") from None
    if not prompts:
        raise ConfigError(f"{said} holds no usable prompt")
    if model_config is not None:
        max_len = cfg.rollout.max_model_len or model_config.max_position_embeddings
        longest = max(prompts, key=lambda p: len(p.token_ids))
        if len(longest.token_ids) + max_tokens(cfg) > max_len:
            raise ConfigError(f"eval prompt {longest.uid!r} has {len(longest.token_ids)} tokens; with eval.max_tokens="
                              f"{max_tokens(cfg)} that is more than {max_len} positions: lower eval.max_tokens or "
                              "data.max_prompt_tokens (which drops long prompts)")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return prompts, files


def max_tokens(cfg) -> int:
    return cfg.rollout.max_tokens if cfg.eval.max_tokens is None else cfg.eval.max_tokens


def eval_requests(cfg, step: int, prompts: list, stop_token_ids) -> list[Request]:
    """The keyed requests of the evaluation after ``step``: (uid, j) for j < k sampled, (uid, k) greedy."""
    from rlrepro.rollout import SamplingParams, eval_seed

    e, r = cfg.eval, cfg.rollout
    temperature = r.temperature if e.temperature is None else e.temperature
    n, stops = e.num_samples, tuple(stop_token_ids)

    def params(j: int, t: float) -> SamplingParams:
        return SamplingParams(temperature=t, top_p=r.top_p, top_k=r.top_k, max_tokens=max_tokens(cfg),
                              seed=eval_seed(cfg.run.seed, step, p.uid, j), stop_token_ids=stops)

    requests = []
    for p in prompts:
        requests += [Request((p.uid, j), p.token_ids, params(j, temperature)) for j in range(n)]
        if e.greedy:
            requests.append(Request((p.uid, n), p.token_ids, params(n, 0.0)))
    return requests


def run_eval(generate: Callable[[list[Request]], list], cfg, step: int, prompts: list, tokenizer, reward_fn,
             stop_token_ids, records: list | None = None, fingerprint: bool = False) -> dict:
    """Generate (``generate(requests) -> [(key, RequestOutput)]`` in any order), score and reduce to the
    ``eval/*`` metrics of the evaluation after ``step``; ``records``: a list that gets one dict per request, in
    key order (:func:`_record`); ``fingerprint``: add ``repro/eval_fingerprint`` (the requests' token ids and
    logprobs)."""
    from rlrepro.data import compute_rewards

    n = cfg.eval.num_samples
    results = sorted(generate(eval_requests(cfg, step, prompts, stop_token_ids)), key=lambda kv: kv[0])
    record_of = {p.uid: p.record for p in prompts}
    texts = [tokenizer.decode(out.token_ids) for _, out in results]
    rewards, _ = compute_rewards(reward_fn, texts, [record_of[uid] for (uid, _), _ in results],
                                 policy=cfg.reward.on_error)
    sampled: dict[str, list[float]] = {p.uid: [] for p in prompts}
    lengths: dict[str, list[int]] = {p.uid: [] for p in prompts}
    greedy: dict[str, float] = {}
    for ((uid, j), out), text, reward in zip(results, texts, rewards):
        if records is not None:
            records.append(_record(cfg, (uid, j), reward, len(out.token_ids), out.finish_reason, text))
        if j < n:
            sampled[uid].append(reward)
            lengths[uid].append(len(out.token_ids))
        else:
            greedy[uid] = reward
    uids = [p.uid for p in prompts]
    out = eval_metrics([sampled[u] for u in uids], [lengths[u] for u in uids],
                       [greedy[u] for u in uids] if cfg.eval.greedy else None, k=n,
                       threshold=cfg.eval.pass_threshold)
    if fingerprint:
        out.update(_fingerprint((key, o.token_ids, o.logprobs) for key, o in results))
    return out


def _fingerprint(samples) -> dict:
    """``{repro/eval_fingerprint: digest}`` of ``(key, token_ids, logprobs[, loss_mask])`` per request."""
    from rlrepro.repro.fingerprint import EVAL_FINGERPRINT_KEY, eval_fingerprint

    return {EVAL_FINGERPRINT_KEY: eval_fingerprint(samples)}


def _record(cfg, key: tuple, reward: float, length: int, finish_reason: str, text: str, **extra) -> dict:
    uid, j = key
    return {"uid": uid, "sample": j, "greedy": j == cfg.eval.num_samples, "reward": reward, "length": length,
            "finish_reason": finish_reason, **extra, "text": text}


def eval_env_seed(run_seed: int, step: int, uid: str, j: int) -> int:
    """The environment seed of eval episode ``(uid, j)`` after ``step``: ``rlrepro.envs.episode_seed`` keyed by
    the episode's sampling seed (``eval_seed``), so no training episode's environment seed is drawn again."""
    from rlrepro.envs import episode_seed
    from rlrepro.rollout import eval_seed

    return episode_seed(eval_seed(run_seed, step, uid, j), step, uid, j)


class _EpisodePrompt(GenerationSteps):
    """The driver's rendering of an episode's start (``GenerationSteps.episode_prompt``) for the eval prompts."""

    def __init__(self, cfg, tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer


def eval_episode_requests(cfg, step: int, prompts: list, env_spec, tokenizer, stop_token_ids) -> list:
    """:func:`eval_requests` as episodes (:class:`~.episodes.EpisodeRequest`): the same keys and sampling params
    (every turn of episode (uid, j) samples with its ``eval_seed``), the environment seed :func:`eval_env_seed`,
    the start rendered as the training episodes' (``GenerationSteps.episode_prompt``)."""
    from .episodes import EpisodeRequest

    render, record_of = _EpisodePrompt(cfg, tokenizer), {p.uid: p for p in prompts}
    out = []
    for r in eval_requests(cfg, step, prompts, stop_token_ids):
        p = record_of[r.key[0]]
        env_seed = eval_env_seed(cfg.run.seed, step, *r.key)
        ids = render.episode_prompt(p, env_spec.make(p.record, env_seed).reset())
        out.append(EpisodeRequest(r.key, p.record, ids, r.params, env_seed))
    return out


def _tool_calls(result) -> int:
    """The tool calls of an episode: its environment results' ``info["calls"]`` (ToolEnv: every call parsed,
    malformed and skipped ones included), else its tool turns."""
    if any("calls" in info for info in result.infos):
        return sum(len(info.get("calls") or []) for info in result.infos)
    return sum(t.role == "tool" for t in result.turns)


def run_eval_episodes(run_episodes: Callable[[list], list], cfg, step: int, prompts: list, env_spec, tokenizer,
                      stop_token_ids, records: list | None = None, fingerprint: bool = False) -> dict:
    """The evaluation after ``step`` of a run with ``env.*``: ``run_episodes(requests) -> [EpisodeResult]`` (the
    rollout's episode runner, any order) on :func:`eval_episode_requests`; the ``eval/*`` metrics of
    :func:`run_eval` on the episodes' rewards (``EpisodeResult.total_reward``, as training scores an episode)
    and policy-token lengths, plus the episodes' figures (sampled episodes). ``records``: as :func:`run_eval`'s,
    with the turns and tool calls; ``fingerprint``: as :func:`run_eval`'s, with the episodes' loss masks."""
    n, uids = cfg.eval.num_samples, [p.uid for p in prompts]
    results = sorted(run_episodes(eval_episode_requests(cfg, step, prompts, env_spec, tokenizer, stop_token_ids)),
                     key=lambda res: res.key)
    sampled: dict[str, list] = {u: [] for u in uids}
    greedy: dict[str, float] = {}
    for res in results:
        uid, j = res.key
        if records is not None:
            records.append(_record(cfg, res.key, res.total_reward, sum(res.loss_mask), res.finish_reason,
                                   tokenizer.decode(res.completion_token_ids), outcome_reward=res.reward,
                                   penalties=list(res.penalties), num_turns=res.num_turns,
                                   num_tool_calls=_tool_calls(res),
                                   turns=[{"role": t.role, "text": t.text} for t in res.turns]))
        if j < n:
            sampled[uid].append(res)
        else:
            greedy[uid] = res.total_reward
    out = eval_metrics([[r.total_reward for r in sampled[u]] for u in uids],
                       [[sum(r.loss_mask) for r in sampled[u]] for u in uids],
                       [greedy[u] for u in uids] if cfg.eval.greedy else None, k=n, threshold=cfg.eval.pass_threshold)
    flat = [r for u in uids for r in sampled[u]]
    out["eval/turns_mean"] = sum(r.num_turns for r in flat) / len(flat)
    out["eval/tool_calls_mean"] = sum(_tool_calls(r) for r in flat) / len(flat)
    out["eval/outcome_reward_mean"] = sum(r.reward for r in flat) / len(flat)
    out["eval/penalty_mean"] = sum(sum(r.penalties) for r in flat) / len(flat)
    from .episodes import finish_fractions

    out.update(finish_fractions(flat, "eval/"))
    if fingerprint:
        out.update(_fingerprint((r.key, r.completion_token_ids, r.rollout_logprobs, r.loss_mask) for r in results))
    return out


class Evaluator:
    """The driver's evaluation: the held-out prompts, loaded at set-up (bad input fails before any work)."""

    env_spec: Any = None  # a run with env.*: its environment (the steps are evaluated on episodes)
    end_of_turn: str | None = None

    def __init__(self, cfg, tokenizer, reward_fn, stop_token_ids, model_config: Any = None,
                 later: list[tuple[int, Any]] = (), load_prompts: bool = True, env_spec: Any = None,
                 end_of_turn: str | None = None, flag: bool = False) -> None:
        """``later``: ``(from_step, config)`` of each later eval setting, ascending (``rlrepro verify`` re-running
        steps over which a resume amended ``eval.*``: each step is evaluated as it was). ``load_prompts`` False:
        none (a setting with ``eval.every=0``, which evaluates no step). ``env_spec`` (a run with ``env.*``):
        the steps are evaluated on episodes (:func:`run_eval_episodes`, on ``actors.run_episodes``), their turns
        ended by ``end_of_turn`` (``preflight.check_end_of_turn``); ``stop_token_ids`` then holds its id.
        ``flag``: messages name ``--source`` (``rlrepro eval``), not ``eval.source``."""
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn
        self.stop_token_ids = list(stop_token_ids)
        self.env_spec, self.end_of_turn = env_spec, end_of_turn
        self.prompts, self.files = load_eval_prompts(cfg, tokenizer, model_config, flag) if load_prompts else ([], [])
        self.later = [(s, Evaluator(c, tokenizer, reward_fn, stop_token_ids, model_config,
                                    load_prompts=bool(c.eval.every), env_spec=env_spec, end_of_turn=end_of_turn))
                      for s, c in later]

    def __call__(self, actors, step: int) -> dict:
        """The ``eval/*`` metrics after ``step`` on the rollout engines, or {} when the step is not evaluated."""
        for from_step, evaluator in reversed(self.later):
            if step >= from_step:
                return evaluator(actors, step)
        if not is_eval_step(self.cfg, step):
            return {}
        if self.env_spec is not None:
            return run_eval_episodes(episode_runner(actors.run_episodes, self.cfg, self.end_of_turn), self.cfg, step,
                                     self.prompts, self.env_spec, self.tokenizer, self.stop_token_ids,
                                     fingerprint=True)
        return run_eval(actors.generate, self.cfg, step, self.prompts, self.tokenizer, self.reward_fn,
                        self.stop_token_ids, fingerprint=True)


# ------------------------------------------------------------------------------------------ after the fact

def _checkpoint_weights(run_dir: Path, ckpt: Path, tmp: Path) -> dict:
    """The policy's state dict of a checkpoint (its sha256 checked): a full checkpoint's model.safetensors, a dist
    one through its HF export."""
    from safetensors.torch import load_file

    from rlrepro.trainer.checkpoint import verify_checkpoint

    from .export import export_checkpoint

    manifest = verify_checkpoint(ckpt, check_hashes=True)
    if manifest.get("layout") in (None, "full"):
        return load_file(str(ckpt / "model.safetensors"))
    out = export_checkpoint(run_dir, tmp / "hf", step=int(manifest["step"]))
    weights: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def evaluate_checkpoint(run_dir: str | Path, step: int | None = None, source: str | None = None,
                        records: list | None = None, fingerprint: bool = False,
                        eval_keys: dict | None = None) -> tuple[int, dict]:
    """``(step, eval/* metrics)`` of the run's checkpoint of ``step`` (default: the newest complete one), as the
    run computes them after that step; ``source``: another held-out file than the run's ``eval.source``;
    ``records``: a list that gets one dict per request (key order); ``fingerprint``: add ``repro/eval_fingerprint``;
    ``eval_keys``: how to read ``source`` (``eval.prompt_field`` and the other data keys of :data:`FILE_KEYS`).
    A run with ``env.*`` is evaluated on its episodes (:func:`run_eval_episodes`, on the worker's episode runner,
    as its rollout ran them)."""
    import tempfile

    from omegaconf import OmegaConf

    from rlrepro.data import load_reward_fn
    from rlrepro.model import load_tokenizer
    from rlrepro.model.checkpoint_io import check_pretrained
    from rlrepro.model.model_dirs import checkpoint_base

    from .config import ConfigError, migrate_legacy_keys, uses_episodes, validate
    from .episodes import turn_stop_token_ids
    from .export import checkpoint_of
    from .preflight import check_end_of_turn
    from .resume import config_at_step, read_amendments
    from .run_dirs import missing_run_dir
    from .workers import RolloutWorker

    run_dir = Path(run_dir)
    from .run_dirs import checkpoint_dir_hint

    missing = missing_run_dir("eval", run_dir)  # "not found", or "no config.yaml" for a directory with no run
    if missing is not None:  # a checkpoint directory (RUN/checkpoints/step_N): the run and --step N
        raise ValueError(checkpoint_dir_hint("eval", run_dir, "--step {step}") or missing)
    ckpt = checkpoint_of(run_dir, step)
    # eval.* as they were at that step (a resume may have amended them later: amendments.jsonl)
    latest = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    at_step = config_at_step(latest, read_amendments(run_dir), int(ckpt.name.split("_")[1]))
    if eval_keys:  # --source FILE read with its own columns: checked by validate as the run's keys are
        at_step.setdefault("eval", {}).update(eval_keys)
    cfg = validate(migrate_legacy_keys(at_step, warn=False))
    if source is not None:
        cfg.eval.source = source
    check_eval_source(cfg, run_dir, flag=source is not None, command=True)  # before the model loads
    base = checkpoint_base(ckpt, run_dir)
    tokenizer = load_tokenizer(base)
    end_of_turn = check_end_of_turn(cfg, tokenizer, base)  # the turns end as the run's did
    stops = turn_stop_token_ids(tokenizer, [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
                                end_of_turn)
    evaluator = Evaluator(cfg, tokenizer, load_reward_fn(cfg.reward.fn), stops, check_pretrained(base),
                          flag=source is not None)
    env_spec = None
    if uses_episodes(cfg):  # the run's environment, built as the driver builds it (bad env.* fails before loading)
        from rlrepro.data import reward_with_policy
        from rlrepro.envs import load_env

        try:
            env_spec = load_env(cfg.env, reward_with_policy(evaluator.reward_fn, cfg.reward.on_error))
        except ValueError as e:
            raise ConfigError(f"env.* of {run_dir}/config.yaml: {e}") from None
    tp = cfg.train.engine_tp_emulation  # as the run's engines sampled: TP on megatron, or train.tp_partials
    with tempfile.TemporaryDirectory(prefix="rlrepro-eval-") as tmp:
        weights = _checkpoint_weights(run_dir, ckpt, Path(tmp))
        worker = RolloutWorker(str(base), cfg.rollout.engine, device=cfg.run.device, dtype=cfg.model.dtype,
                               deterministic=cfg.run.deterministic, seed=cfg.run.seed, tensor_parallel_emulation=tp)
        done = int(ckpt.name.split("_")[1])
        worker.load_weights(weights, version=done)  # as a weight sync loads the trainer's state dict
        del weights

    if env_spec is not None:  # as GenerationSteps.generate_episodes and Evaluator run them
        return done, run_eval_episodes(episode_runner(worker.run_episodes, cfg, end_of_turn), cfg, done,
                                       evaluator.prompts, env_spec, tokenizer, stops, records, fingerprint)

    def generate(requests: list[Request]) -> list:
        return [(r.key, out) for r, out in zip(requests, worker.generate(requests))]

    return done, run_eval(generate, cfg, done, evaluator.prompts, tokenizer, evaluator.reward_fn,
                          evaluator.stop_token_ids, records, fingerprint)


def _logged(run_dir: Path, step: int) -> dict | None:
    """The ``eval/*`` metrics the run logged at ``step`` and its ``repro/eval_fingerprint`` (runs recorded before
    it existed have none), or None."""
    from rlrepro.repro.records import EVAL_FINGERPRINT_KEY, read_step_records

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    # as every reader of a step log: a torn last line (a crashed run) is dropped, a malformed one before it is a
    # ReproError naming the file and line (it was a raw JSONDecodeError traceback)
    rec = read_step_records(path).get(step)
    if rec is None:
        return None
    return {k: v for k, v in rec.items() if k.startswith("eval/") or k == EVAL_FINGERPRINT_KEY} or None


# the eval.* keys that say how to read a held-out file, which `rlrepro eval --source FILE` takes as KEY=VALUE
FILE_KEYS = ("split", "prompt_field", "answer_field", "id_field", "messages_field", "template", "system_prompt",
             "limit")


def _file_keys(items: list[str], source: str | None) -> dict:
    """``eval.KEY=VALUE`` arguments as ``{KEY: value}`` (``null``: None, digits: an int); only with ``--source``:
    the run's own eval numbers come from its recorded keys."""
    import yaml

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        name = key.removeprefix("eval.")
        if not eq or not key.startswith("eval.") or name not in FILE_KEYS:
            raise ValueError(f"{item!r} is not eval.KEY=VALUE with KEY one of {', '.join(FILE_KEYS)} (how to read "
                             f"the --source file), e.g. eval.prompt_field=question")
        parsed = yaml.safe_load(value) if value else value
        out[name] = parsed if parsed is None or isinstance(parsed, int) and not isinstance(parsed, bool) else value
        if name == "limit" and out[name] is not None and not isinstance(out[name], int):
            raise ValueError(f"{item}: eval.limit takes a positive integer (the first N rows) or null")
    if out and source is None:
        raise ValueError(f"{', '.join(items)}: these say how to read a --source file; the run's own eval reads its "
                         f"eval.source with the keys it recorded. Fix: add --source FILE, or leave them out")
    return out


def main_eval(argv: list[str]) -> int:
    """``rlrepro eval RUN [--step K] [--source FILE [eval.KEY=VALUE ...]] [--json]``: exit 0; 2 on a bad argument or
    run; 1 when the run logged other eval/* numbers at that step (another eval file, machine or software)."""
    import argparse

    from rlrepro.checks import ConfigError

    ap = argparse.ArgumentParser(prog="rlrepro eval", description="evaluate a run's checkpoint on its eval.source "
                                 "with the numbers (keys, seeds) the run logs under eval/*")
    ap.add_argument("run", help="the run directory")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    ap.add_argument("--source", default=None, help="another held-out file than the run's eval.source (the numbers "
                                                   "are then not compared with the run's)")
    ap.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    ap.add_argument("--records", default=None, metavar="FILE", help="write one JSON line per request (key, reward, "
                    "length, finish reason, text; with env.*: turns and tool calls) to FILE")
    ap.add_argument("keys", nargs="*", metavar="eval.KEY=VALUE", help="with --source: how to read FILE (eval."
                    + ", eval.".join(FILE_KEYS) + "), e.g. eval.prompt_field=question")
    ns = ap.parse_intermixed_args(argv)
    try:
        eval_keys = _file_keys(ns.keys, ns.source)
    except ValueError as e:
        print(f"rlrepro eval: {e}", file=sys.stderr)
        return 2
    records: list | None = [] if ns.records is not None else None
    if ns.records is not None and not Path(ns.records).resolve().parent.is_dir():
        print(f"rlrepro eval: --records {ns.records}: its folder {Path(ns.records).resolve().parent} does not exist; "
              "create it or name a file in an existing folder", file=sys.stderr)
        return 2
    from rlrepro.repro.inputs import in_launch_dir
    from rlrepro.repro.records import EVAL_FINGERPRINT_KEY, ReproError, atomic_write_bytes

    # the user's paths are resolved where the user is, before moving to the run's launch directory
    ns.records = None if ns.records is None else str(Path(ns.records).resolve())
    if ns.source is not None and Path(ns.source).exists():  # a local file (not a data set's name)
        ns.source = str(Path(ns.source).resolve())
    try:
        with in_launch_dir(ns.run) as ns.run:
            step, metrics = evaluate_checkpoint(ns.run, ns.step, ns.source, records, fingerprint=True,
                                                eval_keys=eval_keys)
        if records is not None:  # complete or absent: a crash while writing leaves the previous file, not a part
            atomic_write_bytes(ns.records, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode())
        logged = _logged(Path(ns.run), step) if ns.source is None else None
    except (ConfigError, ValueError, OSError, ReproError) as e:  # ReproError: a damaged or missing record
        print(f"rlrepro eval: {e}", file=sys.stderr)
        return 2

    digest = metrics.pop(EVAL_FINGERPRINT_KEY)  # compared with the run's (where it logged one), not printed
    same = None if logged is None else logged == (dict(metrics, **{EVAL_FINGERPRINT_KEY: digest})
                                                  if EVAL_FINGERPRINT_KEY in logged else metrics)
    if ns.json:
        print(json.dumps({"step": step, **metrics, "matches_run_log": same}, sort_keys=True))
    else:
        print(f"step {step}")
        for key, value in metrics.items():
            print(f"  {key:<28} {value}")
        note = {None: "the run logged no eval at this step", True: "equal to what the run logged at this step",
                False: f"DIFFERENT from what the run logged at this step: {logged}"}[same]
        if ns.source is not None:
            note = "not compared with the run's log: --source is another held-out set"
        print(f"  ({note})")
    return 1 if same is False else 0
