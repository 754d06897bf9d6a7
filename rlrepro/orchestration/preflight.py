"""Pre-flight checks: everything that can be known before any work (devices, the run directory, the tokenizer,
prompt lengths, the reward on a gold answer). Each raises :class:`ConfigError` naming the value and the fix,
before Ray starts and before ``config.yaml`` is written."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from rlrepro.repro.records import (CHECKPOINTS_DIR, CONFIG_FILE, FINGERPRINTS_FILE, METRICS_FILE, ROLLOUTS_DIR)

from .config import ConfigError, RunSchema
from .errors import log

__all__ = ["check_devices", "check_run_dir", "overwrite_plan", "describe_deletions", "check_tokenizer",
           "check_end_of_turn", "check_lengths", "check_reward", "remove_partial_checkpoints", "resume_checkpoint",
           "RUN_FILES", "RUN_DIRS"]


def check_devices(cfg: RunSchema) -> None:
    import torch

    if cfg.run.device != "cuda" or cfg.ray.address is not None:
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ConfigError("run.device=cuda but this machine has no visible CUDA device (actors would wait "
                          "forever for one). Fix: run.device=cpu, or check CUDA_VISIBLE_DEVICES and the driver")
    if cfg.train.num_gpus > have:
        raise ConfigError(f"train.num_gpus={cfg.train.num_gpus} but {have} CUDA device(s) are visible; "
                          f"lower it to at most {have}")
    need = cfg.train.num_gpus + (0 if cfg.ray.colocate else cfg.rollout.num_workers)
    if need > have:
        raise ConfigError(f"ray.colocate=false puts each of the rollout.num_workers={cfg.rollout.num_workers} "
                          f"engines on its own GPU beside train.num_gpus={cfg.train.num_gpus}: {need} GPUs, "
                          f"but {have} are visible; set ray.colocate=true or lower the counts")


# What rlrepro writes into a run directory: the files run.overwrite=true deletes, and nothing else.
RUN_FILES = (CONFIG_FILE, METRICS_FILE, FINGERPRINTS_FILE, "inputs.json", "amendments.jsonl", "summary.json",
             "summary.txt")
# directories only rlrepro writes into, with the names of the entries it makes there
RUN_DIRS = {ROLLOUTS_DIR: ("step_*.jsonl.gz", ".step_*.tmp"), CHECKPOINTS_DIR: ("step_*",), "verify": ("from_*",),
            "data": ("synthetic_*.jsonl", ".synthetic_*.tmp"),
            "export": ("step_*", "step_*.tmp-*", "step_*.old-*")}
RUN_GLOBS = ("base_model", "base_model.tmp*")  # rlrepro's own model directory (model.init=tiny|random)


def check_run_dir(cfg: RunSchema, run_dir: Path, fresh: bool) -> None:
    """A fresh run refuses a run.dir that already holds a run: starting over would truncate its records. With
    run.overwrite=true that run's files (:func:`overwrite_plan`) are deleted first, and nothing else; refused
    when the run's inputs lie among them or one is a symbolic link."""
    from rlrepro.trainer.checkpoint import scan_checkpoints

    if not fresh:
        return
    found = []
    for name in (METRICS_FILE, FINGERPRINTS_FILE):
        f = run_dir / name
        if f.is_file() and f.stat().st_size > 0:
            found.append(name)
    ckpts = scan_checkpoints(run_dir / CHECKPOINTS_DIR)
    usable = [step for step, _, problem in ckpts if problem is None]
    if usable:
        found.append(f"checkpoints up to step {usable[0]}")
    elif ckpts:
        found.append(f"{len(ckpts)} damaged checkpoint directories")
    # copies an interrupted save set aside (step_N.old-PID): a fresh run would put them back as its own step_N
    aside = sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).glob("step_*.old-*")
                   if p.is_dir() and p.name.rsplit(".old-", 1)[1].isdigit())
    if aside:
        found.append(f"{len(aside)} checkpoint copies set aside by an interrupted save ({aside[0]})")
    if not found:
        return
    if not cfg.run.overwrite:
        raise ConfigError(f"run.dir={str(run_dir)!r} already holds a run ({', '.join(found)}). Fix: continue "
                          "it with run.resume=true, start it over with run.overwrite=true (deletes the files that "
                          "run wrote: its records, checkpoints, rollouts, base_model, verify runs and synthetic data, "
                          "nothing else), or choose another run.dir")
    plan = overwrite_plan(run_dir)
    _refuse_inputs_inside(cfg, run_dir, plan)
    links = [q for q in plan if q.is_symlink()]
    if links:
        raise ConfigError(f"run.overwrite=true would delete {links[0]}, a symbolic link to {os.readlink(links[0])!r}; "
                          "rlrepro never deletes through a link (its target is not in the run directory). Move or "
                          "empty the target and remove the link yourself, or choose another run.dir")
    log(f"run.overwrite=true: deleting the run in {run_dir}: {describe_deletions(plan, run_dir)}")
    for q in plan:
        if q.is_dir():
            shutil.rmtree(q)
        else:
            q.unlink(missing_ok=True)
    for name in RUN_DIRS:
        d = run_dir / name
        if d.is_dir() and not d.is_symlink():
            left = sorted(e.name for e in d.iterdir())
            if left:
                more = f" and {len(left) - 8} more" if len(left) > 8 else ""
                log(f"run.overwrite=true: kept {d}, which holds {len(left)} entries rlrepro did not write: "
                    f"{', '.join(left[:8])}{more}")
            else:
                d.rmdir()


