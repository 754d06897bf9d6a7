"""The GRPO driver loop: generate -> reward -> advantages -> train -> sync weights -> log -> checkpoint.

Everything that decides a number is keyed, never timed: the prompts of step k come from the seeded epoch order
(its cursor is checkpointed), each sample's sampling seed is ``request_seed(run.seed, k, prompt uid, sample
index)``, requests are dealt to rollout workers by position, and results are put back in (prompt uid, sample
index) order whatever order they arrive in. So the number of workers, their batch settings and their speed
cannot change a run, and a resumed run repeats the uninterrupted one.
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlrepro.repro.fingerprint import fingerprint_from_samples
from rlrepro.repro.records import (CHECKPOINTS_DIR, CONFIG_FILE, FINGERPRINTS_FILE, METRICS_FILE, ROLLOUTS_DIR,
                                   FingerprintWriter, MetricsWriter, RolloutWriter, atomic_write_bytes)

from .config import ConfigError, validate_model_layout
from .faults import RunFailed, describe, is_actor_death, log, unwrap
from .ray_runtime import Cluster


@dataclass
class Prompt:
    uid: str
    token_ids: list[int]
    record: Any


def prepare_model_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """The directory every actor loads the starting policy from (always through ``load_pretrained``)."""
    from rlrepro.model import Qwen3Config, Qwen3ForCausalLM, init_random_weights, save_pretrained
    from rlrepro.model import write_tiny_checkpoint

    if cfg.model.init == "pretrained":
        return Path(cfg.model.path)
    target = run_dir / "base_model"
    if (target / "config.json").is_file():
        return target
    tmp = run_dir / "base_model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if cfg.model.init == "tiny":
        write_tiny_checkpoint(tmp, seed=cfg.model.init_seed, **OmegaConf.to_container(cfg.model.tiny_overrides))
    else:  # random weights of the shape in model.path/config.json, tokenizer from there too
        config = Qwen3Config.from_file(cfg.model.path)
        import torch

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.model.dtype or "", config.dtype)
        model = init_random_weights(Qwen3ForCausalLM(config).to(dtype), cfg.model.init_seed)
        save_pretrained(model, tmp, max_shard_bytes=5 << 30, tokenizer_from=cfg.model.path)
        del model
    os.replace(tmp, target)
    return target


def load_prompts(cfg: DictConfig, run_dir: Path, tokenizer) -> tuple[list[Prompt], Any]:
    from rlrepro.data import load_records, make_synthetic_records, tokenize_prompt, write_jsonl

    source = cfg.data.source
    fields = dict(prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field, id_field=cfg.data.id_field,
                  messages_field=cfg.data.messages_field)
    if source is None:  # the synthetic task, written as jsonl and read back through the same loader
        source = run_dir / "data" / f"synthetic_{cfg.data.synthetic.task}.jsonl"
        fields = dict(prompt_field="prompt", answer_field="answer", id_field="id", messages_field=None)
        if not source.is_file():
            records = make_synthetic_records(cfg.data.synthetic.task, cfg.data.synthetic.num, cfg.data.synthetic.seed,
                                             **OmegaConf.to_container(cfg.data.synthetic.kwargs))
            write_jsonl(records, source)
    records, stats = load_records(str(source), split=cfg.data.split, on_bad_row=cfg.data.on_bad_row,
                                  allow_hub=cfg.data.allow_hub, limit=cfg.data.limit, **fields)
    prompts = []
    skipped = []
    for rec in records:
        ids = tokenize_prompt(rec, tokenizer, template=cfg.data.template, system_prompt=cfg.data.system_prompt,
                              use_chat_template=cfg.data.use_chat_template)
        problem = None
        if not ids:
            problem = f"prompt {rec.uid!r} tokenizes to nothing; fix the row or the template"
        elif len(ids) > cfg.data.max_prompt_tokens:
            problem = (f"prompt {rec.uid!r} has {len(ids)} tokens > data.max_prompt_tokens="
                       f"{cfg.data.max_prompt_tokens}; raise the limit, filter the data set, or set "
                       "data.on_bad_row=skip to leave such prompts out")
        if problem is not None:
            if cfg.data.on_bad_row != "skip":
                raise ConfigError(problem)
            skipped.append(rec.uid)
            continue
        prompts.append(Prompt(rec.uid, ids, rec))
    if skipped:
        print(f"rlrepro: data.on_bad_row=skip: left out {len(skipped)} prompt(s) that are empty or longer than "
              f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} (first: {skipped[0]!r})", file=sys.stderr)
    if not prompts:
        raise ConfigError(f"no prompt of {source} is left after leaving out {len(skipped)} empty or too long ones; "
                          "raise data.max_prompt_tokens")
    uids = [p.uid for p in prompts]
    if len(set(uids)) != len(uids):
        raise ConfigError("prompt uids are not unique; set data.id_field to a unique column")
    return prompts, stats


def shaped_penalties(lengths: list[int], cfg: DictConfig) -> list[float] | None:
    """The per-sample reward shaping of ``cfg.reward`` (DAPO's overlong punishment over completion ``lengths``,
    in tokens), or None when it is off."""
    from rlrepro.data import overlong_penalty

    buffer = cfg.reward.overlong_buffer
    if not buffer:
        return None
    return [overlong_penalty(n, cfg.rollout.max_tokens, buffer, cfg.reward.overlong_penalty_factor) for n in lengths]


class GRPODriver:
    def __init__(self, cfg: DictConfig, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run.dir)
        self.cluster: Cluster | None = None
        self.wandb_run = None

    # ------------------------------------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Check everything that can be known before work (reward, model directory, tokenizer, data, lengths),
        then write config.yaml and start the actors. A check that fails raises ConfigError / ValueError /
        FileNotFoundError naming the value and the fix, before Ray starts and before config.yaml is written."""
        from rlrepro.data import EpochOrder, load_reward_fn
        from rlrepro.model import load_tokenizer
        from rlrepro.model.checkpoint_io import check_pretrained

        cfg = self.cfg
        self._check_devices()
        self.reward_fn = load_reward_fn(cfg.reward.fn)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = prepare_model_dir(cfg, self.run_dir)
        self.model_config = check_pretrained(self.model_dir)
        validate_model_layout(cfg, self.model_config)  # e.g. trainer.tensor_parallel must divide the heads
        self.tokenizer = load_tokenizer(self.model_dir)
        self._check_tokenizer()
        self.prompts, self.data_stats = load_prompts(cfg, self.run_dir, self.tokenizer)
        if len(self.prompts) < cfg.rollout.prompts_per_step:
            raise ConfigError(f"the data set has {len(self.prompts)} prompts < rollout.prompts_per_step="
                              f"{cfg.rollout.prompts_per_step}")
        self._check_lengths()
        self._check_reward()
        atomic_write_bytes(self.run_dir / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True).encode("utf-8"))
        self.order = EpochOrder(len(self.prompts), seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        eos = self.tokenizer.eos_token_id
        self.stop_token_ids = [eos] if eos is not None else []
        self.metrics = MetricsWriter(self.run_dir)
        self.fingerprints = FingerprintWriter(self.run_dir)
        self.rollouts = RolloutWriter(self.run_dir)
        self.cluster = Cluster(cfg, str(self.model_dir))

    # ------------------------------------------------------------------------------------------- checks
    def _check_devices(self) -> None:
        import torch

        cfg = self.cfg
        if cfg.run.device == "cuda" and cfg.ray.address is None:
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

    def _check_tokenizer(self) -> None:
        vocab, tok = self.model_config.vocab_size, self.tokenizer
        if tok.vocab_size > vocab:
            raise ConfigError(
                f"the tokenizer in {self.model_dir} has {tok.vocab_size} tokens but the model's vocab_size is "
                f"{vocab} (config.json): token ids >= {vocab} have no embedding. Fix: use the tokenizer that belongs "
                "to these weights (tokenizer.json next to config.json in model.path), or a model with a larger "
                "vocabulary")
        eos = tok.eos_token_id
        if tok.eos_token is not None and eos is None:
            raise ConfigError(f"the tokenizer in {self.model_dir} names eos_token {tok.eos_token!r} "
                              "(tokenizer_config.json), which is not in its vocabulary; fix tokenizer_config.json")

    def _check_lengths(self) -> None:
        """Every prompt plus rollout.max_tokens fits the context and the KV cache (the engine would refuse the
        request mid-run otherwise)."""
        r = self.cfg.rollout
        max_len = r.max_model_len or self.model_config.max_position_embeddings
        longest = max(self.prompts, key=lambda p: len(p.token_ids))
        n = len(longest.token_ids)
        if n + r.max_tokens > max_len:
            src = "rollout.max_model_len" if r.max_model_len else "the model's max_position_embeddings"
            raise ConfigError(f"prompt {longest.uid!r} has {n} tokens; with rollout.max_tokens={r.max_tokens} that is "
                              f"{n + r.max_tokens} > {max_len} ({src}). Fix: lower rollout.max_tokens to at most "
                              f"{max_len - n}, lower data.max_prompt_tokens to drop long prompts, or raise "
                              "rollout.max_model_len")
        if r.num_kv_blocks is not None:
            need = -(-(n + r.max_tokens - 1) // r.block_size)
            if need > r.num_kv_blocks:
                raise ConfigError(f"prompt {longest.uid!r} ({n} tokens) + rollout.max_tokens={r.max_tokens} needs "
                                  f"{need} KV blocks of {r.block_size} tokens > rollout.num_kv_blocks="
                                  f"{r.num_kv_blocks}. Fix: raise rollout.num_kv_blocks to at least {need} or lower "
                                  "rollout.max_tokens")

    def _check_reward(self) -> None:
        """Under reward.on_error=raise, score the first prompt's gold answer once: a reward that raises or returns
        something other than a number in [0, 1] fails now rather than at the end of the first rollout."""
        from rlrepro.data import compute_rewards
        from rlrepro.data.rewards import RewardError

        cfg = self.cfg
        if cfg.reward.on_error != "raise":
            return
        rec = self.prompts[0].record
        try:
            compute_rewards(self.reward_fn, [rec.answer], [rec], policy="raise")
        except (RewardError, TypeError) as e:
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
            raise ConfigError(f"reward.fn={cfg.reward.fn!r} fails on the gold answer of prompt {rec.uid!r}: {e}{cause}. "
                              "Fix the function (it must return a float in [0, 1] for any completion), or set "
                              "reward.on_error=zero to score such completions 0 and count them") from None

    def _check_run_dir(self, fresh: bool) -> None:
        """A fresh run refuses a run.dir that already holds a run: starting over would truncate its records."""
        from rlrepro.trainer import list_checkpoints

        if not fresh:
            return
        found = []
        for name in (METRICS_FILE, FINGERPRINTS_FILE):
            f = self.run_dir / name
            if f.is_file() and f.stat().st_size > 0:
                found.append(name)
        ckpts = list_checkpoints(self.checkpoint_root())
        if ckpts:
            found.append(f"checkpoints up to step {ckpts[-1][0]}")
        if not found:
            return
        if not self.cfg.run.overwrite:
            raise ConfigError(f"run.dir={str(self.run_dir)!r} already holds a run ({', '.join(found)}). Fix: continue "
                              "it with run.resume=true, start it over with run.overwrite=true (deletes its records, "
                              "checkpoints, base_model and data), or choose another run.dir")
        log(f"run.overwrite=true: deleting the run in {self.run_dir}")
        for name in (METRICS_FILE, FINGERPRINTS_FILE, CONFIG_FILE):
            (self.run_dir / name).unlink(missing_ok=True)
        for name in (ROLLOUTS_DIR, CHECKPOINTS_DIR, "base_model", "data", "verify"):
            shutil.rmtree(self.run_dir / name, ignore_errors=True)

    def _warm_start(self) -> None:
        cfg = self.cfg
        if cfg.warm_start.steps <= 0:
            return
        from rlrepro.data import make_synthetic_records, tokenize_prompt

        ws = cfg.warm_start
        syn = cfg.data.synthetic
        records = make_synthetic_records(syn.task, max(256, ws.batch_size * 4), syn.seed + 1_000_003 + ws.seed,
                                         **OmegaConf.to_container(syn.kwargs))
        rng = random.Random(ws.seed)
        charset = sorted({c for rec in records for c in rec.answer})
        examples = []
        for rec in records:
            p = tokenize_prompt(rec, self.tokenizer, template=cfg.data.template, system_prompt=cfg.data.system_prompt,
                                use_chat_template=cfg.data.use_chat_template)
            target = rec.answer if ws.target == "answer" else "".join(rng.choice(charset) for _ in rec.answer)
            examples.append((p, self.tokenizer.encode(target) + self.stop_token_ids))
        losses = self.cluster.warm_start(examples, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size, seed=ws.seed)
        self._log_line(f"warm start: {ws.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    # ------------------------------------------------------------------------------------------------ one step
    def _requests(self, step: int, batch: list[Prompt]) -> list[dict]:
        from rlrepro.rollout import request_seed

        r = self.cfg.rollout
        reqs = []
        for p in batch:
            for j in range(r.group_size):
                reqs.append({"key": (p.uid, j), "prompt_token_ids": p.token_ids, "sampling": dict(
                    temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                    seed=request_seed(self.cfg.run.seed, step, p.uid, j), stop_token_ids=tuple(self.stop_token_ids))})
        return reqs

    def run_step(self, step: int) -> dict:
        from rlrepro.data import compute_rewards
        from rlrepro.trainer import compute_advantages
        import torch

        cfg = self.cfg
        t0 = time.perf_counter()
        batch = [self.prompts[i] for i in self.order.next_batch(cfg.rollout.prompts_per_step)]
        by_uid = {p.uid: p for p in batch}
        results = self.cluster.generate(self._requests(step, batch))  # a lost worker is replaced, its part re-run
        results.sort(key=lambda res: res["key"])  # (prompt uid, sample index): arrival order never matters
        t1 = time.perf_counter()
        texts = [self.tokenizer.decode(res["token_ids"]) for res in results]
        records = [by_uid[res["key"][0]].record for res in results]
        rewards, num_reward_errors = compute_rewards(self.reward_fn, texts, records, policy=cfg.reward.on_error)
        penalties = shaped_penalties([len(res["token_ids"]) for res in results], cfg)
        if penalties is not None:  # DAPO's soft overlong punishment: part of the reward the advantages see
            rewards = [r + p for r, p in zip(rewards, penalties)]
        t2 = time.perf_counter()
        g = cfg.rollout.group_size
        reward_t = torch.tensor(rewards, dtype=torch.float32).view(-1, g)
        advantages = compute_advantages(reward_t, mode=cfg.train.advantage).view(-1).tolist()
        samples = [{"prompt_uid": res["key"][0], "sample_index": res["key"][1],
                    "prompt_token_ids": by_uid[res["key"][0]].token_ids, "token_ids": res["token_ids"],
                    "logprobs": res["logprobs"], "reward": rewards[i], "advantage": advantages[i],
                    "finish_reason": res["finish_reason"]} for i, res in enumerate(results)]
        train_samples = [{"prompt_token_ids": s["prompt_token_ids"], "completion_token_ids": s["token_ids"],
                          "rollout_logprobs": s["logprobs"], "advantage": s["advantage"]} for s in samples]
        self._trainer_step = None  # unknown while the update runs
        try:
            train_metrics = self.cluster.train_step(train_samples)
        except FloatingPointError:
            self._trainer_step = step - 1  # the trainer refused the update before any weight changed
            raise
        self._trainer_step = step
        if train_metrics.get("train/nonfinite_skipped"):
            self._log_line(f"step {step}: non-finite loss or gradient norm; update skipped (train.on_nonfinite=skip)")
        t3 = time.perf_counter()
        weights_digest = self.cluster.sync_weights(version=step)
        t4 = time.perf_counter()
        lengths = [len(s["token_ids"]) for s in samples]
        metrics = {
            "step": step,
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/reward_max": max(rewards),
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": max(lengths),
            "rollout/finish_stop_frac": sum(s["finish_reason"] == "stop" for s in samples) / len(samples),
            "rollout/reward_errors": num_reward_errors,
            "rollout/num_samples": len(samples),
        }
        if penalties is not None:
            metrics["rollout/overlong_penalty_mean"] = sum(penalties) / len(penalties)
        metrics.update({k: v for k, v in train_metrics.items() if k.startswith("train/")})
        metrics.update({
            "repro/weights_digest": weights_digest[:16],
            "perf/rollout_s": t1 - t0, "perf/reward_s": t2 - t1, "perf/train_s": t3 - t2, "perf/sync_s": t4 - t3,
            "perf/rollout_tokens_per_s": sum(lengths) / max(t1 - t0, 1e-9),
            "perf/step_time_s": t4 - t0,
            "perf/rollout_worker_restarts": self.cluster.restarts,  # (run environment, not compared by diff)
        })
        metrics.update(self._perf_metrics(train_metrics, samples, t3 - t2))
        fp = fingerprint_from_samples(step, samples, loss=train_metrics["train/loss"],
                                      grad_norm=train_metrics["train/grad_norm"], weights=weights_digest)
        self.fingerprints.write(fp)
        self.metrics.write(metrics)
        if cfg.run.save_rollouts:
            self.rollouts.write(step, samples)
        self._last_samples = [(by_uid[s["prompt_uid"]].record, texts[i], s["reward"]) for i, s in enumerate(samples)]
        return metrics

    def _perf_metrics(self, train_metrics: dict, samples: list[dict], train_s: float) -> dict:
        """Trainer throughput and MFU (model FLOPs over the step's train wall time and the GPUs' bf16 dense peak),
        and peak GPU memory per actor since the last step."""
        n_tokens = sum(len(s["prompt_token_ids"]) + len(s["token_ids"]) for s in samples)
        out = {"perf/train_tokens_per_s": n_tokens / max(train_s, 1e-9)}
        flops = train_metrics.get("perf/train_flops")
        if self.cfg.run.device == "cuda":
            peak = train_metrics.get("perf/gpu_peak_flops")
            if flops is not None and peak:
                out["perf/mfu"] = flops / (train_s * peak * self.cfg.train.num_gpus)
            for actor, stats in self.cluster.memory_stats().items():
                if stats:
                    out[f"perf/peak_mem_gib_{actor}"] = stats["peak_allocated_gib"]
        return out

    # ------------------------------------------------------------------------------------------------ the loop
    def checkpoint_root(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def save_checkpoint(self, step: int, data_order: dict | None = None) -> str:
        order = self.order.state_dict() if data_order is None else data_order
        extra = {"step": step, "data_order": order, "recipe": self.cfg.recipe}
        return self.cluster.save_checkpoint(str(self.checkpoint_root()), step, extra, self.cfg.checkpoint.keep_last)

    def restore(self, ckpt_path: str) -> int:
        extra = self.cluster.load_checkpoint(ckpt_path)
        self.order.load_state_dict(extra["data_order"])
        step = int(extra["step"])
        self.cluster.sync_weights(version=step)
        return step

    def run(self, *, start_checkpoint: str | None = None, last_step: int | None = None) -> list[dict]:
        """Run steps up to ``last_step`` (default train.steps). Resumes from ``start_checkpoint`` if given, else
        from the latest complete checkpoint when run.resume is true, else from scratch."""
        from rlrepro.trainer import latest_checkpoint

        cfg = self.cfg
        last_step = cfg.train.steps if last_step is None else last_step
        self._check_run_dir(fresh=start_checkpoint is None and not cfg.run.resume)
        self.setup()
        try:
            self._remove_partial_checkpoints()
            ckpt = start_checkpoint
            if ckpt is None and cfg.run.resume:
                found = latest_checkpoint(self.checkpoint_root())
                ckpt = None if found is None else str(found)
            if ckpt is not None:
                if cfg.train.kl_coef > 0:
                    self._warm_start()  # rebuilds the KL reference (the warm-started policy) deterministically
                done = self.restore(ckpt)
                self._log_line(f"resumed from {ckpt} (step {done})")
            else:
                done = 0
                self._warm_start()
                self.cluster.sync_weights(version=0)
            for writer in (self.metrics, self.fingerprints, self.rollouts):
                writer.truncate_from(done + 1)
            self._init_wandb()
            history = []
            t_start = time.perf_counter()
            # what a checkpoint of the last completed step needs, should a later step fail
            self._done_step, self._done_order, self._trainer_step = done, self.order.state_dict(), done
            for step in range(done + 1, last_step + 1):
                self._saving = False
                try:
                    metrics = self.run_step(step)
                    self._done_step, self._done_order = step, self.order.state_dict()
                    history.append(metrics)
                    self._log_wandb(step, metrics)
                    every = cfg.checkpoint.every
                    if (every and step % every == 0) or (step == last_step and cfg.checkpoint.save_last):
                        self._saving = True
                        t_ckpt = time.perf_counter()
                        path = self.save_checkpoint(step)
                        self._log_line(f"checkpoint {path}: {time.perf_counter() - t_ckpt:.1f} s")
                        self._saving = False
                except Exception as e:  # noqa: BLE001 - every failure of a step ends the run the same way
                    raise self._failed(step, e) from e
                self._progress(step, last_step, done, metrics, time.perf_counter() - t_start)
            return history
        finally:
            self.close()

    def _remove_partial_checkpoints(self) -> None:
        """Delete ``step_NNNNNN.tmp-<pid>`` directories that a killed run left (never loaded; they only take disk)."""
        root = self.checkpoint_root()
        if not root.is_dir():
            return
        for d in sorted(root.glob("step_*.tmp-*")):
            if d.is_dir():
                self._log_line(f"rlrepro: removing the partial checkpoint {d} (a write that did not finish)")
                shutil.rmtree(d, ignore_errors=True)

    def _failed(self, step: int, error: BaseException) -> RunFailed:
        """The error a failed step ends the run with. When the trainer still holds the state of the last completed
        step (the failure came before the update, or the update was refused as non-finite) and that step has no
        checkpoint, one is written first, so a resumed run repeats nothing that was recorded."""
        from rlrepro.trainer import latest_checkpoint
        from rlrepro.trainer.checkpoint import checkpoint_dir_name

        cause = unwrap(error)
        notes = []
        done = self._done_step
        trainer_died = is_actor_death(error)  # rollout workers are replaced; a lost actor here is the trainer
        if (self._trainer_step == done and done > 0 and not self._saving and not trainer_died
                and not (self.checkpoint_root() / checkpoint_dir_name(done)).is_dir()):
            try:
                path = self.save_checkpoint(done, data_order=self._done_order)
                notes.append(f"saved a checkpoint of the last completed step {done}: {path}")
            except Exception as e:  # noqa: BLE001
                notes.append(f"a checkpoint of the last completed step {done} could not be saved ({describe(e)})")
        if self._saving:
            notes.append(f"the checkpoint of step {step} was not written (nothing partial is ever loaded)")
        if trainer_died:
            notes.append("the trainer process died (out of memory? killed?)")
        latest = latest_checkpoint(self.checkpoint_root())
        where = f"{latest}" if latest is not None else "none (a resumed run starts from step 1)"
        message = (f"step {step} failed: {describe(error)}. " + "".join(n[0].upper() + n[1:] + ". " for n in notes)
                   + f"The last complete checkpoint is {where}; rerun with run.resume=true to continue from it "
                   "(the steps after it are repeated bit for bit).")
        return RunFailed(message, step=step, checkpoint=None if latest is None else str(latest), cause=cause)

    # ------------------------------------------------------------------------------------------------ logging
    def _log_line(self, text: str) -> None:
        if self.cfg.logger.progress:
            print(text, file=sys.stderr, flush=True)

    def _progress(self, step: int, last: int, first_done: int, m: dict, elapsed: float) -> None:
        if not self.cfg.logger.progress:
            return
        done = step - first_done
        eta = elapsed / done * (last - step)
        width = 20
        filled = int(width * step / last)
        bar = "#" * filled + "." * (width - filled)
        print(f"[{bar}] step {step}/{last} | reward {m['rollout/reward_mean']:.3f} | loss {m['train/loss']:+.4f} "
              f"| grad {m['train/grad_norm']:.3f} | len {m['rollout/response_length_mean']:.1f} "
              f"| lp_diff {m['train/rollout_logprob_abs_diff']:.1e} | {m['perf/step_time_s']:.2f}s/step "
              f"| ETA {eta:.0f}s", file=sys.stderr, flush=True)

    def _init_wandb(self) -> None:
        lc = self.cfg.logger
        if not lc.wandb:
            return
        os.environ.setdefault("WANDB_MODE", lc.mode)
        import wandb

        self.wandb_run = wandb.init(project=lc.project, dir=str(self.run_dir), mode=lc.mode,
                                    name=self.run_dir.name, group=self.cfg.recipe,
                                    config=OmegaConf.to_container(self.cfg, resolve=True))
        for group in ("rollout", "train", "repro", "perf"):
            wandb.define_metric(f"{group}/*", step_metric="step")

    def _log_wandb(self, step: int, metrics: dict) -> None:
        if self.wandb_run is None:
            return
        import wandb

        payload = {k: v for k, v in metrics.items() if not isinstance(v, str)}
        n = self.cfg.logger.num_table_samples
        if n:
            table = wandb.Table(columns=["step", "prompt_uid", "prompt", "completion", "answer", "reward"])
            for rec, text, reward in self._last_samples[:n]:
                table.add_data(step, rec.uid, rec.prompt if hasattr(rec, "prompt") else "", text, rec.answer, reward)
            payload["rollout/samples"] = table
        self.wandb_run.log(payload)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def run_training(cfg: DictConfig) -> list[dict]:
    return GRPODriver(cfg).run()

