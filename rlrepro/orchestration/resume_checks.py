"""What a resume checks before Ray starts, and what it records about its inputs once it is accepted.

* :func:`check_checkpoint_state`: the checkpoint's data order (``num_items``, ``seed``, ``shuffle``, cursor) against
  the prompts this run loaded and its config, and the batches it holds generated ahead (``rollout.max_staleness``)
  against the steps that follow it. Read from ``extra_state.pt`` alone (checked against the manifest's sha256),
  so a data set of another size is refused before Ray, the warm start and the checkpoint load, not after them.
* :func:`check_inputs`: the data set (each data file's sha256, the loaded records' digest, the revision) against
  the record of the run's first start (``inputs.json``). The recorded steps were made from that data; resuming on
  other data would not repeat the uninterrupted run, so it is refused, naming what differs and the fix.
* :func:`record_resumed_inputs`: any other input that differs from the record (an environment knob, a version, the
  tokenizer, the code of ``reward.fn``, the held-out set) is said on stderr whatever ``logger.progress`` is, and
  appended to the record's ``resumes`` list: ``{"from_step", "differences": [{"what", "key", "a", "b", "bits",
  "message"}]}`` (``a``: the record's value, ``b``: the resume's). The first start's record stays as it was.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

from .config import ConfigError
from .errors import log

__all__ = ["check_checkpoint_state", "check_pending", "check_inputs", "record_resumed_inputs", "DATA_DIFFERENCES"]

# the InputDiff kinds (rlrepro.repro.inputs) that mean another data set
DATA_DIFFERENCES = ("data_file", "data_records", "data_revision")


def check_checkpoint_state(ckpt: str | Path, order: Any, cfg: Any) -> int:
    """The step of ``ckpt``, after checking that its data order fits ``order`` (this run's ``EpochOrder``: the
    loaded prompts, ``run.seed``, ``data.shuffle``) and that it holds the batches generated ahead that
    ``rollout.max_staleness`` needs. ConfigError naming the checkpoint, the values and the fix otherwise."""
    from rlrepro.data import EpochOrder
    from rlrepro.trainer.checkpoint import load_extra_state

    step, extra = load_extra_state(ckpt)
    step = int(extra.get("step", step))
    state = extra.get("data_order")
    if not isinstance(state, dict):
        raise ConfigError(f"the checkpoint {ckpt} holds no data order (extra_state.pt: {sorted(extra)}); it was not "
                          "written by a run of rlrepro's driver. Resume from another checkpoint, or start a new run "
                          "in another run.dir")
    probe = EpochOrder(order.num_items, seed=order.seed, shuffle=order.shuffle)
    try:
        probe.load_state_dict(state)
    except ValueError as e:
        raise ConfigError(f"the checkpoint {ckpt} (step {step}) cannot continue on this run's data: {e} This run "
                          f"loaded {order.num_items} prompts (after data.limit and any rows left out). Nothing was "
                          "started; start a new run in another run.dir to train on other data") from None
    check_pending(ckpt, step, extra.get("pending") or {}, cfg.rollout.max_staleness)
    return step


def check_pending(ckpt: str | Path, step: int, pending: Any, staleness: int) -> None:
    """The checkpoint of ``step`` holds the ``rollout.max_staleness`` batches generated ahead after it (keys of
    ``pending``); ConfigError naming them and the fix otherwise."""
    if not staleness or step <= 0:
        return
    have = sorted(int(k) for k in pending)
    want = list(range(step + 1, step + 1 + staleness))
    if have != want:
        raise ConfigError(f"the checkpoint {ckpt} holds the batches generated ahead for steps {have}, not the "
                          f"rollout.max_staleness={staleness} batches after step {step} ({want}); resume with the "
                          "recorded rollout.max_staleness")


def _listed_differences(recorded: dict, diffs: list) -> list:
    """``diffs`` without the data files the record lists that this start no longer lists but that are still there,
    unchanged (their sha256 as recorded): runs recorded before ``data.sources.source_files`` left a data folder's
    hidden files (``.gitattributes``) and the files of run directories inside it out listed them. An unchanged file
    is not another data set."""
    from rlrepro.repro.inputs import file_sha256

    paths = (recorded.get("data") or {}).get("paths") or {}

    def unchanged(d: Any) -> bool:
        path = paths.get(d.key) if d.what == "data_file" and d.b is None and d.a is not None else None
        try:
            return path is not None and Path(path).is_file() and file_sha256(path) == d.a
        except OSError:
            return False
    return [d for d in diffs if not unchanged(d)]


def check_inputs(run_dir: str | Path, now: dict) -> None:
    """Refuse a resume whose data set differs from the one ``RUN/inputs.json`` recorded (``now``: this start's
    ``collect_inputs``). Nothing to compare (no inputs.json: an older run) passes."""
    from rlrepro.repro.inputs import input_differences, read_inputs
    from rlrepro.repro.records import ReproError

    try:
        recorded = read_inputs(run_dir)
    except ReproError as e:
        raise ConfigError(f"{e}: the record of the run's inputs is damaged, so a resume cannot check that it reads "
                          "what the run read. Fix: restore inputs.json from a copy, or start a new run in another "
                          "run.dir") from None
    if recorded is None:
        return
    data = [d for d in _listed_differences(recorded, input_differences(recorded, now)) if d.what in DATA_DIFFERENCES]
    if not data:
        return
    paths = (recorded.get("data") or {}).get("paths") or {}
    where = f" (it read {', '.join(sorted(map(str, paths.values())))})" if paths else ""
    raise ConfigError("run.resume=true, but the data set is not the one this run recorded in inputs.json (recorded "
                      "vs now): " + "; ".join(d.message for d in data) + ". The recorded steps were made from the "
                      f"recorded data{where}; continuing on other data would not repeat the uninterrupted run, "
                      "so nothing was started or changed. Fix: put the recorded data back, or start a new run on this "
                      "data in another run.dir (run.resume=false run.overwrite=true starts this one over)")


def record_resumed_inputs(run_dir: str | Path, recorded: dict, now: dict, from_step: int,
                          say: Callable[[str], None] = log, generated_ahead: Sequence[int] = ()) -> list:
    """Say on stderr each difference between the record and ``now`` (this resume's inputs), and append them to
    the record's ``resumes`` as the inputs of the steps from ``from_step`` on. ``generated_ahead``: the steps whose
    batches the checkpoint holds, generated and scored before the stop (``rollout.max_staleness``) and reused, so
    that what changes generation or scoring reaches the rollouts only after them (recorded in the entry and said
    in the warning). Returns the differences."""
    from rlrepro.repro.inputs import input_differences, write_inputs

    diffs = _listed_differences(recorded, input_differences(recorded, now))
    ahead = sorted(int(s) for s in generated_ahead)
    later = (f" (the batches of steps {ahead[0]}-{ahead[-1]} were generated and scored before the stop and are "
             f"reused: a change to generation or scoring reaches the rollouts from step {ahead[-1] + 1})"
             if ahead else "")
    for d in diffs:
        say(f"warning: resuming at step {from_step} with other inputs than the run recorded (recorded vs now): "
            f"{d.message}{later}")
    if diffs:
        out = dict(recorded)
        entry = {"from_step": from_step, "differences": [dataclasses.asdict(d) for d in diffs]}
        if ahead:
            entry["generated_ahead"] = ahead
        out["resumes"] = list(recorded.get("resumes") or []) + [entry]
        write_inputs(run_dir, out)
    return diffs
