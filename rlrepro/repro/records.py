"""Run-directory records: append-only JSONL step logs and per-step rollout files.

Nothing here imports torch: ``rlrepro diff`` reads run directories with this module alone.

Layout (see docs/RUN_DIRECTORY.md)::

    RUN/config.yaml
    RUN/metrics.jsonl                      one JSON object per step, key "step" (evaluated steps: EVAL_FINGERPRINT_KEY)
    RUN/fingerprints.jsonl                 one JSON object per step, key "step"
    RUN/rollouts/step_NNNNNN.jsonl.gz      one JSON object per sample
    RUN/checkpoints/step_NNNNNN/
"""
from __future__ import annotations

import difflib
import gzip
import io
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Union

from rlrepro._files import atomic_write_bytes
from rlrepro.samples import Sample

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
FINGERPRINTS_FILE = "fingerprints.jsonl"
ROLLOUTS_DIR = "rollouts"
CHECKPOINTS_DIR = "checkpoints"

#: metrics.jsonl key of an evaluated step (``eval.every``): ``fingerprint.eval_fingerprint`` of its eval requests'
#: token ids and logprobs, in key order; ``rlrepro diff`` compares it where both runs have it (runs recorded before
#: it existed, and runs without eval, have none)
EVAL_FINGERPRINT_KEY = "repro/eval_fingerprint"

ROLLOUT_SAMPLE_KEYS = ("prompt_uid", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "reward", "advantage")
#: optional keys of a rollout record (``Sample.to_record`` writes them when set); older files lack them
ROLLOUT_OPTIONAL_KEYS = ("finish_reason", "seed", "weight_version", "prompt_text", "completion_text", "loss_mask",
                         "turns", "extra")


class ReproError(Exception):
    """A run directory is missing, unreadable or malformed (``rlrepro diff`` exits 2)."""


def _holds_run(p: Path) -> bool:
    return p.is_dir() and any((p / n).exists() for n in (CONFIG_FILE, METRICS_FILE, FINGERPRINTS_FILE, ROLLOUTS_DIR))


def missing_run_dir(command: str, run: str | os.PathLike, *, need_config: bool = True,
                    inside: bool = True) -> str | None:
    """The one wording of ``rlrepro COMMAND RUN``'s error when ``RUN`` is not a run directory; None when it is one.
    "not found" for a path that does not exist (with the run directories beside it whose names are close to it),
    "is a file" for a file (naming the run directory it lies in, if any), and, when ``need_config`` (the commands
    that rebuild the run: verify, eval), "no config.yaml" for a directory that holds no run. The commands that only
    read records (show, diff, plot, export) pass ``need_config=False`` and say themselves what a directory lacks.
    A folder inside a run (``rollouts/``, ``checkpoints/step_N/``) names that run, with ``--step N`` where the
    command takes it (``inside=False``: diff, which says it in its own words).
    ``rlrepro.orchestration.run_dirs.missing_run_dir`` is this function."""
    run = Path(run)
    hint = f"give the directory a training wrote (its run.dir, e.g. `rlrepro {command} runs/NAME`)"
    if not run.exists():
        parent = run.parent if str(run.parent) else Path(".")
        try:  # the names close to the one given (a typo), not every run of a sweep
            names = [e.name for e in os.scandir(parent)] if parent.is_dir() else []
        except OSError:
            names = []
        close = difflib.get_close_matches(run.name, names, n=5, cutoff=0.6)
        runs = [n for n in close if _holds_run(parent / n)]
        beside = f"; did you mean {' or '.join(str(parent / n) for n in runs)}?" if runs else ""
        return f"run directory {run} not found; {hint}{beside}"
    if not run.is_dir():
        owner = next((p for p in run.parents if _holds_run(p)), None)
        where = (f"its run directory is {owner}: rlrepro {command} {owner}" if owner is not None
                 else "give the directory a training wrote (its run.dir)")
        return f"{run} is a file, not a run directory; {where}"
    if inside and not _holds_run(run):
        message = _inside_run_message(command, run)
        if message is not None:
            return message
    if need_config and not (run / CONFIG_FILE).is_file():
        return (f"{run} is not a run directory (no {CONFIG_FILE}); give the directory a training wrote (its "
                "run.dir)")
    return None


