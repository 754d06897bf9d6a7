"""``rlrepro diff RUN_A RUN_B``: compare two run directories step by step and name the first divergence.

Exit codes: 0 identical, 1 diverged, 2 error (missing directory, missing or corrupt fingerprints.jsonl, ...).
When both runs have ``inputs.json`` (:mod:`.inputs`) it is compared first and its differences are printed before
the records', as the likely cause of a divergence; they do not change the verdict, which is the records' alone.
``--strict`` also exits 1 when the runs recorded different sets of steps; ``--strict-inputs`` also exits 1 when an
input that can change bits differs (data, tokenizer, starting weights, versions, GPU, bit-relevant environment).
Imports neither torch nor anything of rlrepro outside this package.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .records import (
    CONFIG_FILE,
    FINGERPRINTS_FILE,
    METRICS_FILE,
    ReproError,
    float_bits_equal,
    read_rollouts,
    read_step_records,
)
from .inputs import INPUTS_FILE, InputDiff, input_differences, read_inputs
from .turns import TurnPosition, kind_text, num_turns_text, record_value, structure_text, turn_position, where_text

__all__ = ["ReproError", "DiffReport", "ConfigDiff", "Divergence", "TokenDiff", "TurnPosition", "MetricDiff",
           "diff_runs", "main_diff", "FIELDS", "DEFAULT_IGNORED_CONFIG_KEYS"]

# kept in sync with fingerprint.FIELDS / SAMPLE_FIELDS (this module must not import torch)
FIELDS = ("prompt_ids", "rollout_token_ids", "rollout_logprobs", "rewards", "advantages", "loss", "grad_norm",
          "weights")
SAMPLE_FIELDS = {"prompt_ids": "sample_prompt_ids", "rollout_token_ids": "sample_token_ids",
                 "rollout_logprobs": "sample_logprobs"}
# multi-turn steps only (fingerprint.TURN_FIELDS): absent from single-turn records, compared where either run has them
TURN_SAMPLE_FIELDS = {"loss_masks": "sample_loss_masks", "turns": "sample_turns"}
COMPARED_FIELDS = FIELDS[:3] + tuple(TURN_SAMPLE_FIELDS) + FIELDS[3:]   # the order diff reports them in
KNOWN_FORMATS = ("rlrepro.fingerprint.v1",)
DEFAULT_IGNORED_CONFIG_KEYS = ("run.dir", "run.resume", "logger.*", "repro.ignore_keys")
IGNORED_METRIC_PREFIXES = ("perf/",)
# held-out evaluation (eval.every): compared where both runs logged it, not a difference where one run did not
# evaluate (a run with eval on trains the same bits as one without)
OPTIONAL_METRIC_PREFIXES = ("eval/",)
_FINISH_SHARE = "*/finish_*_frac"  # absent from records before 2026-12-04 where no episode ended so: 0.0

_ABSENT = "<absent>"


@dataclass
class ConfigDiff:
    key: str
    a: Any
    b: Any


@dataclass
class TokenDiff:
    """Where two samples first differ, read from the runs' rollout files."""
    what: str                      # "token_ids" | "logprobs" | "prompt_token_ids" | "reward" | "advantage" | "length"
    #                                | "loss_mask" | "turns"
    position: int | None           # token position (None for reward / advantage; the turn index for "turns")
    a: Any                         # the values at that position (token id, logprob, reward, ...)
    b: Any
    token_a: int | None = None     # for logprob differences: the token ids at that position
    token_b: int | None = None
    logprob_a: float | None = None  # for token differences: the logprobs at that position
    logprob_b: float | None = None
    length_a: int | None = None
    length_b: int | None = None
    turn_a: TurnPosition | None = None   # multi-turn samples: the turn of ``position`` in each run
    turn_b: TurnPosition | None = None


