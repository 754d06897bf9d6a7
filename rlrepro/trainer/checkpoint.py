"""Training checkpoints that are complete or absent, verified before use, and hold everything a resume needs.

Layout of ``ckpt_root/step_NNNNNN/`` (six-digit zero-padded step)::

    model.safetensors   the policy's state dict (compute dtype)
    optimizer.pt        optimizer.state_dict() (AdamW moments, and float32 master weights when separate)
    scheduler.pt        scheduler.state_dict()
    rng.pt              capture_rng_state(): python random, numpy, torch CPU, every CUDA device, named generators
    extra_state.pt      the caller's dict (data cursor, driver state, ...)
    manifest.json       {"format": "rlrepro-checkpoint", "version": 1, "step": N,
                         "files": {name: {"size": bytes, "sha256": hex}}}

Atomicity: everything is written into ``step_NNNNNN.tmp-<pid>/``, each file fsynced, the manifest written last
and fsynced, the directory fsynced, then renamed to ``step_NNNNNN`` (``os.rename`` of a directory is atomic on
POSIX file systems) and the parent fsynced. A crash at any point leaves either no ``step_NNNNNN`` or a complete
one; leftover ``*.tmp-*`` directories are ignored by :func:`latest_checkpoint`. Saving a step that exists sets the
old copy aside (``step_NNNNNN.old-<pid>``) until the new one is in place, and puts it back if that fails; a copy a
killed process left aside is put back (or, beside its replacement, deleted) by :func:`restore_set_aside`, which a
resume runs first.

File modes: every file gets the mode a plain ``open()`` would give it (0o666 masked by the umask, so 0o644
under umask 022), whatever the writing library does (safetensors 0.8 creates its files 0o600).

``.pt`` files are read with ``torch.load(weights_only=True)``: tensors and plain containers only, no code.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlrepro._files import apply_default_mode, fsync_path
from rlrepro.model import save_pretrained

from .rng_state import capture_rng_state, check_rng_state, restore_rng_state

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "verify_checkpoint",
           "capture_rng_state",
           "restore_rng_state", "export_hf", "LoadedCheckpoint", "checkpoint_dir_name", "load_pt", "scan_checkpoints",
           "write_error", "commit_checkpoint_dir", "check_rng_state", "restore_set_aside", "CheckpointVersionError",
           "other_version", "load_extra_state"]

FORMAT = "rlrepro-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:06d}"


class CheckpointVersionError(ValueError):
    """A checkpoint whose manifest names another format version than this rlrepro writes and reads (``VERSION``):
    not damaged, written by another rlrepro; never loaded, replaced or pruned."""

    def __init__(self, message: str, version) -> None:
        super().__init__(message)
        self.version = version


def other_version(path: str | os.PathLike):
    """The format version of the checkpoint directory ``path`` when its manifest is an rlrepro checkpoint manifest
    of another version than ``VERSION`` (a checkpoint another rlrepro wrote), else None."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("version") != VERSION:
        return manifest.get("version")
    return None


# ------------------------------------------------------------------------------------------------------ writing

_fsync_dir = fsync_path


def _file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _write_file(path: Path, write: Callable[[Path], None]) -> dict:
    """Write one file with ``write(path)``, give it the mode ``open()`` would (0o666 & ~umask; safetensors 0.8
    creates its files 0o600), fsync it and return its size and sha256."""
    write(path)
    apply_default_mode(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return _file_digest(path)


def _model_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


class StateHolder:
    """A ready state dict in the shape ``save_checkpoint`` reads (``obj.state_dict()``): a gathered or converted
    state that no live module or optimizer holds."""

    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self):
        return self.state


def write_on_one_rank(is_writer: bool, write: Callable[[], object], barrier: Callable[[], None]):
    """``write()`` on the writer rank, then ``barrier()`` on every rank; the writer's exception, if any, is raised
    after the barrier, so the other ranks never hang waiting for it. Returns ``write()``'s result (None elsewhere)."""
    result, error = None, None
    if is_writer:
        try:
            result = write()
        except BaseException as e:  # still reach the barrier
            error = e
    barrier()
    if error is not None:
        raise error
    return result


_ASIDE = ".old-"  # commit_checkpoint_dir's suffix for a directory being replaced


