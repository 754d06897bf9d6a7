"""Ray: starting it (local on 127.0.0.1, or joining ``ray.address``), placing the actors, moving data.

This module and the driver are the only places that import ray.
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .workers import RolloutWorker, TrainerWorker


def start_ray(address: str | None, num_cpus: int | None) -> None:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        # Local mode: Ray's processes listen on loopback only, no dashboard, no usage stats.
        import torch

        # Name the GPUs: a stripped Ray may not detect them, and actors asking for one would wait forever.
        ray.init(num_cpus=num_cpus or os.cpu_count(), num_gpus=torch.cuda.device_count(),
                 include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True, configure_logging=True, logging_level="WARNING")


class Cluster:
    """The rollout workers and the trainer for one run."""

    def __init__(self, cfg: DictConfig, model_dir: str) -> None:
        import ray

        self.cfg = cfg
        start_ray(cfg.ray.address, cfg.ray.num_cpus)
        self._ray = ray
        on_gpu = cfg.run.device == "cuda"
        nw = cfg.rollout.num_workers
        if on_gpu and cfg.ray.colocate:
            worker_gpus, trainer_gpus = 0.5 / nw, 0.5
        elif on_gpu:
            worker_gpus, trainer_gpus = 1.0, 1.0
        else:
            worker_gpus = trainer_gpus = 0
        r = cfg.rollout
        engine_kwargs = dict(seed=cfg.run.seed, max_num_seqs=r.max_num_seqs,
                             max_num_batched_tokens=r.max_num_batched_tokens, enable_prefix_cache=r.prefix_cache,
                             block_size=r.block_size, num_kv_blocks=r.num_kv_blocks, max_model_len=r.max_model_len,
                             gpu_memory_fraction=r.gpu_memory_fraction / nw)
        common = dict(device=cfg.run.device, dtype=cfg.model.dtype, deterministic=cfg.run.deterministic)
        self.workers = [
            ray.remote(num_cpus=0, num_gpus=worker_gpus)(RolloutWorker).remote(
                model_dir, engine_kwargs=engine_kwargs, **common)
            for _ in range(nw)]
        train_kwargs = trainer_kwargs(cfg)
        self.trainer = ray.remote(num_cpus=0, num_gpus=trainer_gpus)(TrainerWorker).remote(
            model_dir, train_kwargs=train_kwargs, **common)
        self.weight_version = -1

    def get(self, refs: Any) -> Any:
        return self._ray.get(refs)

    def generate(self, requests: list[dict]) -> list[dict]:
        """Deal requests to workers by position (request i to worker i mod W); gather in any order."""
        nw = len(self.workers)
        parts = [requests[i::nw] for i in range(nw)]
        refs = [w.generate.remote(part) for w, part in zip(self.workers, parts) if part]
        return [res for out in self.get(refs) for res in out]

    def train_step(self, samples: list[dict]) -> dict:
        return self.get(self.trainer.train_step.remote(samples))

    def warm_start(self, examples, **kw) -> list[float]:
        return self.get(self.trainer.warm_start.remote(examples, **kw))

    def sync_weights(self, version: int) -> str:
        """Trainer -> object store -> every worker; returns the digest of the weights sent. Each worker
        reports the version it now holds and a mismatch is an error, never a silent stale policy."""
        weights_ref = self.trainer.get_weights.remote()
        digest = self.trainer.weights_digest.remote()
        versions = self.get([w.load_weights.remote(weights_ref, version) for w in self.workers])
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync to version {version} failed: workers report {versions}")
        self.weight_version = version
        return self.get(digest)

    def save_checkpoint(self, ckpt_root: str, step: int, extra: dict, keep_last: int) -> str:
        return self.get(self.trainer.save_checkpoint.remote(ckpt_root, step, extra, keep_last))

    def load_checkpoint(self, path: str) -> dict:
        return self.get(self.trainer.load_checkpoint.remote(path))

    def shutdown(self) -> None:
        for actor in self.workers + [self.trainer]:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.workers = []
        if self.cfg.ray.address is None and self._ray.is_initialized():
            self._ray.shutdown()


def trainer_kwargs(cfg: DictConfig) -> dict:
    t = cfg.train
    return dict(lr=t.lr, min_lr_ratio=t.min_lr_ratio, warmup_steps=t.warmup_steps, total_steps=t.steps,
                weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                max_grad_norm=t.max_grad_norm, micro_batch_size=t.micro_batch_size, ppo_epochs=t.ppo_epochs,
                clip_low=t.clip_low, clip_high=t.clip_high, loss_agg=t.loss_agg, kl_coef=t.kl_coef,
                kl_estimator=t.kl_estimator, temperature=cfg.rollout.temperature,
                max_response_length=cfg.rollout.max_tokens)


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
