"""The errors a run stops with, and how Ray's failures are recognised.

Policies (docs/RELIABILITY.md has the table of faults tried):

- A rollout worker that dies is replaced by :class:`~rlrepro.orchestration.actors.ActorGroup` (new actor,
  weights of the current version), and its unfinished requests are re-run; requests are pure functions of
  their keys, so the samples are the same. At most ``rollout.max_restarts`` replacements per step, then
  :class:`RolloutWorkerLost`.
- Any other failure of a step stops the run with :class:`RunFailed`, naming the step and the cause. When the
  trainer still holds the state of the last completed step, a checkpoint of that step is written first, so
  ``run.resume=true`` loses nothing that was recorded.
- Ctrl-C (or SIGTERM) stops the run with :class:`RunInterrupted`, naming the checkpoint left.

Test-only fault injection lives apart, in :mod:`.fault_injection`.
"""
from __future__ import annotations

import sys


class RunFailed(RuntimeError):
    """A step failed and the run stopped. ``step``: the step that failed; ``checkpoint``: the newest complete
    checkpoint left (None: a resumed run starts from step 1); ``cause``: the underlying exception."""

    def __init__(self, message: str, *, step: int, checkpoint: str | None, cause: BaseException) -> None:
        super().__init__(message)
        self.step, self.checkpoint, self.cause = step, checkpoint, cause


class TrainerHung(RuntimeError):
    """A trainer call did not answer within ``train.call_timeout_s``: the trainer is taken as hung (its actors are
    stopped with the run; no checkpoint is asked of it)."""


class RolloutWorkerLost(RuntimeError):
    """Rollout workers died more often in one step than ``rollout.max_restarts`` allows."""


def is_actor_death(exc: BaseException) -> bool:
    """True for Ray's "the actor's process is gone" errors (killed, crashed, its node lost)."""
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def dead_actor_class(exc: BaseException) -> str | None:
    """The class of the actor whose death ``exc`` reports (Ray writes ``class_name: X`` into its message), or None."""
    import re

    if not is_actor_death(exc):
        return None
    m = re.search(r"class_name: (\w+)", str(exc))
    return m.group(1) if m else None


def unwrap(exc: BaseException) -> BaseException:
    """The exception raised inside an actor, without Ray's wrapper (its message holds the remote traceback)."""
    from ray.exceptions import RayTaskError

    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def describe(exc: BaseException, limit: int = 600) -> str:
    exc = unwrap(exc)
    text = str(exc).strip().splitlines()
    first = " ".join(text[:3]) if text else ""
    out = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."


def log(text: str) -> None:
    print(f"rlrepro: {text}", file=sys.stderr, flush=True)


class RunInterrupted(RunFailed):
    """The run was stopped by Ctrl-C (SIGINT) or SIGTERM between or during steps."""
