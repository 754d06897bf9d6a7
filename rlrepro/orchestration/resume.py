"""Resuming a run with a config that differs from its record: which differences are allowed, and what they amend.

``run.resume=true`` continues the run recorded in ``RUN/config.yaml``. :func:`reconcile_resume` compares that
recorded config with the one the command line asks for (both plain nested dicts of the fully resolved config,
``OmegaConf.to_container(cfg, resolve=True)``), key by dotted key:

* keys that cannot change a single bit of the run (:data:`BIT_NEUTRAL_KEYS`: logging, checkpoint cadence, the
  run's own switches and location, the Ray cluster, the engine's batching and memory settings and the weight-sync
  path, which docs/DETERMINISM.md proves do not change a number) take the requested value and are returned as
  amendments ``{"key", "old", "new", "from_step"}`` (``from_step``: the first step run with the new value); a run
  with no step left to run (resumed after its last step) runs no step with them, so it keeps its recorded values
  and records nothing (but how it was started, :data:`START_KEYS`, and a ``train.steps`` cut to the steps done);
* the layout keys (:data:`LAYOUT_KEYS`: ``train.num_gpus``, ``train.tensor_parallel`` and its legacy spelling
  ``trainer.tensor_parallel``) may change when the run is ``train.layout_invariant=true`` (recorded and requested):
  then the step's bits do not depend on them (docs/TRAINER.md, "Layout invariance"), and full checkpoints hold the
  optimizer state unsharded (any DP, any TP loads them); without it they are refused with that reason
  (:func:`layout_change_problem`). A run recorded on one trainer rank without the option may turn it on (and then
  change its layout): at one rank the option's micro-batch fold is the plain step's accumulation, bit for bit
  (:func:`one_rank_run`);
* ``train.steps`` may change when the LR schedule gives every step, the recorded ones and those to come, the same
  rate under both lengths (:func:`steps_change_problem`): the schedule's cosine runs over ``train.steps``, so a new
  length changes the rate of every step after the warm-up unless ``train.min_lr_ratio == 1`` (or the run never
  leaves its warm-up);
* any other difference raises :class:`~rlrepro.checks.ConfigError` listing each one as
  ``key: recorded -> requested``, with the fix.

The function knows nothing of the schema's sections: keys are dotted paths (``train.backend`` and a former
``trainer.backend`` are just two keys; migrate a recorded config's old spellings first).
"""
from __future__ import annotations

import copy
import json
import sys
from fnmatch import fnmatchcase
from typing import Any, Iterator

from rlrepro.checks import ConfigError  # the class rlrepro.orchestration.config exports

__all__ = ["reconcile_resume", "config_at_step", "read_amendments", "EVAL_KEYS", "BIT_NEUTRAL_KEYS", "STEPS_KEY",
           "LAYOUT_KEYS", "LAYOUT_INVARIANT_KEY", "START_KEYS",
           "steps_change_problem", "layout_change_problem", "one_rank_run", "flatten", "differences", "with_keys"]

