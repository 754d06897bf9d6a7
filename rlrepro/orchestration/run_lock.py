"""One writer per run directory: an exclusive lock held for a run's whole life (and for ``rlrepro verify``'s writes).

``RUN/.lock`` is locked with ``fcntl.flock(LOCK_EX | LOCK_NB)`` on an open descriptor, so the operating system
releases it when the holder ends in any way (exit, exception, SIGKILL, OOM kill). The holder writes who it is
into the file: ``{"format": "rlrepro-run-lock", "pid", "host", "command", "started", "run_dir"}``; a second run
finds the lock taken and is refused before it writes anything, with that description. A holder that ends cleanly
empties the file and leaves it. It is removed only with the directory, by a start that created the directory itself
and was refused or interrupted before its first step (``release(remove_created=True)``: while still locked, and
only when the lock file is all the directory holds). A process that locked the file's old inode meanwhile finds it
no longer at ``RUN/.lock`` and starts again (``acquire`` compares the two), so two processes never hold two lock
files of one directory.

A lock file that still names a holder but is not locked was left by a process that ended without cleaning up
(killed): it is taken over, and the log says whose it was. When the lock is held but the process it names is gone
from this host, a process that inherited its descriptor holds it: the refusal names the processes of this host
that have the file open.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Callable

from .config import ConfigError
from .errors import log

__all__ = ["LOCK_FILE", "RunLock", "RunDirLocked", "read_holder", "describe_holder"]

LOCK_FILE = ".lock"
FORMAT = "rlrepro-run-lock"


class RunDirLocked(ConfigError):
    """Another process holds the run directory's lock; ``holder`` is what it wrote into the lock file (or None)."""

    def __init__(self, message: str, holder: dict | None) -> None:
        super().__init__(message)
        self.holder = holder


