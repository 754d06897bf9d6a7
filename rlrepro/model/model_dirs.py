"""What a model path may name, resolved to weights + config.json + tokenizer: :func:`resolve_model_dir`.

Three kinds of directory are accepted:

* an **HF model directory**: ``config.json``, ``*.safetensors`` (sharded too), ``tokenizer.json``;
* an **rlrepro run directory** (``config.yaml``, ``checkpoints/``), or its ``checkpoints/`` folder: its newest
  complete checkpoint, as below;
* a **training checkpoint** ``RUN/checkpoints/step_NNNNNN/`` (``manifest.json``, ``model.safetensors`` holding the
  policy's state dict in the compute dtype, no config.json, no tokenizer). Its config.json and tokenizer come
  from the run: ``RUN/base_model`` when the run made its starting weights (``model.init`` tiny or random), the
  ``model.path`` of ``RUN/config.yaml`` when it started from a pretrained one, or the ``base`` argument.

A checkpoint's tensor names are the HF ones (``Qwen3ForCausalLM.state_dict()``), so its weights load through the
same reading code as an HF directory (:func:`rlrepro.model.checkpoint_io.iter_checkpoint_tensors`), into a model
built from the run's config.json in the dtype the checkpoint holds.

The checkpoint layout is :mod:`rlrepro.trainer.checkpoint`'s; ``rlrepro.model`` may not import the trainer (the
layer contract in pyproject.toml), so the few lines that find a complete checkpoint are repeated here: a
``step_NNNNNN`` directory whose ``manifest.json`` parses as an ``rlrepro-checkpoint`` of version 1 and whose listed
files are present with their recorded sizes (what ``latest_checkpoint`` considers complete). The sha256 of
``model.safetensors`` is checked before its tensors are read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rlrepro._files import sha256_file

from .base_model import BASE_MODEL_DIR
from .checkpoint_io import fill_model, load_pretrained
from .config import SAFETENSORS_DTYPES, Qwen3Config
from .qwen3 import Qwen3ForCausalLM

__all__ = ["resolve_model_dir", "ResolvedModel", "ModelDirError", "load_resolved", "checkpoint_base"]

CHECKPOINT_FORMAT = "rlrepro-checkpoint"  # rlrepro.trainer.checkpoint.FORMAT / VERSION / MANIFEST
CHECKPOINT_VERSION = 1
CHECKPOINT_MANIFEST = "manifest.json"
CHECKPOINT_WEIGHTS = "model.safetensors"
CHECKPOINTS_DIR = "checkpoints"  # rlrepro.repro.records.CHECKPOINTS_DIR
RUN_CONFIG = "config.yaml"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SAFETENSORS_DTYPES = {k: getattr(torch, v) for k, v in SAFETENSORS_DTYPES.items()}

ACCEPTS = ("an HF model directory (config.json, *.safetensors, tokenizer.json), an rlrepro run directory "
           "(config.yaml, checkpoints/: its newest complete checkpoint) or a checkpoint directory "
           "(RUN/checkpoints/step_NNNNNN with manifest.json)")


class ModelDirError(ValueError):
    """A model path that names no usable model; the message names the path, the problem and what is accepted."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where the pieces of a model are. ``kind``: ``"hf"`` (``weights_dir`` is an HF directory, the same as
    ``config_dir`` and ``tokenizer_dir``) or ``"checkpoint"`` (``weights_dir`` is a training checkpoint;
    ``step`` its step, ``run_dir`` its run when it lies in one). ``path``: what was asked for."""

    path: Path
    kind: str
    weights_dir: Path
    config_dir: Path
    tokenizer_dir: Path
    step: int | None = None
    run_dir: Path | None = None

    @property
    def is_hf(self) -> bool:
        return self.kind == "hf"

    def describe(self) -> str:
        if self.is_hf:
            return f"HF model directory {self.weights_dir}"
        return (f"checkpoint {self.weights_dir} (step {self.step}), config.json from {self.config_dir}, "
                f"tokenizer from {self.tokenizer_dir}")

    def load(self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Qwen3ForCausalLM:
        """The model (``dtype=None``: the weights' own dtype); see :func:`load_resolved`."""
        return load_resolved(self, device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------ checkpoints

def _checkpoint_manifest(path: Path) -> dict:
    """The manifest of a complete full-layout checkpoint holding the policy's weights, else ModelDirError."""
    mpath = path / CHECKPOINT_MANIFEST
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"{path} has no {CHECKPOINT_MANIFEST}: an incomplete checkpoint (a write that did not "
                            f"finish) or no checkpoint at all; pass {ACCEPTS}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{mpath} cannot be read ({e}): the checkpoint is damaged; use an earlier one") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT
            or not isinstance(manifest.get("files"), dict)):
        raise ModelDirError(f"{mpath} is not an {CHECKPOINT_FORMAT} manifest; pass {ACCEPTS}")
    if manifest.get("version") != CHECKPOINT_VERSION:
        raise ModelDirError(f"{mpath} has checkpoint version {manifest.get('version')!r}; this rlrepro reads "
                            f"version {CHECKPOINT_VERSION}")
    layout = manifest.get("layout")
    if layout not in (None, "full"):
        raise ModelDirError(f"checkpoint {path} has the {layout!r} layout (shards of a tensor-parallel run), which "
                            "holds no single weights file; convert it first: rlrepro.trainer.megatron."
                            f"dist_to_hf({str(path)!r}, OUT_DIR), then pass OUT_DIR")
    for name, entry in manifest["files"].items():
        f = path / name
        size = f.stat().st_size if f.is_file() else None
        if size is None or not isinstance(entry, dict) or size != entry.get("size"):
            what = "is missing" if size is None else f"has {size} bytes, the manifest says {entry.get('size')}"
            raise ModelDirError(f"checkpoint file {f} {what}: the checkpoint is damaged; use an earlier one")
    if CHECKPOINT_WEIGHTS not in manifest["files"]:
        raise ModelDirError(f"checkpoint {path} holds no {CHECKPOINT_WEIGHTS} (saved without a model); "
                            "use another checkpoint")
    return manifest


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete ``step_NNNNNN`` checkpoints under ``root``, newest first."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_DIR.match(d.name)
            if not m or not d.is_dir():
                continue
            try:
                manifest = json.loads((d / CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))
                files = manifest["files"]
                complete = manifest.get("format") == CHECKPOINT_FORMAT and all(
                    (d / n).is_file() and (d / n).stat().st_size == e["size"] for n, e in files.items())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                complete = False
            if complete:
                found.append((int(m.group(1)), d))
    return sorted(found, reverse=True)