@dataclass
class Divergence:
    step: int
    field: str                     # first differing field in FIELDS order
    fields: list[str]              # every differing field at that step
    sample_index: int | None = None   # position in the step's sample list (= line in the rollout file)
    prompt_uid: Any = None
    sample_index_in_prompt: int | None = None
    num_samples_a: int | None = None
    num_samples_b: int | None = None
    token: TokenDiff | None = None
    detail_note: str | None = None
    num_turns_a: int | None = None    # the sample is a multi-turn episode (in either run)
    num_turns_b: int | None = None


@dataclass
class MetricDiff:
    step: int
    key: str
    a: Any
    b: Any


@dataclass
class DiffReport:
    run_a: str
    run_b: str
    verdict: str = "identical"                     # "identical" | "diverged"
    steps_compared: list[int] = field(default_factory=list)
    steps_only_a: list[int] = field(default_factory=list)
    steps_only_b: list[int] = field(default_factory=list)
    config_diffs: list[ConfigDiff] = field(default_factory=list)
    inputs_compared: bool = False                  # both runs have inputs.json
    input_diffs: list[InputDiff] = field(default_factory=list)
    divergence: Divergence | None = None           # first fingerprint divergence
    diverged_steps: list[int] = field(default_factory=list)
    metric_diffs: list[MetricDiff] = field(default_factory=list)   # every differing key at the first metric step
    metrics_diverged_steps: list[int] = field(default_factory=list)
    metrics_compared: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"

    @property
    def complete(self) -> bool:
        """Both runs recorded the same steps."""
        return not self.steps_only_a and not self.steps_only_b

    @property
    def first_divergent_step(self) -> int | None:
        steps = [s for s in (self.divergence.step if self.divergence else None,
                             self.metric_diffs[0].step if self.metric_diffs else None) if s is not None]
        return min(steps) if steps else None

    @property
    def inputs_differ_in_bits(self) -> bool:
        """An input that can change bits differs (inputs.json)."""
        return any(d.bits for d in self.input_diffs)

    def exit_code(self, strict: bool = False, strict_inputs: bool = False) -> int:
        if not self.identical:
            return 1
        if strict_inputs and self.inputs_differ_in_bits:
            return 1
        return 1 if strict and not self.complete else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["first_divergent_step"] = self.first_divergent_step
        d["complete"] = self.complete
        d["inputs_differ_in_bits"] = self.inputs_differ_in_bits
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=True, default=str)

    def format(self, max_config_diffs: int = 50) -> str:
        L = [f"rlrepro diff: A = {self.run_a}", f"              B = {self.run_b}"]
        if self.inputs_compared:
            if self.input_diffs:
                L.append(f"inputs: {len(self.input_diffs)} difference(s) in {INPUTS_FILE} "
                         "(the likely cause of a divergence):")
                L.extend(f"  {d.message}" for d in self.input_diffs)
            else:
                L.append(f"inputs: same ({INPUTS_FILE}: data, tokenizer, starting weights, environment, versions)")
        if self.config_diffs:
            L.append(f"config: {len(self.config_diffs)} key(s) differ (ignored: run.dir, run.resume, logger.*, "
                     "keys in repro.ignore_keys)")
            for c in self.config_diffs[:max_config_diffs]:
                L.append(f"  {c.key}: A={_short(c.a)}  B={_short(c.b)}")
            if len(self.config_diffs) > max_config_diffs:
                L.append(f"  ... {len(self.config_diffs) - max_config_diffs} more")
        else:
            L.append("config: same (after ignored keys)")
        sc = self.steps_compared
        L.append(f"fingerprints: {len(sc)} common step(s)" + (f" ({_ranges(sc)})" if sc else ""))
        if self.steps_only_a:
            L.append(f"  only in A: {len(self.steps_only_a)} step(s) ({_ranges(self.steps_only_a)})")
        if self.steps_only_b:
            L.append(f"  only in B: {len(self.steps_only_b)} step(s) ({_ranges(self.steps_only_b)})")
        dv = self.divergence
        if dv is not None:
            others = [f for f in dv.fields if f != dv.field]
            L.append(f"FIRST DIVERGENCE: step {dv.step}, field {dv.field}"
                     + (f" (also differ: {', '.join(others)})" if others else ""))
            if dv.num_samples_a != dv.num_samples_b:
                L.append(f"  number of samples: A={dv.num_samples_a} B={dv.num_samples_b}")
            if dv.sample_index is not None:
                who = f"  sample {dv.sample_index}"
                if dv.prompt_uid is not None:
                    who += f" (prompt_uid {dv.prompt_uid!r}, sample_index {dv.sample_index_in_prompt})"
                if dv.num_turns_a is not None or dv.num_turns_b is not None:
                    who += ", a multi-turn episode: " + num_turns_text(dv.num_turns_a, dv.num_turns_b)
                L.append(who)
            t = dv.token
            if t is not None:
                where = where_text(t.turn_a, t.turn_b)
                if t.what == "length":
                    L.append(f"    same prefix, lengths differ: A={t.length_a} B={t.length_b} tokens")
                elif t.what == "token_ids":
                    L.append(f"    first differing token at position {t.position}{where}: A={t.a} B={t.b}"
                             + (f"  (logprobs A={t.logprob_a!r} B={t.logprob_b!r})"
                                if t.logprob_a is not None or t.logprob_b is not None else ""))
                elif t.what == "logprobs":
                    L.append(f"    first differing logprob at position {t.position} (token {t.token_a}"
                             f"{where.replace(' (', '; ', 1) or ')'}: A={t.a!r} B={t.b!r}")
                elif t.what in ("loss_mask", "turns"):
                    L.append(f"    {structure_text(t.what, t.position, t.a, t.b, where)}")
                elif t.what == "prompt_token_ids":
                    L.append(f"    first differing prompt token at position {t.position}: A={t.a} B={t.b}")
                else:
                    L.append(f"    {t.what}: A={t.a!r} B={t.b!r}")
                kind = kind_text(t.what, t.turn_a, t.turn_b)
                if kind:
                    L.append(f"    {kind}")
            if dv.detail_note:
                L.append(f"    ({dv.detail_note})")
            L.append(f"  diverged steps: {len(self.diverged_steps)} of {len(sc)} ({_ranges(self.diverged_steps)})")
        if self.metrics_compared:
            if self.metric_diffs:
                s = self.metric_diffs[0].step
                L.append(f"metrics: first difference at step {s} "
                         f"({len(self.metrics_diverged_steps)} step(s) differ of {self.metrics_compared}):")
                for m in self.metric_diffs[:20]:
                    L.append(f"  {m.key}: A={m.a!r} B={m.b!r}")
            else:
                L.append(f"metrics: same on {self.metrics_compared} common step(s) (perf/* ignored)")
        for n in self.notes:
            L.append(f"note: {n}")
        verdict = self.verdict.upper()
        if self.identical and not self.complete:
            verdict += " on the common steps (step counts differ)"
        if self.identical and self.inputs_differ_in_bits:
            verdict += " (although inputs that can change bits differ)"
        L.append(f"verdict: {verdict}")
        return "\n".join(L)