def describe_deletions(plan: list[Path], run_dir: Path, shown: int = 5) -> str:
    """What ``plan`` holds, for the log: how many files and directories, the first ``shown`` of them (relative to
    ``run_dir``) and how many more, e.g. ``"7 files and 2 directories: config.yaml, metrics.jsonl,
    fingerprints.jsonl, inputs.json, amendments.jsonl and 4 more"``."""
    if not plan:
        return "nothing"
    dirs = sum(1 for q in plan if q.is_dir() and not q.is_symlink())
    counts = [f"{n} {word if n == 1 else plural}" for n, word, plural in
              ((len(plan) - dirs, "file", "files"), (dirs, "directory", "directories")) if n]
    names = ", ".join(str(q.relative_to(run_dir)) for q in plan[:shown])
    more = f" and {len(plan) - shown} more" if len(plan) > shown else ""
    return f"{' and '.join(counts)}: {names}{more}"


def overwrite_plan(run_dir: Path) -> list[Path]:
    """The files and directories rlrepro wrote into ``run_dir`` (what run.overwrite=true deletes), in that order:
    :data:`RUN_FILES`, the entries matching :data:`RUN_DIRS` inside those directories, :data:`RUN_GLOBS`. A
    directory that is a symbolic link is listed itself (not looked into)."""
    plan = [run_dir / n for n in RUN_FILES if (run_dir / n).is_symlink() or (run_dir / n).exists()]
    for name, patterns in RUN_DIRS.items():
        d = run_dir / name
        if d.is_symlink():
            plan.append(d)
        elif d.is_dir():
            plan += sorted({e for pattern in patterns for e in d.glob(pattern)})
    plan += sorted(q for pattern in RUN_GLOBS for q in run_dir.glob(pattern))
    return plan


def _config_paths(cfg: RunSchema) -> list[tuple[str, str]]:
    """(key, value) of every config value that names an existing file or directory, run.dir aside;
    data.source and model.path first."""
    from omegaconf import OmegaConf

    from .resume import flatten

    tree = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    out = []
    for key, value in sorted(flatten(tree), key=lambda kv: kv[0] not in ("data.source", "model.path")):
        if key != "run.dir" and isinstance(value, str) and value.strip() and len(value) < 4096:
            try:
                if Path(value).exists():
                    out.append((key, value))
            except (OSError, ValueError):
                continue
    return out


