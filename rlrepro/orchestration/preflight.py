"""Pre-flight checks: everything that can be known before any work (devices, the run directory, the tokenizer,
prompt lengths, the reward on a gold answer). Each raises :class:`ConfigError` naming the value and the fix,
before Ray starts and before ``config.yaml`` is written."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rlrepro.repro.records import (CHECKPOINTS_DIR, CONFIG_FILE, FINGERPRINTS_FILE, METRICS_FILE, ROLLOUTS_DIR)

from .config import ConfigError, RunSchema
from .errors import log

__all__ = ["check_devices", "check_run_dir", "check_tokenizer", "check_lengths", "check_reward",
           "remove_partial_checkpoints"]


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


def check_run_dir(cfg: RunSchema, run_dir: Path, fresh: bool) -> None:
    """A fresh run refuses a run.dir that already holds a run: starting over would truncate its records. With
    run.overwrite=true that run's files are deleted first."""
    from rlrepro.trainer import list_checkpoints

    if not fresh:
        return
    found = []
    for name in (METRICS_FILE, FINGERPRINTS_FILE):
        f = run_dir / name
        if f.is_file() and f.stat().st_size > 0:
            found.append(name)
    ckpts = list_checkpoints(run_dir / CHECKPOINTS_DIR)
    if ckpts:
        found.append(f"checkpoints up to step {ckpts[-1][0]}")
    if not found:
        return
    if not cfg.run.overwrite:
        raise ConfigError(f"run.dir={str(run_dir)!r} already holds a run ({', '.join(found)}). Fix: continue "
                          "it with run.resume=true, start it over with run.overwrite=true (deletes its records, "
                          "checkpoints, base_model and data), or choose another run.dir")
    log(f"run.overwrite=true: deleting the run in {run_dir}")
    for name in (METRICS_FILE, FINGERPRINTS_FILE, CONFIG_FILE):
        (run_dir / name).unlink(missing_ok=True)
    for name in (ROLLOUTS_DIR, CHECKPOINTS_DIR, "base_model", "data", "verify"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


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
    if r.num_kv_blocks is not None:
        need = -(-(n + r.max_tokens - 1) // r.block_size)
        if need > r.num_kv_blocks:
            raise ConfigError(f"prompt {longest.uid!r} ({n} tokens) + rollout.max_tokens={r.max_tokens} needs "
                              f"{need} KV blocks of {r.block_size} tokens > rollout.num_kv_blocks="
                              f"{r.num_kv_blocks}. Fix: raise rollout.num_kv_blocks to at least {need} or lower "
                              "rollout.max_tokens")


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
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
        raise ConfigError(f"reward.fn={cfg.reward.fn!r} fails on the gold answer of prompt {rec.uid!r}: {e}{cause}. "
                          "Fix the function (it must return a float in [0, 1] for any completion), or set "
                          "reward.on_error=zero to score such completions 0 and count them") from None


def remove_partial_checkpoints(root: Path, say) -> None:
    """Delete ``step_NNNNNN.tmp-<pid>`` directories that a killed run left (never loaded; they only take disk)."""
    if not root.is_dir():
        return
    for d in sorted(root.glob("step_*.tmp-*")):
        if d.is_dir():
            say(f"rlrepro: removing the partial checkpoint {d} (a write that did not finish)")
            shutil.rmtree(d, ignore_errors=True)
