"""``rlrepro show RUN [--step K] [--n 8]``: print what a run sampled at one step, as text.

For each of the first ``--n`` samples of the step's rollout file (``rollouts/step_NNNNNN.jsonl.gz``, which is in
key order, (prompt uid, sample index)): its key, reward, advantage, finish reason and length, then the prompt and
the completion (and the turns of a multi-turn episode). The text is the decoded text the run recorded
(``prompt_text``, ``completion_text``); files written before those fields existed are decoded with the run's
tokenizer (``RUN/base_model``, else the config's ``model.path``), or shown as token ids when there is none.

Exit 0, or 2 with a message naming what exists (a missing run, a step without a rollout file, a corrupt file).
Reads the run with ``records`` alone; torch is imported only to find a tokenizer for files without text.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from rlrepro.samples import Sample

from .records import (
    CONFIG_FILE,
    FINGERPRINTS_FILE,
    METRICS_FILE,
    ROLLOUTS_DIR,
    ReproError,
    missing_run_dir,
    read_rollout_samples,
    read_step_records,
    rollout_steps,
)
from .report import _ranges

__all__ = ["main_show", "format_step", "find_tokenizer", "show_step"]

Decoder = Callable[[Sequence[int]], str]
_METRIC_KEYS = (("rollout/reward_mean", "reward mean"), ("rollout/response_length_mean", "length mean"),
                ("train/loss", "loss"), ("train/rollout_logprob_abs_diff", "logprob diff"))


def _is_run_dir(p: Path) -> bool:
    return p.is_dir() and any((p / n).exists() for n in (METRICS_FILE, FINGERPRINTS_FILE, ROLLOUTS_DIR))


def _config_model_path(run: Path) -> Optional[Path]:
    if not (run / CONFIG_FILE).is_file():
        return None
    try:
        from omegaconf import OmegaConf

        path = OmegaConf.select(OmegaConf.load(run / CONFIG_FILE), "model.path", default=None)
    except Exception:  # a config we cannot read gives no tokenizer, not an error: the text is optional
        return None
    return Path(str(path)) if path else None


def find_tokenizer(run_dir: str | Path) -> tuple[Optional[Decoder], str]:
    """A decoder for the run's token ids and where it came from: ``RUN/base_model`` or the config's
    ``model.path`` (the first holding a ``tokenizer.json``); ``(None, reason)`` when there is none."""
    run = Path(run_dir)
    candidates = [run / "base_model", _config_model_path(run)]
    tried = []
    for d in candidates:
        if d is None:
            continue
        tried.append(str(d))
        if not (d / "tokenizer.json").is_file():
            continue
        try:
            from rlrepro.model.tokenizer import load_tokenizer

            tok = load_tokenizer(d)
        except Exception as e:  # noqa: BLE001  (any tokenizer failure: fall back to ids, say why)
            return None, f"the tokenizer in {d} does not load ({type(e).__name__}: {e})"
        return (lambda ids: tok.decode(list(ids), skip_special_tokens=False)), f"decoded with the tokenizer in {d}"
    return None, "token ids: no tokenizer found (looked in " + (", ".join(tried) or "RUN/base_model") + ")"


def _visible(text: str) -> str:
    """Control characters other than newline and tab as escapes, so a completion cannot garble the terminal."""
    return "".join(c if c in "\n\t" or c.isprintable() else repr(c)[1:-1] for c in text)


def _block(text: str, indent: str) -> list[str]:
    if text == "":
        return [f"{indent}(empty)"]
    return [f"{indent}| {line}" for line in _visible(text).split("\n")]


def _text(text: Optional[str], ids: Sequence[int], decode: Optional[Decoder]) -> str:
    if text is not None:
        return text
    if decode is not None:
        return decode(ids)
    return "token ids: " + " ".join(str(i) for i in ids) if ids else ""


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):  # short values exactly (1.0, 0.5), long ones to 6 digits
        r = repr(x)
        return r if len(r) <= 10 else f"{x:.6g}"
    return str(x)


def _turn_summary(s: Sample) -> str:
    """'12 policy tokens (sampled, loss mask 1), 40 tool tokens (context, loss mask 0)'."""
    counts: dict[str, int] = {}
    for t in s.turns or ():
        counts[t.role] = counts.get(t.role, 0) + len(t.token_ids)
    parts = [f"{n} {role} tokens ({'sampled' if role == 'policy' else 'context'})" for role, n in counts.items()]
    if s.loss_mask is not None:
        parts.append(f"loss mask 1 on {sum(s.loss_mask)} of {len(s.loss_mask)} tokens")
    return ", ".join(parts)


def _turn_note(role: str, start: int, end: int, mask: Optional[Sequence[int]]) -> Optional[str]:
    """The line under a turn that the policy did not sample (or whose loss mask disagrees with its role), with its
    completion positions (those ``rlrepro diff`` names)."""
    bits = None if mask is None else list(mask[start:end])
    expected = 1 if role == "policy" else 0
    if role == "policy" and (bits is None or all(b == expected for b in bits)):
        return None
    span = f"completion tokens {start}-{end - 1}" if end > start else f"empty, at completion position {start}"
    if bits is None:
        mask_words = "no loss mask"
    elif all(b == expected for b in bits):
        mask_words = f"loss mask {expected}"
    else:
        mask_words = f"loss mask 1 on {sum(bits)} of {len(bits)}"
    if role == "policy":
        return f"policy turn ({span}): {mask_words}"
    return f"{role} turn ({span}): context from the environment, not sampled by the policy ({mask_words})"


def format_sample(i: int, s: Sample, decode: Optional[Decoder]) -> list[str]:
    lines = [f"[{i}] prompt_uid {s.prompt_uid!r}  sample_index {s.sample_index}",
             f"    reward {_num(s.reward)}   advantage {_num(s.advantage)}   finish {s.finish_reason}   "
             f"length {len(s.completion_token_ids)} tokens (prompt {len(s.prompt_token_ids)})"]
    lines.append("    prompt:")
    lines.extend(_block(_text(s.prompt_text, s.prompt_token_ids, decode), "      "))
    if s.turns:
        lines.append(f"    turns ({len(s.turns)}): {_turn_summary(s)}")
        start = 0
        for k, t in enumerate(s.turns):
            end = start + len(t.token_ids)
            lines.append(f"      {k + 1}. {t.role}, {len(t.token_ids)} tokens:")
            lines.extend(_block(_text(t.text, t.token_ids, decode), "        "))
            note = _turn_note(t.role, start, end, s.loss_mask)
            if note:
                lines.append(f"        ^ {note}")
            start = end
    else:
        lines.append("    completion:")
        lines.extend(_block(_text(s.completion_text, s.completion_token_ids, decode), "      "))
    return lines


def format_step(run_dir: str | Path, step: int, samples: Sequence[Sample], n: int,
                decode: Optional[Decoder], text_source: str, metrics: Optional[dict] = None) -> str:
    """The text ``rlrepro show`` prints for one step (``n <= 0``: every sample)."""
    shown = list(samples) if n <= 0 else list(samples)[:n]
    head = (f"{run_dir}  step {step}: {len(samples)} sample(s), showing {len(shown)} in key order "
            "(prompt_uid, sample_index)")
    lines = [head]
    if metrics:
        vals = [f"{label} {_num(metrics[k])}" for k, label in _METRIC_KEYS if k in metrics]
        if vals:
            lines.append("metrics: " + " | ".join(vals))
    lines.append(f"text: {text_source}")
    for i, s in enumerate(shown):
        lines.append("")
        lines.extend(format_sample(i, s, decode))
    return "\n".join(lines)


def show_step(run_dir: str | Path, step: Optional[int] = None, n: int = 8) -> str:
    """Load the step (default: the last with a rollout file) and return its text; ReproError naming what exists."""
    run = Path(run_dir)
    missing = missing_run_dir("show", run, need_config=False)  # the one wording: "not found", "is a file"
    if missing is not None:
        raise ReproError(missing)
    steps = rollout_steps(run)
    if not steps:
        if not _is_run_dir(run):
            raise ReproError(f"{run} is not a run directory (no {METRICS_FILE}, {FINGERPRINTS_FILE} or "
                             f"{ROLLOUTS_DIR}/)")
        raise ReproError(f"{run} has no rollout files ({ROLLOUTS_DIR}/step_NNNNNN.jsonl.gz): it was run with "
                         "run.save_rollouts=false, or no step finished")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise ReproError(f"{run} has no rollout file for step {step}; steps with rollouts: {_ranges(steps)}")
    samples = read_rollout_samples(run, step) or []
    metrics = None
    if (run / METRICS_FILE).is_file():
        try:
            metrics = read_step_records(run / METRICS_FILE).get(step)
        except ReproError:
            metrics = None  # the metrics line is a bonus; `rlrepro diff` reports a corrupt file
    needs_decoding = any(s.prompt_text is None or s.completion_text is None
                         or any(t.text is None for t in s.turns or ()) for s in samples)
    if not needs_decoding:
        decode, source = None, "as recorded by the run"
    else:
        decode, found = find_tokenizer(run)
        has_text = any(s.prompt_text is not None or s.completion_text is not None for s in samples)
        source = f"as recorded where present, otherwise {found}" if has_text else found
    return format_step(run, step, samples, n, decode, source, metrics)


def main_show(argv: Sequence[str] | None = None) -> int:
    """``rlrepro show RUN [--step K] [--n 8]``: 0 ok, 2 error."""
    ap = argparse.ArgumentParser(prog="rlrepro show", description="Print the prompts, completions, rewards and "
                                 "advantages of one recorded step (default: the last).")
    ap.add_argument("run", help="run directory")
    ap.add_argument("--step", type=int, default=None, help="step to show (default: the last with rollouts)")
    ap.add_argument("--n", type=int, default=8, help="samples to show, in key order (default 8; 0 = all)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    if args.n < 0:
        print(f"rlrepro show: error: --n {args.n}: give a number of samples >= 1, or 0 for all of them",
              file=sys.stderr)
        return 2
    try:
        text = show_step(args.run, args.step, args.n)
    except ReproError as e:
        print(f"rlrepro show: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_show())
