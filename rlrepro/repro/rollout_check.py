"""A run's rollout files (``RUN/rollouts/step_NNNNNN.jsonl.gz``) checked against its own ``fingerprints.jsonl``.

The fingerprints are digests of what the run computed; a rollout file is a copy of the samples kept beside them,
which can be edited (or damaged) afterwards without touching the fingerprints. ``check_rollout_files`` digests each
step's file again with the function that wrote the fingerprints (``fingerprint_from_samples``) and names every step
whose file does not give the run's own digests: the run, the step, the file, the fingerprint field, the sample
(from the per-sample digests) and, where another run's file holds the recorded values, the first value that
differs. ``rlrepro diff`` runs it on both runs, ``rlrepro verify`` on the run and its re-execution; a mismatch is a
divergence (exit 1). The record-to-record comparison here (``first_record_difference``) is also verify's.

Imports the digests' module (torch) on the first file it checks, not on import.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .records import ReproError, read_rollouts, rollouts_path

__all__ = ["check_runs", "check_rollout_files", "add_reference_detail", "first_record_difference",
           "first_value_difference", "ROLLOUT_FIELDS"]

#: the fingerprint fields a rollout file can be checked against (in diff's order), and the rollout-record key each
#: digests; the ``sample_*`` lists name the sample
ROLLOUT_FIELDS = {"prompt_ids": "prompt_token_ids", "rollout_token_ids": "token_ids", "rollout_logprobs": "logprobs",
                  "loss_masks": "loss_mask", "turns": "turns", "rewards": "reward", "advantages": "advantage"}
_SAMPLE_LISTS = {"prompt_ids": "sample_prompt_ids", "rollout_token_ids": "sample_token_ids",
                 "rollout_logprobs": "sample_logprobs", "loss_masks": "sample_loss_masks", "turns": "sample_turns"}
_ABSENT = "<absent>"


def _dumped(x: Any) -> str:
    return json.dumps(x, sort_keys=True)


def first_value_difference(a: Any, b: Any, labels: Sequence[str] = ("recorded", "re-executed")) -> str:
    """Where two JSON values first differ: ``[i]: LABEL_A A, LABEL_B B`` for lists of one length, else the counts
    (lists) or the two values."""
    la, lb = labels
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if _dumped(x) != _dumped(y):
                return f"[{i}]: {la} {x!r}, {lb} {y!r}"
    if isinstance(a, list) and isinstance(b, list):
        return f": {la} {len(a)} item(s), {lb} {len(b)}"
    return f": {la} {a!r}, {lb} {b!r}"


def first_record_difference(x: Mapping, y: Mapping, labels: Sequence[str] = ("recorded", "re-executed"),
                            keys: Sequence[str] | None = None) -> tuple[str, str] | None:
    """(key, ``key`` + where its values first differ) for the first key (of ``keys``, else of both records, in
    their order) whose JSON values differ between two rollout records; None when they agree."""
    for k in (keys if keys is not None else list(dict.fromkeys([*x, *y]))):
        a, b = x.get(k, _ABSENT), y.get(k, _ABSENT)
        if _dumped(a) != _dumped(b):
            return k, k + first_value_difference(a, b, labels)
    return None


def _negative_nans(x: Any) -> Any:
    """``x`` with every NaN given the sign bit: JSON keeps no NaN sign (a GPU's or x86's NaN is often negative),
    so a file whose NaNs read back positive is digested a second time with them negative."""
    if isinstance(x, float) and math.isnan(x):
        return -math.nan
    if isinstance(x, list):
        return [_negative_nans(v) for v in x]
    if isinstance(x, dict):
        return {k: _negative_nans(v) for k, v in x.items()}
    return x


def _has_nan(x: Any) -> bool:
    if isinstance(x, float):
        return math.isnan(x)
    if isinstance(x, list):
        return any(_has_nan(v) for v in x)
    if isinstance(x, dict):
        return any(_has_nan(v) for v in x.values())
    return False


def _digests(step: int, records: list[dict]) -> list[dict]:
    """The fingerprint record(s) of the file's samples: as read, and (when they hold a NaN) with negative NaNs."""
    from .fingerprint import fingerprint_from_samples

    out = [fingerprint_from_samples(step, records, loss=None, grad_norm=None, weights=None)]
    if _has_nan(records):
        out.append(fingerprint_from_samples(step, _negative_nans(records), loss=None, grad_norm=None, weights=None))
    return out


def _differing(recorded: Mapping, digested: Sequence[Mapping]) -> list[str]:
    """The fingerprint fields of ``recorded`` that no digest of the file gives. A field the run did not fingerprint
    (null, or a turn field the record lacks: a single-turn step, or one recorded before fingerprints covered them)
    is not checked."""
    out = []
    for f in ROLLOUT_FIELDS:
        if recorded.get(f) is None:
            continue
        if all(d.get(f) != recorded.get(f) for d in digested):
            out.append(f)
    return out


def _first_sample(field: str, recorded: Mapping, digested: Mapping) -> int | None:
    key = _SAMPLE_LISTS.get(field)
    a, b = recorded.get(key), digested.get(key)
    if key is None or not isinstance(a, list) or not isinstance(b, list):
        return None
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def _message(m: dict) -> str:
    """The sentence of a mismatch: run, step, sample, file, what differs (and the reference's value, if any)."""
    who = "" if m["sample"] is None else (f", sample {m['sample']} (prompt_uid {m['prompt_uid']!r}, sample_index "
                                          f"{m['sample_index']})")
    return (f"run {m['run']}, step {m['step']}{who}: {m['file']} {m['problem']}"
            + (f"; {m['detail']}" if m["detail"] else ""))