def commit_checkpoint_dir(tmp: Path, final: Path) -> None:
    """Rename the complete, fsynced ``tmp`` directory to ``final`` (atomic on POSIX) and fsync the parent. An
    existing ``final`` (the same step saved again) is moved aside to ``final.old-<pid>`` first: if the rename of
    ``tmp`` then fails it is put back (a failed save loses nothing), else deleted. One that a killed process left
    set aside is put back, or deleted once its replacement is in place, by :func:`restore_set_aside`."""
    root = final.parent
    version = other_version(final) if final.is_dir() and not final.is_symlink() else None
    if version is not None:  # another rlrepro's checkpoint: not this one's to replace
        raise CheckpointVersionError(f"{final} is a checkpoint of format version {version!r}, written by another "
                                     f"rlrepro (this one writes version {VERSION}); it is not replaced. Move it away "
                                     "or write this run into another run.dir", version)
    if not final.exists():
        os.rename(tmp, final)
        _fsync_dir(root)
        return
    aside = root / f"{final.name}{_ASIDE}{os.getpid()}"
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)  # the new one is committed; a failure here leaves a stale copy only


def restore_set_aside(root: Path, say=None, name: str | None = None) -> None:
    """Directories ``NAME.old-<pid>`` under ``root`` that :func:`commit_checkpoint_dir` set aside and a killed
    process left: put back as ``NAME`` when there is none (its replacement never landed, so it is the step's only
    copy), deleted when ``NAME`` exists (the replacement did). ``say``: a function told what was done. ``name``:
    only that ``NAME``'s (a folder of the user's, such as an export's destination's parent, holds other things).
    Only names ending in ``.old-`` and digits are touched."""
    if not root.is_dir():
        return
    for aside in sorted(root.glob(f"{glob.escape(name) if name else '*'}{_ASIDE}*")):
        if aside.is_symlink() or not aside.is_dir() or not aside.name.rsplit(_ASIDE, 1)[1].isdigit():
            continue
        final = root / aside.name.rsplit(_ASIDE, 1)[0]
        if final.exists() or final.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
            what = f"removed {aside}, a copy set aside while {final.name} was replaced"
        else:
            os.rename(aside, final)
            _fsync_dir(root)
            what = f"put back {final}: a save of it was interrupted after the old copy was set aside as {aside.name}"
        if say is not None:
            say(f"rlrepro: {what}")


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122", "storagefull")
# torch's zip writer reports a short write (a full disk) as "[enforce fail at inline_container.cc:NNN] . unexpected
# pos A vs B" or "PytorchStreamWriter failed writing file ...", without an errno
_TORCH_SHORT_WRITE = re.compile(r"inline_container\.cc.*unexpected pos|PytorchStreamWriter failed writing")
_NEARLY_FULL = 16 << 20  # bytes free under which a short write is taken for a full disk


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _mib(n: int | None) -> str:
    return "unknown space" if n is None else f"{n / 2**20:.1f} MiB"


def write_error(exc: BaseException, path: Path, what: str, free: int | None) -> OSError | None:
    """The error to raise for ``exc``, raised while writing ``path`` (part of ``what``), when its own words hide
    the cause: a full disk (``ENOSPC``/``EDQUOT``, or torch's "unexpected pos" short write with little space left)
    becomes ``OSError(ENOSPC, "disk full at PATH ...")``; None: raise ``exc`` as it is."""
    text = " ".join(str(e) for e in _chain(exc))
    full = any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in _chain(exc))
    full = full or any(t in text.lower() for t in _DISK_FULL_TEXT)
    short = _TORCH_SHORT_WRITE.search(text) is not None
    if not full and not (short and free is not None and free < _NEARLY_FULL):
        if short:
            return OSError(errno.EIO, f"writing {path} stopped short ({_mib(free)} still free on that file system: "
                                      f"a quota or a file-size limit?); {what} was not written. torch said: "
                                      f"{str(exc).strip().splitlines()[0][:200]}")
        return None
    return OSError(errno.ENOSPC, f"disk full at {path} (No space left on device; {_mib(free)} free on that file "
                                 f"system): {what} was not written, and nothing partial is left. Free some space "
                                 "there (or lower checkpoint.keep_last, or choose a run.dir on a larger disk)")