def _short(v: Any, n: int = 80) -> str:
    s = v if v == _ABSENT else repr(v)
    return s if len(s) <= n else s[:n - 3] + "..."


def _ranges(steps: Sequence[int]) -> str:
    steps = sorted(steps)
    out = []
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    if len(out) > 12:
        out = out[:6] + ["..."] + out[-5:]
    return ", ".join(out)


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


def diff_configs(cfg_a: dict, cfg_b: dict) -> list[ConfigDiff]:
    patterns = list(DEFAULT_IGNORED_CONFIG_KEYS) + _ignore_keys(cfg_a) + _ignore_keys(cfg_b)
    fa, fb = flatten(cfg_a), flatten(cfg_b)
    out = []
    for key in sorted(set(fa) | set(fb)):
        if _ignored(key, patterns):
            continue
        a, b = fa.get(key, _ABSENT), fb.get(key, _ABSENT)
        if type(a) is not type(b) or a != b:
            out.append(ConfigDiff(key, a, b))
    return out


# ------------------------------------------------------------------------------------------- fingerprints


def read_fingerprints(run_dir: str | os.PathLike) -> dict[int, dict]:
    path = Path(run_dir) / FINGERPRINTS_FILE
    if not path.exists():
        raise ReproError(f"{path}: file not found")
    recs = read_step_records(path, required=FIELDS)
    for step, rec in recs.items():
        fmt = rec.get("format", KNOWN_FORMATS[0])
        if fmt not in KNOWN_FORMATS:
            raise ReproError(f"{path}: step {step}: unknown fingerprint format {fmt!r}")
        for f in FIELDS:
            if rec[f] is not None and not isinstance(rec[f], str):
                raise ReproError(f"{path}: step {step}: field {f!r} must be a hex string or null")
        for f in TURN_SAMPLE_FIELDS:
            if rec.get(f) is not None and not isinstance(rec[f], str):
                raise ReproError(f"{path}: step {step}: field {f!r} must be a hex string or null")
        for key in (*SAMPLE_FIELDS.values(), *TURN_SAMPLE_FIELDS.values()):
            if key in rec and not isinstance(rec[key], list):
                raise ReproError(f"{path}: step {step}: field {key!r} must be a list")
    return recs


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


