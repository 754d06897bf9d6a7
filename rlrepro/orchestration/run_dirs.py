"""What `rlrepro train` leaves in, and says about, a run directory around the steps themselves: a refused or
interrupted start removes what it made (:func:`remove_created_entries`, under :func:`uninterruptible`; the
directory too when the start created it, :meth:`.run_lock.RunLock.release`), and the commands that read a run
name a missing one the same way (:func:`missing_run_dir`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Iterator

from .run_lock import LOCK_FILE

__all__ = ["uninterruptible", "remove_created_entries", "missing_run_dir"]


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """Ctrl-C and SIGTERM are ignored inside (a second one must not stop a clean-up half-way); outside the main
    thread, where handlers cannot be set, nothing changes."""
    try:
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(s, handler)


def remove_created_entries(run_dir: Path, before: set[str]) -> None:
    """Remove the entries of ``run_dir`` that are not in ``before`` (what it held when its lock was taken), the
    lock file excepted (:class:`.run_lock.RunLock` removes that, with the directory it created, when released)."""
    for name in sorted(set(os.listdir(run_dir)) - before - {LOCK_FILE}):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def missing_run_dir(command: str, run: Path) -> str | None:
    """The error of ``rlrepro COMMAND RUN`` when ``RUN`` is not a run directory (None when it is one, as far as a
    config.yaml says): "not found" for a path that does not exist, as `rlrepro show`, `diff`, `export` and `plot`
    say it, and "no config.yaml" for a directory that holds no run."""
    if (run / "config.yaml").is_file():
        return None
    if not run.exists():
        return (f"run directory {run} not found; give the directory a training wrote (its run.dir, e.g. "
                f"`rlrepro {command} runs/NAME`)")
    if not run.is_dir():
        return f"{run} is a file, not a run directory; give the directory a training wrote (its run.dir)"
    return f"{run} is not a run directory (no config.yaml); give the directory a training wrote (its run.dir)"
