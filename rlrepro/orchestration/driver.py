"""The GRPO driver loop: generate -> reward -> advantages -> train -> sync weights -> log -> checkpoint.

Everything that decides a number is keyed, never timed: the prompts of step k come from the seeded epoch order
(its cursor is checkpointed), each sample's sampling seed is ``request_seed(run.seed, k, prompt uid, sample
index)``, requests are dealt to rollout workers by position, and results are put back in (prompt uid, sample
index) order whatever order they arrive in. So the number of workers, their batch settings and their speed
cannot change a run, and a resumed run repeats the uninterrupted one.
"""
from __future__ import annotations

import json
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
from rlrepro.repro.records import CHECKPOINTS_DIR, FingerprintWriter, MetricsWriter, RolloutWriter

from .config import ConfigError
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
    for rec in records:
        ids = tokenize_prompt(rec, tokenizer, template=cfg.data.template, system_prompt=cfg.data.system_prompt,
                              use_chat_template=cfg.data.use_chat_template)
        if not ids:
            raise ConfigError(f"prompt {rec.uid!r} tokenizes to nothing; fix the row or the template")
        if len(ids) > cfg.data.max_prompt_tokens:
            raise ConfigError(f"prompt {rec.uid!r} has {len(ids)} tokens > data.max_prompt_tokens="
                              f"{cfg.data.max_prompt_tokens}; raise the limit or filter the data set")
        prompts.append(Prompt(rec.uid, ids, rec))
    uids = [p.uid for p in prompts]
    if len(set(uids)) != len(uids):
        raise ConfigError("prompt uids are not unique; set data.id_field to a unique column")
    return prompts, stats


class GRPODriver:
    def __init__(self, cfg: DictConfig, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run.dir)
        self.cluster: Cluster | None = None
        self.wandb_run = None

    # ------------------------------------------------------------------------------------------------ set-up
    def setup(self) -> None:
        from rlrepro.data import EpochOrder, load_reward_fn
        from rlrepro.model import load_tokenizer

        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        self.reward_fn = load_reward_fn(cfg.reward.fn)
        self.model_dir = prepare_model_dir(cfg, self.run_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.prompts, self.data_stats = load_prompts(cfg, self.run_dir, self.tokenizer)
        if len(self.prompts) < cfg.rollout.prompts_per_step:
            raise ConfigError(f"the data set has {len(self.prompts)} prompts < rollout.prompts_per_step="
                              f"{cfg.rollout.prompts_per_step}")
        self.order = EpochOrder(len(self.prompts), seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        eos = self.tokenizer.eos_token_id
        self.stop_token_ids = [eos] if eos is not None else []
        self.metrics = MetricsWriter(self.run_dir)
        self.fingerprints = FingerprintWriter(self.run_dir)
        self.rollouts = RolloutWriter(self.run_dir)
        self.cluster = Cluster(cfg, str(self.model_dir))

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
        results = self.cluster.generate(self._requests(step, batch))
        results.sort(key=lambda res: res["key"])  # (prompt uid, sample index): arrival order never matters
        t1 = time.perf_counter()
        texts = [self.tokenizer.decode(res["token_ids"]) for res in results]
        records = [by_uid[res["key"][0]].record for res in results]
        rewards, num_reward_errors = compute_rewards(self.reward_fn, texts, records, policy=cfg.reward.on_error)
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
        train_metrics = self.cluster.train_step(train_samples)
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
        metrics.update({k: v for k, v in train_metrics.items() if k.startswith("train/")})
        metrics.update({
            "repro/weights_digest": weights_digest[:16],
            "perf/rollout_s": t1 - t0, "perf/reward_s": t2 - t1, "perf/train_s": t3 - t2, "perf/sync_s": t4 - t3,
            "perf/rollout_tokens_per_s": sum(lengths) / max(t1 - t0, 1e-9),
            "perf/step_time_s": t4 - t0,
        })
        fp = fingerprint_from_samples(step, samples, loss=train_metrics["train/loss"],
                                      grad_norm=train_metrics["train/grad_norm"], weights=weights_digest)
        self.fingerprints.write(fp)
        self.metrics.write(metrics)
        if cfg.run.save_rollouts:
            self.rollouts.write(step, samples)
        self._last_samples = [(by_uid[s["prompt_uid"]].record, texts[i], s["reward"]) for i, s in enumerate(samples)]
        return metrics

    # ------------------------------------------------------------------------------------------------ the loop
    def checkpoint_root(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def save_checkpoint(self, step: int) -> str:
        extra = {"step": step, "data_order": self.order.state_dict(), "recipe": self.cfg.recipe}
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
        self.setup()
        try:
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
            for step in range(done + 1, last_step + 1):
                metrics = self.run_step(step)
                history.append(metrics)
                self._log_wandb(step, metrics)
                every = cfg.checkpoint.every
                if (every and step % every == 0) or step == last_step:
                    self.save_checkpoint(step)
                self._progress(step, last_step, done, metrics, time.perf_counter() - t_start)
            return history
        finally:
            self.close()

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
