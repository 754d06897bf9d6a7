"""Validation of the megatron backend's settings, run before any work (no process group, no model, no GPU touched).

The recipe keys it checks (wired by the orchestration layer): ``train.backend`` (``default`` | ``megatron``),
``train.tensor_parallel`` (TP ranks per model replica), ``train.num_gpus`` (trainer ranks in all: one GPU each on
CUDA, one process each on CPU) and ``run.device``. Data parallelism is what is left: ``num_gpus // tensor_parallel``
replicas.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

__all__ = ["BACKENDS", "MegatronLayout", "validate_megatron_config", "megatron_core_version", "require_megatron_core"]

from ..config import BACKENDS  # noqa: E402 - the registry lives with TrainConfig


def megatron_core_version() -> str | None:
    """The installed megatron-core's version, or None; imports nothing of it (importing megatron takes seconds)."""
    try:
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def require_megatron_core(what: str = "train.backend=megatron") -> str:
    version = megatron_core_version()
    if version is None:
        raise ValueError(f"{what} needs megatron-core, which is not installed: pip install 'rlrepro[megatron]' "
                         "(megatron-core >= 0.12; 0.16.x is the last for Python 3.11), or set train.backend=default")
    return version


@dataclass(frozen=True)
class MegatronLayout:
    """How the trainer's ranks are laid out: ``world_size = tensor_parallel * data_parallel``; the TP ranks of a
    replica are consecutive (Megatron's default order), so global rank ``g`` is TP rank ``g % tensor_parallel``
    of replica ``g // tensor_parallel``."""
    backend: str
    tensor_parallel: int
    data_parallel: int
    device: str

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.data_parallel


def _get(model_config, name: str):
    if model_config is None:
        return None
    if isinstance(model_config, dict):
        return model_config.get(name)
    return getattr(model_config, name, None)


SHARDED_DIMS = (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                ("intermediate_size", "MLP columns"), ("vocab_size", "vocabulary rows"))


def check_divides_model(key: str, parts: int, model_config, why: str) -> None:
    """``parts`` (``key``'s value: the TP size, or ``train.tp_partials``) must divide the model's heads, KV heads,
    MLP width and vocabulary; raises ValueError naming the first that it does not divide and the divisors to choose
    from. Nothing to check without ``model_config`` or for ``parts <= 1``."""
    if parts <= 1:
        return
    for name, what in SHARDED_DIMS:
        value = _get(model_config, name)
        if value is not None and value % parts:
            divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]
            raise ValueError(f"{key}={parts} does not divide the model's {name}={value} ({why} of the {what}); "
                             f"choose {key} from {divisors}")


def validate_megatron_config(backend: str, tensor_parallel: int, num_gpus: int, device: str,
                             model_config=None, *, check_installed: bool = True) -> MegatronLayout:
    """Check the trainer layout and return it; raise ``ValueError`` naming the key, the value and the fix.

    ``model_config``: a :class:`~rlrepro.model.Qwen3Config` (or a dict / object with its fields), optional; with
    it, heads, KV heads, intermediate size and vocabulary must divide by ``tensor_parallel``.
    ``check_installed``: with ``backend='megatron'``, megatron-core must be importable.
    """
    if backend not in BACKENDS:
        raise ValueError(f"train.backend={backend!r} is not one of {BACKENDS}")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"train.tensor_parallel must be a positive int (TP ranks per model replica), "
                         f"got {tensor_parallel!r}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"train.num_gpus must be a positive int, got {num_gpus!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"run.device={device!r} is not one of ('cpu', 'cuda')")
    unit = "GPUs" if device == "cuda" else "trainer processes (train.num_gpus counts processes on CPU)"
    if backend == "default" and tensor_parallel != 1:
        raise ValueError(f"train.tensor_parallel={tensor_parallel} needs train.backend=megatron (the default "
                         "backend has no tensor parallelism); set train.backend=megatron or "
                         "train.tensor_parallel=1")
    if tensor_parallel > num_gpus:
        raise ValueError(f"train.tensor_parallel={tensor_parallel} needs {tensor_parallel} {unit} per replica but "
                         f"train.num_gpus={num_gpus}; raise train.num_gpus to a multiple of {tensor_parallel} or lower "
                         f"train.tensor_parallel to at most {num_gpus}")
    if num_gpus % tensor_parallel:
        raise ValueError(f"train.num_gpus={num_gpus} is not a multiple of train.tensor_parallel={tensor_parallel}: "
                         f"every data-parallel replica needs {tensor_parallel} {unit}; use train.num_gpus="
                         f"{(num_gpus // tensor_parallel) * tensor_parallel or tensor_parallel} or "
                         f"{(num_gpus // tensor_parallel + 1) * tensor_parallel}")
    check_divides_model("train.tensor_parallel", tensor_parallel, model_config, "each TP rank holds an equal share")
    if backend == "megatron" and check_installed:
        require_megatron_core()
    return MegatronLayout(backend=backend, tensor_parallel=tensor_parallel, data_parallel=num_gpus // tensor_parallel,
                          device=device)
