"""The synthetic data set of a run without ``data.source``: ``RUN/data/synthetic_<task>.jsonl``.

The file holds what ``data.synthetic.*`` (task, num, seed, kwargs) makes (``rlrepro.data.make_synthetic_records``,
serialized as ``write_jsonl`` does), written with ``atomic_write_bytes`` (complete or absent, under a temporary
name ``run.overwrite`` cleans up). The settings make the same bytes every time, so a start that finds the file
compares it with what its own settings make: a file left by an earlier start with other settings (one that failed
before recording a step), or edited since, is refused naming the file and the fix, not trained on; a fresh run with
``run.overwrite=true`` makes it again. A resume reads the file as it is, whatever it holds: its run trained on it,
and the resume's check of ``inputs.json`` (each data file's sha256) decides whether it is still the run's data.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rlrepro._files import atomic_write_bytes

from .config import ConfigError
from .errors import log

__all__ = ["prepare_synthetic_data", "synthetic_path", "synthetic_bytes"]


def synthetic_path(run_dir: str | Path, task: str) -> Path:
    """``RUN/data/synthetic_<task>.jsonl``."""
    return Path(run_dir) / "data" / f"synthetic_{task}.jsonl"


def synthetic_bytes(syn: Any) -> bytes:
    """The file's bytes for the settings ``syn`` (``data.synthetic``)."""
    from rlrepro.data import make_synthetic_records
    from rlrepro.data.records import jsonl_bytes

    return jsonl_bytes(make_synthetic_records(syn.task, syn.num, syn.seed, **dict(syn.kwargs or {})))


def prepare_synthetic_data(run_dir: str | Path, syn: Any, *, overwrite: bool = False, resume: bool = False,
                           say: Callable[[str], None] = log) -> Path:
    """The run's synthetic data file for ``syn`` (``cfg.data.synthetic``): made when absent, compared with what
    ``syn`` makes when present (the module docstring). ``overwrite`` (a fresh run's ``run.overwrite``) replaces a
    file that differs; ``resume`` reads it as it is."""
    data = synthetic_path(run_dir, syn.task)
    if data.exists() and resume:
        return data
    content = synthetic_bytes(syn)
    if data.is_file() and data.read_bytes() == content:
        return data
    if data.exists():
        what = (f"{data} is not what this run's data.synthetic settings (task={syn.task!r}, num={syn.num}, "
                f"seed={syn.seed}, kwargs={dict(syn.kwargs or {})}) make: it was left in run.dir by an earlier start "
                "(one that failed before recording a step, or one with other settings) or edited since, and would "
                "be trained on")
        if not overwrite or not data.is_file():
            raise ConfigError(f"{what}. Fix: run.overwrite=true (makes it again), delete {data.name}, or choose "
                              "another run.dir")
        say(f"run.overwrite=true: making {data} again (it differs from what data.synthetic makes)")
    atomic_write_bytes(data, content)
    return data
