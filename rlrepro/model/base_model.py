"""``RUN/base_model/``: the starting weights a run creates itself (``model.init=tiny`` or ``model.init=random``),
written atomically with a manifest, and verified against that manifest every time a run reuses them.

Layout: an HF model directory (``config.json``, ``*.safetensors``, tokenizer files) plus ``manifest.json``::

    {"format": "rlrepro-base-model", "version": 1,
     "recipe": {...how it was made...}, "source": {"path": ...} (init=random only),
     "files": {name: {"size": bytes, "sha256": hex}}}     every other file of the directory

The recipe holds exactly the inputs the bytes depend on:

* ``init=tiny``: ``init``, ``init_seed``, ``tiny_overrides`` (the tiny config's overrides; its dtype is the
  ``torch_dtype`` they name, float32 by default, so ``model.dtype`` is not an input and not recorded);
* ``init=random``: ``init``, ``init_seed``, ``dtype`` (the dtype written: ``model.dtype``, or the source
  config's own when it is None), ``source_config_sha256`` (``model.path/config.json``) and
  ``source_tokenizer_sha256`` (the tokenizer files copied from ``model.path``). The source path itself is
  recorded for information only: a moved but identical source still matches.

Writing: into ``RUN/base_model.tmp-<pid>-<random>/``, each file fsynced, the manifest last, the directory
fsynced, one ``os.rename`` to ``base_model`` and an fsync of the run directory: ``base_model`` is complete or
absent. ``base_model.tmp*`` entries left by a killed start (or the ``base_model.tmp`` of older versions) are
deleted before anything is written; they are never read.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from rlrepro._files import sha256_file, fsync_path

from .checkpoint_io import TOKENIZER_FILES, save_pretrained
from .config import Qwen3Config
from .qwen3 import Qwen3ForCausalLM, init_random_weights
from .tiny import write_tiny_checkpoint

__all__ = ["prepare_base_model", "base_model_recipe", "verify_base_model", "BaseModelError", "BASE_MODEL_DIR",
           "MANIFEST_FORMAT"]

BASE_MODEL_DIR = "base_model"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "rlrepro-base-model"
VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_RANDOM_MAX_SHARD_BYTES = 5 << 30  # the shard size prepare_model_dir has always written


class BaseModelError(ValueError):
    """A ``base_model`` directory that cannot be used as it is; the message names it, the problem and the fix."""


# ----------------------------------------------------------------------------------------------------- helpers

def _sha256(path: Path) -> str:
    return sha256_file(path)


def _fsync(path: Path) -> None:
    fsync_path(path)


def _plain(obj):
    """JSON-plain copy of a config value (an OmegaConf DictConfig/ListConfig works too: Mapping / sequence)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"tiny_overrides holds a {type(obj).__name__} ({obj!r}); only JSON values are allowed")


def _listing(path: Path) -> dict[str, Path]:
    """Every file under ``path`` by its relative POSIX name, the manifest excluded."""
    return {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*"))
            if p.is_file() and p.relative_to(path).as_posix() != MANIFEST}


def _digests(path: Path) -> dict[str, dict]:
    return {name: {"size": f.stat().st_size, "sha256": _sha256(f)} for name, f in _listing(path).items()}


def _fix(target: Path) -> str:
    return (f"Fix: delete {target} (it is made again from the recipe), or start the run over with "
            "run.overwrite=true")


