"""The kernel mode: ``deterministic`` (batch-invariant, the default) or ``fast`` (stock torch kernels).

The mode lives in a :class:`contextvars.ContextVar`, so it is per thread / per task and is always restored by
the context manager, even when the body raises.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

MODES = ("deterministic", "fast")

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("rlrepro_kernel_mode", default="deterministic")


def check_mode(name: str) -> str:
    if name not in MODES:
        raise ValueError(f"unknown kernel mode {name!r}; choose one of {MODES}")
    return name


def current_mode() -> str:
    """The mode in force: ``"deterministic"`` unless inside ``with kernels.mode("fast")``."""
    return _MODE.get()


@contextlib.contextmanager
def mode(name: str) -> Iterator[str]:
    """``with kernels.mode("fast"): ...`` runs the body on stock kernels; the previous mode always comes back."""
    token = _MODE.set(check_mode(name))
    try:
        yield name
    finally:
        _MODE.reset(token)
