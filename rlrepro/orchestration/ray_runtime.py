"""Ray: starting it (local on 127.0.0.1, or joining ``ray.address``), placing the actors, moving data, and
replacing rollout workers that die (see :mod:`.faults` for the policies).

This module and the driver are the only places that import ray.
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .faults import FaultPlan, RolloutWorkerLost, describe, is_actor_death, kill_actor_later, log, trainer_actor_class
from .workers import RolloutWorker

# Ray turns a node address of 127.0.0.1 into the machine's outward address (services.resolve_ip_for_localhost),
# and its servers then bind that address or every interface. With this set to 0 (read when ray is imported, and
# inherited by every Ray process) the node address stays 127.0.0.1 and every server binds loopback only.
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def start_ray(address: str | None, num_cpus: int | None) -> None:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if not address:
        os.environ.update(LOCAL_ONLY_ENV)
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        # Local mode: Ray's processes listen on loopback only (tests/test_exposure.py checks every listening
        # socket), no dashboard, no usage stats.
        import torch
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # the same as LOCAL_ONLY_ENV, for a ray imported before now
        # Name the GPUs: a stripped Ray may not detect them, and actors asking for one would wait forever.
        ray.init(num_cpus=num_cpus or os.cpu_count(), num_gpus=torch.cuda.device_count(),
                 include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True, configure_logging=True, logging_level="WARNING")


class Cluster:
    """The rollout workers and the trainer for one run.

    A rollout worker that dies (its process killed, its actor lost) during ``generate`` or ``sync_weights`` is
    replaced: a new actor, loaded with the trainer's current weights under the current version, gets the dead
    one's unfinished requests again. Requests are pure functions of their keys, so the results are the ones the
    dead worker would have returned. At most ``rollout.max_restarts`` replacements per step (counted from the
    step's ``generate``); then :class:`~.faults.RolloutWorkerLost`. The trainer is not replaced: its state is the
    run's state, and a run whose trainer died resumes from its last checkpoint (``run.resume=true``).
    """

    def __init__(self, cfg: DictConfig, model_dir: str) -> None:
        import ray

        self.cfg = cfg
        start_ray(cfg.ray.address, cfg.ray.num_cpus)
        self._ray = ray
        self.fault_plan = FaultPlan.from_env()  # empty unless a test sets RLREPRO_FAULTS
        self.max_restarts = cfg.rollout.max_restarts
        self.restarts = 0  # replacements over the whole run
        self._restarts_in_step = 0
        self._active_kills: list[dict] = []
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
        self._worker_cls = ray.remote(num_cpus=0, num_gpus=worker_gpus, max_restarts=0)(RolloutWorker)
        self._worker_args = (model_dir,), dict(engine_kwargs=engine_kwargs, **common)
        self.workers = [self._new_worker() for _ in range(nw)]
        train_kwargs = trainer_kwargs(cfg)
        trainer_cls = trainer_actor_class(self.fault_plan)
        extra = {"fault_plan": self.fault_plan} if self.fault_plan.has_trainer_faults() else {}
        self.trainer = ray.remote(num_cpus=0, num_gpus=trainer_gpus)(trainer_cls).remote(
            model_dir, train_kwargs=train_kwargs, **common, **extra)
        self.weight_version = -1

    def get(self, refs: Any) -> Any:
        return self._ray.get(refs)

    # ------------------------------------------------------------------------------------ rollout workers
    def _new_worker(self):
        args, kwargs = self._worker_args
        return self._worker_cls.remote(*args, **kwargs)

    def _call(self, i: int, method: str, *args: Any):
        """``self.workers[i].<method>.remote(*args)``; a test's kill_worker fault may end the worker right after."""
        actor = self.workers[i]
        fault = next((f for f in self._active_kills if f["worker"] == i and f["left"] > 0), None)
        pid = None
        if fault is not None and fault["how"] == "sigkill":
            pid = self.get(actor.pid.remote())  # before the work: an actor runs one call at a time
        ref = getattr(actor, method).remote(*args)
        if fault is not None:
            fault["left"] -= 1
            kill_actor_later(self._ray, actor, pid, fault["how"], fault["delay_s"])
        return ref

    def _arm_faults(self, at: str, step: int) -> None:
        """Test-only (RLREPRO_FAULTS): the kill_worker faults of this call; ``times`` counts the worker and its
        replacements."""
        if not self.fault_plan:
            return
        for i in range(len(self.workers)):
            f = self.fault_plan.take("kill_worker", step, at=at, worker=i)
            if f is not None:
                self._active_kills.append({"worker": i, "left": int(f.get("times", 1)), "how": f.get("how", "sigkill"),
                                           "delay_s": float(f.get("delay_s", 0.0))})

    def _replace_worker(self, i: int, error: BaseException, during: str, version: int,
                        weights_ref: Any = None) -> None:
        """Put a new worker in slot ``i``, holding the trainer's current weights as ``version`` (-1: the starting
        weights from the model directory). Counts against the per-step budget; raises RolloutWorkerLost past it."""
        ray = self._ray
        while True:
            self._restarts_in_step += 1
            if self._restarts_in_step > self.max_restarts:
                raise RolloutWorkerLost(
                    f"rollout worker {i} was lost during {during}, and the {self.max_restarts} replacement(s) that "
                    f"rollout.max_restarts={self.max_restarts} allows per step are used up; last error: "
                    f"{describe(error)}. Fix the cause (memory? the Ray logs under /tmp/ray/session_latest/logs "
                    "say why the process ended) or raise rollout.max_restarts")
            self.restarts += 1
            redo = "its requests are re-run" if during == "generate" else "it gets the weights"
            log(f"rollout worker {i} lost during {during} ({describe(error, 200)}); replacing it "
                f"({self._restarts_in_step}/{self.max_restarts} this step), {redo}")
            try:
                ray.kill(self.workers[i], no_restart=True)
            except Exception:  # noqa: BLE001 - it is gone already
                pass
            self.workers[i] = self._new_worker()
            if version < 0:
                return
            ref = weights_ref if weights_ref is not None else self.trainer.get_weights.remote()
            try:
                got = self.get(self._call(i, "load_weights", ref, version))
            except Exception as e:  # noqa: BLE001
                if not is_actor_death(e):
                    raise
                error = e
                continue
            if got != version:
                raise RuntimeError(f"replacement rollout worker {i} reports weight version {got}, expected {version}")
            return

    def _gather(self, calls: dict[int, Any], resubmit, during: str, version: int, weights_ref: Any = None) -> dict:
        """Wait for one call per worker slot; a slot whose worker died gets a replacement, then ``resubmit(i)``
        (a new call, or None when the replacement needs none)."""
        ray = self._ray
        pending = {ref: i for i, ref in calls.items()}
        results: dict[int, Any] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except Exception as e:  # noqa: BLE001
                if not is_actor_death(e):
                    raise
                self._replace_worker(i, e, during, version, weights_ref)
                new_ref = resubmit(i)
                if new_ref is None:
                    results[i] = version
                else:
                    pending[new_ref] = i
        return results

    def generate(self, requests: list[dict]) -> list[dict]:
        """Deal requests to workers by position (request i to worker i mod W); gather in any order. A worker
        that dies is replaced and its part re-run (see the class docstring)."""
        nw = len(self.workers)
        parts = {i: requests[i::nw] for i in range(nw) if requests[i::nw]}
        self._restarts_in_step = 0
        self._arm_faults("generate", self.weight_version + 1)  # step k generates with the weights of version k-1
        calls = {i: self._call(i, "generate", part) for i, part in parts.items()}
        results = self._gather(calls, lambda i: self._call(i, "generate", parts[i]), "generate",
                               self.weight_version)
        return [res for i in sorted(results) for res in results[i]]

    def train_step(self, samples: list[dict]) -> dict:
        return self.get(self.trainer.train_step.remote(samples))

    def warm_start(self, examples, **kw) -> list[float]:
        return self.get(self.trainer.warm_start.remote(examples, **kw))

    def sync_weights(self, version: int) -> str:
        """Trainer -> object store -> every worker; returns the digest of the weights sent. Each worker
        reports the version it now holds and a mismatch is an error, never a silent stale policy."""
        weights_ref = self.trainer.get_weights.remote()
        digest = self.trainer.weights_digest.remote()
        self._arm_faults("sync", version)
        calls = {i: self._call(i, "load_weights", weights_ref, version) for i in range(len(self.workers))}
        # a replacement is loaded with weights_ref as it is made: nothing to resubmit
        got = self._gather(calls, lambda i: None, "weight sync", version, weights_ref)
        versions = [got[i] for i in range(len(self.workers))]
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
                max_response_length=cfg.rollout.max_tokens, on_nonfinite=t.on_nonfinite)


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