def _problem(label: str, step: int, path: Path, what: str, **extra: Any) -> dict:
    m = {"run": label, "step": step, "file": str(path), "fields": [], "sample": None, "prompt_uid": None,
         "sample_index": None, "detail": None, "problem": what, **extra}
    m["message"] = _message(m)
    return m


def _check_step(run: Path, label: str, step: int, recorded: Mapping) -> tuple[dict | None, list[dict] | None]:
    """(the mismatch of one step's file, or None; the file's records, None when there is none)."""
    path = rollouts_path(run, step)
    try:
        records = read_rollouts(run, step)
    except ReproError as e:
        return _problem(label, step, path, f"cannot be checked against run {label}'s fingerprints.jsonl: {e}"), None
    if records is None:
        return None, None
    try:
        digested = _digests(step, records)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a record without a key, or of another shape
        return _problem(label, step, path, f"cannot be checked against run {label}'s fingerprints.jsonl: a "
                        f"malformed record ({type(e).__name__}: {e})"), records
    fields = _differing(recorded, digested)
    n_rec, n_file = recorded.get("num_samples"), len(records)
    if not fields and n_rec in (None, n_file):
        return None, records
    if not fields or n_rec != n_file:
        return _problem(label, step, path, f"holds {n_file} sample(s), run {label}'s fingerprints.jsonl {n_rec}: "
                        "the file is not what the run computed", fields=fields or ["num_samples"]), records
    i = _first_sample(fields[0], recorded, digested[0])
    rec = records[i] if i is not None and i < len(records) else {}
    what = (f"does not give run {label}'s recorded {', '.join(fields)} digest{'s' if len(fields) > 1 else ''} "
            "(fingerprints.jsonl): not what the run computed (edited or damaged after the run wrote it)")
    return _problem(label, step, path, what, fields=fields, sample=i, prompt_uid=rec.get("prompt_uid"),
                    sample_index=rec.get("sample_index")), records


def check_rollout_files(run_dir: str | os.PathLike, fingerprints: Mapping[int, Mapping], label: str) -> \
        tuple[list[dict], list[int]]:
    """Each rollout file of the steps in ``fingerprints`` (``{step: record}``, the run's own) digested again and
    compared with the record: ([mismatch], the steps checked). A mismatch is {``run`` (``label``), ``step``,
    ``file``, ``fields`` (the fingerprint fields the file does not give), ``sample`` (its position in the file, from
    the per-sample digests; null for rewards / advantages, or a file that cannot be read), ``prompt_uid``,
    ``sample_index``, ``detail`` (null: ``add_reference_detail`` fills it), ``problem``, ``message``}. A step
    without a rollout file is not checked; one whose file cannot be read or holds a malformed record is a mismatch
    too (it cannot give the digests)."""
    run = Path(run_dir)
    mismatches, checked = [], []
    for step in sorted(fingerprints):
        bad, records = _check_step(run, label, step, fingerprints[step])
        if records is not None or bad is not None:
            checked.append(step)
        if bad is not None:
            mismatches.append(bad)
    return mismatches, checked


def add_reference_detail(mismatch: dict, run_dir: str | os.PathLike, other_dir: str | os.PathLike, other: str,
                         own_record: Mapping, other_record: Mapping | None) -> None:
    """Fill in ``mismatch['detail']`` (and its message) with the first value where the file differs from the other
    run's file of the step, when that file holds the recorded values: the other run's fingerprint agrees on the
    field (and its file was checked against it, the caller's part). Left as it is otherwise."""
    fields = mismatch["fields"]
    if not fields or fields[0] not in ROLLOUT_FIELDS or other_record is None:
        return
    field, step = fields[0], mismatch["step"]
    if own_record.get(field) != other_record.get(field):
        return  # the runs recorded other values: the other file says nothing of this run's
    try:
        mine, theirs = read_rollouts(run_dir, step), read_rollouts(other_dir, step)
    except ReproError:
        return
    if not mine or not theirs or len(mine) != len(theirs):
        return
    key = ROLLOUT_FIELDS[field]
    labels = ("this file", f"run {other}'s file")
    order = [mismatch["sample"]] if mismatch["sample"] is not None else range(len(mine))
    for i in order:
        if i >= len(mine):
            return
        found = first_record_difference(mine[i], theirs[i], labels, keys=[key])
        if found is not None:
            break
    else:
        return
    mismatch["detail"] = f"{found[1]} (run {other}'s file gives the {field} digest both runs recorded)"
    if mismatch["sample"] is None:
        mismatch["sample"] = i
        mismatch["prompt_uid"], mismatch["sample_index"] = mine[i].get("prompt_uid"), mine[i].get("sample_index")
    mismatch["message"] = _message(mismatch)


def check_runs(run_a: str | os.PathLike, fps_a: Mapping[int, Mapping], run_b: str | os.PathLike,
               fps_b: Mapping[int, Mapping]) -> tuple[list[dict], dict[str, list[int]]]:
    """``check_rollout_files`` on both runs (A's mismatches first), each mismatch with the other run's file as the
    reference where that file was checked and matches (``add_reference_detail``): (mismatches, {"A"/"B": steps
    checked})."""
    runs = {"A": (run_a, fps_a), "B": (run_b, fps_b)}
    found = {r: check_rollout_files(d, fps, r) for r, (d, fps) in runs.items()}
    for r, (mismatches, _) in found.items():
        o = "B" if r == "A" else "A"
        trusted = set(found[o][1]) - {m["step"] for m in found[o][0]}
        for m in mismatches:
            if m["step"] in trusted:
                add_reference_detail(m, runs[r][0], runs[o][0], o, runs[r][1][m["step"]], runs[o][1].get(m["step"]))
    return found["A"][0] + found["B"][0], {r: checked for r, (_, checked) in found.items()}