def _inside_run_message(command: str, folder: Path) -> str | None:
    """When ``folder`` lies inside a run directory (its ``rollouts/``, ``checkpoints/step_N/``, ``base_model/``):
    the message naming that run directory, with ``--step N`` for a step's folder; else None."""
    resolved = folder.resolve()
    owner = next((p for p in resolved.parents if (p / CONFIG_FILE).is_file()
                  and ((p / METRICS_FILE).is_file() or (p / FINGERPRINTS_FILE).is_file())), None)
    if owner is None:
        return None
    form = f"rlrepro {command} {owner}"
    step = next((part for part in resolved.relative_to(owner).parts if part.startswith("step_")), None)
    if step is not None and step[5:].isdigit() and command in ("show", "export", "eval"):
        form += f" --step {int(step[5:])}"
    if command == "export":
        form += " OUT"
    return f"{folder} is inside the run directory {owner}, not a run directory itself; give the run directory: {form}"


def step_dirname(step: int) -> str:
    return f"step_{int(step):06d}"


def rollouts_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"{step_dirname(step)}.jsonl.gz"


# ----------------------------------------------------------------------------------------------- JSON helpers


def _json_default(obj: Any) -> Any:
    """Turn numpy / torch scalars and arrays into plain Python values (exact: float32 -> float64 is exact)."""
    item = getattr(obj, "item", None)
    tolist = getattr(obj, "tolist", None)
    shape = getattr(obj, "shape", None)
    if shape is not None and tolist is not None:
        if len(tuple(shape)) == 0 and item is not None:
            return item()
        if type(obj).__module__.startswith("torch"):
            obj = obj.detach().cpu()
            if obj.dtype.is_floating_point and obj.element_size() < 4:
                obj = obj.float()  # bf16/fp16 -> fp32 is exact, numpy/tolist cannot take bf16
            return obj.tolist()
        return tolist()
    if item is not None:
        return item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def dumps_line(record: dict) -> str:
    """One compact JSON line. Floats are written with ``repr`` (shortest round-trip), so reading back is exact;
    NaN/Infinity are written as the JSON extensions Python reads back."""
    return json.dumps(record, separators=(",", ":"), allow_nan=True, default=_json_default)


# ------------------------------------------------------------------------------------------- JSONL step logs


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for every non-blank line; raise ReproError naming file and line otherwise."""
    path = Path(path)
    try:
        f = open(path, "r", encoding="utf-8")
    except FileNotFoundError:
        raise ReproError(f"{path}: file not found") from None
    except OSError as e:
        raise ReproError(f"{path}: cannot read: {e}") from None
    with f:
        yield from _json_objects(path, f)


def _json_objects(path: Path, lines: Iterable[str]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; ReproError naming the file and line for anything else."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReproError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise ReproError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


TORN_LINE_NOTE = "the run crashed or is still writing; a resume repairs it"


def _step_log_lines(path: Path) -> Iterator[tuple[int, str | None, bool]]:
    """(line number, text or None when it is not UTF-8, is the last line) for each line of a step log."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ReproError(f"{path}: file not found") from None
    except OSError as e:
        raise ReproError(f"{path}: cannot read: {e}") from None
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    while raw and not raw[-1].strip():  # blank lines after the last record: the last record is the last line
        raw.pop()
    for i, line in enumerate(raw):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        yield i + 1, text, i == len(raw) - 1


def read_step_records(path: str | os.PathLike, required: Iterable[str] = (),
                      notes: list[str] | None = None) -> dict[int, dict]:
    """Read a step log into ``{step: record}``. Each record needs an integer ``step`` and the ``required`` keys;
    a step may appear once. Errors name the file and the line.

    A last line that is not a whole JSON object is torn (a crash while appending, or a run that is still writing:
    ``JsonlStepWriter.truncate_from`` drops it on resume): it is dropped, and a sentence saying so is appended to
    ``notes`` when given. A malformed line before the last one is an error."""
    path = Path(path)
    required = tuple(required)
    out: dict[int, dict] = {}
    lines: dict[int, int] = {}
    for lineno, text, last in _step_log_lines(path):
        if text is not None and not text.strip():
            continue
        try:
            if text is None:
                raise ValueError("not UTF-8 text")
            obj = json.loads(text)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            if last:
                if notes is not None:
                    notes.append(f"{path}:{lineno}: torn last line dropped ({TORN_LINE_NOTE})")
                break
            what = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ReproError(f"{path}:{lineno}: invalid JSON ({what})") from None
        if not isinstance(obj, dict):
            raise ReproError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        step = obj.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ReproError(f"{path}:{lineno}: missing or non-integer 'step' field")
        missing = [k for k in required if k not in obj]
        if missing:
            raise ReproError(f"{path}:{lineno}: step {step}: missing field(s) {', '.join(missing)}")
        if step in out:
            raise ReproError(f"{path}:{lineno}: step {step} already recorded at line {lines[step]}")
        out[step] = obj
        lines[step] = lineno
    return dict(sorted(out.items()))


