"""Waiting on rollout workers (:class:`WorkerCalls`, a part of :class:`~.actors.ActorGroup`): gathering one call per
worker slot, replacing a worker that died or hung, and loading a replacement with the weights it needs.

With ``rollout.hang_timeout_s`` set, every wait on a rollout worker here is bounded by it: a generation call
(``generate``, ``run_episodes``), a weight-sync call (``load_weights``, ``load_weights_ipc``, ``sync_receive``,
the collective liveness check), and a replacement's first call (its start, which loads ``model.path``, and its
weight load). A call not answered within that many seconds of its submission is a hung worker's: the worker is
killed (``ray.kill``, no restart) and replaced as a dead one is, within ``rollout.max_restarts``, and its part is
done again from its keys, so a timeout only ever restarts, it never decides a number. The time a call waits for
the trainer (the weights it loads are the trainer's answer) is not the worker's: the weights are waited for
first, then the worker's call is submitted and timed.
"""
from __future__ import annotations

import time
from typing import Any

from .errors import RolloutWorkerLost, describe, is_actor_death, log

NODE_CHECK_S = 2.0  # while waiting on rollout workers: how often the nodes of the run are looked at
LOGS = "/tmp/ray/session_latest/logs"  # where a local Ray's worker logs are (a cluster's: on the worker's node)


class WorkerHung(TimeoutError):
    """A rollout worker's call took longer than ``rollout.hang_timeout_s``: it is replaced."""


def hung(i: int, call: str, waited: float, timeout: float) -> WorkerHung:
    """The error of rollout worker ``i`` whose ``call`` was not answered in ``waited`` seconds: it names the
    worker, the call, the timeout and the fix."""
    return WorkerHung(f"rollout worker {i}'s {call} call unanswered after {waited:.1f} s; raise "
                      f"rollout.hang_timeout_s (now {timeout:g}) if it legitimately takes that long, or look at the "
                      f"worker's log ({LOGS}, or RLREPRO_STACK_DUMP_S=60 for its stacks) for where it stopped")


def why(error: BaseException, limit: int = 600) -> str:
    """``describe(error)``; for an actor whose constructor raised, that exception (the last line of Ray's message,
    whose first lines name only the actor)."""
    if is_actor_death(error) and getattr(error, "actor_init_failed", False):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        if lines:
            out = f"its constructor raised {lines[-1]}"
            return out if len(out) <= limit else out[: limit - 3] + "..."
    return describe(error, limit)