def _save_plain(state: dict, path: Path) -> None:
    """``torch.save(state, path)``, refused (ValueError naming the key) when ``load_pt`` could not read it back (a
    numpy scalar or array, a dataclass, a Path: every checkpoint of the run would be unloadable at its resume)."""
    import io
    import pickle

    def loads(f) -> bool:
        try:
            torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            return False
        return True

    torch.save(state, path)
    if loads(path):
        return
    for key, value in state.items():
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        if not loads(buf):
            raise ValueError(f"extra_state[{key!r}] holds a {type(value).__module__}.{type(value).__qualname__}, "
                             "which torch.load(weights_only=True) does not read back, so the checkpoint could never be "
                             "resumed; store only tensors, Python numbers, strings and plain containers (e.g. int(x), "
                             "x.tolist(), torch.from_numpy(a))")
    raise ValueError("extra_state holds objects torch.load(weights_only=True) does not read back; store only tensors, "
                     "Python numbers, strings and plain containers")


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, *, model=None, optimizer=None, scheduler=None,
                    extra_state: Mapping | None = None, rng_state: Mapping | None = None,
                    keep_last: int | None = None) -> Path:
    """Write ``ckpt_root/step_NNNNNN/`` atomically and return its path.

    ``rng_state`` defaults to :func:`capture_rng_state` taken now. ``keep_last``: afterwards delete all but the
    newest ``keep_last`` complete checkpoints, this one always kept. ``extra_state``: what ``load_pt`` reads back
    (else ValueError, nothing written). Saving a step that already exists replaces it (the old one is moved
    aside first, so for a moment neither exists under that name; :func:`latest_checkpoint` then finds the previous).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_dir_name(step)
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    rng_state = capture_rng_state() if rng_state is None else rng_state
    writers: list[tuple[str, Callable[[Path], None]]] = []
    if model is not None:
        writers.append(("model.safetensors",
                        lambda p: save_file(_model_state(model), str(p), metadata={"format": "pt"})))
    if optimizer is not None:
        writers.append(("optimizer.pt", lambda p: torch.save(optimizer.state_dict(), p)))
    if scheduler is not None:
        writers.append(("scheduler.pt", lambda p: torch.save(scheduler.state_dict(), p)))
    writers.append(("rng.pt", lambda p: torch.save(dict(rng_state), p)))
    writers.append(("extra_state.pt", lambda p: _save_plain(dict(extra_state or {}), p)))
    files: dict[str, dict] = {}
    current = tmp
    try:
        for name, write in writers:
            current = tmp / name
            files[name] = _write_file(current, write)
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": dict(sorted(files.items()))}
        current = tmp / MANIFEST
        _write_file(current, lambda p: p.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n"))
        current = tmp
        _fsync_dir(tmp)
        commit_checkpoint_dir(tmp, final)
    except BaseException as e:
        free = _free_bytes(root)  # before the partial files are removed
        shutil.rmtree(tmp, ignore_errors=True)
        clear = write_error(e, current, f"the checkpoint of step {step}", free)
        if clear is not None:
            raise clear from e
        raise
    if keep_last is not None:  # the one just written is always kept, even below a newer step (an older resume)
        for old in [s for s in _complete_steps(root) if s != step][keep_last - 1:]:
            shutil.rmtree(root / checkpoint_dir_name(old), ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------------------ reading

def _read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"{mpath} is missing: {path} is incomplete or not an rlrepro checkpoint; "
                         "resume from latest_checkpoint(ckpt_root) instead")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath} is not valid JSON ({e}); the checkpoint is corrupt, "
                         "resume from an earlier one (latest_checkpoint skips it only if files are missing)") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"),
                                                                                           dict):
        fmt = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{mpath} is not an {FORMAT} manifest (format {fmt!r})")
    bad = [n for n, e in manifest["files"].items() if not isinstance(e, dict) or not isinstance(e.get("size"), int)
           or not isinstance(e.get("sha256"), str)]
    if bad:
        raise ValueError(f"{mpath} lists {bad[0]!r} without an integer size and a sha256; the manifest is damaged")
    if manifest.get("version") != VERSION:
        raise CheckpointVersionError(f"{mpath} has format version {manifest.get('version')!r}; this rlrepro writes "
                                     f"and reads version {VERSION}", manifest.get("version"))
    return manifest


def verify_checkpoint(path: str | os.PathLike, check_hashes: bool = True) -> dict:
    """Check every file the manifest lists: present, the recorded size and (``check_hashes``) sha256.

    Raises ValueError naming the first bad file and what to do; returns the manifest.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    advice = "the checkpoint is damaged: delete it and resume from an earlier one"
    for name, entry in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint file {f} is missing; {advice}")
        size = f.stat().st_size
        if size != entry["size"]:
            raise ValueError(f"checkpoint file {f} has {size} bytes, the manifest says {entry['size']} "
                             f"(truncated or overwritten); {advice}")
        if check_hashes:
            digest = _file_digest(f)["sha256"]
            if digest != entry["sha256"]:
                raise ValueError(f"checkpoint file {f} has sha256 {digest}, the manifest says {entry['sha256']} "
                                 f"(corrupted); {advice}")
    return manifest


