"""Qwen3 configuration read from an HF ``config.json``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rlrepro._files import model_json
from rlrepro.checks import finite_number

from .weight_files import weight_files

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config(head_dim=128): what a config.json without the key means


# safetensors dtype -> config torch_dtype name: the floating dtypes a checkpoint may hold
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _stored_float_dtype(directory: Path) -> str | None:
    """The dtype of the first floating tensor of the model directory's first safetensors file (the files
    loading reads, :func:`.weight_files.weight_files`), as a config ``torch_dtype`` name; None when there is no
    readable weights file or no such tensor."""
    from safetensors import safe_open

    try:
        with safe_open(str(weight_files(directory)[0]), framework="pt", device="cpu") as h:
            for name in h.keys():
                dtype = SAFETENSORS_DTYPES.get(h.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    except Exception:  # noqa: BLE001 - loading reports a missing or damaged weights file itself, with its fix
        return None
    return None


def _positive_real(value) -> bool:
    return finite_number(value) and value > 0


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict)  # keys of config.json we carry through unchanged
    # generation_config.json's eos_token_id (Qwen3: <|im_end|> and <|endoftext|>), read by from_file: the engine
    # stops on these too, as vLLM does; not a config.json key (to_dict leaves it out)
    generation_eos_token_ids: tuple = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not _positive_real(getattr(self, name)):
                raise ValueError(f"config.{name} must be a finite number > 0, got {getattr(self, name)!r}")
        if not _positive_real(self.initializer_range) and self.initializer_range != 0:
            raise ValueError(f"config.initializer_range must be a finite number >= 0, got {self.initializer_range!r}")
        if not isinstance(self.tie_word_embeddings, bool):  # a string "false" would tie the LM head (truthy)
            raise ValueError(f"config.tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"config torch_dtype {self.torch_dtype!r} is not one of {sorted(_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen3Config":
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type != "qwen3":
            raise ValueError(f"rlrepro builds dense Qwen3 models (model_type 'qwen3'); config.json has model_type "
                             f"{model_type!r}: point model.path at a Qwen3 (dense) checkpoint")
        _refuse_unsupported(raw)
        theta = _rope_theta(raw)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        names = {f for f in cls.__dataclass_fields__
                 if f not in ("extra", "rope_theta", "torch_dtype", "generation_eos_token_ids")}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        kwargs = {k: raw.pop(k) for k in list(raw) if k in names}
        # head_dim absent: transformers' Qwen3Config default, 128, not hidden_size // num_attention_heads (Qwen3
        # decouples them: Qwen3-0.6B has 1024 / 16 = 64 but 128-wide heads); null: derived from the two
        kwargs.setdefault("head_dim", QWEN3_DEFAULT_HEAD_DIM)
        for k in ("num_key_value_heads", "head_dim"):  # null means derived
            if kwargs.get(k, 0) is None:
                del kwargs[k]
        if "tie_word_embeddings" in kwargs and kwargs["tie_word_embeddings"] is None:
            kwargs["tie_word_embeddings"] = False  # null: untied, as transformers reads it
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        return cls(**kwargs, rope_theta=float(theta), torch_dtype=str(dtype).replace("torch.", ""), extra=raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            unfinished = " (it holds weights: a save that did not finish? save it again)" \
                if any(path.parent.glob("*.safetensors")) else ""
            raise FileNotFoundError(f"no config.json at {path}{unfinished}; a model directory needs config.json and "
                                    "*.safetensors")
        raw = model_json(path)
        if not raw.get("torch_dtype") and not raw.get("dtype"):
            stored = _stored_float_dtype(path.parent)
            if stored is not None:  # no dtype in config.json: the weights' own, not a guess
                raw["torch_dtype"] = stored
        try:
            cfg = cls.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        cfg.generation_eos_token_ids = _generation_eos(path.parent / "generation_config.json")
        return cfg

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out = {**self.extra, **out}
        for k in ("rope_parameters", "rope_scaling", "dtype", "generation_eos_token_ids"):
            out.pop(k, None)
        out.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False,
                   use_sliding_window=False, hidden_act="silu", rope_scaling=None, attention_dropout=0.0)
        return out


def _refuse_unsupported(raw: dict) -> None:
    """Refuse the config.json fields that ask for something rlrepro's Qwen3 does not compute (transformers would
    honour them, so ignoring one would silently give other logits); each error names the field and the fix."""
    arch = raw.get("architectures")
    if arch is not None and (not isinstance(arch, list) or "Qwen3ForCausalLM" not in arch):
        raise ValueError(f"architectures={arch!r}: rlrepro loads Qwen3ForCausalLM checkpoints (a causal LM head); "
                         "point model.path at one, or set architectures to [\"Qwen3ForCausalLM\"] if it is one")
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) \
            else raw["quantization_config"]
        raise ValueError(f"quantization_config (quant_method {method!r}) is not supported: rlrepro loads "
                         "unquantized float weights; use the unquantized (BF16) checkpoint")
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported; set it to false in config.json")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ValueError(f"layer_types must be a list or null, got {layer_types!r}")
        other = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        if other:
            kinds = sorted({str(layer_types[i]) for i in other})
            raise ValueError(f"layer_types lists {', '.join(map(repr, kinds))} for layers {other}: rlrepro runs full "
                             "attention only; set every entry to \"full_attention\" (or remove layer_types)")
    if raw.get("attention_bias"):
        raise ValueError("attention_bias=true (biases on q/k/v/o_proj) is not supported: Qwen3 has none; "
                         "use a Qwen3 checkpoint with attention_bias=false")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported: Qwen3's MLP uses silu")


TRANSFORMERS_ROPE_THETA = 10_000.0  # transformers.Qwen3Config's rope_theta when config.json gives none


def _rope_theta(raw: dict) -> float:
    """RoPE's base from config.json: ``rope_theta``, or ``rope_parameters`` / ``rope_scaling``'s (transformers 5
    writes ``rope_parameters``; older ones ``rope_theta`` and ``rope_scaling``). Both of ``rope_parameters`` and
    ``rope_scaling`` are checked (transformers lets ``rope_scaling`` win, so a YaRN one beside a default
    ``rope_parameters`` is YaRN there), and two different rope_theta values are refused, not one picked."""
    ropes = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"{key} must be an object or null, got {rope!r}")
        # transformers' older spelling of rope_type is "type" (e.g. {"type": "yarn", "factor": 4.0})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported (only default RoPE); remove rope_scaling "
                             "(and set rope_parameters' rope_type to \"default\") in config.json to run the model at "
                             "its native context length")
        ropes[key] = rope
    for where, factor in [("partial_rotary_factor", raw.get("partial_rotary_factor"))] + \
            [(f"{k}.partial_rotary_factor", r.get("partial_rotary_factor")) for k, r in ropes.items()]:
        if factor is not None and factor != 1:
            raise ValueError(f"{where}={factor!r} is not supported: rlrepro's RoPE rotates the whole head; "
                             "use a Qwen3 checkpoint without partial_rotary_factor")
    thetas = {"rope_theta": raw["rope_theta"]} if "rope_theta" in raw else {}
    thetas.update({f"{k}.rope_theta": r["rope_theta"] for k, r in ropes.items() if "rope_theta" in r})
    for value in thetas.values():
        if not _positive_real(value):
            raise ValueError(f"rope_theta must be a finite number > 0, got {value!r}")
    if len({float(v) for v in thetas.values()}) > 1:
        given = ", ".join(f"{k}={float(v)}" for k, v in thetas.items())
        raise ValueError(f"config.json gives different RoPE bases ({given}); keep one (the one the model was trained "
                         "with) and delete the other")
    # none given: transformers' Qwen3Config default (10,000), so that both run the same model from this file (the
    # dataclass's own default, 1e6, is Qwen3's released value, for configs built in code)
    return float(next(iter(thetas.values()), TRANSFORMERS_ROPE_THETA))


def _generation_eos(path: Path) -> tuple:
    """The ``eos_token_id`` of ``generation_config.json`` (an int or a list of ints) as a tuple; () without the
    file or the key."""
    if not path.is_file():
        return ()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it (the engine reads its eos_token_id)") \
            from None
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)