def _log(message: str) -> None:
    print(f"rlrepro: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------ recipe

def _random_dtype(config: Qwen3Config, dtype: str | None) -> torch.dtype:
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not one of None, {', '.join(_DTYPES)}")
    return _DTYPES[dtype] if dtype is not None else config.dtype


def base_model_recipe(*, init: str, path: str | os.PathLike | None, init_seed: int, dtype: str | None,
                      tiny_overrides: Mapping | None) -> dict:
    """The recipe ``prepare_base_model`` records for these inputs (see the module docstring): the inputs that the
    bytes of ``base_model`` depend on, as plain JSON values."""
    if isinstance(init_seed, bool) or not isinstance(init_seed, int):
        raise ValueError(f"model.init_seed must be an integer, got {init_seed!r}")
    if init == "tiny":
        return {"init": "tiny", "init_seed": init_seed, "tiny_overrides": _plain(tiny_overrides or {})}
    if init != "random":
        raise ValueError(f"model.init={init!r}: a base_model is made for init=tiny or init=random only")
    if path is None:
        raise ValueError("model.init=random needs model.path (the HF directory whose shape and tokenizer to use)")
    source = Path(path)
    config = Qwen3Config.from_file(source)  # a clear error when config.json is missing or bad
    tokenizer = {f: _sha256(source / f) for f in TOKENIZER_FILES if (source / f).is_file()}
    return {"init": "random", "init_seed": init_seed,
            "dtype": str(_random_dtype(config, dtype)).replace("torch.", ""),
            "source_config_sha256": _sha256(source / "config.json"), "source_tokenizer_sha256": tokenizer}


def _write_weights(tmp: Path, *, init: str, path, init_seed: int, dtype: str | None, tiny_overrides) -> None:
    """What ``orchestration.driver.prepare_model_dir`` has always written for these inputs, byte for byte."""
    if init == "tiny":
        write_tiny_checkpoint(tmp, seed=init_seed, **_plain(tiny_overrides or {}))
        return
    config = Qwen3Config.from_file(path)
    model = init_random_weights(Qwen3ForCausalLM(config).to(_random_dtype(config, dtype)), init_seed)
    save_pretrained(model, tmp, max_shard_bytes=_RANDOM_MAX_SHARD_BYTES, tokenizer_from=path)
    del model


def _build(run_dir: Path, recipe: dict, **inputs) -> Path:
    """A complete, fsynced ``base_model.tmp-XXXX`` directory with its manifest; removed again on failure."""
    tmp = run_dir / f"{BASE_MODEL_DIR}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # mode 0o777 & ~umask, as base_model always had (tempfile.mkdtemp would make it 0o700)
    try:
        _write_weights(tmp, **inputs)
        files = _digests(tmp)
        for name in files:
            _fsync(tmp / name)
        manifest = {"format": MANIFEST_FORMAT, "version": VERSION, "recipe": recipe, "files": files}
        if recipe["init"] == "random":
            manifest["source"] = {"path": str(inputs["path"])}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


# ------------------------------------------------------------------------------------------------ verification

def _read_manifest(target: Path) -> dict | None:
    """The parsed manifest, None when there is none; BaseModelError when it is not a base_model manifest."""
    mpath = target / MANIFEST
    if not mpath.is_file():
        return None
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaseModelError(f"{mpath} is not valid JSON ({e}): {target} is damaged. {_fix(target)}") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("recipe"), dict)):
        raise BaseModelError(f"{mpath} is not an {MANIFEST_FORMAT} manifest: {target} was not written by "
                             f"prepare_base_model. {_fix(target)}")
    if manifest.get("version") != VERSION:
        raise BaseModelError(f"{mpath} has version {manifest.get('version')!r}; this rlrepro writes and reads "
                             f"version {VERSION}. {_fix(target)}")
    return manifest


def _file_problems(target: Path, listed: Mapping[str, Mapping], what: str = "the manifest") -> list[str]:
    """What differs between the files under ``target`` and ``listed`` ({name: {size, sha256}}, from ``what``)."""
    have = _listing(target)
    problems = [f"{name} is missing" for name in sorted(set(listed) - set(have))]
    problems += [f"{name} is not in {what} (an extra file)" for name in sorted(set(have) - set(listed))]
    for name in sorted(set(listed) & set(have)):
        size = have[name].stat().st_size
        if size != listed[name].get("size"):
            problems.append(f"{name} has {size} bytes, {what} has {listed[name].get('size')}")
        elif _sha256(have[name]) != listed[name].get("sha256"):
            problems.append(f"{name} has another sha256 than {what} (corrupted or changed)")
    return problems


def _recipe_problems(have: Mapping, want: Mapping) -> list[str]:
    return [f"{key}: base_model was made with {have.get(key, '<absent>')!r}, this run asks for "
            f"{want.get(key, '<absent>')!r}" for key in sorted(set(have) | set(want)) if have.get(key) != want.get(key)]


def verify_base_model(path: str | os.PathLike, recipe: Mapping | None = None) -> dict:
    """Check a ``base_model`` directory against its manifest: every listed file present with its size and sha256,
    no other file, and (when ``recipe`` is given) the recorded recipe equal to it. Returns the manifest; raises
    :class:`BaseModelError` naming the directory, every problem and the fix (also when there is no manifest)."""
    target = Path(path)
    manifest = _read_manifest(target)
    if manifest is None:
        raise BaseModelError(f"{target} has no {MANIFEST}: it was written by an older rlrepro or not by "
                             f"prepare_base_model, so nothing says it is complete or how it was made. {_fix(target)}")
    problems = _file_problems(target, manifest["files"])
    if recipe is not None:
        problems += _recipe_problems(manifest["recipe"], json.loads(json.dumps(recipe)))
    if problems:
        raise BaseModelError(f"{target} does not match its manifest or this run's model settings: "
                             + "; ".join(problems) + f". {_fix(target)}")
    return manifest


# ------------------------------------------------------------------------------------------------------- entry