class JsonlStepWriter:
    """Append-only log of one JSON object per step (``metrics.jsonl``, ``fingerprints.jsonl``).

    Every ``write`` appends one line, flushes and fsyncs. Steps must increase; a resumed run that re-executes
    steps ``>= k`` calls ``truncate_from(k)`` first, which atomically rewrites the file without those lines (and
    without a torn last line left by a crash).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last_step: int | None = None
        self._torn = False
        if self.path.exists():
            kept, torn = self._scan()
            self._torn = torn
            if kept:
                self._last_step = max(s for s, _ in kept)

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def _scan(self) -> tuple[list[tuple[int, str]], bool]:
        """Return ([(step, raw_line)], torn_tail). A malformed line that is not the last one is an error."""
        data = self.path.read_text(encoding="utf-8")
        raw = data.split("\n")
        ends_with_newline = data.endswith("\n") or data == ""
        if ends_with_newline:
            raw = raw[:-1] if raw and raw[-1] == "" else raw
        kept: list[tuple[int, str]] = []
        torn = False
        for i, line in enumerate(raw):
            if not line.strip():
                continue
            is_last = i == len(raw) - 1
            try:
                obj = json.loads(line)
                step = obj["step"]
                if isinstance(step, bool) or not isinstance(step, int):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                if is_last:
                    torn = True
                    continue
                raise ReproError(f"{self.path}:{i + 1}: malformed line in the middle of the file ({line[:60]!r}): "
                                 "the record is damaged (only a torn last line, left by a crash, is repaired). Fix: "
                                 f"restore {self.path.name} from a copy, or start the run over (run.resume=false "
                                 "run.overwrite=true) or in another run.dir") from None
            if is_last and not ends_with_newline:
                torn = True  # parsed, but its newline never made it to disk: rewrite it cleanly
            kept.append((step, line))
        return kept, torn

    def write(self, record: dict) -> None:
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError("record needs an integer 'step'")
        if self._torn:
            raise ReproError(f"{self.path}: the last line is torn (crash while writing); call truncate_from(step) "
                             "before appending")
        if self._last_step is not None and step <= self._last_step:
            raise ReproError(f"{self.path}: step {step} <= last recorded step {self._last_step}; "
                             f"call truncate_from({step}) before rewriting steps")
        line = dumps_line(record) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._last_step = step

    append = write

    def truncate_from(self, step: int) -> int:
        """Drop every line whose step is ``>= step`` (and a torn last line). Returns the number of lines dropped."""
        if not self.path.exists():
            self._last_step, self._torn = None, False
            return 0
        kept, torn = self._scan()
        keep = [(s, line) for s, line in kept if s < step]
        dropped = len(kept) - len(keep) + (1 if torn else 0)
        if dropped:
            atomic_write_bytes(self.path, "".join(line + "\n" for _, line in keep).encode("utf-8"))
        self._torn = False
        self._last_step = max((s for s, _ in keep), default=None)
        return dropped


class MetricsWriter(JsonlStepWriter):
    """``RUN/metrics.jsonl``."""

    def __init__(self, run_dir: str | os.PathLike):
        super().__init__(Path(run_dir) / METRICS_FILE)


class FingerprintWriter(JsonlStepWriter):
    """``RUN/fingerprints.jsonl``; write the dicts made by ``fingerprint_step``."""

    def __init__(self, run_dir: str | os.PathLike):
        super().__init__(Path(run_dir) / FINGERPRINTS_FILE)


# ------------------------------------------------------------------------------------------------- rollouts


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return _json_default(value)


def rollout_record(sample: Union[Sample, Mapping[str, Any]]) -> dict:
    """The rollout-file object of one sample: ``Sample.to_record()`` for a :class:`~rlrepro.samples.Sample`
    (decoded text included when set), a copy of a dict as it is."""
    if isinstance(sample, Sample):
        return sample.to_record()
    if isinstance(sample, Mapping):
        return dict(sample)
    raise TypeError(f"a rollout sample is a rlrepro.samples.Sample or a dict, not {type(sample).__name__}")


class RolloutWriter:
    """``RUN/rollouts/step_NNNNNN.jsonl.gz``: one JSON line per sample, in fingerprint order
    (prompt uid, sample index). Written atomically (temp file + ``os.replace``); the gzip header carries no
    file name or time, so two identical runs write byte-identical files. Samples are
    :class:`~rlrepro.samples.Sample` objects (written with ``to_record()``) or dicts with the same keys."""

    def __init__(self, run_dir: str | os.PathLike, *, compresslevel: int = 6):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / ROLLOUTS_DIR
        self.compresslevel = compresslevel

    def path(self, step: int) -> Path:
        return rollouts_path(self.run_dir, step)

    def write(self, step: int, samples: Iterable[Union[Sample, Mapping[str, Any]]]) -> Path:
        text = io.StringIO()
        for i, sample in enumerate(samples):
            s = rollout_record(sample)
            missing = [k for k in ROLLOUT_SAMPLE_KEYS if k not in s]
            if missing:
                raise ValueError(f"sample {i}: missing key(s) {', '.join(missing)}")
            text.write(dumps_line(_plain(s)))
            text.write("\n")
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=self.compresslevel, mtime=0) as gz:
            gz.write(text.getvalue().encode("utf-8"))
        path = self.path(step)
        atomic_write_bytes(path, buf.getvalue())
        return path

    def truncate_from(self, step: int) -> list[Path]:
        """Delete the rollout files of steps ``>= step`` (a resumed run rewrites them)."""
        removed = []
        if self.dir.is_dir():
            for p in sorted(self.dir.glob("step_*.jsonl.gz")):
                try:
                    s = int(p.name[len("step_"):-len(".jsonl.gz")])
                except ValueError:
                    continue
                if s >= step:
                    p.unlink()
                    removed.append(p)
        return removed


def read_rollouts(run_dir: str | os.PathLike, step: int) -> list[dict] | None:
    """The samples of one step, or None when the run has no rollout file for it. ReproError if it is corrupt."""
    path = rollouts_path(run_dir, step)
    if not path.exists():
        return None
    out = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            out.extend(obj for _, obj in _json_objects(path, f))
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # zlib.error: damaged compressed data
        what = f"zlib: {e}" if isinstance(e, zlib.error) else str(e)
        raise ReproError(f"{path}: unreadable ({what}): the file is damaged; restore it from a "
                         "copy (rlrepro diff --no-detail compares the runs without it)") from None
    return out


def rollout_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps that have a rollout file under ``RUN/rollouts/``, ascending."""
    d = Path(run_dir) / ROLLOUTS_DIR
    steps = []
    if d.is_dir():
        for p in d.glob("step_*.jsonl.gz"):
            num = p.name[len("step_"):-len(".jsonl.gz")]
            if num.isdigit():
                steps.append(int(num))
    return sorted(steps)


