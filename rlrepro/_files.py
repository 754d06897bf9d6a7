"""File-mode policy for everything rlrepro writes, and file digests (plain Python, nothing else of rlrepro, no
torch).

A file rlrepro writes gets the mode an ordinary ``open(path, "w")`` would give it: ``0o666`` masked by the
process umask (``0o644`` under the usual umask 022). Atomic writers create a private temp file
(``tempfile.mkstemp`` makes it ``0o600``) and libraries such as safetensors do the same; they call
:func:`apply_default_mode` on it before the rename, so the policy holds for every file of a run directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

__all__ = ["current_umask", "default_file_mode", "apply_default_mode", "sha256_file", "fsync_path",
           "atomic_write_bytes"]


def fsync_path(path: str | os.PathLike) -> None:
    """``fsync`` a file or a directory by its path (a directory: its entries, after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike, block: int = 1 << 24) -> str:
    """The hex sha256 of a file's bytes, read in blocks of ``block`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux >= 4.7: ``/proc/self/status``);
    elsewhere by setting and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """``0o666 & ~umask``: the mode ``open()`` gives a new file."""
    return 0o666 & ~current_umask()


def apply_default_mode(target: int | str | os.PathLike) -> None:
    """Give ``target`` (an open file descriptor or a path) the mode of :func:`default_file_mode`."""
    mode = default_file_mode()
    if isinstance(target, int):
        os.fchmod(target, mode)
    else:
        os.chmod(target, mode)


def _fsync_dir(path: Path) -> None:
    """``fsync`` a directory after a rename into it, where the OS allows it (not every file system does)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the complete new one, never a part: into a
    temporary ``.NAME.<random>.tmp`` beside it, fsynced, given the mode a plain ``open()`` would (0o666 masked by
    the umask, not mkstemp's 0o600), renamed, the directory fsynced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            apply_default_mode(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def model_json(file: str | os.PathLike) -> dict:
    """The JSON object in a model directory's ``file`` (config.json, tokenizer_config.json, ...): a damaged file is
    a ValueError naming it (not a bare JSONDecodeError, or an AttributeError later for a JSON list)."""
    try:
        raw = json.loads(Path(file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); the model directory is damaged: copy it again") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} holds a JSON {type(raw).__name__}, not an object; the model directory is damaged")
    return raw
