"""The synthetic data set of a run without ``data.source``: ``RUN/data/synthetic_<task>.jsonl`` and its manifest.

The file holds what ``data.synthetic.*`` (task, num, seed, kwargs) makes (``rlrepro.data.make_synthetic_records``,
serialized as ``write_jsonl`` does). It is written with ``atomic_write_bytes`` (a temporary
``.synthetic_<task>.jsonl.<random>.tmp``, fsynced, renamed: complete or absent, and a name ``run.overwrite``
cleans up), then its manifest ``synthetic_<task>.manifest.json``::

    {"format": "rlrepro-synthetic-data", "version": 1, "settings": {"task", "num", "seed", "kwargs"},
     "size": bytes, "sha256": hex}

A start that finds the file checks it against the manifest (size and sha256) and the manifest's settings against
its own, and refuses one that differs, naming the file, each differing key and the fix: a file left by an earlier
start with other settings (one that failed before recording a step) would otherwise be trained on. A fresh run with
``run.overwrite=true`` replaces it instead. A file without a manifest (an older rlrepro, or a start killed between
the two writes) is made again in memory and adopted, its manifest added, only when bit-identical; a resume reads
such a file as it is (the run that wrote it trained on it), leaving the data check to inputs.json's record.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from rlrepro.repro.records import atomic_write_bytes

from .config import ConfigError
from .errors import log

__all__ = ["prepare_synthetic_data", "synthetic_paths", "synthetic_bytes", "FORMAT", "VERSION"]

FORMAT = "rlrepro-synthetic-data"
VERSION = 1
KEYS = ("task", "num", "seed", "kwargs")


def synthetic_paths(run_dir: str | Path, task: str) -> tuple[Path, Path]:
    """``(RUN/data/synthetic_<task>.jsonl, RUN/data/synthetic_<task>.manifest.json)``."""
    data_dir = Path(run_dir) / "data"
    return data_dir / f"synthetic_{task}.jsonl", data_dir / f"synthetic_{task}.manifest.json"


def _settings(syn: Any) -> dict:
    """The ``data.synthetic`` settings as plain JSON values (what the manifest records)."""
    raw = {"task": syn.task, "num": syn.num, "seed": syn.seed, "kwargs": dict(syn.kwargs or {})}
    return json.loads(json.dumps(raw, sort_keys=True, default=repr))


def synthetic_bytes(syn: Any) -> bytes:
    """The file's bytes for the settings ``syn`` (``data.synthetic``)."""
    from rlrepro.data import make_synthetic_records
    from rlrepro.data.records import jsonl_bytes

    return jsonl_bytes(make_synthetic_records(syn.task, syn.num, syn.seed, **dict(syn.kwargs or {})))


def _problems(data: Path, manifest_path: Path, settings: dict, build: Callable[[], bytes]) -> tuple[list[str], bool]:
    """What makes the existing ``data`` unusable for ``settings`` (empty: usable), and whether it has to be adopted
    (no manifest, bit-identical to what the settings make)."""
    if not manifest_path.is_file():
        if data.read_bytes() == build():
            return [], True
        return [f"it has no manifest ({manifest_path.name}: written by an older rlrepro, or by hand) and differs "
                f"from what this run's data.synthetic settings {json.dumps(settings, sort_keys=True)} make"], False
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"its manifest {manifest_path.name} is not valid JSON ({e})"], False
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("settings"),
                                                                                            dict):
        return [f"{manifest_path.name} is not an {FORMAT} manifest"], False
    if manifest.get("version") != VERSION:
        return [f"{manifest_path.name} has version {manifest.get('version')!r}; this rlrepro writes and reads "
                f"version {VERSION}"], False
    made = manifest["settings"]
    problems = [f"data.synthetic.{k}: the file was made with {json.dumps(made.get(k))}, this run asks for "
                f"{json.dumps(settings.get(k))}" for k in KEYS if made.get(k) != settings.get(k)]
    if not problems:
        have = data.read_bytes()
        if len(have) != manifest.get("size") or hashlib.sha256(have).hexdigest() != manifest.get("sha256"):
            problems.append(f"it has {len(have)} bytes and sha256 {hashlib.sha256(have).hexdigest()[:12]}..., its "
                            f"manifest says {manifest.get('size')} bytes, sha256 {str(manifest.get('sha256'))[:12]}... "
                            "(changed after it was written)")
    return problems, False


def _write_manifest(manifest_path: Path, settings: dict, data: bytes) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "settings": settings, "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_bytes(manifest_path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def prepare_synthetic_data(run_dir: str | Path, syn: Any, *, overwrite: bool = False, resume: bool = False,
                           say: Callable[[str], None] = log) -> Path:
    """The run's synthetic data file for ``syn`` (``cfg.data.synthetic``), made when absent, checked when present
    (see the module docstring). ``overwrite`` (a fresh run's ``run.overwrite``) replaces a file that does not match;
    ``resume`` words the refusal for a resumed run, whose recorded steps were made from the file as it was."""
    data, manifest_path = synthetic_paths(run_dir, syn.task)
    settings = _settings(syn)
    built: list[bytes] = []

    def build() -> bytes:
        if not built:
            built.append(synthetic_bytes(syn))
        return built[0]

    if data.exists():
        if not data.is_file():
            problems, adopt = [f"{data} is not a file"], False
        else:
            problems, adopt = _problems(data, manifest_path, settings, build)
        if not problems:
            if adopt:
                say(f"{data} has no manifest (an older rlrepro wrote it); it is bit-identical to what "
                    "data.synthetic makes: its manifest is added")
                _write_manifest(manifest_path, settings, build())
            return data
        what = f"{data} does not match this run's data.synthetic settings: {'; '.join(problems)}"
        if resume and not manifest_path.exists() and data.is_file():  # an older rlrepro's file, its run's own data
            say(f"{data} has no manifest and differs from what data.synthetic makes now (an older rlrepro made "
                "it): the resume reads it as it is; inputs.json's record of it decides whether it is the run's data")
            return data
        if resume:
            raise ConfigError(f"{what}. The run's recorded steps were made from that file as it was written; "
                              "resuming on another data set would not repeat them. Fix: put the file back (from a "
                              "copy), or start a new run in another run.dir")
        if not overwrite or not data.is_file():
            raise ConfigError(f"{what}. It was left in run.dir by an earlier start (one that failed before recording "
                              "a step, or one with other settings), and would be trained on. Fix: run.overwrite=true "
                              f"(makes it again), delete {data.name} and {manifest_path.name}, or choose another "
                              "run.dir")
        say(f"run.overwrite=true: making {data} again ({'; '.join(problems)})")
    content = build()
    manifest_path.unlink(missing_ok=True)  # a new file never sits under an old manifest, even if killed below
    atomic_write_bytes(data, content)
    _write_manifest(manifest_path, settings, content)
    return data
