"""Test-only fault injection: the environment variable ``RLREPRO_FAULTS`` holds a JSON list of faults, each a
dict with ``kind`` and ``step`` (the GRPO step, 1-based). Each fault fires once per process. Production code never
imports this module unless ``RLREPRO_FAULTS`` is set (:func:`actor_group_class`).

==========================  =========================================================================================
kind                        what happens
==========================  =========================================================================================
``kill_worker``             ``at`` ``"generate"`` (after the step's requests are dealt), ``"sync"`` (after the
                            weights are sent) or ``"join"`` (``rollout.weight_sync=collective``: as the worker's
                            join of the weight-sync group is submitted, after the sync's liveness check):
                            rollout worker ``worker`` (default 0) is ended after ``delay_s``
                            (default 0) seconds, ``how`` ``"sigkill"`` (``os.kill`` of its pid, default) or
                            ``"ray_kill"``; ``times`` (default 1): also end that many - 1 of its replacements.
``hang_worker``             rollout worker ``worker`` (default 0) sleeps ``seconds`` (default 600) inside a call
                            before doing its work: a hung worker, alive but silent, for ``rollout.hang_timeout_s``
                            to find. ``at``: ``"generate"`` (default: its ``generate`` or ``run_episodes`` call of
                            that step), ``"sync"`` (its weight-sync call of the sync to version ``step``:
                            ``load_weights``, ``load_weights_ipc`` or ``sync_receive``; step 0 is the first sync)
                            or ``"join"`` (``rollout.weight_sync=collective``: its ``sync_group_join``).
                            ``times`` (default 1): also that many - 1 of its replacements hang, each in its first
                            call (its start and weight load: ``load_weights``, or the call that follows a start
                            without weights). Otherwise a replacement's call does not sleep (the fault fires once,
                            in the driver).
``nan_grad``                the trainer's gradient at that step is NaN (a hook on one parameter).
``hang_trainer``            the trainer's ``train_step`` call of that step sleeps ``seconds`` (default 3600) first: a
                            hung trainer, for ``train.call_timeout_s`` to find.
``checkpoint_enospc``       writing the checkpoint of that step fails with ``OSError(ENOSPC)`` after
                            ``after_files`` (default 2) of its files.
``crash_in_checkpoint``     while writing the checkpoint of that step, after ``after_files`` (default 2) files, the
                            driver process and the trainer are killed with SIGKILL (a partial checkpoint is left).
``sigterm``                 ``step`` 0 (set-up): the driver sends itself SIGTERM ``at`` ``"before_ray"`` (as the
                            actors are about to be made, before Ray starts), ``"ray_init"`` (inside ``ray.init``,
                            right after Ray installed its own SIGTERM handler) or ``"after_ray"`` (Ray is up, no
                            actor made yet).
==========================  =========================================================================================
"""
from __future__ import annotations

import errno
import json
import os
import signal
import threading
from typing import Any

from .actors import ActorGroup
from .workers import TrainerWorker

FAULTS_ENV = "RLREPRO_FAULTS"
KINDS = ("kill_worker", "hang_worker", "nan_grad", "checkpoint_enospc", "crash_in_checkpoint", "sigterm",
         "hang_trainer")
TRAINER_KINDS = ("nan_grad", "checkpoint_enospc", "crash_in_checkpoint", "hang_trainer")
# hang_worker's `at` -> the rollout-worker methods that sleep there
HANG_METHODS = {"generate": ("generate", "run_episodes"), "sync": ("load_weights", "load_weights_ipc", "sync_receive"),
                "join": ("sync_group_join",)}