def _refuse_inputs_inside(cfg: RunSchema, run_dir: Path, plan: list[Path]) -> None:
    """run.overwrite=true must not delete what the run reads: data.source, model.path, eval data or any other
    path a key names."""
    real = [(q, Path(os.path.realpath(q))) for q in plan if not q.is_symlink()]
    for key, value in _config_paths(cfg):
        target = Path(os.path.realpath(value))
        for q, r in real:
            if target == r or r in target.parents:
                raise ConfigError(f"run.overwrite=true would delete {q}, and {key}={value!r} lies inside it: the run "
                                  "would delete its own input. Move it out of the run directory (or choose another "
                                  "run.dir); nothing was deleted")


def check_tokenizer(model_config: Any, tokenizer: Any, model_dir: Path) -> None:
    vocab = model_config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer in {model_dir} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{vocab} (config.json): token ids >= {vocab} have no embedding. Fix: use the tokenizer that belongs "
            "to these weights (tokenizer.json next to config.json in model.path), or a model with a larger "
            "vocabulary")
    if tokenizer.eos_token is not None and tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {model_dir} names eos_token {tokenizer.eos_token!r} "
                          "(tokenizer_config.json), which is not in its vocabulary; fix tokenizer_config.json")


def check_end_of_turn(cfg: RunSchema, tokenizer: Any, model_dir: Path) -> str | None:
    """The chat template's end-of-turn token (:func:`rlrepro.envs.end_of_turn_token`) of a run with
    data.use_chat_template=true: what each turn (a single-turn response too) stops at besides the EOS, and, in
    multi-turn episodes (env.*), what an observation follows. It is the tokenizer's EOS wherever the template
    closes an assistant turn with it (those runs keep their bits), else the special token the template closes it
    with (Qwen3-*-Base: ``<|im_end|>``, EOS ``<|endoftext|>``). None without the chat template. Raises
    ConfigError when a multi-turn run's template says no usable token; a single-turn run then stops at the EOS
    alone (None), as it always did."""
    from .config import uses_episodes

    if not cfg.data.use_chat_template:
        return None
    single_turn = cfg.env.fn is None and cfg.env.name == "single_turn"
    from rlrepro.envs import end_of_turn_token

    try:
        return end_of_turn_token(tokenizer)
    except ValueError as e:  # also: no chat template at all (the tokenizer says so and how to fix it)
        if not uses_episodes(cfg) or single_turn:
            return None
        raise ConfigError(f"data.use_chat_template=true with env.* (multi-turn episodes), model {model_dir}: "
                          f"{e}") from None