def read_rollout_samples(run_dir: str | os.PathLike, step: int) -> list[Sample] | None:
    """:func:`read_rollouts` as :class:`~rlrepro.samples.Sample` objects (files with or without the text fields);
    None when the step has no rollout file, ReproError when a record lacks a required key."""
    recs = read_rollouts(run_dir, step)
    if recs is None:
        return None
    out = []
    for i, rec in enumerate(recs):
        missing = [k for k in ROLLOUT_SAMPLE_KEYS if k not in rec]
        if missing:
            raise ReproError(f"{rollouts_path(run_dir, step)}: sample {i}: missing key(s) {', '.join(missing)}")
        try:
            sample = Sample.from_record(rec)
            texts = [("prompt_text", sample.prompt_text), ("completion_text", sample.completion_text)]
            texts += [(f"turns[{k}].text", t.text) for k, t in enumerate(sample.turns or ())]
            bad = next((f"{name} is {type(v).__name__}, not a string" for name, v in texts
                        if v is not None and not isinstance(v, str)), None)
            if bad is not None:
                raise ValueError(bad)
        except (TypeError, ValueError, KeyError) as e:
            raise ReproError(f"{rollouts_path(run_dir, step)}: sample {i}: malformed record ({e})") from None
        out.append(sample)
    return out


def float_bits_equal(a: Any, b: Any) -> bool:
    """Exact equality of JSON-decoded values: same type, floats by their bits (NaN == NaN, 0.0 != -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(float_bits_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(float_bits_equal(a[k], b[k]) for k in a)
    return a == b