class FaultPlan:
    """The faults named by ``RLREPRO_FAULTS`` (empty when unset). Picklable: the trainer actor gets a copy."""

    def __init__(self, faults: list[dict] | None = None, driver_pid: int | None = None) -> None:
        self.faults = [dict(f) for f in faults or []]
        for f in self.faults:
            if f.get("kind") not in KINDS or not isinstance(f.get("step"), int):
                raise ValueError(f"{FAULTS_ENV}: bad fault {f!r}; each needs 'kind' in {KINDS} and an integer 'step'")
            if f["kind"] == "hang_worker":  # no `at`: a generation call's hang (the fault's first meaning)
                f.setdefault("at", "generate")
                if f["at"] not in HANG_METHODS:
                    raise ValueError(f"{FAULTS_ENV}: bad fault {f!r}; a hang_worker's 'at' is one of "
                                     f"{tuple(HANG_METHODS)}")
        self.driver_pid = driver_pid if driver_pid is not None else os.getpid()
        self._fired: set[int] = set()

    @classmethod
    def from_env(cls) -> "FaultPlan":
        raw = os.environ.get(FAULTS_ENV, "").strip()
        if not raw:
            return cls()
        try:
            faults = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{FAULTS_ENV} is not JSON ({e}): {raw!r}") from None
        if isinstance(faults, dict):
            faults = [faults]
        return cls(faults)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def has_trainer_faults(self) -> bool:
        return any(f["kind"] in TRAINER_KINDS for f in self.faults)

    def take(self, kind: str, step: int, **match: Any) -> dict | None:
        """The first unfired fault of ``kind`` at ``step`` whose fields equal ``match``; marks it fired."""
        for i, f in enumerate(self.faults):
            if i in self._fired or f["kind"] != kind or f["step"] != step:
                continue
            if any(f.get(k, v) != v for k, v in match.items()):
                continue
            self._fired.add(i)
            return f
        return None


def sleep_then(worker, seconds: float, method: str, *args: Any) -> Any:
    """Run on a rollout worker through Ray's ``__ray_call__``: sleep ``seconds``, then its ``method(*args)``."""
    import time

    time.sleep(seconds)
    return getattr(worker, method)(*args)


def kill_actor_later(ray, actor, pid: int | None, how: str, delay_s: float) -> None:
    """End a rollout worker after ``delay_s`` seconds (on a timer thread, so the caller keeps waiting on it)."""

    def kill() -> None:
        try:
            if how == "ray_kill" or pid is None:
                ray.kill(actor, no_restart=True)
            else:
                os.kill(pid, signal.SIGKILL)
        except Exception:  # noqa: BLE001 - already gone
            pass

    if delay_s <= 0:
        kill()
    else:
        t = threading.Timer(delay_s, kill)
        t.daemon = True
        t.start()


