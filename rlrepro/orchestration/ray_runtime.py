"""Ray: starting it (local on 127.0.0.1, or joining ``ray.address``), placing the actors, moving data, and
replacing rollout workers that die (see :mod:`.faults` for the policies).

This module and the driver are the only places that import ray.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

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
        nw, nt = cfg.rollout.num_workers, cfg.train.num_gpus
        self.sync_mode = resolve_weight_sync(cfg)
        r = cfg.rollout
        engine_kwargs = dict(seed=cfg.run.seed, max_num_seqs=r.max_num_seqs,
                             max_num_batched_tokens=r.max_num_batched_tokens, enable_prefix_cache=r.prefix_cache,
                             block_size=r.block_size, num_kv_blocks=r.num_kv_blocks, max_model_len=r.max_model_len,
                             gpu_memory_fraction=r.gpu_memory_fraction / -(-nw // nt) if cfg.ray.colocate
                             else r.gpu_memory_fraction)
        common = dict(device=cfg.run.device, dtype=cfg.model.dtype, deterministic=cfg.run.deterministic)
        # Placement (see plan_placement): on CUDA one placement-group bundle per GPU; on CPU, plain actors.
        self._placement = None
        if on_gpu:
            plan = plan_placement(nt, nw, cfg.ray.colocate)
            self._placement = make_placement(ray, plan.num_gpus, cfg)
            self._worker_options = [self._in_bundle(b, g) for b, g in plan.workers]
            self._worker_gpu = [b for b, _ in plan.workers]  # colocated: trainer rank b shares GPU b
            trainer_options = [self._in_bundle(b, g) for b, g in plan.trainers]
        else:
            self._worker_options = [dict(num_gpus=0)] * nw
            self._worker_gpu = []
            trainer_options = [dict(num_gpus=0)] * nt
        self._worker_cls = ray.remote(num_cpus=0, max_restarts=0)(RolloutWorker)
        self.megatron = cfg.trainer.backend == "megatron"
        tp_emulation = cfg.trainer.tensor_parallel if self.megatron else 1
        self._worker_args = (model_dir,), dict(engine_kwargs=engine_kwargs, tensor_parallel_emulation=tp_emulation,
                                               **common)
        self.workers = [self._new_worker(i) for i in range(nw)]
        train_kwargs = trainer_kwargs(cfg)
        trainer_cls = ray.remote(num_cpus=0)(trainer_actor_class(self.fault_plan))
        extra = {"fault_plan": self.fault_plan} if self.fault_plan.has_trainer_faults() else {}
        self.trainers = [trainer_cls.options(**trainer_options[g]).remote(
            model_dir, train_kwargs=train_kwargs, rank=g, world_size=nt, backend=cfg.trainer.backend,
            tensor_parallel=cfg.trainer.tensor_parallel, checkpoint_format=cfg.checkpoint.format,
            distributed_optimizer=cfg.train.distributed_optimizer, grad_sync=cfg.trainer.grad_sync, **common,
            **extra) for g in range(nt)]
        self.trainer = self.trainers[0]  # rank 0: weights, digests and checkpoints come from it
        if nt > 1 or self.megatron:
            host, port = self.get(self.trainer.rendezvous_address.remote())
            self.get([t.init_data_parallel.remote(host, port) for t in self.trainers])
        self.weight_version = -1
        self._sync_generation = 0
        self._sync_group_ready = False

    def _in_bundle(self, bundle: int, gpus: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._placement, placement_group_bundle_index=bundle))

    def get(self, refs: Any) -> Any:
        return self._ray.get(refs)

    # ------------------------------------------------------------------------------------ rollout workers
    def _new_worker(self, i: int):
        args, kwargs = self._worker_args
        return self._worker_cls.options(**self._worker_options[i]).remote(*args, **kwargs)

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
            self.workers[i] = self._new_worker(i)
            self._sync_group_ready = False  # a collective weight-sync group is formed again, with the new worker
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
        """Every trainer rank gets the whole batch (it computes its own micro-batches of it); rank 0 reports."""
        ref = self._ray.put(samples)
        return self.get([t.train_step.remote(ref) for t in self.trainers])[0]

    def warm_start(self, examples, **kw) -> list[float]:
        ref = self._ray.put(examples)
        return self.get([t.warm_start.remote(ref, **kw) for t in self.trainers])[0]

    def memory_stats(self) -> dict:
        """Peak GPU memory (GiB) of each actor since the last call: ``trainer{g}`` and ``worker{i}``."""
        refs = {f"trainer{g}": t.memory_stats.remote() for g, t in enumerate(self.trainers)}
        refs.update({f"worker{i}": w.memory_stats.remote() for i, w in enumerate(self.workers)})
        return {name: self.get(ref) for name, ref in refs.items()}

    def sync_weights(self, version: int) -> str:
        """Trainer -> every worker, by ``rollout.weight_sync`` (see :func:`resolve_weight_sync`); returns the
        digest of the weights sent. Each worker reports the version it now holds and a mismatch is an error,
        never a silent stale policy."""
        digest = self.trainer.weights_digest.remote()
        self._arm_faults("sync", version)
        weights_ref = send = None  # without weights_ref, a replacement worker gets the weights from the trainer
        if self.sync_mode == "object_store":
            weights_ref = self.trainer.get_weights.remote()
            calls = {i: self._call(i, "load_weights", weights_ref, version) for i in range(len(self.workers))}
        elif self.sync_mode == "cuda_ipc":  # each engine from the trainer rank on its own GPU (plan_placement)
            handles = {g: self.trainers[g].ipc_handles.remote() for g in sorted(set(self._worker_gpu))}
            calls = {i: self._call(i, "load_weights_ipc", handles[g], version) for i, g in enumerate(self._worker_gpu)}
        else:
            self._form_sync_group()
            send = self.trainer.sync_send.remote(version)
            calls = {i: self._call(i, "sync_receive") for i in range(len(self.workers))}
        got = self._gather(calls, lambda i: None, "weight sync", version, weights_ref)
        if send is not None:
            self.get(send)
        versions = [got[i] for i in range(len(self.workers))]
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync to version {version} failed: workers report {versions}")
        self.weight_version = version
        return self.get(digest)

    def _form_sync_group(self) -> None:
        """The collective weight-sync group (trainer rank 0 + every worker), formed at first use and again after
        a worker was replaced (a new generation: the old group's keys are never met)."""
        if self._sync_group_ready:
            return
        self._sync_generation += 1
        backend = "nccl" if self.cfg.run.device == "cuda" else "gloo"
        world = len(self.workers) + 1
        host, port = self.get(self.trainer.rendezvous_address.remote())
        refs = [self.trainer.sync_group_join.remote(host, port, world, backend, self._sync_generation)]
        refs += [w.sync_group_join.remote(host, port, i + 1, world, backend, self._sync_generation)
                 for i, w in enumerate(self.workers)]
        self.get(refs)
        self._sync_group_ready = True

    def save_checkpoint(self, ckpt_root: str, step: int, extra: dict, keep_last: int) -> str:
        # default backend: every rank holds the same state, rank 0 writes it; megatron: a collective (the
        # shards are gathered and one rank writes)
        # (distributed_optimizer: the optimizer state is gathered from every rank, rank 0 writes)
        savers = self.trainers if self.megatron or self.cfg.train.distributed_optimizer else [self.trainer]
        return self.get([t.save_checkpoint.remote(ckpt_root, step, extra, keep_last) for t in savers])[0]

    def load_checkpoint(self, path: str) -> dict:
        return self.get([t.load_checkpoint.remote(path) for t in self.trainers])[0]

    def shutdown(self) -> None:
        for actor in self.workers + self.trainers:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.workers = []
        if self._placement is not None:  # on a shared cluster the GPUs go back at once
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._placement)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            self._placement = None
        if self.cfg.ray.address is None and self._ray.is_initialized():
            self._ray.shutdown()


