"""What `rlrepro train` leaves in, and says about, a run directory around the steps themselves: a refused or
interrupted start removes what it made (:func:`remove_created_entries`, under :func:`uninterruptible`; the
directory too when the start created it, :meth:`.run_lock.RunLock.release`), and the commands that read a run
name a missing one the same way (:func:`missing_run_dir`, which lives in ``rlrepro.repro.records`` so that the
record readers, which must not import orchestration, say it in the same words).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Iterator

from rlrepro.repro.records import missing_run_dir  # the one wording; show, diff, plot and export use it too

from .run_lock import LOCK_FILE

__all__ = ["uninterruptible", "remove_created_entries", "missing_run_dir", "checkpoint_dir_hint"]


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


def checkpoint_dir_hint(command: str, path: str | os.PathLike, option: str) -> str | None:
    """When ``path`` is a checkpoint directory of a run (``RUN/checkpoints/step_N``) or a run's ``checkpoints``
    folder, the one-line message naming the run directory and the command's form (``option`` with ``{step}`` for N:
    ``--step {step}``); else None."""
    path = Path(path)
    m = re.fullmatch(r"step_(\d+)", path.name)
    ckpts = path.parent if m else path
    run = ckpts.parent
    if ckpts.name != "checkpoints" or not (run / "config.yaml").is_file():
        return None
    if m is None:
        flag = option.split(" ")[0]
        return (f"{path} is the checkpoints folder of the run directory {run}, not a run directory; give the run "
                f"directory: rlrepro {command} {run} ({flag} picks the step)")
    step = int(m.group(1))
    return (f"{path} is a checkpoint of the run directory {run}, not a run directory; give the run directory with "
            f"the step: rlrepro {command} {run} {option.format(step=step, next=step + 1)}")
