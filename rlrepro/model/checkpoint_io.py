"""HF-format checkpoints: config.json + safetensors (single file or sharded with model.safetensors.index.json)."""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlrepro._files import apply_default_mode, atomic_write_bytes, fsync_path

from .config import Qwen3Config
from .weight_files import weight_files
from .qwen3 import Qwen3ForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# the RoPE frequencies older transformers saved with the weights (``model.layers.N.self_attn.rotary_emb.inv_freq``,
# ``model.rotary_emb.inv_freq``): a buffer derived from the config, which transformers skips on load too
_ROTARY_BUFFER = "rotary_emb.inv_freq"
# the safetensors dtypes a weight may be stored in (cast to the compute dtype on load); integers, booleans and FP8
# are a quantized checkpoint's codes, which a cast would turn into garbage weights
_FLOAT_STORED = frozenset({"F32", "F16", "BF16", "F64"})


def model_dir_config(path: str | os.PathLike) -> tuple[Path, Qwen3Config]:
    """The directory as a Path and its parsed config.json; a clear error when it is not a directory."""
    given = path
    path = Path(path).expanduser()
    if not path.is_dir():
        hub = (f"; {given!r} looks like a Hugging Face hub id: rlrepro reads local directories only (no network), "
               f"so download it first (e.g. `huggingface-cli download {given} --local-dir DIR`) and pass DIR"
               if isinstance(given, str) and given.count("/") == 1 and not given.startswith((".", "/", "~"))
               and not path.exists() else "")
        raise FileNotFoundError(f"model path {path} is not a directory (expected an HF model dir with config.json)"
                                f"{hub}")
    return path, Qwen3Config.from_file(path)


def iter_checkpoint_tensors(path: Path, config: Qwen3Config, names: Collection[str],
                            config_source: str = "config.json") -> Iterator[tuple[Path, str, object]]:
    """Walk every tensor of the model directory's safetensors files: yields (file, name, open safe_open handle)
    for each tensor a Qwen3ForCausalLM of ``config`` has (``names``: the full model's parameter names, whatever
    shapes the caller's parameters have, e.g. a tensor-parallel shard's), skipping a stored LM head of a tied model
    and stored RoPE ``inv_freq`` buffers. Before the first tensor is yielded, :func:`check_checkpoint` runs
    (every header against the shapes ``config`` implies, none missing or extra, and the tied-head comparison), so
    every loader that walks the files (:func:`fill_model`, the megatron ``TPQwen3ForCausalLM.from_pretrained``)
    refuses a bad directory before it reads a weight. Raises ValueError naming the file and the fix."""
    check_checkpoint(path, config, config_source)
    yield from _walk_tensors(path, config, names)


def _walk_tensors(path: Path, config: Qwen3Config, names: Collection[str]) -> Iterator[tuple[Path, str, object]]:
    """:func:`iter_checkpoint_tensors` without the pre-checks. An unreadable file, an unknown tensor name, a
    tensor stored in two files or one stored in a dtype that is not a float one (a quantized checkpoint's integers
    or FP8) raises ValueError naming the file and the fix."""
    where: dict[str, Path] = {}
    for f in weight_files(path):
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise ValueError(f"cannot read weights file {f} (truncated or corrupt?): {e}. Fix: copy the model "
                             "directory again") from e
        with handle:
            for name in handle.keys():
                if name in where:  # which copy a loader takes depends on the file order: refuse, not pick one
                    raise ValueError(f"tensor {name!r} is stored in both {where[name]} and {f}; the model directory "
                                     "mixes two saves: delete the stale file (and fix model.safetensors.index.json)")
                where[name] = f
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name.endswith(_ROTARY_BUFFER):  # an older save's RoPE buffer: recomputed from rope_theta
                    continue
                if name not in names:
                    raise ValueError(f"{f} holds tensor {name!r}, which a Qwen3ForCausalLM does not have (no biases, "
                                     "no quantization scales, no other heads); use a dense Qwen3ForCausalLM "
                                     "checkpoint, or remove the tensor if it does not belong to the model")
                stored = handle.get_slice(name).get_dtype()
                if stored not in _FLOAT_STORED:
                    raise ValueError(f"{f}: tensor {name!r} is stored as {stored}; rlrepro loads float weights (F32, "
                                     "F16 or BF16): a quantized checkpoint? use its unquantized version")
                yield f, name, handle