def check_lengths(cfg: RunSchema, prompts: list, model_config: Any) -> None:
    """Every prompt plus rollout.max_tokens fits the context and the KV cache (the engine would refuse the
    request mid-run otherwise)."""
    r = cfg.rollout
    max_len = r.max_model_len or model_config.max_position_embeddings
    longest = max(prompts, key=lambda p: len(p.token_ids))
    n = len(longest.token_ids)
    if n + r.max_tokens > max_len:
        src = "rollout.max_model_len" if r.max_model_len else "the model's max_position_embeddings"
        room = max_len - n
        fix = (f"lower rollout.max_tokens to at most {room}, " if room >= 1 else
               f"the prompt alone leaves no room for a generated token; ")
        raise ConfigError(f"prompt {longest.uid!r} has {n} tokens; with rollout.max_tokens={r.max_tokens} that is "
                          f"{n + r.max_tokens} > {max_len} ({src}). Fix: {fix}lower data.max_prompt_tokens to drop "
                          "long prompts, or raise rollout.max_model_len")
    if cfg.env.name is not None or cfg.env.fn is not None:
        check_episode_prompt(cfg, longest.uid, n, model_config)
    if r.num_kv_blocks is not None:
        need = -(-(n + r.max_tokens - 1) // r.block_size)
        if need > r.num_kv_blocks:
            raise ConfigError(f"prompt {longest.uid!r} ({n} tokens) + rollout.max_tokens={r.max_tokens} needs "
                              f"{need} KV blocks of {r.block_size} tokens > rollout.num_kv_blocks="
                              f"{r.num_kv_blocks}. Fix: raise rollout.num_kv_blocks to at least {need} or lower "
                              "rollout.max_tokens")


def check_episode_prompt(cfg: RunSchema, uid: str, n: int, model_config: Any) -> None:
    """An episode's prompt of ``n`` tokens (the environment's start, tools' schemas included) leaves room for a
    generated token under ``env.max_episode_tokens`` and the engine's context, else every such episode would end
    (token_budget) before its first turn and the run would train on nothing."""
    max_len = cfg.rollout.max_model_len or model_config.max_position_embeddings
    budget = cfg.env.max_episode_tokens
    for limit, key in ((budget, f"env.max_episode_tokens={budget}"), (max_len, f"the engine's context ({max_len})")):
        if limit is not None and n >= limit:
            raise ConfigError(f"prompt {uid!r} starts its episode with {n} tokens, {key}: the episode would end "
                              "(token_budget) before the first generated token, and the run would train on nothing. "
                              f"Fix: raise env.max_episode_tokens / rollout.max_model_len above {n} (the prompt, the "
                              "turns and the observations all count) or lower data.max_prompt_tokens to drop long "
                              "prompts")


def check_micro_batch_tokens(cfg: RunSchema, prompts: list, model_config: Any, episodes: bool) -> None:
    """``train.micro_batch_tokens`` holds the longest sample the run can produce, so that no micro-batch passes the
    budget. Single-turn: the longest prompt plus ``rollout.max_tokens`` (at most the context). Episodes: the
    transcript budget, ``env.max_episode_tokens`` (capped by the engine's context, the budget when it is null):
    every turn is cut to the tokens left under it, and an observation that reaches it ends the episode and is left
    out of the sample (a sample always ends with a policy turn), so no trained sample is longer
    (rlrepro.envs.Episode, rlrepro.orchestration.episodes)."""
    budget = cfg.train.micro_batch_tokens
    if not budget:
        return
    max_len = cfg.rollout.max_model_len or model_config.max_position_embeddings
    if episodes:
        cap = cfg.env.max_episode_tokens
        if cap is not None and cap <= max_len:
            longest = cap
            what = (f"an episode's transcript, prompt, turns and observations, can reach env.max_episode_tokens="
                    f"{cap}; an observation that passes it ends the episode and is not trained")
            fix = "lower env.max_episode_tokens"
        else:
            longest = max_len
            src = "rollout.max_model_len" if cfg.rollout.max_model_len else "the model's max_position_embeddings"
            shown = "null" if cap is None else f"{cap}, above the context"
            what = (f"an episode's transcript can fill the engine's context ({src}), its only bound with "
                    f"env.max_episode_tokens={shown}")
            fix = (f"set env.max_episode_tokens<={budget} (a transcript budget: every episode then ends within it), "
                   "or lower rollout.max_model_len")
    else:
        n = max(len(p.token_ids) for p in prompts)
        longest = min(max_len, n + cfg.rollout.max_tokens)
        what = f"the longest prompt has {n} tokens, rollout.max_tokens={cfg.rollout.max_tokens}"
        fix = "lower rollout.max_tokens or data.max_prompt_tokens"
    if longest > budget:
        raise ConfigError(f"train.micro_batch_tokens={budget} is below the longest sample this run can produce, "
                          f"{longest} tokens ({what}); such a sample would be a micro-batch of its own, past the "
                          f"budget. Fix: set train.micro_batch_tokens>={longest}, or {fix}")


def warn_rationale_answers(cfg: RunSchema, prompts: list, say=log) -> bool:
    """With a string reward (``exact_match``, ``prefix_match``), gold answers that are GSM8K rationales (text ending
    in ``#### <answer>``, as AReaL's and OpenRLHF's gsm8k files hold them) are compared whole, so almost every
    completion scores 0 and nothing fails: said once on stderr, naming ``reward.fn=math`` (which reads the final
    answer). Returns whether it was said."""
    if cfg.reward.fn not in ("exact_match", "prefix_match") or not prompts:
        return False
    answers = [p.record.answer for p in prompts[:200]]
    marked = sum(1 for a in answers if isinstance(a, str) and "####" in a and a.split("####")[0].strip())
    if 2 * marked < len(answers):
        return False
    say(f"warning: {marked} of the first {len(answers)} gold answers are worked solutions ending in '#### <answer>' "
        f"(GSM8K style), which reward.fn={cfg.reward.fn} compares whole: a completion scores only when it repeats "
        "the whole solution. Set reward.fn=math to score the final answer (docs/DATA.md)")
    return True


def check_reward(cfg: RunSchema, reward_fn: Any, prompts: list) -> None:
    """Under reward.on_error=raise, score the first prompt's gold answer once: a reward that raises or returns
    something other than a number in [0, 1] fails now rather than at the end of the first rollout."""
    from rlrepro.data import compute_rewards
    from rlrepro.data.rewards import RewardError

    if cfg.reward.on_error != "raise":
        return
    rec = prompts[0].record
    try:
        compute_rewards(reward_fn, [rec.answer], [rec], policy="raise")
    except (RewardError, TypeError) as e:
        cause = "" if e.__cause__ is None else f" ({type(e.__cause__).__name__}: {e.__cause__})"
        if cause and cause[2:-1] in str(e):  # the message names the cause already
            cause = ""
        raise ConfigError(f"reward.fn={cfg.reward.fn!r} fails on the gold answer of prompt {rec.uid!r}: {e}{cause}. "
                          "Fix the function (it must return a float in [0, 1] for any completion), or set "
                          "reward.on_error=zero to score such completions 0 and count them") from None


def remove_partial_checkpoints(root: Path, say) -> None:
    """Delete ``step_NNNNNN.tmp-<pid>`` directories that a killed run left (never loaded; they only take disk).
    A symbolic link of that name is left alone (rlrepro never made it and does not follow it), and said so."""
    from rlrepro.trainer.checkpoint import restore_set_aside

    if not root.is_dir():
        return
    restore_set_aside(root, say)
    for d in sorted(root.glob("step_*.tmp-*")):
        if d.is_symlink():
            say(f"rlrepro: leaving {d} alone: a symbolic link (to {os.readlink(d)!r}), not a partial checkpoint "
                "rlrepro wrote; links are not followed")
        elif d.is_dir():
            say(f"rlrepro: removing the partial checkpoint {d} (a write that did not finish)")
            shutil.rmtree(d, ignore_errors=True)
            if d.exists():
                say(f"rlrepro: could not remove all of {d} (permissions?); it is never loaded")


def resume_checkpoint(root: Path, say=log) -> str | None:
    """The checkpoint ``run.resume=true`` continues from: the newest complete one under ``root``. Each newer
    directory that is not a complete checkpoint is named with the reason it is skipped. None when there is no
    checkpoint directory at all (the run starts at step 1); ConfigError when there are some but none is usable
    (starting over would silently rewrite every record). A newer checkpoint of another format version (another
    rlrepro wrote it) is not skipped: the resume is refused, since the steps after the older one would replace it."""
    from rlrepro.trainer.checkpoint import VERSION, other_version, restore_set_aside, scan_checkpoints

    restore_set_aside(root, say)  # a save killed while it replaced a step: that step's copy is put back first
    entries = scan_checkpoints(root)
    for step, path, problem in entries:
        if problem is None:
            return str(path)
        version = other_version(path) if path.is_dir() else None
        if version is not None:
            raise ConfigError(f"run.resume=true: {path} is a checkpoint of format version {version!r}, and this "
                              f"rlrepro writes and reads version {VERSION}: another rlrepro wrote it. Resuming from "
                              "an older checkpoint would re-execute its step and replace it, so nothing was changed. "
                              "Fix: resume with the rlrepro that wrote it, or start a new run in another run.dir")
        say(f"run.resume=true: skipping {path}, not a complete checkpoint: {problem}")
    if not entries:
        say("run.resume=true but no checkpoint exists yet: starting at step 1")
        return None
    names = ", ".join(path.name for _, path, _ in entries)
    raise ConfigError(f"run.resume=true, but none of the {len(entries)} checkpoint directories in {root} is usable "
                      f"({names}; the reasons are above). Resuming would start over at step 1 and rewrite every "
                      "record, so nothing was changed. Fix: restore the missing or damaged files (from a copy), or "
                      "start the run over with run.resume=false run.overwrite=true, or choose another run.dir")