def scan_checkpoints(ckpt_root: str | os.PathLike) -> list[tuple[int, Path, str | None]]:
    """Every ``step_NNNNNN`` entry under ``ckpt_root``, newest first, as ``(step, path, problem)``: ``problem`` is
    None for a complete checkpoint (manifest present, every listed file of the recorded size; hashes are checked
    when it is loaded), else why it is not one. ``*.tmp-*`` (a write that did not finish) and other names are
    not listed."""
    root = Path(ckpt_root)
    out = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if not m:
            continue
        problem = None
        if not d.is_dir():
            problem = f"{d} is not a directory"
        else:
            try:
                verify_checkpoint(d, check_hashes=False)
            except ValueError as e:
                problem = str(e)
        out.append((int(m.group(1)), d, problem))
    return sorted(out, key=lambda t: t[0], reverse=True)


def _complete_steps(root: Path) -> list[int]:
    """Steps of complete checkpoints (manifest present, every listed file of the recorded size), newest first."""
    return [step for step, _, problem in scan_checkpoints(root) if problem is None]


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of each complete checkpoint under ``ckpt_root``, oldest first; see latest_checkpoint."""
    return [(s, Path(ckpt_root) / checkpoint_dir_name(s)) for s in reversed(_complete_steps(Path(ckpt_root)))]


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete ``step_NNNNNN`` under ``ckpt_root`` (None if there is none).

    Skips ``*.tmp-*`` directories and directories whose manifest is missing or lists a missing or wrongly sized
    file. Hashes are checked by :func:`load_checkpoint`, not here (reading every byte of a large checkpoint).
    """
    steps = _complete_steps(Path(ckpt_root))
    return Path(ckpt_root) / checkpoint_dir_name(steps[0]) if steps else None


def load_extra_state(path: str | os.PathLike) -> tuple[int, dict]:
    """A checkpoint's step and ``extra_state.pt`` (the data cursor, the batches generated ahead), without loading
    anything else: the manifest is read and ``extra_state.pt`` checked against it (size and sha256) first. What a
    resume checks before it starts anything. ValueError naming the file when it is missing or damaged."""
    path = Path(path)
    manifest = _read_manifest(path)
    entry = manifest["files"].get("extra_state.pt")
    f = path / "extra_state.pt"
    if entry is None or not f.is_file():
        raise ValueError(f"checkpoint {path} has no extra_state.pt (the data cursor); the checkpoint is damaged: "
                         "delete it and resume from an earlier one")
    have = _file_digest(f)
    if have["size"] != entry["size"] or have["sha256"] != entry["sha256"]:
        raise ValueError(f"checkpoint file {f} has {have['size']} bytes and sha256 {have['sha256']}, the manifest "
                         f"says {entry['size']} bytes and {entry['sha256']} (truncated or corrupted); the checkpoint "
                         "is damaged: delete it and resume from an earlier one")
    return int(manifest["step"]), load_pt(f)


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    extra_state: dict
    rng_state: dict