def require_all_tensors(path: Path, names: Collection[str], seen: set[str]) -> None:
    missing = sorted(set(names) - seen)
    if missing:
        hint = ("; config.json has tie_word_embeddings=false: if the model shares its embedding with the LM head, "
                "set tie_word_embeddings to true" if missing == ["lm_head.weight"] else "")
        raise ValueError(f"checkpoint {path} lacks tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                         f"a shard is missing from the index or the directory is incomplete{hint}")


def _check_tensors(path: Path, config: Qwen3Config, shapes: dict[str, tuple], config_source: str) -> None:
    """Every tensor's name, dtype and shape from the files' headers (no tensor is read), none missing."""
    seen: set[str] = set()
    for f, name, handle in _walk_tensors(path, config, shapes):
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != shapes[name]:
            raise ValueError(f"{f}: tensor {name!r} has shape {shape}, {config_source} implies {shapes[name]}; "
                             f"{config_source} and the weights do not belong together")
        seen.add(name)
    require_all_tensors(path, shapes, seen)


def check_tied_head(path: Path, config: Qwen3Config) -> None:
    """A tied model (``tie_word_embeddings=true``) whose files also hold an ``lm_head.weight``: older saves store
    the shared tensor twice, which is fine, but a different one is a model with its own head (transformers then
    loads it untied), which rlrepro would silently replace by the embedding. Reads the two tensors only then."""
    if not config.tie_word_embeddings:
        return
    files: dict[str, Path] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            files.update({name: f for name in handle.keys()
                          if name in ("lm_head.weight", "model.embed_tokens.weight")})
    if "lm_head.weight" not in files or "model.embed_tokens.weight" not in files:
        return
    found = {}
    for name, f in files.items():
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            found[name] = handle.get_tensor(name)
    head, embed = found.get("lm_head.weight"), found.get("model.embed_tokens.weight")
    if head is not None and embed is not None and not (head.shape == embed.shape and torch.equal(head, embed)):
        raise ValueError(f"config.json of {path} has tie_word_embeddings=true, but its lm_head.weight differs from "
                         "model.embed_tokens.weight: the model has its own LM head; set tie_word_embeddings to false "
                         "in config.json (transformers loads that head)")


def full_shapes(config: Qwen3Config) -> dict[str, tuple]:
    """Every parameter of a Qwen3ForCausalLM of ``config`` with its full (unsharded) shape; nothing allocated."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Qwen3ForCausalLM(config).named_parameters()}


def check_checkpoint(path: Path, config: Qwen3Config, config_source: str = "config.json") -> dict[str, tuple]:
    """The checks every loader runs before it reads a weight (one function, so no loader skips one): each
    tensor's name, dtype and shape from the files' headers against :func:`full_shapes`, none missing or extra,
    then :func:`check_tied_head`. Returns the shapes."""
    shapes = full_shapes(config)
    _check_tensors(path, config, shapes, config_source)
    check_tied_head(path, config)
    return shapes


def fill_model(path: Path, config: Qwen3Config, device: str | torch.device, dtype: torch.dtype,
               config_source: str = "config.json") -> Qwen3ForCausalLM:
    """A model of ``config`` in ``dtype`` on ``device`` holding every tensor of the checkpoint directory ``path``:
    each tensor's name, dtype and shape checked against the ones ``config_source`` implies, none missing, from
    the files' headers before any tensor is read (the loading loop of :func:`load_pretrained` and of a run
    checkpoint's weights, ``model_dirs.load_resolved``)."""
    check_checkpoint(path, config, config_source)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for f, name, handle in _walk_tensors(path, config, params):  # (check_checkpoint ran above, before allocating)
        try:
            tensor = handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from {f} (truncated or corrupt?): {e}") from e
        if tuple(tensor.shape) != tuple(params[name].shape):  # (checked above; the files changed meanwhile?)
            raise ValueError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"{config_source} implies {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor.to(dtype))
        seen.add(name)
    require_all_tensors(path, params, seen)
    return model


def load_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The compute dtype a loader was asked for: None or "auto" (the checkpoint's own), torch.float32,
    torch.float16 or torch.bfloat16, or one of their names (with or without ``torch.``); ValueError naming the choices for any
    other (a loader's check: :func:`load_pretrained`, ``TPQwen3ForCausalLM.from_pretrained``)."""
    if isinstance(dtype, str) and dtype == "auto":  # transformers' torch_dtype="auto": the checkpoint's own
        return None
    if isinstance(dtype, str):
        if dtype.replace("torch.", "") not in _DTYPE_NAMES:
            raise ValueError(f"dtype={dtype!r} is not one of None, 'auto', {', '.join(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[dtype.replace("torch.", "")]
    if dtype is not None and dtype not in _DTYPE_NAMES.values():
        raise ValueError(f"dtype={dtype!r} is not one of None, 'auto', {', '.join(_DTYPE_NAMES)}")
    return dtype


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> Qwen3ForCausalLM:
    """Load an HF Qwen3 checkpoint directory. ``dtype=None`` keeps the checkpoint's own dtype (config torch_dtype)."""
    dtype = load_dtype(dtype)
    path, config = model_dir_config(path)
    model = fill_model(path, config, device, dtype or config.dtype)
    model.source_path = str(path)
    return model


def check_pretrained(path: str | os.PathLike) -> Qwen3Config:
    """Check an HF model directory without loading it: config.json parses, every shard is present and complete
    (safetensors checks that its header covers the file), the tensors' names and shapes are the ones
    ``config.json`` implies, none missing, and a tied config's stored LM head (if any) equals the embedding
    (:func:`check_checkpoint`: the only tensors it reads are those two, and only then). Raises the errors
    :func:`load_pretrained` would, before any work; returns the config."""
    path, config = model_dir_config(path)
    check_checkpoint(path, config)
    return config


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy when it is a view into a larger storage (e.g. fused projections on the CPU):
    safetensors refuses tensors that share memory."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def _remove_stale_weights(path: Path, num_shards: int) -> None:
    """Delete the weights an earlier save left in ``path`` that this one does not overwrite: a stale index (a
    loader would follow it to the old shards), a single file next to new shards, shards of another count."""
    keep = ({"model.safetensors"} if num_shards == 1 else
            {f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)})
    for f in path.glob("model*.safetensors*"):
        if f.name not in keep and (f.name in ("model.safetensors", "model.safetensors.index.json")
                                   or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f.name)):
            f.unlink()


def save_pretrained(model: Qwen3ForCausalLM, path: str | os.PathLike, max_shard_bytes: int | None = None,
                    tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write config.json + safetensors (sharded with an index when ``max_shard_bytes`` is exceeded), config.json
    last, once every other file is fsynced (:func:`write_config_last`).

    Tokenizer files are copied from ``tokenizer_from`` or, if unset, from the directory the model was loaded from.
    Every file gets the mode ``open()`` would give it (0o666 & ~umask), whatever safetensors or the source had.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["torch_dtype"] = str(model.dtype).replace("torch.", "")
    # config.json goes last: while the weights are written (over an earlier save's, say) the directory has none,
    # so a save that fails or is killed half way leaves one no loader takes for a model, never old and new
    # shards mixed under a config.json
    (path / "config.json").unlink(missing_ok=True)
    fsync_path(path)
    state = {k: _own_storage(v.detach().to("cpu").contiguous()) for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    meta = {"format": "pt"}
    _remove_stale_weights(path, len(shards))
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
        apply_default_mode(path / "model.safetensors")  # safetensors 0.8 creates it 0o600
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata=meta)
            apply_default_mode(path / fname)
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    source = tokenizer_from or getattr(model, "source_path", None)
    if source is not None and Path(source).resolve() != path.resolve():
        extra = sorted(p.relative_to(source) for p in Path(source).glob("additional_chat_templates/*.jinja"))
        for fname in (*TOKENIZER_FILES, *extra):  # the named chat templates too (the tokenizer reads them)
            if (Path(source) / fname).is_file():
                (path / fname).parent.mkdir(exist_ok=True)
                shutil.copy2(Path(source) / fname, path / fname)
                apply_default_mode(path / fname)  # not the source's mode (a read-only cache, say)
    write_config_last(path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return path


def write_config_last(path: str | os.PathLike, config: bytes) -> Path:
    """Write ``config`` as ``path/config.json``, the mark of a complete HF model directory, once everything else
    in it is on disk: every other file under ``path`` fsynced, then each directory (deepest first, its entries),
    then config.json written atomically (a temporary file, fsynced, renamed, the directory fsynced). A power loss
    cannot leave a config.json beside weights that are not on disk. Used by :func:`save_pretrained` and by
    ``rlrepro export`` (``rlrepro.orchestration.export.finish_export``)."""
    path = Path(path)
    for root, dirs, files in os.walk(path, topdown=False):  # not into symlinked directories
        for name in sorted(files):
            f = Path(root) / name
            if f.is_file() and not f.is_symlink() and f != path / "config.json":
                fsync_path(f)
        fsync_path(root)
    atomic_write_bytes(path / "config.json", config)
    return path