def _compare_step(step: int, fa: dict, fb: dict) -> Divergence | None:
    differing = [f for f in COMPARED_FIELDS if fa.get(f) != fb.get(f)]
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


# ------------------------------------------------------------------------------------------------ metrics


def read_metrics(run_dir: str | os.PathLike) -> dict[int, dict] | None:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return None
    return read_step_records(path)


def _metric_diffs(step: int, ma: dict, mb: dict) -> list[MetricDiff]:
    out = []
    for key in sorted(set(ma) | set(mb)):
        if key == "step" or key.startswith(IGNORED_METRIC_PREFIXES):
            continue
        a, b = ma.get(key, _ABSENT), mb.get(key, _ABSENT)
        if key.startswith(OPTIONAL_METRIC_PREFIXES) and (key not in ma or key not in mb):
            continue
        zero = 0.0 if fnmatch.fnmatchcase(key, _FINISH_SHARE) else _ABSENT  # what an absent value compares as
        if not float_bits_equal(zero if a == _ABSENT else a, zero if b == _ABSENT else b):
            out.append(MetricDiff(step, key, a, b))
    return out


# ------------------------------------------------------------------------------------------------- driver


def diff_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, steps: Iterable[int] | None = None,
              detail: bool = True) -> DiffReport:
    """Compare two run directories. ``steps`` restricts the comparison to those steps (``rlrepro verify`` uses it
    for a re-executed window); ``detail=False`` skips reading rollout files.
    Raises ReproError for a missing directory or a missing / corrupt fingerprints.jsonl, metrics.jsonl or
    config.yaml."""
    a, b = Path(run_a), Path(run_b)
    for p in (a, b):
        if not p.exists():
            raise ReproError(f"{p}: run directory not found")
        if not p.is_dir():
            raise ReproError(f"{p}: not a directory")
    rep = DiffReport(run_a=str(a), run_b=str(b))

    inp_a, inp_b = read_inputs(a), read_inputs(b)  # first: when the records diverge, this is the likely cause
    if inp_a is not None and inp_b is not None:
        rep.inputs_compared = True
        rep.input_diffs = input_differences(inp_a, inp_b)
    elif inp_a is not None or inp_b is not None:
        rep.notes.append(f"inputs not compared: no {INPUTS_FILE} in run {'A' if inp_a is None else 'B'}")

    cfg_a, cfg_b = load_config(a), load_config(b)
    if cfg_a is None or cfg_b is None:
        missing = [str(p / CONFIG_FILE) for p, c in ((a, cfg_a), (b, cfg_b)) if c is None]
        rep.notes.append(f"config not compared: missing {', '.join(missing)}")
    else:
        rep.config_diffs = diff_configs(cfg_a, cfg_b)

    fps_a, fps_b = read_fingerprints(a), read_fingerprints(b)
    met_a, met_b = read_metrics(a), read_metrics(b)
    want = set(steps) if steps is not None else None
    if want is not None:
        fps_a = {s: r for s, r in fps_a.items() if s in want}
        fps_b = {s: r for s, r in fps_b.items() if s in want}
    common = sorted(set(fps_a) & set(fps_b))
    rep.steps_compared = common
    rep.steps_only_a = sorted(set(fps_a) - set(fps_b))
    rep.steps_only_b = sorted(set(fps_b) - set(fps_a))
    if not common:
        raise ReproError(f"no common fingerprinted steps to compare ({a / FINGERPRINTS_FILE}: {len(fps_a)} step(s), "
                         f"{b / FINGERPRINTS_FILE}: {len(fps_b)} step(s))")

    for step in common:
        dv = _compare_step(step, fps_a[step], fps_b[step])
        if dv is None:
            continue
        rep.diverged_steps.append(step)
        if rep.divergence is None:
            if detail:
                _sample_detail(dv, a, b)
            rep.divergence = dv
    for s in common:
        fw = [f for f in FIELDS if fps_a[s].get(f) is None and fps_b[s].get(f) is None]
        if fw:
            rep.notes.append(f"fields not fingerprinted in either run (null): {', '.join(fw)}")
            break

    if met_a is None or met_b is None:
        missing = [str(p / METRICS_FILE) for p, m in ((a, met_a), (b, met_b)) if m is None]
        rep.notes.append(f"metrics not compared: missing {', '.join(missing)}")
    else:
        mcommon = sorted(set(met_a) & set(met_b) & (want if want is not None else set(met_a)))
        rep.metrics_compared = len(mcommon)
        for s in mcommon:
            md = _metric_diffs(s, met_a[s], met_b[s])
            if md:
                rep.metrics_diverged_steps.append(s)
                if not rep.metric_diffs:
                    rep.metric_diffs = md
        only = sorted((set(met_a) ^ set(met_b)) & (want if want is not None else set(met_a) | set(met_b)))
        if only:
            rep.notes.append(f"metrics.jsonl steps in one run only: {_ranges(only)}")

    rep.verdict = "diverged" if rep.divergence is not None or rep.metric_diffs else "identical"
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
                        help="also exit 1 when the runs recorded different sets of steps")
    parser.add_argument("--strict-inputs", action="store_true",
                        help=f"also exit 1 when an input that can change bits differs ({INPUTS_FILE})")
    parser.add_argument("--no-detail", action="store_true", help="do not read rollout files for token detail")
    parser.add_argument("--bisect", action="store_true",
                        help="on divergence, replay the first divergent step and name the first differing op")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    try:
        rep = diff_runs(args.run_a, args.run_b, detail=not args.no_detail)
    except ReproError as e:
        print(f"rlrepro diff: error: {e}", file=sys.stderr)
        return 2
    bisect = None
    if args.bisect and rep.divergence is not None:
        from .bisect import bisect_runs

        try:
            bisect = bisect_runs(args.run_a, args.run_b, step=rep.divergence.step,
                                 sample_index=rep.divergence.sample_index, config_a=load_config(Path(args.run_a)),
                                 config_b=load_config(Path(args.run_b)))
        except ReproError as e:
            print(f"rlrepro diff: bisect: {e}", file=sys.stderr)
    if args.json:
        out = json.loads(rep.to_json())
        if bisect is not None:
            out["bisect"] = bisect.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(rep.format())
        if bisect is not None:
            print(bisect.format())
    return rep.exit_code(strict=args.strict, strict_inputs=args.strict_inputs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_diff())