def _remove_stale(run_dir: Path) -> None:
    for stale in sorted(run_dir.glob(f"{BASE_MODEL_DIR}.tmp*")):
        _log(f"removing {stale}, left by a start that did not finish writing base_model (never read)")
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _commit(tmp: Path, target: Path) -> None:
    """Rename the complete ``tmp`` to ``target``; an existing ``target`` is moved aside first and deleted after."""
    aside = None
    if target.exists() or target.is_symlink():
        aside = target.with_name(f"{BASE_MODEL_DIR}.tmp-old-{os.getpid()}")
        os.rename(target, aside)
    os.rename(tmp, target)
    _fsync(target.parent)
    if aside is not None and aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    elif aside is not None:
        aside.unlink(missing_ok=True)


def _differences(existing: Path, built: Path) -> list[str]:
    """How the files of ``existing`` differ from those of the freshly built ``built`` (empty: bit-identical)."""
    manifest = json.loads((built / MANIFEST).read_text())
    return _file_problems(existing, manifest["files"], what="what the recipe makes")


def prepare_base_model(run_dir: str | os.PathLike, *, init: str, path: str | os.PathLike | None, init_seed: int,
                       dtype: str | None, tiny_overrides: Mapping | None, overwrite: bool = False) -> Path:
    """The directory a run loads its starting policy from.

    ``init="pretrained"``: ``Path(path)``, untouched. ``init="tiny"`` / ``"random"``: ``RUN/base_model``, made
    when absent (the very bytes ``orchestration.driver.prepare_model_dir`` always wrote: ``write_tiny_checkpoint``,
    or seeded random weights of ``path``'s shape in ``dtype`` with its tokenizer) with a manifest, and verified
    when present: every file's sha256 against the manifest, and the recorded recipe against the one these
    arguments give. A ``base_model`` that fails is refused with :class:`BaseModelError` (a ValueError) naming the
    directory, what is wrong and the fix (delete it, or ``run.overwrite=true``); with ``overwrite=True`` (pass
    ``run.overwrite``) it is replaced instead. An empty ``base_model`` directory is simply replaced.

    A ``base_model`` **without a manifest** (written by an older rlrepro, or by hand) is regenerated into a
    temporary directory and compared file by file: if every file is bit-identical, its manifest is added and it
    is used (nothing changes, so a run started by an older version resumes); otherwise it is refused (or replaced,
    with ``overwrite``). It is not simply regenerated over: a run's records, checkpoints and KL reference were
    made from the weights it holds, and if the code that generates them changed since, a silent regeneration would
    resume that run from other starting weights; the comparison makes "regenerate" safe exactly when it changes
    nothing. Verification reads every byte (about 1 GB/s); the manifest is what makes reuse safe.
    """
    if init == "pretrained":
        if path is None:
            raise ValueError("model.init=pretrained needs model.path (an HF model directory)")
        return Path(path)
    inputs = dict(init=init, path=path, init_seed=init_seed, dtype=dtype, tiny_overrides=tiny_overrides)
    recipe = base_model_recipe(**inputs)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / BASE_MODEL_DIR
    _remove_stale(run_dir)
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        target.rmdir()
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            if not overwrite:
                raise BaseModelError(f"{target} is not a directory. {_fix(target)}")
        elif overwrite or (target / MANIFEST).exists():
            try:
                verify_base_model(target, recipe)
                return target
            except BaseModelError as e:
                if not overwrite:
                    raise
                _log(f"run.overwrite=true: replacing {target} ({e})")
        else:  # no manifest: regenerate and compare
            built = _build(run_dir, recipe, **inputs)
            try:
                differences = _differences(target, built)
                if not differences:
                    _log(f"{target} has no manifest (an older rlrepro wrote it); it is bit-identical to what this "
                         "recipe makes: its manifest is added")
                    tmp = run_dir / f"{BASE_MODEL_DIR}.tmp-manifest-{os.getpid()}"  # stale ones are removed
                    shutil.copyfile(built / MANIFEST, tmp)
                    _fsync(tmp)
                    os.replace(tmp, target / MANIFEST)
                    _fsync(target)
                    return target
            finally:
                shutil.rmtree(built, ignore_errors=True)
            more = f" (and {len(differences) - 4} more)" if len(differences) > 4 else ""
            raise BaseModelError(f"{target} has no {MANIFEST} (written by an older rlrepro, by hand, or cut short) "
                                 f"and differs from what this run's model settings (init={init}, "
                                 f"init_seed={init_seed}) make: {'; '.join(differences[:4])}{more}. {_fix(target)}")
    tmp = _build(run_dir, recipe, **inputs)
    try:
        _commit(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