def resolve_weight_sync(cfg: DictConfig) -> str:
    """``rollout.weight_sync``: ``auto`` is CUDA IPC when trainer and engines share GPUs (ray.colocate on CUDA),
    a collective broadcast (NCCL) when they do not, and the object store on CPU."""
    mode = cfg.rollout.weight_sync
    if mode != "auto":
        return mode
    if cfg.run.device != "cuda":
        return "object_store"
    return "cuda_ipc" if cfg.ray.colocate else "collective"


class Placement(NamedTuple):
    num_gpus: int
    trainers: list[tuple[int, float]]  # (GPU bundle, share of that GPU) per trainer rank
    workers: list[tuple[int, float]]  # the same per rollout worker


def plan_placement(num_trainers: int, num_workers: int, colocate: bool) -> Placement:
    """Colocated: trainer rank g and rollout workers g, g + N, g + 2N, ... share GPU g (N trainer ranks), half of
    it for the trainer and the other half split evenly among its workers. Separate: the trainer ranks on the first
    N GPUs, one GPU per rollout worker after them. (Ray's shares schedule; they do not cap memory: the engine's KV
    cache is sized by rollout.gpu_memory_fraction, split among the engines of a GPU.)"""
    if colocate:
        per_gpu = -(-num_workers // num_trainers)
        return Placement(num_trainers, [(g, 0.5) for g in range(num_trainers)],
                         [(i % num_trainers, 0.5 / per_gpu) for i in range(num_workers)])
    return Placement(num_trainers + num_workers, [(g, 1.0) for g in range(num_trainers)],
                     [(num_trainers + i, 1.0) for i in range(num_workers)])


def make_placement(ray, num_gpus: int, cfg: DictConfig):
    """A placement group of ``num_gpus`` one-GPU bundles, packed; a clear error when the cluster has fewer."""
    from ray.util.placement_group import placement_group

    have = int(ray.cluster_resources().get("GPU", 0))
    if num_gpus > have:
        layout = ("train.num_gpus" if cfg.ray.colocate
                  else "train.num_gpus + rollout.num_workers (ray.colocate=false: one GPU per rollout worker)")
        raise RuntimeError(f"this run needs {num_gpus} GPUs ({layout}) but the Ray cluster has {have}; lower "
                           "train.num_gpus / rollout.num_workers, set ray.colocate=true, or add GPUs")
    pg = placement_group([{"GPU": 1}] * num_gpus, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    return pg


def trainer_kwargs(cfg: DictConfig) -> dict:
    t = cfg.train
    return dict(lr=t.lr, min_lr_ratio=t.min_lr_ratio, warmup_steps=t.warmup_steps, total_steps=t.steps,
                weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                max_grad_norm=t.max_grad_norm, micro_batch_size=t.micro_batch_size,
                logits_chunk_size=t.logits_chunk_size, ppo_epochs=t.ppo_epochs,
                clip_low=t.clip_low, clip_high=t.clip_high, dual_clip=t.dual_clip, entropy_coef=t.entropy_coef,
                loss_agg=t.loss_agg, kl_coef=t.kl_coef,
                kl_estimator=t.kl_estimator, temperature=cfg.rollout.temperature,
                max_response_length=cfg.rollout.max_tokens, on_nonfinite=t.on_nonfinite)


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
