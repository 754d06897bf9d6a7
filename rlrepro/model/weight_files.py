"""The safetensors files of an HF model directory, as loading reads them: the shards its index names, else
``model.safetensors``, else every ``*.safetensors``; an index beside ``model.safetensors`` is refused (which one
is the model is ambiguous: transformers takes the single file). Its own module because the config reads the
weights' dtype from them (:func:`.config._stored_float_dtype`) and the checkpoint loader, which imports the
config, reads their tensors."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["weight_files"]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file() and (path / "model.safetensors").is_file():
        # transformers reads model.safetensors first, the index's shards only without it: two loaders, two models
        raise ValueError(f"{path} holds both model.safetensors and model.safetensors.index.json (with its shards): "
                         "two saves of the model, or a half-finished copy; delete the stale one (transformers would "
                         "load model.safetensors)")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to file names; the model directory is "
                             "damaged: copy it again")
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files