class FaultyTrainerWorker(TrainerWorker):
    """A TrainerWorker that injects the trainer faults of a :class:`FaultPlan` (tests only)."""

    def __init__(self, *args, fault_plan: FaultPlan, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fault_plan = fault_plan

    def train_step(self, samples: list[dict], keep_previous: bool = False) -> dict:
        import torch

        step = self.trainer.step + 1
        hang = self.fault_plan.take("hang_trainer", step)
        if hang is not None:  # the step's call never answers (within the test's train.call_timeout_s)
            import time

            time.sleep(float(hang.get("seconds", 3600)))
        handle = None
        if self.fault_plan.take("nan_grad", step) is not None:
            param = next(p for _, p in sorted(self.model.named_parameters()) if p.requires_grad)
            handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))
        try:
            return super().train_step(samples, keep_previous=keep_previous)
        finally:
            if handle is not None:
                handle.remove()

    def save_checkpoint(self, ckpt_root: str, step: int, extra_state: dict, keep_last: int) -> str:
        from rlrepro.trainer import checkpoint as ckpt_mod

        fault = (self.fault_plan.take("checkpoint_enospc", step)
                 or self.fault_plan.take("crash_in_checkpoint", step))
        if fault is None:
            return super().save_checkpoint(ckpt_root, step, extra_state, keep_last)
        original = ckpt_mod._write_file
        budget = [int(fault.get("after_files", 2))]
        driver_pid = self.fault_plan.driver_pid

        def faulty_write(path, write):
            if budget[0] <= 0:
                if fault["kind"] == "checkpoint_enospc":
                    with open(path, "wb") as f:  # a partial file, as a full disk leaves
                        f.write(b"\0" * 16)
                    raise OSError(errno.ENOSPC, f"No space left on device (injected): {path}")
                os.kill(driver_pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            budget[0] -= 1
            return original(path, write)

        ckpt_mod._write_file = faulty_write
        try:
            return super().save_checkpoint(ckpt_root, step, extra_state, keep_last)
        finally:
            ckpt_mod._write_file = original


def trainer_actor_class(plan: FaultPlan):
    """``TrainerWorker``, or its fault-injecting subclass when ``plan`` holds trainer faults."""
    return FaultyTrainerWorker if plan.has_trainer_faults() else TrainerWorker


class FaultInjectingActorGroup(ActorGroup):
    """An :class:`ActorGroup` whose rollout workers are killed as the plan's ``kill_worker`` faults say, and hang
    as its ``hang_worker`` faults say."""

    def __init__(self, cfg, model_dir: str, fault_plan: FaultPlan) -> None:
        self.fault_plan = fault_plan
        self._active_kills: list[dict] = []
        self._active_hangs: dict[int, dict] = {}  # slot -> {at, seconds, left}: its next call at `at` sleeps
        self._replacement_hangs: dict[int, tuple[float, int]] = {}  # slot -> (seconds, left): its next new worker
        self._first_call_hangs: dict[int, tuple[float, int]] = {}  # slot -> (seconds, left): that worker's 1st call
        self._sigterm_at("before_ray")
        if self.fault_plan.take("sigterm", 0, at="ray_init") is None:
            super().__init__(cfg, model_dir)
            return
        from .ray_start import prepare_ray_env

        prepare_ray_env(cfg.ray.address)  # what start_ray sets before its import of ray, so nothing differs
        import ray._private.utils as ray_utils

        original = ray_utils.set_sigterm_handler

        def then_sigterm(handler) -> None:  # ray.init installs its handler first thing: the signal comes next
            ray_utils.set_sigterm_handler = original
            original(handler)
            os.kill(os.getpid(), signal.SIGTERM)

        ray_utils.set_sigterm_handler = then_sigterm
        try:
            super().__init__(cfg, model_dir)
        finally:
            ray_utils.set_sigterm_handler = original

    def _sigterm_at(self, at: str) -> None:
        if self.fault_plan.take("sigterm", 0, at=at) is not None:
            os.kill(os.getpid(), signal.SIGTERM)

    def _start(self, cfg, model_dir: str) -> None:
        self._sigterm_at("after_ray")
        super()._start(cfg, model_dir)

    def _trainer_actor(self):
        extra = {"fault_plan": self.fault_plan} if self.fault_plan.has_trainer_faults() else {}
        return trainer_actor_class(self.fault_plan), extra

    def _call(self, i: int, method: str, *args: Any):
        """``self.workers[i].<method>.remote(*args)``, then the worker is ended if a kill_worker fault says so."""
        actor = self.workers[i]
        join = method == "sync_group_join"  # only an at="join" fault ends a worker at its join, and only there
        fault = next((f for f in self._active_kills
                      if f["worker"] == i and f["left"] > 0 and (f["at"] == "join") == join), None)
        pid = None
        if fault is not None and fault["how"] == "sigkill":
            pid = self.get(actor.pid.remote())  # before the work: an actor runs one call at a time
        seconds = self._hang_of(i, method)
        if seconds is not None:
            ref = actor.__ray_call__.remote(sleep_then, seconds, method, *args)
        else:
            ref = getattr(actor, method).remote(*args)
        if fault is not None:
            fault["left"] -= 1
            kill_actor_later(self._ray, actor, pid, fault["how"], fault["delay_s"])
        return ref

    def _hang_of(self, i: int, method: str) -> float | None:
        """The seconds call ``method`` of slot ``i`` sleeps (a hang_worker fault), or None; its replacements' first
        calls hang too while the fault's ``times`` lasts."""
        if i in self._first_call_hangs:  # a replacement's first call: its start and weight load
            seconds, left = self._first_call_hangs.pop(i)
        elif i in self._active_hangs and method in HANG_METHODS[self._active_hangs[i]["at"]]:
            hang = self._active_hangs.pop(i)
            seconds, left = hang["seconds"], hang["left"]
        else:
            return None
        if left > 1:
            self._replacement_hangs[i] = (seconds, left - 1)
        return seconds

    def _new_worker(self, i: int):
        if i in self._replacement_hangs:
            self._first_call_hangs[i] = self._replacement_hangs.pop(i)
        return super()._new_worker(i)

    def _before(self, at: str, step: int) -> None:
        """The kill_worker and hang_worker faults of this call; ``times`` counts the worker and its replacements."""
        # a hang of a slot that got no call of its kind at its step lapses
        self._active_hangs = {i: h for i, h in self._active_hangs.items() if h["at"] != at}
        for i in range(len(self.workers)):
            hang = self.fault_plan.take("hang_worker", step, at=at, worker=i)
            if hang is not None:
                self._active_hangs[i] = {"at": at, "seconds": float(hang.get("seconds", 600.0)),
                                         "left": int(hang.get("times", 1))}
            f = self.fault_plan.take("kill_worker", step, at=at, worker=i)
            if f is not None:
                self._active_kills.append({"worker": i, "left": int(f.get("times", 1)), "at": at,
                                           "how": f.get("how", "sigkill"), "delay_s": float(f.get("delay_s", 0.0))})