def _command() -> str:
    argv = list(sys.argv) or ["?"]
    first = argv[0]
    if first in ("-c", "") or first.replace("\\", "/").endswith("rlrepro/cli.py"):
        argv[0] = "rlrepro" if len(argv) > 1 and argv[1] in ("train", "verify") else f"{Path(sys.executable).name} -c"
    else:
        argv[0] = Path(first).name
    return shlex.join(argv)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def describe_holder(holder: dict | None) -> str:
    """``pid 123 on host h, `rlrepro train ...`, started 2026-12-01T14:28:20+00:00`` (or what is known)."""
    if not holder:
        return "a process that has not written its name yet (or an older rlrepro)"
    parts = [f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"]
    if holder.get("command"):
        parts.append(f"`{holder['command']}`")
    if holder.get("started"):
        parts.append(f"started {holder['started']}")
    return ", ".join(parts)


def _read_fd(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"unreadable": raw[:200].decode("utf-8", "replace")}
    return holder if isinstance(holder, dict) else {"unreadable": repr(holder)[:200]}


def read_holder(run_dir: str | os.PathLike) -> dict | None:
    """What the lock file of ``run_dir`` says about its holder (None: no file, or no holder written)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _processes_with_open(path: Path) -> list[int]:
    """Pids of this host's processes (that we may inspect) with ``path`` open, from /proc."""
    try:
        st = path.stat()
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                s = os.stat(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                found.append(int(entry))
                break
    return found


class RunLock:
    """The exclusive lock of ``run_dir`` (``RUN/.lock``). ``acquire()`` raises :class:`RunDirLocked` naming the
    holder when another process has it; ``release()`` (or leaving the ``with`` block) empties and unlocks it."""

    def __init__(self, run_dir: str | os.PathLike, say: Callable[[str], None] = log) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.say = say
        self._fd: int | None = None
        self.created = False  # acquire() made the run directory (it did not exist before)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        for _ in range(100):  # again only when the file locked was removed with its directory meanwhile
            if self._try_acquire():
                return self
        raise ConfigError(f"cannot lock {self.path}: it was removed and made again 100 times while this process "
                          "locked it; another process is starting and removing this run directory: wait for it")

    def _make_dir(self) -> None:
        """The run directory (and the folders above it); ``created``: whether this call made it."""
        try:
            self.run_dir.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(self.run_dir)
                self.created = True
            except FileExistsError:  # there already (a file there is refused when the lock file is opened)
                self.created = False
        except OSError as e:  # a file where the directory (or a folder above it) should be, no permission, ...
            raise ConfigError(self._unusable(e)) from None

    def _try_acquire(self) -> bool:
        self._make_dir()
        try:  # 0o666 & ~umask, as a plain open() would; a symbolic link is refused, never followed
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"{self.path} is a symbolic link; rlrepro locks the run directory with a file of "
                                  "its own there and does not follow links: remove it") from None
            raise ConfigError(self._unusable(e)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_fd(fd)
            os.close(fd)
            raise RunDirLocked(self._refusal(holder), holder) from None
        except OSError as e:  # a file system without flock (some network / FUSE mounts)
            os.close(fd)
            raise ConfigError(f"cannot lock {self.path} ({e.strerror}): rlrepro needs a file system with flock "
                              "locks for its run directory, so that two runs never write into one; choose a "
                              "run.dir on a local disk") from None
        try:  # the file locked is still RUN/.lock (not one a refused start removed with its directory meanwhile)
            current = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
        except OSError:
            current = False
        if not current:
            os.close(fd)
            return False
        previous = _read_fd(fd)
        if previous:
            self.say(f"taking over the lock of {self.run_dir}: it still named {describe_holder(previous)}, "
                     f"{self._why_stale(previous)} (it ended without releasing the lock: killed?)")
        self._fd = fd
        self._write_holder()
        return True

    def _write_holder(self) -> None:
        me = {"format": FORMAT, "pid": os.getpid(), "host": socket.gethostname(), "command": _command(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "run_dir": str(self.run_dir.resolve())}
        data = (json.dumps(me, sort_keys=True) + "\n").encode("utf-8")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    @staticmethod
    def _why_stale(holder: dict) -> str:
        pid, host = holder.get("pid"), holder.get("host")
        if host != socket.gethostname() or not isinstance(pid, int):
            return "which no longer holds it"
        return f"pid {pid} is no longer running" if not _pid_alive(pid) else f"pid {pid} no longer holds it"

    def _unusable(self, e: OSError) -> str:
        """Why the run directory cannot be created or locked (a file in its place, no permission), and the fix."""
        blocking = next((p for p in (self.run_dir, *self.run_dir.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            what = "it" if blocking == self.run_dir else f"{blocking}, a folder above it,"
            return (f"run directory {self.run_dir} cannot be created: {what} is a file, not a directory; choose "
                    "another run.dir (or move that file away)")
        return (f"run directory {self.run_dir} cannot be created or locked ({e.strerror or e}: "
                f"{e.filename or self.run_dir}); choose a run.dir you can write to")

    def _refusal(self, holder: dict | None) -> str:
        text = (f"run.dir={str(self.run_dir)!r} is in use: {describe_holder(holder)} holds its lock "
                f"({self.path}). Two runs must not write into one run directory. Wait for that process to end "
                "(or stop it), or choose another run.dir")
        pid, host = (holder or {}).get("pid"), (holder or {}).get("host")
        if isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid):
            others = _processes_with_open(self.path)
            who = f"pid(s) {', '.join(map(str, others))}" if others else "a process this user cannot inspect"
            text += (f". Pid {pid} is no longer running, but the lock is still held, by a process that inherited "
                     f"its descriptor: {who} on this host has {self.path} open")
        return text

    def release(self, *, remove_created: bool = False) -> None:
        """Empty and unlock the file. ``remove_created``: when ``acquire`` created the run directory and the lock
        file is all it holds now, the lock file is removed (still locked), then the directory (a refused start
        leaves nothing behind); a directory that existed before, or holds anything else, stays."""
        if self._fd is None:
            return
        remove = False
        if remove_created and self.created:
            try:
                remove = os.listdir(self.run_dir) == [LOCK_FILE]
                if remove:
                    os.unlink(self.path)
            except OSError:
                remove = False
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a clean end leaves no holder named
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        if remove:
            try:
                os.rmdir(self.run_dir)  # only if still empty: another process may have made its own lock file there
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