def load_pt(path: str | os.PathLike, map_location="cpu"):
    """``torch.load(path, weights_only=True)``: tensors and plain containers only. A file that holds anything else
    (a pickle with code, objects of other classes) or is not a torch file raises ValueError naming the file; the
    way to load it anyway is never suggested (it would run the code)."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        code = re.search(r"GLOBAL ([\w.]+)", str(e))
        other = re.search(r"Unsupported (operand \d+|class [\w.]+)", str(e))
        if code:
            what = f"holds pickled code or objects of other classes than tensors and plain containers ({code[1]})"
        else:
            what = ("is not a file of tensors and plain containers" + (f" ({other[1]})" if other else ""))
        raise ValueError(f"checkpoint file {path} {what}: rlrepro writes no such file, so it was made elsewhere or "
                         "damaged or tampered with, and it is not loaded (no code in it runs). Delete this checkpoint "
                         "and resume from an earlier one, or from a copy you trust") from None
    except (RuntimeError, EOFError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"checkpoint file {path} cannot be read as a torch file ({type(e).__name__}: {first}); "
                         "delete this checkpoint and resume from an earlier one") from None


_load_pt = load_pt


def _checked_model_state(f: Path, model) -> dict[str, torch.Tensor]:
    """``f``'s tensors, refused (ValueError) unless they are exactly ``model``'s names, shapes and dtypes: then
    ``load_state_dict`` copies each in place and cannot fail."""
    state = load_file(str(f))
    own = model.state_dict()
    if set(state) != set(own):
        raise ValueError(f"{f} holds tensors {sorted(set(state) - set(own))[:5]} the model lacks and lacks "
                         f"{sorted(set(own) - set(state))[:5]}; load it into the same architecture")
    for k, v in state.items():
        if v.dtype != own[k].dtype or v.shape != own[k].shape:
            raise ValueError(f"{f}: {k!r} is {v.dtype} {tuple(v.shape)}, the model has {own[k].dtype} "
                             f"{tuple(own[k].shape)}; build the model with the saving run's dtype and config")
    return state


@contextmanager
def applying_checkpoint(path: str | os.PathLike) -> Iterator[None]:
    """The apply phase of an all-or-nothing load (every check done): an exception from inside (a device fault, an
    interrupt) gets a note that the model/optimizer/scheduler/RNGs may be partly loaded."""
    try:
        yield
    except BaseException as e:
        e.add_note(f"rlrepro: loading {path} stopped after it began changing the model/optimizer/scheduler/RNGs, "
                   "which may now be partly loaded: build the trainer anew before loading or training again")
        raise


def load_checkpoint(path: str | os.PathLike, *, model=None, optimizer=None, scheduler=None,
                    restore_rng: bool = True, generators: Mapping[str, object] | None = None,
                    map_location: str | torch.device | None = "cpu") -> LoadedCheckpoint:
    """Verify the manifest (sizes and sha256 of every file) and only then load into the given objects.

    ``model``: its state dict is loaded strictly (same names, shapes and dtypes). ``restore_rng``: put the RNG
    states back (Python, numpy, torch CPU and CUDA, and ``generators``). Returns step, extra_state and rng_state.

    All or nothing: every file is read and every check that can refuse (RNG states, the model's names, shapes and
    dtypes, the optimizer's and the scheduler's ``check_state_dict``/``prepare_state_dict`` where they have one)
    runs before anything live changes, so a refused load (a ValueError naming the mismatch and the fix) leaves the
    model, optimizer, scheduler and RNGs exactly as they were. What follows cannot fail on the checkpoint's
    contents: in-place copies of checked shapes and dtypes, an optimizer state already placed on its device (the
    allocation is done in the checks), plain values. Only a device fault or an interrupt can stop it midway (no
    second copy of the weights is kept to undo that); the exception then says the trainer is partly loaded.
    An optimizer without those methods (another trainer's view) checks in its own ``load_state_dict``, after the
    model is loaded.
    """
    path = Path(path)
    manifest = verify_checkpoint(path, check_hashes=True)
    listed = manifest["files"]
    layout = manifest.get("layout")
    if layout is not None and layout != "full":
        raise ValueError(f"checkpoint {path} has the {layout!r} layout (sharded by a tensor-parallel run); load it "
                         "with train.backend=megatron, or convert it first with "
                         "rlrepro.trainer.megatron.dist_to_full(path, ckpt_root)")

    def need(name: str, what: str) -> Path:
        if name not in listed:
            raise ValueError(f"checkpoint {path} has no {name} but a {what} was passed to load; "
                             f"it was saved without one — pass {what}=None")
        return path / name

    # 1. read and check everything; nothing live changes here
    rng_state = _load_pt(path / "rng.pt", "cpu")
    if restore_rng:
        check_rng_state(rng_state, generators)
    model_state = _checked_model_state(need("model.safetensors", "model"), model) if model is not None else None
    optim_state = sched_state = None
    if optimizer is not None:
        optim_state = _load_pt(need("optimizer.pt", "optimizer"), map_location)
        if hasattr(optimizer, "prepare_state_dict"):
            optim_state = optimizer.prepare_state_dict(optim_state)
    if scheduler is not None:
        sched_state = _load_pt(need("scheduler.pt", "scheduler"), map_location)
        if hasattr(scheduler, "check_state_dict"):
            scheduler.check_state_dict(sched_state)
    extra_state = _load_pt(path / "extra_state.pt", map_location)
    # 2. apply, in the order a load always had (the optimizer's masters are cast into the weights last)
    with applying_checkpoint(path):
        if model is not None:
            model.load_state_dict(model_state, strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(optim_state)
        if scheduler is not None:
            scheduler.load_state_dict(sched_state)
        if restore_rng:
            restore_rng_state(rng_state, generators)
    return LoadedCheckpoint(path=path, step=int(manifest["step"]), extra_state=extra_state, rng_state=rng_state)


def export_hf(model, path: str | os.PathLike, **kwargs) -> Path:
    """Write the policy as a Hugging Face checkpoint (config.json + safetensors) via ``rlrepro.model.save_pretrained``;
    ``kwargs`` go to it (``max_shard_bytes``, ``tokenizer_from``)."""
    return save_pretrained(model, path, **kwargs)
