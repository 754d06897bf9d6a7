"""The Ray actors of one run (:class:`ActorGroup`): the rollout workers and the trainer ranks, where they are
placed, how requests are dealt to workers and results gathered, and how workers that die are replaced.

Ray is imported here, in :mod:`.ray_start` (starting or joining it), :mod:`.errors` (recognising its failures),
:mod:`.workers` (the node address) and :mod:`.fault_injection`: all inside ``rlrepro.orchestration``, the only
package that may import it (an import-linter contract, docs/DESIGN.md).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from .errors import RolloutWorkerLost, TrainerHung, describe, is_actor_death, log
from .placement import (NODE_ID_LABEL, Layout, Placement, PlacementError, check_capacity,  # noqa: F401
                        nodes_from_ray, plan_layout, plan_placement, shown_resource, uses_placement_groups)
from .ray_start import is_local, start_ray
from .weight_sync import GROUP_TIMEOUT_S, WEIGHT_SYNC_MODES, resolve_weight_sync
from .worker_calls import NODE_CHECK_S, WorkerCalls, WorkerHung, why as _why  # noqa: F401
from .workers import Request, RolloutWorker, TrainerWorker

# after a collective weight sync broke: how long the driver waits for every member's call to end. A member's
# receive or send fails by the group's timeout at the latest (its peer gone); one that has not answered a minute
# after that is hung (a stopped process, a node cut off), and the driver stops instead of waiting for ever
BROKEN_SYNC_WAIT_S = GROUP_TIMEOUT_S + 60.0


def actor_env_vars(cfg) -> dict[str, str]:
    """Environment variables the actors get through Ray's ``runtime_env``: on a cluster (``ray.address`` set) the
    driver's ``PYTHONHASHSEED`` (pinned to 0 by the CLI), since a node's workers start from ``ray start``'s
    environment and an episode's reward (``reward.fn``, scored on the rollout workers) may iterate a set; and the
    network interface of ``ray.network_interface``. A local run's actors inherit the driver's environment."""
    import os

    env = {}
    if not is_local(cfg.ray.address):
        env["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
    if cfg.ray.network_interface:  # the interface the actors' gloo / NCCL groups use on a cluster (.network)
        from .network import NETWORK_INTERFACE_ENV

        env[NETWORK_INTERFACE_ENV] = cfg.ray.network_interface
    return env


class ActorGroup(WorkerCalls):
    """The rollout workers and the trainer ranks of one run.

    A rollout worker that dies (its process killed, its actor lost) during ``generate`` or ``sync_weights`` is
    replaced: a new actor, loaded with the trainer's current weights under the current version, gets the dead
    one's unfinished requests again. Requests are pure functions of their keys, so the results are the ones the
    dead worker would have returned. With ``rollout.hang_timeout_s`` a worker whose call (generation, weight sync
    or its join, a replacement's start and weight load) has not answered in that many seconds is taken as hung:
    killed and replaced the same way (a timeout only restarts, it never decides a number; :mod:`.worker_calls`).
    At most ``rollout.max_restarts`` replacements per step (counted from the
    step's ``generate``); then :class:`~.errors.RolloutWorkerLost`. The trainer is not replaced: its state is the
    run's state, and a run whose trainer died resumes from its last checkpoint (``run.resume=true``).
    """
    _owns_ray = False  # whether this group started the (local) Ray it runs on: only then does shutdown stop it
    call_timeout_s: float | None = None  # train.call_timeout_s: the bound on a trainer call (None: none)

    def __init__(self, cfg, model_dir: str) -> None:
        """``cfg``: the run's typed config (:class:`~.config.RunSchema`)."""
        self.cfg = cfg
        self.workers: list = []
        self.trainers: list = []
        self._placements: list = []
        # before anything imports ray: it reads its settings then. A Ray the caller had initialised is not ours
        # to shut down (False); a local one this call started is (and a joined cluster is left as it is)
        self._owns_ray = start_ray(cfg.ray.address, cfg.ray.num_cpus) and is_local(cfg.ray.address)
        import ray

        self._ray = ray
        try:
            self._start(cfg, model_dir)
        except BaseException:  # the actors, placement groups and local Ray started so far go too: the caller
            self.shutdown()  # has no group to shut down
            raise

    def _start(self, cfg, model_dir: str) -> None:
        ray = self._ray
        self.max_restarts = cfg.rollout.max_restarts
        self.hang_timeout_s = float(cfg.rollout.hang_timeout_s)
        self.call_timeout_s = cfg.train.call_timeout_s
        self.restarts = 0  # replacements over the whole run
        self._restarts_in_step = 0
        on_gpu = cfg.run.device == "cuda"
        nw, nt = cfg.rollout.num_workers, cfg.train.num_gpus
        self.sync = WEIGHT_SYNC_MODES[resolve_weight_sync(cfg.rollout.weight_sync, cfg.run.device,
                                                          cfg.ray.colocate)]()
        engine_config = cfg.rollout.engine
        if cfg.ray.colocate:  # the engines of one GPU split its KV-cache share
            engine_config = dataclasses.replace(
                engine_config, gpu_memory_fraction=engine_config.gpu_memory_fraction / -(-nw // nt))
        common = dict(device=cfg.run.device, dtype=cfg.model.dtype, deterministic=cfg.run.deterministic)
        # Placement (rlrepro/orchestration/placement.py): Ray placement groups on CUDA and on a cluster, checked
        # against the cluster's nodes first; a local CPU run with the default keys keeps plain actors.
        self.layout = None
        self.worker_gpu = [i % nt for i in range(nw)] if on_gpu and cfg.ray.colocate else []  # rank sharing a GPU
        if uses_placement_groups(cfg.run.device, is_local(cfg.ray.address), cfg.ray.placement, cfg.ray.trainer_node,
                                 cfg.ray.rollout_node):
            self.layout = run_layout(cfg)
            self._placements = make_placement_groups(ray, self.layout, cfg)
            self._worker_options = [self._in_bundle(g, b, share) for g, b, share in self.layout.workers]
            trainer_options = [self._in_bundle(g, b, share) for g, b, share in self.layout.trainers]
        else:
            if cfg.ray.num_nodes:  # plain actors on the one local node: ray.num_nodes is checked all the same
                check_capacity(Layout(cfg.ray.placement), nodes_from_ray(ray), num_nodes=cfg.ray.num_nodes,
                               what=_layout_words(cfg))
            self._worker_options = [dict(num_gpus=0)] * nw
            trainer_options = [dict(num_gpus=0)] * nt
        self._held_nodes = self.actors_by_node()  # fixed at start: a node lost later is named with its actors
        env_vars = actor_env_vars(cfg)
        if env_vars:
            env = {"env_vars": env_vars}
            self._worker_options = [dict(o, runtime_env=env) for o in self._worker_options]
            trainer_options = [dict(o, runtime_env=env) for o in trainer_options]
        self._worker_cls = ray.remote(num_cpus=0, max_restarts=0)(RolloutWorker)
        self.megatron = cfg.train.backend == "megatron"
        tp_emulation = cfg.train.engine_tp_emulation  # the trainer's reduction pieces: TP, or train.tp_partials
        self._worker_args = (model_dir, engine_config), dict(seed=cfg.run.seed, tensor_parallel_emulation=tp_emulation,
                                                              **common)
        for i in range(nw):  # one at a time: those made before a failure are shut down
            self.workers.append(self._new_worker(i))
        trainer_class, extra = self._trainer_actor()
        trainer_cls = ray.remote(num_cpus=0)(trainer_class)
        for g in range(nt):
            self.trainers.append(trainer_cls.options(**trainer_options[g]).remote(
                model_dir, cfg.train, temperature=cfg.rollout.temperature, max_response_length=cfg.rollout.max_tokens,
                rank=g, world_size=nt, checkpoint_format=cfg.checkpoint.format, **common, **extra))
        self.trainer = self.trainers[0]  # rank 0: weights, digests and checkpoints come from it
        if nt > 1 or self.megatron:
            host, port = self.get(self.trainer.rendezvous_address.remote())
            self.get([t.init_data_parallel.remote(host, port) for t in self.trainers])
        self.weight_version = -1

    # ---------------------------------------------------------------------- hooks (fault_injection overrides)
    def _trainer_actor(self) -> tuple[type, dict]:
        """The trainer actor class and extra constructor arguments."""
        return TrainerWorker, {}

    def _call(self, i: int, method: str, *args: Any):
        """``self.workers[i].<method>.remote(*args)``."""
        return getattr(self.workers[i], method).remote(*args)

    def _before(self, at: str, step: int) -> None:
        """Called before the work of ``generate`` (``at="generate"``) and ``sync_weights`` (``"sync"``)."""

    def _in_bundle(self, group: int, bundle: int, gpus: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._placements[group], placement_group_bundle_index=bundle))

    def get(self, refs: Any, what: str = "a call") -> Any:
        """The trainer actors' answers to ``refs`` (``what``: the call, for the error), within
        ``train.call_timeout_s`` when set: past it :class:`TrainerHung`, the trainer actors killed."""
        timeout = self.call_timeout_s
        try:
            return self._ray.get(refs, timeout=timeout) if timeout else self._ray.get(refs)
        except Exception as e:  # noqa: BLE001
            if is_actor_death(e):
                self.check_nodes("a trainer call", e)
            if timeout and _is_get_timeout(e):
                for actor in self.trainers:
                    try:
                        self._ray.kill(actor)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
                raise TrainerHung(f"the trainer has not answered {what} in {timeout:g} s (train.call_timeout_s): "
                                  "it is taken as hung and was stopped. Fix: find why (RLREPRO_STACK_DUMP_S=60 prints "
                                  "its stacks), or raise train.call_timeout_s if the call legitimately takes longer "
                                  "(it is bit-neutral: a resume may change it)") from None
            raise

    # ---------------------------------------------------------------------------------------- nodes (cluster)
    def _bundle_nodes(self) -> dict[tuple[int, int], str]:
        """(group, bundle) -> the id of the node Ray placed that bundle on."""
        from ray.util.placement_group import placement_group_table

        out = {}
        for g, pg in enumerate(self._placements):
            for b, node in placement_group_table(pg).get("bundles_to_node_id", {}).items():
                out[(g, int(b))] = node
        return out

    def actors_by_node(self) -> dict[str, list[str]]:
        """Node id -> the actors of this run placed there ("trainer rank 0", "rollout worker 1")."""
        if self.layout is None:
            return {}
        nodes = self._bundle_nodes()
        out: dict[str, list[str]] = {}
        for what, places in (("trainer rank", self.layout.trainers), ("rollout worker", self.layout.workers)):
            for i, (g, b, _) in enumerate(places):
                if (g, b) in nodes:
                    out.setdefault(nodes[(g, b)], []).append(f"{what} {i}")
        return out

    def check_nodes(self, during: str, error: BaseException | None = None) -> None:
        """Raise :class:`NodeLost` when a node that holds actors of this run is no longer alive."""
        if not self._placements:
            return
        ray = self._ray
        try:
            alive = {n["NodeID"]: n for n in ray.nodes()}
            held = getattr(self, "_held_nodes", {})
        except Exception:  # noqa: BLE001 - the GCS itself unreachable: the caller's error stands
            return
        lost = [(node, actors) for node, actors in held.items() if not alive.get(node, {}).get("Alive", False)]
        if not lost:
            return
        words = "; ".join(f"node {node[:8]} ({alive.get(node, {}).get('NodeManagerAddress', 'address unknown')}) "
                          f"held {', '.join(actors)}" for node, actors in lost)
        cause = f" (first error: {describe(error, 200)})" if error is not None else ""
        raise NodeLost(f"{len(lost)} Ray node(s) of this run left the cluster during {during}: {words}{cause}. "
                       f"Bring the node back (or another that the layout fits: {_layout_words(self.cfg)}) before "
                       "resuming")

    def cluster_info(self) -> dict:
        """What the run ran on, for inputs.json (informational: placement never changes a bit): the number of
        alive nodes, the placement, and per node of the run its address, hostname, CPU/GPU count and actors."""
        ray = self._ray
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        held = self._held_nodes if self._placements else {}
        if not held:  # plain actors (local CPU run): they are all on the one node
            held = {next(iter(nodes), "?"): [f"trainer rank {g}" for g in range(len(self.trainers))]
                    + [f"rollout worker {i}" for i in range(self.cfg.rollout.num_workers)]}
        per_node = []
        for node, actors in held.items():
            info = nodes.get(node, {})
            res = info.get("Resources") or {}
            per_node.append({"address": info.get("NodeManagerAddress"), "hostname": info.get("NodeManagerHostname"),
                             "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0), "actors": actors,
                             "resources": sorted(k for k in res if k not in ("CPU", "GPU") and shown_resource(k))})
        per_node.sort(key=lambda n: n["actors"])
        return {"num_nodes": len(nodes), "placement": self.cfg.ray.placement if self._placements else "local",
                "nodes": per_node}

    # ------------------------------------------------------------------------------------ rollout workers
    def _new_worker(self, i: int):
        args, kwargs = self._worker_args
        return self._worker_cls.options(**self._worker_options[i]).remote(*args, **kwargs)

    def generate(self, requests: list[Request]) -> list[tuple[tuple[str, int], Any]]:
        """Deal requests to workers by position (request i to worker i mod W); gather in any order. Returns
        ``(key, RequestOutput)`` pairs in worker order (the caller sorts by key). A worker that dies is replaced
        and its part re-run (see the class docstring)."""
        nw = len(self.workers)
        parts = {i: requests[i::nw] for i in range(nw) if requests[i::nw]}
        self._restarts_in_step = 0
        self._before("generate", self.weight_version + 1)  # step k generates with the weights of version k-1
        calls = {i: self._call(i, "generate", part) for i, part in parts.items()}
        results = self._gather(calls, lambda i: self._call(i, "generate", parts[i]), "generate",
                               self.weight_version)
        return [(req.key, out) for i in sorted(results) for req, out in zip(parts[i], results[i])]

    def run_episodes(self, requests: list, env_config, reward_fn_spec: str, *, max_tokens: int | None = None,
                     use_chat_template: bool = True, tool_threads: int = 2, reward_on_error: str = "raise",
                     import_dirs: list[str] | None = None, end_of_turn: str | None = None) -> list:
        """Multi-turn episodes (:class:`~.episodes.EpisodeRequest` objects), dealt to workers by position as
        :meth:`generate` deals requests; returns the :class:`~.episodes.EpisodeResult` objects sorted by key
        (``end_of_turn``: the chat template's end-of-turn token, :meth:`RolloutWorker.run_episodes`). A
        worker that dies is replaced and its episodes re-run from their keys (an episode is a pure function of its
        request and the weights, so the results are the ones the dead worker would have returned). Fault
        injection sees this as a ``generate``."""
        nw = len(self.workers)
        parts = {i: requests[i::nw] for i in range(nw) if requests[i::nw]}
        self._restarts_in_step = 0
        self._before("generate", self.weight_version + 1)
        args = (env_config, reward_fn_spec, max_tokens, use_chat_template, tool_threads, reward_on_error, import_dirs,
                end_of_turn)
        calls = {i: self._call(i, "run_episodes", part, *args) for i, part in parts.items()}
        results = self._gather(calls, lambda i: self._call(i, "run_episodes", parts[i], *args), "run_episodes",
                               self.weight_version)
        return sorted((r for i in sorted(results) for r in results[i]), key=lambda r: r.key)

    def train_step(self, samples: list) -> dict:
        """Every trainer rank gets the whole batch (it computes its own micro-batches of it); rank 0 reports.
        With rollout.max_staleness > 0 rank 0 keeps the weights from before the update (a CPU copy) until the
        next step: a rollout worker replaced while the next batch is generated gets them."""
        ref = self._ray.put(samples)
        keep = bool(self.cfg.rollout.max_staleness)
        return self.get([t.train_step.remote(ref, keep_previous=keep and g == 0)
                         for g, t in enumerate(self.trainers)], "its train_step call")[0]

    def warm_start(self, examples, **kw) -> list[float]:
        ref = self._ray.put(examples)
        return self.get([t.warm_start.remote(ref, **kw) for t in self.trainers], "its warm_start call")[0]

    def memory_stats(self) -> dict:
        """Peak GPU memory (GiB) of each actor since the last call: ``trainer{g}`` and ``worker{i}``."""
        refs = {f"trainer{g}": t.memory_stats.remote() for g, t in enumerate(self.trainers)}
        worker_refs = {f"worker{i}": w.memory_stats.remote() for i, w in enumerate(self.workers)}
        out = {name: self.get(ref) for name, ref in refs.items()}
        timeout = self.hang_timeout_s
        started = time.monotonic()
        for name, ref in worker_refs.items():
            try:  # bounded by rollout.hang_timeout_s (from the calls' submission) when it is set
                out[name] = (self._ray.get(ref, timeout=max(0.0, started + timeout - time.monotonic()))
                             if timeout else self._ray.get(ref))
            except Exception as e:  # noqa: BLE001
                # a worker that died after its part of the step (killed between phases), or hung: its peak is not
                # known, and the next generate or weight sync replaces it (the only place a death or a hang is
                # handled); a perf figure must not end the run
                if not is_actor_death(e) and not _is_get_timeout(e):
                    raise
                if _is_get_timeout(e):
                    log(f"rollout {name.replace('worker', 'worker ')} has not answered its memory_stats call in "
                        f"{timeout:g} s (rollout.hang_timeout_s): its peak memory is left out, and its next call "
                        "(weight sync or generate) replaces it if it is hung")
        return out

    def sync_weights(self, version: int) -> str:
        """Trainer -> every worker, by the ``rollout.weight_sync`` strategy (:mod:`.weight_sync`); returns the
        digest of the weights sent. Each worker reports the version it now holds and a mismatch is an error,
        never a silent stale policy."""
        digest = self.trainer.weights_digest.remote()
        self._before("sync", version)
        collective = self.sync.name == "collective"
        if collective:  # a worker dead since its last call would hold the group's rendezvous until its timeout
            self._gather({i: w.pid.remote() for i, w in enumerate(self.workers)}, lambda i: None, "weight sync",
                         version)
        calls, weights_ref, trainer_ref = self.sync.send(self, version)  # the trainer's part awaited first
        actors = list(self.workers)  # the ones called (a slot replaced during the wait gets another)
        try:
            got = self._gather(calls, lambda i: None, "weight sync", version, weights_ref,
                               self.sync.hung_among if collective else None)
            if trainer_ref is not None:
                self.get(trainer_ref)
        except RolloutWorkerLost:
            raise
        except Exception:  # noqa: BLE001
            if not collective:
                raise
            got = self._after_broken_collective(calls, trainer_ref, version, actors)
        versions = [got[i] for i in range(len(self.workers))]
        if any(v != version for v in versions):
            raise RuntimeError(f"weight sync to version {version} failed: workers report {versions}")
        self.weight_version = version
        return self.get(digest)

    def _after_broken_collective(self, calls: dict, trainer_ref: Any, version: int, actors: list | None = None) -> dict:
        """A collective weight sync failed. When a worker died in it (the others' calls then fail at once: the
        trainer closes the group), every worker loads ``version`` from the object store instead, a replacement for
        the dead; the group is formed again at the next sync. Otherwise the error stands."""
        ray = self._ray
        self.sync.worker_replaced()  # the group is closed on one side at least
        refs = [trainer_ref, *calls.values()]
        self._wait_all_or_name_the_hung(refs, {trainer_ref: "the trainer (rank 0)", **{
            ref: f"rollout worker {i}" for i, ref in calls.items()}}, version,
            {ref: (i, (actors or self.workers)[i]) for i, ref in calls.items()})
        errors = []
        for ref in refs:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001
                errors.append((ref, e))
        died = [e for ref, e in errors if ref is not trainer_ref and is_actor_death(e)]
        if not died:  # a worker's refusal says why (the trainer's error only that a worker refused)
            from .weight_sync import WeightsRefused
            refused = [e for ref, e in errors if ref is not trainer_ref and isinstance(e, WeightsRefused)]
            raise (refused or [e for _, e in errors] or [RuntimeError(f"weight sync to version {version} failed")])[0]
        log(f"a rollout worker died during the collective weight sync to version {version} "
            f"({describe(died[0], 200)}); every worker loads it from the object store instead")
        ref = self.trainer.weights_of_version.remote(version)
        loads = {i: self._call(i, "load_weights", ref, version) for i in range(len(self.workers))}
        return self._gather(loads, lambda i: None, "weight sync", version, ref)

    def _wait_all_or_name_the_hung(self, refs: list, names: dict, version: int,
                                   workers: dict | None = None) -> None:
        """Wait for every call of ``refs`` to end, at most ``BROKEN_SYNC_WAIT_S`` (looking at the run's nodes on
        the way); a TimeoutError naming the members (``names``: ref -> words) that did not answer. With
        rollout.hang_timeout_s, a rollout worker's call (``workers``: ref -> (slot, actor)) still running that long
        after the wait began is a hung worker's: the worker is killed (its call then ends as a death, and the reload
        that follows replaces it); only a trainer that does not answer is left to the error."""
        ray = self._ray
        start = time.monotonic()
        deadline = start + BROKEN_SYNC_WAIT_S
        hang_at = start + self.hang_timeout_s if self.hang_timeout_s and workers else None
        pending = list(refs)
        while pending:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                break
            if hang_at is not None and now >= hang_at:
                for ref in [r for r in pending if r in workers]:
                    i, actor = workers[ref]
                    log(f"rollout worker {i} has not answered its weight sync call in {now - start:.1f} s after the "
                        f"collective broadcast broke (rollout.hang_timeout_s={self.hang_timeout_s:g}): taken as "
                        "hung, it is killed and replaced")
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: BLE001 - gone already
                        pass
                hang_at = None
            wait_s = min(left, NODE_CHECK_S) if hang_at is None else max(0.0, min(left, NODE_CHECK_S, hang_at - now))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            if pending:
                self.check_nodes("the broken collective weight sync")
        if pending:
            hung = ", ".join(names.get(ref, "a member") for ref in pending)
            raise TimeoutError(
                f"weight sync to version {version}: the collective broadcast broke, and {hung} did not answer "
                f"within {BROKEN_SYNC_WAIT_S:.0f} s (the group's {GROUP_TIMEOUT_S:.0f} s timeout plus a margin): "
                "the process is hung (stopped, or its node cut off), not dead. Look at its stack (py-spy dump, "
                "or RLREPRO_STACK_DUMP_S=60 for every actor's), end it, and resume the run from its last "
                "checkpoint (run.resume=true); rollout.weight_sync=object_store avoids the collective group")

    def optimizer_state_digest(self) -> str | None:
        """``optimizer_state_digest`` of the trainer's optimizer state (float32 masters, AdamW moments): rank 0's,
        or with train.distributed_optimizer every rank's share merged; None when not fingerprinted (megatron)."""
        from rlrepro.repro.fingerprint import optimizer_state_digest

        ranks = self.trainers if self.cfg.train.distributed_optimizer else [self.trainer]
        shares = self.get([t.optimizer_state_digests.remote() for t in ranks])
        if any(share is None for share in shares):
            return None
        return optimizer_state_digest({name: d for share in shares for name, d in share.items()})

    def save_checkpoint(self, ckpt_root: str, step: int, extra: dict, keep_last: int) -> str:
        # default backend: every rank holds the same state, rank 0 writes it; megatron: a collective (the
        # shards are gathered and one rank writes)
        # (distributed_optimizer: the optimizer state is gathered from every rank, rank 0 writes)
        savers = self.trainers if self.megatron or self.cfg.train.distributed_optimizer else [self.trainer]
        return self.get([t.save_checkpoint.remote(ckpt_root, step, extra, keep_last) for t in savers],
                        "its save_checkpoint call")[0]

    def load_checkpoint(self, path: str) -> dict:
        return self.get([t.load_checkpoint.remote(path) for t in self.trainers], "its load_checkpoint call")[0]

    def export_hf(self, path: str) -> str:
        """The policy as an HF directory in ``path`` (rlrepro.orchestration.export); megatron: every rank (a
        collective), else rank 0 (every rank holds the same weights)."""
        savers = self.trainers if self.megatron else [self.trainer]
        return self.get([t.export_hf.remote(path) for t in savers], "its export_hf call")[0]

    def abandon_generation(self) -> None:
        """The run is ending while a driver thread may still be generating (Ctrl-C during a pipelined step): end the
        rollout workers and replace none from now on, so that the thread's generate fails at once
        (``RolloutWorkerLost``) instead of starting new actors; the trainers stay for the interrupt's checkpoint."""
        self.max_restarts = 0
        for worker in list(self.workers):
            try:
                self._ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def shutdown(self) -> None:
        for actor in self.workers + self.trainers:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.workers = []
        for pg in self._placements:  # on a shared cluster the GPUs go back at once
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._placements = []
        # only a Ray this group started ("local" and "" start one too); a caller's Ray stays up for the caller
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False


def _is_get_timeout(error: BaseException) -> bool:
    """Ray's ``GetTimeoutError`` (a ``ray.get`` with a timeout that ran out)."""
    from ray.exceptions import GetTimeoutError

    return isinstance(error, GetTimeoutError)


class NodeLost(RolloutWorkerLost):
    """A Ray node that held actors of this run left the cluster (its raylet died, the machine went away). The run
    stops naming the node and the actors it held; the checkpoint of the last completed step is written first
    (when the trainer survived), and ``run.resume=true`` continues identically once the cluster holds the layout
    again."""


def run_layout(cfg) -> Layout:
    """The placement groups of the run ``cfg`` asks for (:func:`.placement.plan_layout`)."""
    return plan_layout(num_trainers=cfg.train.num_gpus, num_workers=cfg.rollout.num_workers,
                       tensor_parallel=cfg.train.tensor_parallel if cfg.train.backend == "megatron" else 1,
                       device=cfg.run.device, colocate=cfg.ray.colocate, placement=cfg.ray.placement,
                       trainer_node=cfg.ray.trainer_node, rollout_node=cfg.ray.rollout_node)


def _layout_words(cfg) -> str:
    r = cfg.ray
    words = [f"ray.placement={r.placement}", f"train.num_gpus={cfg.train.num_gpus}",
             f"rollout.num_workers={cfg.rollout.num_workers}", f"run.device={cfg.run.device}"]
    if cfg.run.device == "cuda":
        words.append(f"ray.colocate={r.colocate}")
    words += [f"ray.{k}={getattr(r, k)}" for k in ("trainer_node", "rollout_node") if getattr(r, k)]
    if cfg.train.backend == "megatron" and cfg.train.tensor_parallel > 1:
        words.append(f"train.tensor_parallel={cfg.train.tensor_parallel}")
    return ", ".join(words)


def make_placement_groups(ray, layout: Layout, cfg, timeout_s: float = 300.0) -> list:
    """The layout's placement groups, in order, once the cluster's nodes are checked to hold it (a
    :class:`~.placement.PlacementError` naming what is missing, before any actor starts). ``split``: the engines'
    group excludes the nodes the trainer's groups landed on (Ray's node-id label)."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    check_capacity(layout, nodes_from_ray(ray), num_nodes=cfg.ray.num_nodes, what=_layout_words(cfg))
    groups, trainer_nodes = [], set()
    try:
        for i, g in enumerate(layout.groups):
            kwargs = {}
            if g.exclude_trainer_nodes:
                kwargs["bundle_label_selector"] = [{NODE_ID_LABEL: "!in(" + ",".join(sorted(trainer_nodes)) + ")"}
                                                   for _ in g.bundles]
            try:
                pg = placement_group(g.bundles, strategy=g.strategy, name=f"rlrepro-{g.role}-{i}", **kwargs)
            except TypeError as e:  # a Ray without bundle label selectors
                raise PlacementError(f"ray.placement=split needs a Ray with placement-group label selectors (this "
                                     f"is {ray.__version__}: {e}); name the nodes with ray.trainer_node / "
                                     "ray.rollout_node and ray.placement=pack instead") from None
            groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - GetTimeoutError: the resources exist but are taken
                raise PlacementError(
                    f"the placement group for {', '.join(g.members)} ({g.strategy}, bundles {g.bundles}) was not "
                    f"ready after {timeout_s:.0f} s ({describe(e, 200)}), although the cluster's nodes could hold "
                    f"it: its resources are in use (other jobs?). Available now: {ray.available_resources()}") from None
            if g.role == "trainer":
                trainer_nodes.update(placement_group_table(pg)["bundles_to_node_id"].values())
    except BaseException:
        for pg in groups:
            remove_placement_group(pg)
        raise
    return groups
