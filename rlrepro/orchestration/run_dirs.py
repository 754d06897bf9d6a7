"""What `rlrepro train` leaves in, and says about, a run directory around the steps themselves: a refused or
interrupted start removes what it made (:func:`remove_created_entries`, under :func:`uninterruptible`; the
directory too when the start created it, :meth:`.run_lock.RunLock.release`), and the commands that read a run
name a missing one the same way (:func:`missing_run_dir`, which lives in ``rlrepro.repro.records`` so that the
record readers, which must not import orchestration, say it in the same words).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Iterator

from rlrepro.repro.records import missing_run_dir  # the one wording; show, diff, plot and export use it too

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