# fnmatch patterns of dotted keys whose value cannot change the run's numbers (rollout tokens, logprobs, rewards,
# advantages, loss, grad norm, weights): where and how often things are logged or saved, how the run is started,
# and the engine settings that batch-invariant kernels, canonical KV order and key-derived sampling seeds make
# irrelevant (docs/DETERMINISM.md, tests/test_rollout_invariance.py, tests/test_train_e2e.py).
BIT_NEUTRAL_KEYS: tuple[str, ...] = (
    "logger.*",
    "checkpoint.every", "checkpoint.keep_last", "checkpoint.save_last",
    # an HF copy of the weights beside the checkpoints: it reads the weights only, under forked RNG states
    # (orchestration.workers.TrainerWorker.export_hf; tests/test_export.py: same fingerprints with and without)
    "checkpoint.export_hf",
    "repro.*",  # what `rlrepro diff` lists (repro.ignore_keys): read by diff only, never by the run
    "run.resume", "run.overwrite", "run.save_rollouts",
    "run.dir",  # the record's location: the directory the resumed run was found in
    "ray.address", "ray.num_cpus", "ray.network_interface",
    # where actors are placed (docs/CLUSTER.md): the same kernels on the same device type give the same bits on any
    # node (tests/test_cluster.py: trainer and engines on two nodes == one process)
    "ray.placement", "ray.num_nodes", "ray.trainer_node", "ray.rollout_node",
    # whether engines share the trainer ranks' GPUs (docs/CLUSTER.md): it picks placement, the weight-sync path of
    # rollout.weight_sync=auto (CUDA IPC or NCCL broadcast: exact copies either way) and each engine's share of
    # gpu_memory_fraction (the KV-cache size), all bit-neutral keys above and below (orchestration.actors)
    "ray.colocate",
    "rollout.num_workers", "rollout.max_num_seqs", "rollout.max_num_batched_tokens", "rollout.prefix_cache",
    "rollout.num_kv_blocks", "rollout.gpu_memory_fraction", "rollout.weight_sync", "rollout.max_restarts",
    # ZeRO-1 (docs/TRAINER.md): the same bits as the unsharded optimizer, and either trainer loads the other's
    # checkpoints (full and dist formats)
    "train.distributed_optimizer",
    "train.collective_timeout_s",  # how long the trainer ranks' collectives may wait: a failure or not, no number
    "train.call_timeout_s",  # how long the driver waits for a trainer call: a failure or not, no number
    "rollout.hang_timeout_s",  # a hung worker is replaced and its call re-run from its keys: a restart, no number
    "env.tool_threads",  # environment steps per worker at once: results are put back by key
    # held-out evaluation: its own seed stream (eval_seed), no weight changes (rlrepro.orchestration.evaluation)
    "eval.*",
)
STEPS_KEY = "train.steps"
# how the command was started, not what the run is: never an amendment (the driver leaves them out of
# amendments.jsonl), and applied even by a resume that has no step left to run
START_KEYS: tuple[str, ...] = ("run.resume", "run.dir", "run.overwrite")
# what the LR schedule (rlrepro.trainer.optim.WarmupCosineLR, built in rlrepro.trainer.train) is made of
LR_KEY, WARMUP_KEY, MIN_LR_RATIO_KEY = "train.lr", "train.warmup_steps", "train.min_lr_ratio"
# how many ranks hold the trainer: bit-neutral exactly when train.layout_invariant is true (rlrepro.trainer.grad_fold)
LAYOUT_KEYS: tuple[str, ...] = ("train.num_gpus", "train.tensor_parallel", "trainer.tensor_parallel")
LAYOUT_INVARIANT_KEY = "train.layout_invariant"


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()


def flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` of a nested dict; lists and empty dicts are leaves."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flatten(value, dotted + ".")
        else:
            yield dotted, value


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same kind (``True`` is not ``1``, ``1`` is ``1.0``: OmegaConf types both sides)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def differences(recorded: dict, requested: dict) -> list[tuple[str, Any, Any]]:
    """``(key, recorded, requested)`` of every dotted key whose value differs (:data:`ABSENT` where one side lacks
    it), in the recorded config's key order, then the keys only the request has."""
    old, new = dict(flatten(recorded)), dict(flatten(requested))
    keys = list(old) + [k for k in new if k not in old]
    return [(k, old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys
            if not _same(old.get(k, ABSENT), new.get(k, ABSENT))]


def _show(value: Any) -> str:
    if value is ABSENT:
        return "<absent>"
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def _bit_neutral(key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in BIT_NEUTRAL_KEYS)


def _lr_schedule(lr: float, warmup_steps: int, min_lr_ratio: float, steps: int):
    """The rate of each 0-based optimizer step of a run of ``steps`` train steps, as the trainer computes it."""
    from rlrepro.trainer.config import TrainConfig
    from rlrepro.trainer.optim import lr_at

    warmup = TrainConfig(steps=steps, warmup_steps=warmup_steps).schedule_warmup_steps  # the warm-up is capped
    return lambda step: lr_at(step, base_lr=lr, warmup_steps=warmup, total_steps=steps, min_lr_ratio=min_lr_ratio)


def steps_change_problem(recorded: dict, new_steps: Any, completed_step: int) -> str | None:
    """Why ``train.steps`` may not change from the recorded value to ``new_steps`` (None: it may).

    The LR schedule's cosine runs over ``train.steps`` (and the warm-up is capped at it), and a resumed trainer
    takes the schedule state of its checkpoint: so a changed length is honest only when every step of the
    amended run, those recorded and those to come, gets the same rate under both lengths (then the amended
    config run from scratch repeats the record bit for bit, whichever schedule the resumed trainer holds)."""
    flat = dict(flatten(recorded))
    old_steps = flat.get(STEPS_KEY, ABSENT)
    if not isinstance(new_steps, int) or isinstance(new_steps, bool) or new_steps < 1:
        return f"{STEPS_KEY}={_show(new_steps)} is not a positive number of steps"
    if new_steps < completed_step:
        return (f"{completed_step} steps are already done (the checkpoint resumed from), more than "
                f"{STEPS_KEY}={new_steps}")
    missing = [k for k in (STEPS_KEY, LR_KEY, WARMUP_KEY, MIN_LR_RATIO_KEY) if k not in flat]
    if missing:
        return f"the recorded config has no {', '.join(missing)}, so the LR schedule cannot be compared"
    lr, warmup, ratio = flat[LR_KEY], flat[WARMUP_KEY], flat[MIN_LR_RATIO_KEY]
    before = _lr_schedule(lr, warmup, ratio, old_steps)
    after = _lr_schedule(lr, warmup, ratio, new_steps)
    for step in range(new_steps):
        a, b = before(step), after(step)
        if a != b:
            why = (f"the LR schedule runs over {STEPS_KEY} (warm-up {warmup} steps, then a cosine to "
                   f"{LR_KEY} x {MIN_LR_RATIO_KEY}={ratio}): step {step + 1} would get LR {b!r} instead of the "
                   f"recorded schedule's {a!r}. ")
            if isinstance(old_steps, int) and warmup > old_steps:
                return why + (f"The recorded run's warm-up of {warmup} steps was cut short at its {STEPS_KEY}="
                              f"{old_steps} (the LR never reached {LR_KEY}), so a longer run is another schedule: "
                              f"start it over with {STEPS_KEY}={new_steps} (run.resume=false), or give a short "
                              f"run a warm-up that fits it ({WARMUP_KEY} <= {STEPS_KEY})")
            return why + (f"Only a schedule that is constant after its warm-up ({MIN_LR_RATIO_KEY}=1) can change "
                          "length mid-run")
    return None


def wandb_project_problem(recorded: dict, requested: dict) -> str | None:
    """Why ``logger.project`` may not change at this resume: the run logged to wandb and logs again, and its wandb
    run (the id in RUN/wandb) lives in the recorded project; in another it would become a second run on sync."""
    old, new = dict(flatten(recorded)), dict(flatten(requested))
    if not (old.get("logger.wandb", False) is True and new.get("logger.wandb", False) is True):
        return None
    return (f"the run's wandb run lives in project {_show(old.get('logger.project', ABSENT))}: logged to another it "
            "splits in two on wandb sync; keep the recorded logger.project, or set logger.wandb=false for this leg")


def one_rank_run(recorded: dict) -> bool:
    """Whether the recorded run's steps are those of ``train.layout_invariant=true`` even if it ran without it: one
    trainer rank (``train.num_gpus=1``: no data- or tensor-parallel sum) and no pieces (``train.tp_partials`` 1 or
    absent). There the option's micro-batch fold is exactly the plain step's accumulation
    (:mod:`rlrepro.trainer.grad_fold`), so the option may be turned on at resume."""
    flat = dict(flatten(recorded))
    return flat.get("train.num_gpus", ABSENT) == 1 and flat.get("train.tp_partials", 1) == 1


def layout_change_problem(recorded: dict, requested: dict, key: str) -> str | None:
    """Why the layout key ``key`` (:data:`LAYOUT_KEYS`) may not change between the recorded and the requested config
    (None: it may, both are ``train.layout_invariant=true``, or the recorded run is a :func:`one_rank_run` and the
    requested one turns the option on)."""
    old = dict(flatten(recorded)).get(LAYOUT_INVARIANT_KEY, ABSENT)
    new = dict(flatten(requested)).get(LAYOUT_INVARIANT_KEY, ABSENT)
    if new is True and (old is True or one_rank_run(recorded)):
        return None
    if one_rank_run(recorded):
        return (f"{LAYOUT_INVARIANT_KEY}={_show(False if new is ABSENT else new)} groups the gradient sums by the "
                f"layout, so another {key} changes the run's numbers; this run was recorded on one GPU, where "
                f"{LAYOUT_INVARIANT_KEY}=true computes the very same steps: add {LAYOUT_INVARIANT_KEY}=true to resume "
                "it at another number of GPUs")
    return (f"the run was recorded with {LAYOUT_INVARIANT_KEY}={_show(False if old is ABSENT else old)} on more "
            f"than one trainer rank, so its gradient sums are grouped by the layout and another {key} changes the "
            f"run's numbers; only a run with {LAYOUT_INVARIANT_KEY}=true (from its first step, or recorded on one "
            "GPU) resumes at another number of GPUs")


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if value is ABSENT:
        node.pop(leaf, None)
    else:
        node[leaf] = copy.deepcopy(value)


def reconcile_resume(recorded: dict, requested: dict, *, completed_step: int) -> tuple[dict, list[dict]]:
    """The config to resume with and the amendments it makes to the recorded one.

    ``recorded``: the run's ``config.yaml`` as a plain dict; ``requested``: the resolved config of this command
    line; ``completed_step``: the steps done by the checkpoint the run resumes from (0: none). Returns the
    recorded config with the allowed changes applied (a new dict; the inputs are not changed) and one amendment
    ``{"key", "old", "new", "from_step": completed_step + 1}`` per changed key (``old``/``new`` None where that
    side lacks the key); a run with no step left to run (``completed_step`` >= its ``train.steps``) keeps its
    recorded values and gets no amendment but ``train.steps`` and :data:`START_KEYS` (it changes nothing: said on
    stderr). Raises ConfigError listing every other difference as ``key: recorded -> requested``.
    """
    if not isinstance(completed_step, int) or isinstance(completed_step, bool) or completed_step < 0:
        raise ValueError(f"completed_step must be an int >= 0, got {completed_step!r}")
    allowed, refused = [], []
    for key, old, new in differences(recorded, requested):
        problem = wandb_project_problem(recorded, requested) if key == "logger.project" else None
        if problem is not None:
            refused.append(f"  {key}: {_show(old)} -> {_show(new)} ({problem})")
            continue
        if _bit_neutral(key):
            allowed.append((key, old, new))
            continue
        if key == LAYOUT_INVARIANT_KEY and new is True and one_rank_run(recorded):
            allowed.append((key, old, new))  # the recorded one-rank steps are the option's (one_rank_run)
            continue
        if key in LAYOUT_KEYS or key == STEPS_KEY:
            problem = (layout_change_problem(recorded, requested, key) if key in LAYOUT_KEYS
                       else steps_change_problem(recorded, new, completed_step))
            if problem is None:
                allowed.append((key, old, new))
                continue
            refused.append(f"  {key}: {_show(old)} -> {_show(new)} ({problem})")
            continue
        refused.append(f"  {key}: {_show(old)} -> {_show(new)}")
    if refused:
        accepted = (f"\n(accepted, they cannot change the run's numbers: {', '.join(k for k, _, _ in allowed)})"
                    if allowed else "")
        raise ConfigError(
            "run.resume=true continues the run recorded in run.dir's config.yaml, but this command line asks for "
            f"other values of {len(refused)} key(s) that can change the run's numbers (recorded -> requested):\n"
            + "\n".join(refused) + accepted
            + "\nDrop those overrides to continue the recorded run, or start a new run in another run.dir "
            "(run.overwrite=true starts this one over, deleting its records).")
    config = copy.deepcopy(recorded)
    amendments = []
    allowed = _changing(allowed, recorded, completed_step)
    for key, old, new in allowed:
        _set(config, key, new)
        amendments.append({"key": key, "old": None if old is ABSENT else copy.deepcopy(old),
                           "new": None if new is ABSENT else copy.deepcopy(new), "from_step": completed_step + 1})
    return config, amendments


def _changing(allowed: list[tuple[str, Any, Any]], recorded: dict, completed_step: int) -> list[tuple[str, Any, Any]]:
    """The accepted changes a resume makes. A run with no step left to run (``completed_step`` at its
    ``train.steps``, the amended one where it is amended) runs no step with them: such a resume changes nothing of
    the run, so it keeps the recorded values (no amendment, config.yaml as it was; said on stderr), except how the
    command was started (:data:`START_KEYS`) and a ``train.steps`` cut to the steps done (the run ends there)."""
    steps = next((new for key, _, new in allowed if key == STEPS_KEY), dict(flatten(recorded)).get(STEPS_KEY))
    if not isinstance(steps, int) or isinstance(steps, bool) or completed_step < steps:
        return allowed
    kept = [c for c in allowed if c[0] in START_KEYS or c[0] == STEPS_KEY]
    dropped = [c[0] for c in allowed if c[0] not in START_KEYS and c[0] != STEPS_KEY]
    if dropped:
        hint = ("; `rlrepro export RUN OUT` writes its last checkpoint as an HF directory"
                if "checkpoint.export_hf" in dropped else "")
        print(f"rlrepro: the run has no step left to run ({completed_step} of {steps} done): {', '.join(dropped)} "
              f"not applied and not recorded (a resume records only what it changes){hint}", file=sys.stderr)
    return kept


# the amendable keys that decide what a step records (the eval/* metrics: which steps evaluate, on what, how):
# rlrepro verify and rlrepro eval re-run a step with the values it ran with, not the run's latest ones
EVAL_KEYS: tuple[str, ...] = ("eval.*", STEPS_KEY)


def read_amendments(run_dir) -> list[dict]:
    """The run's ``amendments.jsonl`` (what resumes changed, each ``{"key", "old", "new", "from_step"}``), in the
    order they were made; [] when there is none."""
    from pathlib import Path

    path = Path(run_dir) / "amendments.jsonl"
    if not path.is_file():
        return []
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            a = json.loads(line)
        except ValueError:
            a = None
        ok = (isinstance(a, dict) and {"key", "old", "new", "from_step"} <= set(a) and isinstance(a["key"], str)
              and isinstance(a["from_step"], int) and not isinstance(a["from_step"], bool))
        if not ok:
            raise ConfigError(f"{path}:{lineno}: not an amendment ({line[:80]!r}): each line is a JSON object "
                              '{"key", "old", "new", "from_step"} written by a resume. Fix: restore amendments.jsonl '
                              "from a copy of the run")
        out.append(a)
    return out


def config_at_step(config: dict, amendments: list[dict], step: int, keys: tuple[str, ...] = EVAL_KEYS) -> dict:
    """``config`` (a run's latest, as config.yaml holds it) with each key matching ``keys`` put back to the value
    it had at ``step``: an amendment that took effect after ``step`` is undone (the earliest such one's ``old``;
    of amendments from one step, two resumes from one checkpoint, the one made first)."""
    out = copy.deepcopy(config)
    later = [a for a in amendments if a["from_step"] > step and any(fnmatchcase(a["key"], k) for k in keys)]
    # newest first: by from_step, and in the order they were made where two share it (a stable sort, reversed)
    for a in reversed(sorted(later, key=lambda a: a["from_step"])):
        _set(out, a["key"], copy.deepcopy(a["old"]))
    return out


def with_keys(recorded: dict, composed: dict, keys: list[str]) -> dict:
    """``recorded`` with the value ``composed`` holds at each of ``keys`` (dotted; a key inside a mapping-valued
    field sets that entry; a key ``composed`` lacks is dropped)."""
    out = copy.deepcopy(recorded)
    for key in keys:
        parts = key.split(".")
        src: Any = composed
        for part in parts:
            src = src.get(part, _MISSING) if isinstance(src, dict) else _MISSING
        dst = out
        for part in parts[:-1]:
            dst = dst.setdefault(part, {}) if isinstance(dst, dict) else None
            if dst is None:
                break
        if isinstance(dst, dict):
            if src is _MISSING:
                dst.pop(parts[-1], None)
            else:
                dst[parts[-1]] = copy.deepcopy(src)
    return out


_MISSING = object()
