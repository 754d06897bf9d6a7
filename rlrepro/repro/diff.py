"""``rlrepro diff RUN_A RUN_B``: compare two run directories step by step and name the first divergence.

Exit codes: 0 identical, 1 diverged, 2 error (missing directory, missing or corrupt fingerprints.jsonl, ...).
When both runs have ``inputs.json`` (:mod:`.inputs`) it is compared first and its differences are printed before
the records', as the likely cause of a divergence; they do not change the verdict, which is the records' alone
(an inputs.json that cannot be read, damaged or of another version, is a note and "not compared", not an error).
Fingerprint fields this version does not know (a newer rlrepro's) are compared exactly where both runs have them.
A fingerprint field that is null in both runs (not fingerprinted) was not compared: the report lists it as "not
recorded in either run" and the verdict says the runs are identical in the recorded fields only (exit 0: nothing
differs); so is one null in one run and a digest in the other ("recorded in only one run": a field one run did not
fingerprint is no bit difference, nor is it equal); ``--strict`` also exits 1 for both, and when the runs recorded
different sets of steps (in fingerprints.jsonl or metrics.jsonl, or one run has no metrics.jsonl);
``--strict-inputs`` also exits 1 when an input that can change bits differs (data, tokenizer, starting weights,
versions, rlrepro's code, GPU, bit-relevant environment) or cannot be compared (a run without inputs.json, or
recorded before it held the code digest). A torn last line of a step log (a crashed run, or one still writing) is
dropped with a note. Each run's rollout files are checked against its own fingerprints (:mod:`.rollout_check`): a
file that does not give them (edited or damaged after the run) is a divergence, exit 1 (``--no-detail`` reads no
rollout file, so it skips the check). ``--bisect`` failures are printed after the report, exit 2; it stops when
rlrepro's code differs unless ``--allow-code-change``. The report (``DiffReport``) lives in :mod:`.report`;
``--json`` writes non-finite floats as strings. Imports neither torch nor anything of rlrepro outside this package
(the rollout check imports the digests' module, and torch, when it runs).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from .inputs import CODE_KEY, INPUTS_FILE, input_differences, read_inputs, resumed_differences, uncompared_inputs
from .records import (
    CONFIG_FILE,
    EVAL_FINGERPRINT_KEY,
    FINGERPRINTS_FILE,
    METRICS_FILE,
    ReproError,
    float_bits_equal,
    missing_run_dir,
    read_rollouts,
    read_step_records,
)
from .report import (
    _ABSENT,
    ConfigDiff,
    DiffReport,
    Divergence,
    MetricDiff,
    TokenDiff,
    TurnPosition,
    _ranges,
    json_safe,
)
from .turns import record_value, turn_position

__all__ = ["ReproError", "DiffReport", "ConfigDiff", "Divergence", "TokenDiff", "TurnPosition", "MetricDiff",
           "diff_runs", "main_diff", "FIELDS", "DEFAULT_IGNORED_CONFIG_KEYS"]

# kept in sync with fingerprint.FIELDS / SAMPLE_FIELDS (this module must not import torch)
FIELDS = ("prompt_ids", "rollout_token_ids", "rollout_logprobs", "rewards", "advantages", "loss", "grad_norm",
          "weights")
SAMPLE_FIELDS = {"prompt_ids": "sample_prompt_ids", "rollout_token_ids": "sample_token_ids",
                 "rollout_logprobs": "sample_logprobs"}
# multi-turn steps only (fingerprint.TURN_FIELDS): absent from single-turn records, compared where either run has them
TURN_SAMPLE_FIELDS = {"loss_masks": "sample_loss_masks", "turns": "sample_turns"}
# the optimizer's state (fingerprint.STATE_FIELDS: float32 masters, AdamW moments): compared where both runs have it;
# runs recorded before it existed, and megatron runs, lack it (said in a note)
STATE_FIELDS = ("optimizer_state",)
COMPARED_FIELDS = FIELDS[:3] + tuple(TURN_SAMPLE_FIELDS) + FIELDS[3:] + STATE_FIELDS  # the order diff reports them
KNOWN_FORMATS = ("rlrepro.fingerprint.v1",)
# every key this version writes in a fingerprint record; any other (a newer rlrepro's field) is compared exactly
# where both runs have it, and said in a note (never silently left out)
KNOWN_KEYS = frozenset(("step", "format", "num_samples", *COMPARED_FIELDS, *SAMPLE_FIELDS.values(),
                        *TURN_SAMPLE_FIELDS.values()))
DEFAULT_IGNORED_CONFIG_KEYS = ("run.dir", "run.resume", "logger.*", "repro.ignore_keys")
IGNORED_METRIC_PREFIXES = ("perf/",)
# held-out evaluation (eval.every): compared where both runs logged it, not a difference where one run did not
# evaluate (a run with eval on trains the same bits as one without)
OPTIONAL_METRIC_PREFIXES = ("eval/",)
# and the evaluation's completions (records.EVAL_FINGERPRINT_KEY), as optional as the eval/* numbers: runs recorded
# before it existed lack it (then their completions are compared by the numbers alone, said in a note)
OPTIONAL_METRIC_KEYS = (EVAL_FINGERPRINT_KEY,)
_FINISH_SHARE = "*/finish_*_frac"  # absent from records before 2026-12-04 where no episode ended so: 0.0

# ------------------------------------------------------------------------------------------------- config


def load_config(run_dir: Path) -> dict | None:
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return None
    try:
        from omegaconf import OmegaConf
        cfg = OmegaConf.load(path)
        try:
            data = OmegaConf.to_container(cfg, resolve=True)
        except Exception:
            data = OmegaConf.to_container(cfg, resolve=False)
    except Exception as e:  # yaml errors come in many classes
        raise ReproError(f"{path}: cannot parse ({type(e).__name__}: {e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ReproError(f"{path}: expected a mapping at the top level")
    return data


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    if isinstance(d, dict) and (d or not prefix):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            out.update(flatten(v, key))
    else:
        out[prefix] = d
    return out


def _ignored(key: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        if key == p or key.startswith(p + ".") or fnmatch.fnmatchcase(key, p):
            return True
        if p.endswith(".*") and (key == p[:-2] or key.startswith(p[:-1])):
            return True
    return False


def _ignore_keys(cfg: dict | None) -> list[str]:
    repro = (cfg or {}).get("repro")
    keys = repro.get("ignore_keys") if isinstance(repro, dict) else None
    if keys is None:
        return []
    if isinstance(keys, str):
        return [keys]
    return [str(k) for k in keys]


def diff_configs(cfg_a: dict, cfg_b: dict, ignore: Iterable[str] = ()) -> list[ConfigDiff]:
    patterns = list(DEFAULT_IGNORED_CONFIG_KEYS) + _ignore_keys(cfg_a) + _ignore_keys(cfg_b) + list(ignore)
    fa, fb = flatten(cfg_a), flatten(cfg_b)
    out = []
    for key in sorted(set(fa) | set(fb)):
        if _ignored(key, patterns):
            continue
        a, b = fa.get(key, _ABSENT), fb.get(key, _ABSENT)
        if not float_bits_equal(a, b):  # NaN equals NaN (an identical config), 0.0 is not -0.0
            out.append(ConfigDiff(key, a, b))
    return out


# ------------------------------------------------------------------------------------------- fingerprints


def read_fingerprints(run_dir: str | os.PathLike, notes: list[str] | None = None) -> dict[int, dict]:
    """``{step: fingerprint record}``; a torn last line (a crash, or a run still writing) is dropped, said in
    ``notes`` when given. ReproError for a missing or malformed file."""
    path = Path(run_dir) / FINGERPRINTS_FILE
    if not path.exists():
        raise ReproError(f"{path}: file not found; {_no_fingerprints_hint(Path(run_dir))}")
    recs = read_step_records(path, required=FIELDS, notes=notes)
    for step, rec in recs.items():
        fmt = rec.get("format", KNOWN_FORMATS[0])
        if fmt not in KNOWN_FORMATS:
            raise ReproError(f"{path}: step {step}: unknown fingerprint format {fmt!r} (this rlrepro reads "
                             f"{', '.join(map(repr, KNOWN_FORMATS))}): written by another rlrepro version; "
                             "compare the runs with that version")
        for f in FIELDS:
            if rec[f] is not None and not isinstance(rec[f], str):
                raise ReproError(f"{path}: step {step}: field {f!r} must be a hex string or null")
        for f in (*TURN_SAMPLE_FIELDS, *STATE_FIELDS):
            if rec.get(f) is not None and not isinstance(rec[f], str):
                raise ReproError(f"{path}: step {step}: field {f!r} must be a hex string or null")
        for key in (*SAMPLE_FIELDS.values(), *TURN_SAMPLE_FIELDS.values()):
            if key in rec and not isinstance(rec[key], list):
                raise ReproError(f"{path}: step {step}: field {key!r} must be a list")
    return recs


def _no_fingerprints_hint(run: Path) -> str:
    """Why a directory has no fingerprints.jsonl, and what to give instead."""
    owner = next((p for p in run.resolve().parents if (p / FINGERPRINTS_FILE).is_file()), None)
    if owner is not None:
        return f"{run} is inside the run directory {owner}: give that"
    if (run / METRICS_FILE).exists() or (run / CONFIG_FILE).exists():
        return "the run has not finished a step yet: wait for its first step"
    return (f"{run} is not a run directory (no {FINGERPRINTS_FILE}, {METRICS_FILE} or {CONFIG_FILE}); give the "
            "run.dir of a run")


def _first_mismatch(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if not float_bits_equal(x, y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _sample_detail(dv: Divergence, run_a: Path, run_b: Path) -> None:
    """Fill in the sample and token position from the rollout files, when both runs kept them."""
    try:
        ra, rb = read_rollouts(run_a, dv.step), read_rollouts(run_b, dv.step)
    except ReproError as e:
        dv.detail_note = f"rollout detail unavailable: {e}"
        return
    if ra is None or rb is None:
        if dv.sample_index is not None or dv.field in ("rewards", "advantages"):
            missing = [r for r, x in (("A", ra), ("B", rb)) if x is None]
            dv.detail_note = (f"no rollout file for step {dv.step} in run {' and '.join(missing)}: "
                              "token detail unavailable")
        return
    field_key = {"prompt_ids": "prompt_token_ids", "rollout_token_ids": "token_ids", "rollout_logprobs": "logprobs",
                 "loss_masks": "loss_mask", "turns": "turns", "rewards": "reward",
                 "advantages": "advantage"}.get(dv.field)
    if field_key is None:
        return
    i = dv.sample_index
    if i is None:  # rewards / advantages (or a field one run lacks) carry no per-sample digests: find the sample
        i = _first_mismatch([record_value(s, field_key) for s in ra], [record_value(s, field_key) for s in rb])
        if i is None:
            dv.detail_note = "; ".join(filter(None, (dv.detail_note, f"the rollout files agree on {field_key}; "
                                                                     "the fingerprints do not")))
            return
        dv.sample_index = i
    if i >= len(ra) or i >= len(rb):
        dv.detail_note = f"sample {i} is missing from the rollout file of run {'A' if i >= len(ra) else 'B'}"
        return
    sa, sb = ra[i], rb[i]
    if sa.get("prompt_uid") == sb.get("prompt_uid"):
        dv.prompt_uid = sa.get("prompt_uid")
        dv.sample_index_in_prompt = sa.get("sample_index")
    else:
        dv.detail_note = (f"sample {i} is a different sample: prompt_uid A={sa.get('prompt_uid')!r} "
                          f"B={sb.get('prompt_uid')!r}")
    if sa.get("turns") is not None or sb.get("turns") is not None:
        dv.num_turns_a, dv.num_turns_b = (None if s.get("turns") is None else len(s["turns"]) for s in (sa, sb))
    if field_key in ("reward", "advantage"):
        dv.token = TokenDiff(what=field_key, position=None, a=sa.get(field_key), b=sb.get(field_key))
        return
    va, vb = record_value(sa, field_key), record_value(sb, field_key)
    if field_key == "loss_mask" and (va is None or vb is None):
        dv.token = TokenDiff(what=field_key, position=None, a=None if va is None else len(va),
                             b=None if vb is None else len(vb))
        return
    va, vb = va or [], vb or []
    pos = _first_mismatch(va, vb)
    if pos is None:
        if dv.detail_note is None:
            dv.detail_note = f"the rollout files agree on sample {i}'s {field_key}; the fingerprints do not"
        return
    if field_key == "turns":
        dv.token = TokenDiff(what="turns", position=pos, a=va[pos] if pos < len(va) else None,
                             b=vb[pos] if pos < len(vb) else None)
        return
    if pos >= len(va) or pos >= len(vb):
        dv.token = TokenDiff(what="length", position=pos, a=None, b=None, length_a=len(va), length_b=len(vb))
        return
    t = TokenDiff(what=field_key, position=pos, a=va[pos], b=vb[pos], length_a=len(va), length_b=len(vb),
                  turn_a=turn_position(sa, pos), turn_b=turn_position(sb, pos))
    ta, tb = sa.get("token_ids") or [], sb.get("token_ids") or []
    la, lb = sa.get("logprobs") or [], sb.get("logprobs") or []
    if field_key == "token_ids":
        t.logprob_a = la[pos] if pos < len(la) else None
        t.logprob_b = lb[pos] if pos < len(lb) else None
    elif field_key == "logprobs":
        t.token_a = ta[pos] if pos < len(ta) else None
        t.token_b = tb[pos] if pos < len(tb) else None
    dv.token = t


def _unknown_keys(fa: dict, fb: dict) -> tuple[list[str], list[str]]:
    """(keys unknown to this version that both records have, those only one has), sorted."""
    ua, ub = set(fa) - KNOWN_KEYS, set(fb) - KNOWN_KEYS
    return sorted(ua & ub), sorted(ua ^ ub)


def _compare_step(step: int, fa: dict, fb: dict) -> Divergence | None:
    # a null in one run only (FIELDS, STATE_FIELDS) is a field that run did not record: not compared, never a bit
    # difference (diff_runs lists FIELDS as recorded in only one run; STATE_FIELDS get a note)
    differing = [f for f in COMPARED_FIELDS if fa.get(f) != fb.get(f)
                 and (f in TURN_SAMPLE_FIELDS or (fa.get(f) is not None and fb.get(f) is not None))]
    differing += [k for k in _unknown_keys(fa, fb)[0] if not float_bits_equal(fa[k], fb[k])]
    na, nb = fa.get("num_samples"), fb.get("num_samples")
    if not differing and na == nb:
        return None
    if not differing:
        differing = ["prompt_ids"]  # cannot happen with intact digests; be loud rather than silent
    dv = Divergence(step=step, field=differing[0], fields=differing, num_samples_a=na, num_samples_b=nb)
    missing = [r for r, f in (("A", fa), ("B", fb)) if dv.field in TURN_SAMPLE_FIELDS and f.get(dv.field) is None]
    if missing:
        dv.detail_note = (f"run {missing[0]} has no {dv.field} digest: its samples have no loss masks or turns, or "
                          "it was recorded before fingerprints covered them")
    key = SAMPLE_FIELDS.get(dv.field) or TURN_SAMPLE_FIELDS.get(dv.field)
    if key is not None and isinstance(fa.get(key), list) and isinstance(fb.get(key), list):
        dv.sample_index = _first_mismatch(fa[key], fb[key])
    return dv


def _note_uncompared_state(rep: DiffReport, fps_a: dict, fps_b: dict, steps: Sequence[int]) -> None:
    """A note for each STATE_FIELDS field that one run recorded and the other did not, at some common steps."""
    for f in STATE_FIELDS:
        for run, has, lacks in (("B", fps_a, fps_b), ("A", fps_b, fps_a)):
            missing = [s for s in steps if has[s].get(f) is not None and lacks[s].get(f) is None]
            if missing:
                rep.notes.append(f"{f} not compared at step(s) {_ranges(missing)}: run {run} has no {f} digest "
                                 "(recorded before the optimizer's state was fingerprinted, or a megatron run); "
                                 "its weights are compared alone")


def _note_unknown_keys(rep: DiffReport, fps_a: dict, fps_b: dict, steps: Sequence[int]) -> None:
    """Notes for fingerprint keys this version does not know (a newer rlrepro's): compared exactly where both runs
    have them, not compared where one run has them."""
    both: dict[str, None] = {}
    one: dict[str, list[int]] = {}
    for s in steps:
        shared, lone = _unknown_keys(fps_a[s], fps_b[s])
        both.update(dict.fromkeys(shared))
        for k in lone:
            one.setdefault(k, []).append(s)
    if both:
        rep.notes.append(f"fingerprint field(s) unknown to this rlrepro, compared exactly: {', '.join(sorted(both))}")
    for k in sorted(one):
        run = "A" if k in fps_a[one[k][0]] else "B"
        rep.notes.append(f"fingerprint field {k!r} not compared at step(s) {_ranges(one[k])}: only run {run} has it "
                         "(recorded by another rlrepro version); compare with the version that wrote it")


# ------------------------------------------------------------------------------------------------ metrics


def read_metrics(run_dir: str | os.PathLike, notes: list[str] | None = None) -> dict[int, dict] | None:
    """``{step: metrics record}``, None without metrics.jsonl; a torn last line is dropped (``notes``)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return None
    return read_step_records(path, notes=notes)


def _metric_diffs(step: int, ma: dict, mb: dict) -> list[MetricDiff]:
    out = []
    for key in sorted(set(ma) | set(mb)):
        if key == "step" or key.startswith(IGNORED_METRIC_PREFIXES):
            continue
        a, b = ma.get(key, _ABSENT), mb.get(key, _ABSENT)
        optional = key.startswith(OPTIONAL_METRIC_PREFIXES) or key in OPTIONAL_METRIC_KEYS
        if optional and (key not in ma or key not in mb):
            continue
        zero = 0.0 if fnmatch.fnmatchcase(key, _FINISH_SHARE) else _ABSENT  # what an absent value compares as
        if not float_bits_equal(zero if a == _ABSENT else a, zero if b == _ABSENT else b):
            out.append(MetricDiff(step, key, a, b))
    return out


def _evaluated(m: dict) -> bool:
    return any(k.startswith(OPTIONAL_METRIC_PREFIXES) for k in m)


def _compare_evals(rep: DiffReport, met_a: dict[int, dict], met_b: dict[int, dict], steps: Sequence[int]) -> None:
    """The evaluations' completions (``EVAL_FINGERPRINT_KEY``) at the common metrics steps: compared where both
    runs fingerprinted them; a step both runs evaluated but only one fingerprinted (recorded before the key
    existed) is said in a note. (A difference is also a metric difference: it makes the verdict.)"""
    key = EVAL_FINGERPRINT_KEY
    absent: dict[str, list[int]] = {"A": [], "B": []}
    for s in steps:
        ma, mb = met_a[s], met_b[s]
        if key in ma and key in mb:
            rep.eval_steps_compared.append(s)
            if not float_bits_equal(ma[key], mb[key]):
                rep.eval_diverged_steps.append(s)
        elif key in ma or key in mb:
            run, lacking = ("B", mb) if key in ma else ("A", ma)
            if _evaluated(lacking):  # it evaluated the step (a run without eval is no difference, as eval/* are)
                absent[run].append(s)
    for run, missing in absent.items():
        if missing:
            rep.notes.append(f"eval completions not compared at step(s) {_ranges(missing)}: run {run} has no "
                             f"{key} (recorded before evaluations were fingerprinted); its eval/* numbers are "
                             "compared alone")


# ------------------------------------------------------------------------------------------------- driver


def _ran_resumes(record: dict, fps: dict[int, dict], label: str, notes: list[str]) -> list:
    """The input differences of the run's resumes that ran a step: an entry whose ``from_step`` is past the last
    fingerprinted step (a resume of a finished run, which older rlrepro recorded too) changed no recorded bit,
    and is said in a note instead."""
    last = max(fps, default=0)
    kept = [e for e in record.get("resumes") or [] if not isinstance(e.get("from_step"), int) or e["from_step"] <= last]
    for e in record.get("resumes") or []:
        if e not in kept:
            notes.append(f"run {label}: its resume at step {e['from_step']} ran no step (the run's last fingerprinted "
                         f"step is {last}): the inputs it recorded are not compared")
    return resumed_differences(dict(record, resumes=kept), label)


def _inputs(run: Path) -> tuple[dict | None, str | None]:
    """(inputs.json or None, None) or (None, why it cannot be read)."""
    try:
        return read_inputs(run), None
    except ReproError as e:
        return None, str(e)


def diff_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, steps: Iterable[int] | None = None,
              detail: bool = True, ignore_config_keys: Iterable[str] = ()) -> DiffReport:
    """Compare two run directories. ``steps`` restricts the comparison to those steps (``rlrepro verify`` uses it
    for a re-executed window); ``detail=False`` skips reading rollout files; ``ignore_config_keys``: more config
    keys (patterns) to leave out of the config comparison (``rlrepro verify``: the checkpoint keys it sets).
    Raises ReproError for a missing directory or a missing / corrupt fingerprints.jsonl, metrics.jsonl or
    config.yaml."""
    a, b = Path(run_a), Path(run_b)
    for p in (a, b):
        missing = missing_run_dir("diff", p, need_config=False, inside=False)  # the one wording of every command
        if missing is not None:
            raise ReproError(missing)
    rep = DiffReport(run_a=str(a), run_b=str(b))

    # first: when the records diverge, this is the likely cause; an unreadable one (damaged, or of another rlrepro
    # version) cannot decide the verdict either, so it is said and the records are compared
    (inp_a, err_a), (inp_b, err_b) = _inputs(a), _inputs(b)
    unread = [f"run {r}: {e}" for r, e in (("A", err_a), ("B", err_b)) if e is not None]
    if unread:
        rep.notes.extend(f"inputs not compared: {u}" for u in unread)
        rep.inputs_not_compared = [f"{INPUTS_FILE} unreadable in {u}" for u in unread]
    elif inp_a is not None and inp_b is not None:
        rep.inputs_compared = True
        rep.input_diffs = input_differences(inp_a, inp_b)  # and the resumes' (below, once the steps are known)
        rep.inputs_not_compared = uncompared_inputs(inp_a, inp_b)
    elif inp_a is not None or inp_b is not None:
        rep.notes.append(f"inputs not compared: no {INPUTS_FILE} in run {'A' if inp_a is None else 'B'}")
        rep.inputs_not_compared = [f"no {INPUTS_FILE} in run {'A' if inp_a is None else 'B'}"]
    else:  # older runs diff as before; --strict-inputs cannot pass them
        rep.inputs_not_compared = [f"no {INPUTS_FILE} in either run"]

    cfg_a, cfg_b = load_config(a), load_config(b)
    if cfg_a is None or cfg_b is None:
        missing = [str(p / CONFIG_FILE) for p, c in ((a, cfg_a), (b, cfg_b)) if c is None]
        rep.notes.append(f"config not compared: missing {', '.join(missing)}")
    else:
        rep.config_diffs = diff_configs(cfg_a, cfg_b, ignore_config_keys)

    fps_a, fps_b = read_fingerprints(a, rep.notes), read_fingerprints(b, rep.notes)
    if rep.inputs_compared:  # what a resume of either run (or verify --from-step) recorded of its own inputs
        rep.input_diffs += _ran_resumes(inp_a, fps_a, "A", rep.notes) + _ran_resumes(inp_b, fps_b, "B", rep.notes)
    met_a, met_b = read_metrics(a, rep.notes), read_metrics(b, rep.notes)
    want = set(steps) if steps is not None else None
    if want is not None:
        fps_a = {s: r for s, r in fps_a.items() if s in want}
        fps_b = {s: r for s, r in fps_b.items() if s in want}
    common = sorted(set(fps_a) & set(fps_b))
    rep.steps_compared = common
    rep.steps_only_a = sorted(set(fps_a) - set(fps_b))
    rep.steps_only_b = sorted(set(fps_b) - set(fps_a))
    if not common:
        which = "" if want is None else f" among the steps asked for ({_ranges(sorted(want)) or 'none'})"
        have = ", ".join(f"{p / FINGERPRINTS_FILE}: {len(f)} step(s)" + (f" ({_ranges(list(f))})" if f else "")
                         for p, f in ((a, fps_a), (b, fps_b)))
        raise ReproError(f"no common fingerprinted steps to compare{which} ({have}); a run with 0 steps has not "
                         "finished one yet: wait for it, or check that the paths name the runs meant")
    if detail:  # each run's rollout files against its own fingerprints: an edited file is not what the run computed
        from .rollout_check import check_runs

        rep.rollout_mismatches, rep.rollout_files_checked = check_runs(a, fps_a, b, fps_b)

    for step in common:
        dv = _compare_step(step, fps_a[step], fps_b[step])
        if dv is None:
            continue
        rep.diverged_steps.append(step)
        if rep.divergence is None:
            if detail:
                try:
                    _sample_detail(dv, a, b)
                except (KeyError, TypeError, AttributeError, ValueError) as e:  # a malformed rollout record
                    dv.token = None
                    dv.detail_note = (f"rollout detail unavailable: a malformed record in the rollout files of step "
                                      f"{step} ({type(e).__name__}: {e}); compare with --no-detail")
            rep.divergence = dv
    for f in FIELDS:  # null in both runs, or in one: nothing was compared, which is not "identical" (report)
        unrecorded = [s for s in common if fps_a[s].get(f) is None and fps_b[s].get(f) is None]
        if unrecorded:
            rep.fields_not_recorded[f] = unrecorded
        lone = {r: [s for s in common if has[s].get(f) is not None and lacks[s].get(f) is None]
                for r, has, lacks in (("A", fps_a, fps_b), ("B", fps_b, fps_a))}
        if lone["A"] or lone["B"]:
            rep.fields_recorded_in_one_run[f] = {r: steps for r, steps in lone.items() if steps}
    _note_uncompared_state(rep, fps_a, fps_b, common)
    _note_unknown_keys(rep, fps_a, fps_b, common)

    if met_a is None or met_b is None:
        missing = [str(p / METRICS_FILE) for p, m in ((a, met_a), (b, met_b)) if m is None]
        rep.notes.append(f"metrics not compared: missing {', '.join(missing)}")
        rep.metrics_missing = [r for r, m in (("A", met_a), ("B", met_b)) if m is None]
    else:
        mcommon = sorted(set(met_a) & set(met_b) & (want if want is not None else set(met_a)))
        rep.metrics_compared = len(mcommon)
        for s in mcommon:
            md = _metric_diffs(s, met_a[s], met_b[s])
            if md:
                rep.metrics_diverged_steps.append(s)
                if not rep.metric_diffs:
                    rep.metric_diffs = md
        _compare_evals(rep, met_a, met_b, mcommon)
        window = want if want is not None else set(met_a) | set(met_b)
        rep.metrics_only_a = sorted((set(met_a) - set(met_b)) & window)
        rep.metrics_only_b = sorted((set(met_b) - set(met_a)) & window)
        only = sorted(rep.metrics_only_a + rep.metrics_only_b)
        if only:
            rep.notes.append(f"metrics.jsonl steps in one run only: {_ranges(only)}")

    differ = rep.divergence is not None or rep.metric_diffs or rep.rollout_mismatches
    rep.verdict = "diverged" if differ else "identical"
    return rep