class WorkerCalls:
    """The rollout-worker waits of :class:`~.actors.ActorGroup` (which provides ``_ray``, ``workers``,
    ``trainer``, ``sync``, ``_placements``, ``_new_worker``, ``_call``, ``check_nodes`` and the restart budget)."""
    hang_timeout_s = 0.0  # rollout.hang_timeout_s (0: off)

    def _replace_worker(self, i: int, error: BaseException, during: str, version: int,
                        weights_ref: Any = None, killed: bool = False) -> None:
        """Put a new worker in slot ``i``, holding the trainer's current weights as ``version`` (-1: the starting
        weights from the model directory; its first call, timed as any, then includes its start). Counts against
        the per-step budget; raises RolloutWorkerLost past it. A replacement that dies, or hangs in its start and
        weight load (``rollout.hang_timeout_s``), is replaced again, within the same budget. ``killed``: the
        caller has killed the worker in slot ``i`` already."""
        ray = self._ray
        while True:
            self._restarts_in_step += 1
            if self._restarts_in_step > self.max_restarts:
                raise RolloutWorkerLost(
                    f"rollout worker {i} was lost during {during}, and the {self.max_restarts} replacement(s) that "
                    f"rollout.max_restarts={self.max_restarts} allows per step are used up; last error: "
                    f"{why(error)}. Fix the cause (memory? the Ray logs under {LOGS} "
                    "say why the process ended) or raise rollout.max_restarts")
            self.restarts += 1
            redo = "its requests are re-run" if during in ("generate", "run_episodes") else "it gets the weights"
            log(f"rollout worker {i} lost during {during} ({why(error, 300)}); replacing it "
                f"({self._restarts_in_step}/{self.max_restarts} this step), {redo}")
            if not killed:
                try:
                    ray.kill(self.workers[i], no_restart=True)
                except Exception:  # noqa: BLE001 - it is gone already
                    pass
            killed = False
            self.workers[i] = self._new_worker(i)
            self.sync.worker_replaced()  # a collective weight-sync group is formed again, with the new worker
            if version < 0:
                return
            # the weights of `version`, not the trainer's newest: with rollout.max_staleness the trainer may have
            # trained the next step by the time a worker dies mid-generation (it keeps the version before)
            ref = weights_ref if weights_ref is not None else self.trainer.weights_of_version.remote(version)
            self._wait_for_trainer(ref, during)  # the trainer's time (a step it is training) is not the worker's
            call = "load_weights (a replacement's start and weight load)"
            try:
                got = self._wait_one(self._call(i, "load_weights", ref, version), during, i, call)
            except Exception as e:  # noqa: BLE001
                if not isinstance(e, WorkerHung) and not is_actor_death(e):
                    raise
                error = e
                continue
            if got != version:
                raise RuntimeError(f"replacement rollout worker {i} reports weight version {got}, expected {version}")
            return

    def _wait_for_trainer(self, ref: Any, during: str) -> None:
        """Wait until the trainer's call ``ref`` has answered (without fetching its value), looking at the run's
        nodes on the way; its error, if any, surfaces in the call that uses it."""
        while not self._ray.wait([ref], num_returns=1, timeout=NODE_CHECK_S if self._placements else None,
                                 fetch_local=False)[0]:
            self.check_nodes(during)

    def _wait_one(self, ref: Any, during: str, i: int | None = None, call: str = "") -> Any:
        """``ray.get(ref)`` of rollout worker ``i``'s ``call``, looking at the run's nodes while it waits (a
        replacement placed on a node that died would wait for ever); with rollout.hang_timeout_s, a
        :class:`WorkerHung` once that long has passed since now (the call's submission)."""
        ray, timeout = self._ray, self.hang_timeout_s if i is not None else 0.0
        started = time.monotonic()
        while True:
            wait_s = NODE_CHECK_S if self._placements else None
            if timeout:
                due = max(0.0, started + timeout - time.monotonic())
                wait_s = due if wait_s is None else min(wait_s, due)
            if ray.wait([ref], num_returns=1, timeout=wait_s)[0]:
                return ray.get(ref)
            self.check_nodes(during)
            waited = time.monotonic() - started
            if timeout and waited >= timeout:
                log(f"rollout worker {i} has not answered its {call} call in {waited:.1f} s during {during} "
                    f"(rollout.hang_timeout_s={timeout:g}): taken as hung, it is killed and replaced")
                raise hung(i, f"{call} ({during})", waited, timeout)

    def _gather(self, calls: dict[int, Any], resubmit, during: str, version: int, weights_ref: Any = None,
                hung_among=None) -> dict:
        """Wait for one call per worker slot; a slot whose worker died gets a replacement, then ``resubmit(i)``
        (a new call, or None when the replacement needs none). A call not answered within
        ``rollout.hang_timeout_s`` (when set) of its submission is a hung worker's: it is treated as dead, unless
        ``hung_among`` (late slots -> the hung ones among them; a collective broadcast's) says it only waits on
        one: its call is then given another timeout to end (it fails once the hung one is killed)."""
        ray = self._ray
        pending = {ref: i for i, ref in calls.items()}
        timeout = self.hang_timeout_s
        started = dict.fromkeys(pending, time.monotonic())  # when each call was submitted
        results: dict[int, Any] = {}

        def redo(i: int, error: BaseException, killed: bool = False) -> None:
            self._replace_worker(i, error, during, version, weights_ref, killed)
            new_ref = resubmit(i)
            if new_ref is None:
                results[i] = version
            else:
                pending[new_ref], started[new_ref] = i, time.monotonic()

        while pending:
            # a timeout here decides nothing but how often the nodes are looked at (a node that died takes its
            # actors with it, and a replacement placed in its bundle would wait for a node that is gone) and when
            # a worker is restarted (rollout.hang_timeout_s): results are put back by key, whoever computes them
            wait_s = NODE_CHECK_S if self._placements else None
            if timeout:
                due = min(started[ref] for ref in pending) + timeout - time.monotonic()
                wait_s = max(0.0, due if wait_s is None else min(wait_s, due))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready:
                self.check_nodes(during)
                now = time.monotonic()
                late = {r: now - started[r] for r in list(pending) if timeout and now - started[r] >= timeout}
                hung_slots = hung_among({pending[r] for r in late}) if late and hung_among else None
                for r in [r for r in late if hung_slots is not None and pending[r] not in hung_slots]:
                    log(f"rollout worker {pending[r]} has not answered its {during} call in {late.pop(r):.1f} s, "
                        "but it waits in the broadcast on a worker hung before it: not restarted")
                    started[r] = now
                late = {pending.pop(r): waited for r, waited in late.items()}
                for i, waited in late.items():  # all of them first: in a collective broadcast the others wait on
                    log(f"rollout worker {i} has not answered its {during} call in {waited:.1f} s "  # a hung one
                        f"(rollout.hang_timeout_s={timeout:g}): taken as hung, it is killed and replaced")
                    try:
                        ray.kill(self.workers[i], no_restart=True)
                    except Exception:  # noqa: BLE001 - gone already
                        pass
                for i, waited in late.items():
                    redo(i, hung(i, during, waited, timeout), killed=True)
                continue
            ref = ready[0]
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except Exception as e:  # noqa: BLE001
                if not is_actor_death(e):
                    raise
                self.check_nodes(during, e)
                redo(i, e)
        return results
