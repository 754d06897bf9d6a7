"""The report ``rlrepro diff`` gives (``DiffReport``, split from :mod:`.diff`): what was compared, the first
divergence, and its human (``format``) and JSON (``to_json``) forms.

JSON: floats that are not finite are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (standard
JSON has no such numbers; ``json_safe``), everything else as plain JSON values.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .inputs import INPUTS_FILE, InputDiff
from .records import float_bits_equal
from .turns import TurnPosition, kind_text, num_turns_text, structure_text, where_text

__all__ = ["ConfigDiff", "TokenDiff", "Divergence", "MetricDiff", "DiffReport", "json_safe", "TurnPosition"]

_ABSENT = "<absent>"


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (dicts, lists
    and tuples walked), so that ``json.dumps(..., allow_nan=False)`` writes standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


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
    metrics_missing: list[str] = field(default_factory=list)       # "A" / "B": the run has no metrics.jsonl
    metrics_only_a: list[int] = field(default_factory=list)        # metrics.jsonl steps of one run only
    metrics_only_b: list[int] = field(default_factory=list)
    inputs_not_compared: list[str] = field(default_factory=list)   # why (part of) inputs.json was not compared
    # evaluations (metrics.jsonl repro/eval_fingerprint): the steps both runs fingerprinted, those that differ
    eval_steps_compared: list[int] = field(default_factory=list)
    eval_diverged_steps: list[int] = field(default_factory=list)
    # fingerprint fields null in both runs (not fingerprinted), with the common steps where they are: not compared,
    # so not "identical" either (the verdict says so; --strict fails)
    fields_not_recorded: dict[str, list[int]] = field(default_factory=dict)
    # fingerprint fields null in one run and a digest in the other: {field: {"A"/"B": the common steps where only
    # that run recorded it}}; not compared either (no bit difference, nor equal: the verdict says so; --strict fails)
    fields_recorded_in_one_run: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    # each run's rollout files against its own fingerprints (rollout_check; not with detail=False / --no-detail):
    # {"A"/"B": the steps whose file was checked}, and every file that does not give its run's digests (a divergence)
    rollout_files_checked: dict[str, list[int]] = field(default_factory=dict)
    rollout_mismatches: list[dict] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"

    @property
    def complete(self) -> bool:
        """Both runs recorded the same steps: in fingerprints.jsonl and in metrics.jsonl (which one run lacks)."""
        return not (self.steps_only_a or self.steps_only_b or self.metrics_only_a or self.metrics_only_b
                    or len(self.metrics_missing) == 1)

    @property
    def first_divergent_step(self) -> int | None:
        steps = [s for s in (self.divergence.step if self.divergence else None,
                             self.metric_diffs[0].step if self.metric_diffs else None) if s is not None]
        return min(steps) if steps else None

    @property
    def first_divergence_source(self) -> str | None:
        """Where the first divergent step was found: "fingerprints", "metrics", "fingerprints and metrics" (both
        differ first at that step), or None."""
        step = self.first_divergent_step
        if step is None:
            return None
        fp = self.divergence is not None and self.divergence.step == step
        met = bool(self.metric_diffs) and self.metric_diffs[0].step == step
        return "fingerprints and metrics" if fp and met else ("fingerprints" if fp else "metrics")

    @property
    def inputs_differ_in_bits(self) -> bool:
        """An input that can change bits differs (inputs.json)."""
        return any(d.bits for d in self.input_diffs)

    def strict_failures(self, strict: bool = False, strict_inputs: bool = False) -> list[str]:
        """Why ``--strict`` / ``--strict-inputs`` fail runs whose records agree (empty: they pass)."""
        out = []
        if strict:
            for what, a, b in (("fingerprints.jsonl", self.steps_only_a, self.steps_only_b),
                               ("metrics.jsonl", self.metrics_only_a, self.metrics_only_b)):
                if a or b:
                    out.append(f"--strict: {what} steps in one run only: "
                               + "; ".join(f"{r}: {_ranges(x)}" for r, x in (("A", a), ("B", b)) if x))
            if len(self.metrics_missing) == 1:
                out.append(f"--strict: run {self.metrics_missing[0]} has no metrics.jsonl")
            if self.fields_not_recorded:
                out.append("--strict: fingerprint field(s) not recorded in either run: "
                           + ", ".join(self.fields_not_recorded))
            if self.fields_recorded_in_one_run:
                out.append("--strict: fingerprint field(s) recorded in only one run: "
                           + ", ".join(f"{f} ({' and '.join(f'run {r}' for r in runs)} only)"
                                       for f, runs in self.fields_recorded_in_one_run.items()))
        if strict_inputs:
            bits = [d for d in self.input_diffs if d.bits]
            if bits:
                out.append(f"--strict-inputs: {len(bits)} input(s) that can change bits differ ({INPUTS_FILE})")
            out.extend(f"--strict-inputs: inputs not compared: {r}" for r in self.inputs_not_compared)
        return out

    def exit_code(self, strict: bool = False, strict_inputs: bool = False) -> int:
        if not self.identical:
            return 1
        return 1 if self.strict_failures(strict, strict_inputs) else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["first_divergent_step"] = self.first_divergent_step
        d["first_divergence_source"] = self.first_divergence_source
        d["complete"] = self.complete
        d["inputs_differ_in_bits"] = self.inputs_differ_in_bits
        return d

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict`` as standard JSON: non-finite floats as ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``."""
        return json.dumps(json_safe(self.to_dict()), indent=indent, allow_nan=False, default=str)

    def format(self, max_config_diffs: int = 50, *, strict: bool = False, strict_inputs: bool = False) -> str:
        """The human report; ``strict`` / ``strict_inputs``: also say why those flags fail it (``strict_failures``)."""
        L = [f"rlrepro diff: A = {self.run_a}", f"              B = {self.run_b}"]
        if self.inputs_compared:
            if self.input_diffs:
                L.append(f"inputs: {len(self.input_diffs)} difference(s) in {INPUTS_FILE} "
                         "(the likely cause of a divergence):")
                L.extend(f"  {d.message}" for d in self.input_diffs)
            else:
                L.append(f"inputs: same ({INPUTS_FILE}: data, tokenizer, starting weights, environment, versions"
                         + (", rlrepro code)" if not self.inputs_not_compared else ")"))
            L.extend(f"  not compared: {r}" for r in self.inputs_not_compared)
        if self.config_diffs:
            L.append(f"config: {len(self.config_diffs)} key(s) differ (ignored: run.dir, run.resume, logger.*, "
                     "keys in repro.ignore_keys)")
            for c in self.config_diffs[:max_config_diffs]:
                L.append(f"  {c.key}: A={_short(c.a)}  B={_short(c.b)}" + _hidden_difference(c.a, c.b))
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
        for f, steps in self.fields_not_recorded.items():
            L.append(f"  {f}: not recorded in either run (null) at {len(steps)} step(s) ({_ranges(steps)}): "
                     "not compared")
        for f, runs in self.fields_recorded_in_one_run.items():
            for r, steps in runs.items():
                L.append(f"  {f}: recorded in run {r} only (null in run {'B' if r == 'A' else 'A'}) at {len(steps)} "
                         f"step(s) ({_ranges(steps)}): not compared")
        dv = self.divergence
        metrics_first = bool(self.metric_diffs) and (dv is None or self.metric_diffs[0].step < dv.step)
        if metrics_first:  # the report's head is the first divergent step overall, wherever it was found
            keys = [m.key for m in self.metric_diffs]
            L.append(f"FIRST DIVERGENCE: step {self.metric_diffs[0].step}, in metrics.jsonl ("
                     + ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "") + "); "
                     + (f"the fingerprints agree there and first differ at step {dv.step}" if dv is not None
                        else "every common fingerprinted step is equal"))
        if dv is not None:
            others = [f for f in dv.fields if f != dv.field]
            L.append(("  first fingerprint divergence: " if metrics_first else "FIRST DIVERGENCE: ")
                     + f"step {dv.step}, field {dv.field}" + (f" (also differ: {', '.join(others)})" if others else ""))
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
        if self.rollout_mismatches:
            L.append(f"ROLLOUT FILES DO NOT MATCH THEIR RUN'S FINGERPRINTS: {len(self.rollout_mismatches)} file(s) "
                     "(the fingerprints are what the run computed; these files were changed or damaged since):")
            L.extend(f"  {m['message']}" for m in self.rollout_mismatches[:20])
            if len(self.rollout_mismatches) > 20:
                L.append(f"  ... {len(self.rollout_mismatches) - 20} more (--json lists them all)")
        elif any(self.rollout_files_checked.values()):
            L.append("rollout files: match their run's fingerprints.jsonl (" + ", ".join(
                f"run {r}: {len(s)} step(s)" for r, s in self.rollout_files_checked.items() if s) + ")")
        if self.metrics_compared:
            if self.metric_diffs:
                s = self.metric_diffs[0].step
                L.append(f"metrics: first difference at step {s} "
                         f"({len(self.metrics_diverged_steps)} step(s) differ of {self.metrics_compared}):")
                for m in self.metric_diffs[:20]:
                    L.append(f"  {m.key}: A={m.a!r} B={m.b!r}")
            else:
                L.append(f"metrics: same on {self.metrics_compared} common step(s) (perf/* ignored)")
        if self.eval_diverged_steps:
            ev = self.eval_diverged_steps
            L.append(f"eval completions: first difference at step {ev[0]} ({len(ev)} of "
                     f"{len(self.eval_steps_compared)} evaluated step(s) differ: {_ranges(ev)}; "
                     "repro/eval_fingerprint, the eval requests' token ids and logprobs)")
        elif self.eval_steps_compared:
            L.append(f"eval completions: same on {len(self.eval_steps_compared)} common evaluated step(s) "
                     "(repro/eval_fingerprint)")
        for n in self.notes:
            L.append(f"note: {n}")
        verdict = self.verdict.upper()
        uncompared = [f"{what}, so not compared: " + ", ".join(fields) for what, fields in (
            ("not recorded in either run", self.fields_not_recorded),
            ("recorded in only one run", self.fields_recorded_in_one_run)) if fields]
        if self.identical and uncompared:
            verdict += " in the recorded fields; " + "; ".join(uncompared)
        if self.identical and not self.complete:
            verdict += " on the common steps (step counts differ)"
        if self.identical and self.inputs_differ_in_bits:
            verdict += " (although inputs that can change bits differ)"
        failures = self.strict_failures(strict, strict_inputs) if self.identical else []
        L.extend(failures)
        if failures:
            verdict += "; exit 1: " + " and ".join(dict.fromkeys(f.split(":", 1)[0] for f in failures)) + " failed"
        L.append(f"verdict: {verdict}")
        return "\n".join(L)


def _short(v: Any, n: int = 80) -> str:
    s = v if v == _ABSENT else repr(v)
    return s if len(s) <= n else s[:n - 3] + "..."


def _first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any]:
    """(where, value in A, value in B) of the first place two values differ: a list index or dict key path, or
    ``[i:]`` for the rest of a string from its first differing character."""
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if not float_bits_equal(x, y):
                return _first_difference(x, y, f"{where}[{i}]")
        n = min(len(a), len(b))
        return f"{where}[{n}:]", a[n:], b[n:]
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b or not float_bits_equal(a[k], b[k]):
                return _first_difference(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{where}.{k}" if where else str(k))
    if isinstance(a, str) and isinstance(b, str) and a != _ABSENT and b != _ABSENT:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"{where}[{i}:]", a[i:], b[i:]
    return where, a, b


def _hidden_difference(a: Any, b: Any) -> str:
    """Where two values differ, when their shortened texts agree (a long list or template differing past the cut)."""
    if _short(a) != _short(b):
        return ""
    where, x, y = _first_difference(a, b)
    return f"  (first difference at {where or 'the value'}: A={_short(x, 40)}  B={_short(y, 40)})"


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