def main_diff(argv: Sequence[str] | None = None) -> int:
    """``rlrepro diff RUN_A RUN_B [--json] [--strict] [--strict-inputs]``: 0 identical, 1 diverged, 2 error."""
    parser = argparse.ArgumentParser(
        prog="rlrepro diff",
        description="Compare two run directories step by step: exit 0 identical, 1 diverged, 2 error.")
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true",
                        help="also exit 1 when the runs recorded different sets of steps (fingerprints.jsonl or "
                        "metrics.jsonl, or one run has no metrics.jsonl), or a fingerprint field not recorded in "
                        "both runs (null in either)")
    parser.add_argument("--strict-inputs", action="store_true",
                        help=f"also exit 1 when an input that can change bits differs ({INPUTS_FILE}) or cannot "
                        "be compared (a run without it, or without the rlrepro code digest)")
    parser.add_argument("--no-detail", action="store_true",
                        help="do not read the rollout files: no token detail, and no check of each run's rollout "
                        "files against its own fingerprints (a file that does not match them exits 1)")
    parser.add_argument("--bisect", action="store_true",
                        help="on divergence, replay the first divergent step and name the first differing op "
                        "(exit 2 when the replay fails); it stops before any replay when inputs that can change "
                        "bits differ, rlrepro's own code included")
    parser.add_argument("--allow-code-change", action="store_true",
                        help="with --bisect: replay even though rlrepro's code digest differs between the runs "
                        "(inputs.json rlrepro_code); a WARNING says so, as the replay runs this rlrepro's code")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    if args.allow_code_change and not args.bisect:
        print("rlrepro diff: error: --allow-code-change applies to --bisect only: add --bisect (or drop "
              "--allow-code-change)", file=sys.stderr)
        return 2
    try:
        rep = diff_runs(args.run_a, args.run_b, detail=not args.no_detail)
    except ReproError as e:
        print(f"rlrepro diff: error: {e}", file=sys.stderr)
        return 2
    bisect, bisect_error = None, None
    if args.bisect and rep.first_divergent_step is not None:
        from .bisect import bisect_report

        try:
            bisect = bisect_report(rep, load_config(Path(args.run_a)), load_config(Path(args.run_b)),
                                   allow_code_change=args.allow_code_change)
        except Exception as e:  # noqa: BLE001 - whatever the replay hits is a bisect error (exit 2), not a crash
            bisect_error = str(e) if isinstance(e, ReproError) else f"{type(e).__name__}: {e}"
    if args.json:
        out = json.loads(rep.to_json())
        out["strict_failures"] = rep.strict_failures(args.strict, args.strict_inputs)
        if bisect is not None:
            out["bisect"] = json_safe(bisect.to_dict())
        if bisect_error is not None:
            out["bisect_error"] = bisect_error
        print(json.dumps(out, indent=2, allow_nan=False))
    else:
        print(rep.format(strict=args.strict, strict_inputs=args.strict_inputs))
        if bisect is not None:
            print(bisect.format())
    code_changed = [d.message for d in rep.input_diffs if d.bits and d.what == CODE_KEY]
    attempted = args.bisect and rep.first_divergent_step is not None
    if attempted and args.allow_code_change and code_changed and (args.json or bisect is None):
        from .bisect import code_change_warning  # said on stdout with the bisect result, else here

        print(f"rlrepro diff: {code_change_warning('; '.join(code_changed))}", file=sys.stderr)
    if bisect_error is not None:
        print(f"rlrepro diff: bisect error: {bisect_error}", file=sys.stderr)
        return 2
    return rep.exit_code(strict=args.strict, strict_inputs=args.strict_inputs)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_diff())