def _newest_checkpoint(root: Path, run_dir: Path) -> Path:
    found = _complete_checkpoints(root)
    if found:
        return found[0][1]
    base = run_dir / BASE_MODEL_DIR
    hint = f"; its starting weights are the HF directory {base}" if (base / "config.json").is_file() else ""
    raise ModelDirError(f"run directory {run_dir} has no complete checkpoint under {root}{hint}; pass {ACCEPTS}")


def _run_model_path(run_dir: Path) -> tuple[str | None, str | None]:
    """(model.init, model.path) from RUN/config.yaml; (None, None) without one."""
    cfg_file = run_dir / RUN_CONFIG
    if not cfg_file.is_file():
        return None, None
    import yaml  # PyYAML (an omegaconf dependency); config.yaml is OmegaConf.to_yaml's output, resolved

    try:
        model = (yaml.safe_load(cfg_file.read_text(encoding="utf-8")) or {}).get("model") or {}
    except (yaml.YAMLError, UnicodeDecodeError, AttributeError) as e:
        raise ModelDirError(f"{cfg_file} cannot be read ({e}); pass the model's HF directory as base") from None
    return model.get("init"), model.get("path")


def checkpoint_base(ckpt: Path, run_dir: Path | None) -> Path:
    """The HF directory that holds the checkpoint's config.json and tokenizer."""
    if run_dir is None:
        raise ModelDirError(f"checkpoint {ckpt} does not lie in a run directory (RUN/{CHECKPOINTS_DIR}/step_NNNNNN), "
                            "so nothing says which config.json and tokenizer belong to it; pass base=HF_DIR "
                            "(rlrepro generate --base HF_DIR)")
    init, model_path = _run_model_path(run_dir)
    if init == "pretrained":
        if not model_path:
            raise ModelDirError(f"{run_dir / RUN_CONFIG} has model.init=pretrained but no model.path; pass base=HF_DIR")
        base = Path(model_path)
        if not (base / "config.json").is_file():
            raise ModelDirError(f"checkpoint {ckpt} belongs to a run started from model.path={model_path!r} "
                                f"({run_dir / RUN_CONFIG}), which holds no config.json from here "
                                f"({Path.cwd()}); run from where the training ran, or pass base=HF_DIR")
        return base
    base = run_dir / BASE_MODEL_DIR
    if not (base / "config.json").is_file():
        raise ModelDirError(f"checkpoint {ckpt} belongs to run {run_dir}, which has no {base}/config.json "
                            f"(model.init={init!r}); pass base=HF_DIR with the run's config.json and tokenizer")
    return base


def _require_tokenizer(tok_dir: Path, what: str) -> None:
    if not (tok_dir / "tokenizer.json").is_file():
        raise ModelDirError(f"{what}: no tokenizer.json in {tok_dir}; the model directory must hold the tokenizer "
                            "(copy tokenizer.json and tokenizer_config.json into it)")


# --------------------------------------------------------------------------------------------------- resolve

