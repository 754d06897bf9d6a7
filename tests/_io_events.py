"""Record a test's file-system commits in order: every ``os.fsync`` (the path of its descriptor) and every
``os.replace`` / ``os.rename`` (source, destination), so that a test can check what was made durable before what."""
from __future__ import annotations

import os


def record_io(monkeypatch, renames: bool = False) -> list[tuple]:
    """Patch ``os.fsync`` and ``os.replace`` (and ``os.rename`` with ``renames``) to append ``("fsync", path)`` and
    ``("rename", src, dst)`` to the returned list, then do what they do."""
    events: list[tuple] = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def moving(name):
        def move(src, dst, *a, **k):
            events.append(("rename", os.fspath(src), os.fspath(dst)))
            return real[name](src, dst, *a, **k)
        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", moving("replace"))
    if renames:
        monkeypatch.setattr(os, "rename", moving("rename"))
    return events