def resolve_model_dir(path: str | os.PathLike, *, base: str | os.PathLike | None = None) -> ResolvedModel:
    """Resolve ``path`` (an HF model directory, a run directory, its ``checkpoints/`` folder, or a checkpoint
    directory; see the module docstring) to a :class:`ResolvedModel`. ``base``: an HF directory whose
    config.json and tokenizer a checkpoint uses, instead of the run's. Checks what can be checked without reading
    the weights; raises :class:`ModelDirError` (a ValueError) naming the path, the problem and what is accepted."""
    path = Path(path)
    if not path.exists():
        raise ModelDirError(f"model path {path} does not exist; pass {ACCEPTS}")
    if not path.is_dir():
        raise ModelDirError(f"model path {path} is a file, not a directory; pass {ACCEPTS}")
    if (path / "config.json").is_file():
        _require_tokenizer(path, f"HF model directory {path}")
        return ResolvedModel(path=path, kind="hf", weights_dir=path, config_dir=path, tokenizer_dir=path)
    run_dir = None
    if ".tmp-" in path.name or ".old-" in path.name:
        raise ModelDirError(f"{path} is the temporary directory of a checkpoint write that did not finish (never "
                            f"committed); pass a complete checkpoint RUN/{CHECKPOINTS_DIR}/step_NNNNNN or the run")
    if (path / CHECKPOINT_MANIFEST).is_file() or _STEP_DIR.match(path.name):
        ckpt = path
    elif (path / CHECKPOINTS_DIR).is_dir() or (path / RUN_CONFIG).is_file():
        run_dir = path
        ckpt = _newest_checkpoint(path / CHECKPOINTS_DIR, path)
    elif path.name == CHECKPOINTS_DIR or _complete_checkpoints(path):
        run_dir = path.parent
        ckpt = _newest_checkpoint(path, path.parent)
    else:
        raise ModelDirError(f"model path {path} holds none of config.json, manifest.json, config.yaml or "
                            f"{CHECKPOINTS_DIR}/; pass {ACCEPTS}")
    manifest = _checkpoint_manifest(ckpt)
    if run_dir is None and ckpt.parent.name == CHECKPOINTS_DIR:
        run_dir = ckpt.parent.parent
    src = Path(base) if base is not None else checkpoint_base(ckpt, run_dir)
    if not (src / "config.json").is_file():
        raise ModelDirError(f"base {src} has no config.json; it must be an HF model directory")
    _require_tokenizer(src, f"the config.json and tokenizer of checkpoint {ckpt}")
    return ResolvedModel(path=path, kind="checkpoint", weights_dir=ckpt, config_dir=src, tokenizer_dir=src,
                         step=int(manifest.get("step", -1)), run_dir=run_dir)


# ------------------------------------------------------------------------------------------------------ load

def _sha256(path: Path) -> str:
    return sha256_file(path)


def _stored_dtype(f: Path) -> torch.dtype:
    try:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            names = {h.get_slice(n).get_dtype() for n in h.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise ModelDirError(f"cannot read weights file {f} (truncated or corrupt?): {e}") from e
    if len(names) != 1 or next(iter(names)) not in _SAFETENSORS_DTYPES:
        raise ModelDirError(f"{f} holds tensors of dtypes {sorted(names)}; a checkpoint holds one of "
                            f"{sorted(_SAFETENSORS_DTYPES)}")
    return _SAFETENSORS_DTYPES[names.pop()]


def load_resolved(resolved: ResolvedModel, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None) -> Qwen3ForCausalLM:
    """Load a :class:`ResolvedModel`: an HF directory through ``load_pretrained``; a checkpoint's
    ``model.safetensors`` (sha256 checked against its manifest first) into a model of the run's config.json, in the
    checkpoint's own dtype when ``dtype`` is None. ``model.source_path`` is the tokenizer directory, so
    ``save_pretrained(model, out)`` writes a complete HF directory."""
    if resolved.is_hf:
        return load_pretrained(resolved.weights_dir, device=device, dtype=dtype)
    ckpt = resolved.weights_dir
    entry = _checkpoint_manifest(ckpt)["files"][CHECKPOINT_WEIGHTS]
    f = ckpt / CHECKPOINT_WEIGHTS
    if _sha256(f) != entry.get("sha256"):
        raise ModelDirError(f"checkpoint file {f} has another sha256 than its manifest records (corrupted); "
                            "use an earlier checkpoint")
    stored = _stored_dtype(f)
    config = Qwen3Config.from_file(resolved.config_dir)
    config = dataclasses.replace(config, torch_dtype=str(stored).replace("torch.", ""))
    try:
        model = fill_model(ckpt, config, device, dtype or stored, config_source=f"{resolved.config_dir}/config.json")
    except ValueError as e:
        raise ModelDirError(f"checkpoint {ckpt} does not fit the config.json of {resolved.config_dir}: {e}; pass "
                            "base=HF_DIR with the config.json of the run that wrote it") from None
    model.source_path = str(resolved.tokenizer_dir)
    return model
