"""The engine's configuration (:class:`EngineConfig`, what ``Engine.from_config`` takes) and the sampling keys'
defaults (:class:`SamplingConfig`, whose defaults are :class:`SamplingParams`' own).

In the run schema both are parts of the ``rollout:`` section (``rollout.max_num_seqs``, ``rollout.temperature``).
Each checks its values in ``__post_init__`` and raises :class:`rlrepro.checks.ConfigError` naming the key.
Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional

from rlrepro.checks import Checker, ConfigError

from .params import MIN_TEMPERATURE, SamplingParams

__all__ = ["EngineConfig", "SamplingConfig"]

_SAMPLING_DEFAULTS = SamplingParams()


@dataclass
class EngineConfig:
    """Batching and KV-cache settings of one engine. None of them changes a request's tokens or logprobs (the
    engine is batch-invariant); they change speed and memory only. ``engine_arg`` metadata names the ``Engine``
    argument a field maps to when it is spelled differently; a field without it is passed under its own name."""
    SECTION: ClassVar[str] = "rollout"

    max_num_seqs: int = 256
    # the most tokens in one engine step: any value >= 1, below block_size too (a prompt longer than it is prefilled
    # in chunks; the tokens are the same for every value, only speed changes, as the Engine accepts it)
    max_num_batched_tokens: int = 8192
    prefix_cache: bool = field(default=True, metadata={"engine_arg": "enable_prefix_cache"})
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    # on CUDA: the KV cache's share of the GPU's memory when num_kv_blocks is unset (split among the engines that
    # share a GPU)
    gpu_memory_fraction: float = 0.3
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        c = Checker(self)
        c.positive_int("max_num_seqs", "max_num_batched_tokens", "block_size")
        c.positive_int("num_kv_blocks", "max_model_len", optional=True)
        c.boolean("prefix_cache")
        c.in_range("gpu_memory_fraction", 0, 1, low_inclusive=False)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"rollout.max_model_len={self.max_model_len} must be >= 2 (a prompt token and a "
                              "generated one), or null for the model's max_position_embeddings")

    def engine_kwargs(self) -> dict:
        """The ``Engine`` keyword arguments of these fields (``gpu_memory_fraction`` included)."""
        out = {}
        for f in fields(EngineConfig):
            out[f.metadata.get("engine_arg", f.name)] = getattr(self, f.name)
        return out

    @classmethod
    def of(cls, section) -> "EngineConfig":
        """The EngineConfig part of a larger section object (the run schema's ``rollout``)."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)})


@dataclass
class SamplingConfig:
    """The sampling keys every request of a run shares; :meth:`params` makes one request's SamplingParams."""
    SECTION: ClassVar[str] = "rollout"

    temperature: float = _SAMPLING_DEFAULTS.temperature
    top_p: float = _SAMPLING_DEFAULTS.top_p
    top_k: int = _SAMPLING_DEFAULTS.top_k
    max_tokens: int = _SAMPLING_DEFAULTS.max_tokens

    def __post_init__(self) -> None:
        c = Checker(self)
        c.non_negative("temperature")
        c.require(not 0 < self.temperature < MIN_TEMPERATURE, "temperature",
                  f"is too small (logits / T overflows); use 0 for greedy decoding or a value >= {MIN_TEMPERATURE}")
        c.in_range("top_p", 0, 1, low_inclusive=False)  # (a bool is no probability: True would pass as 1)
        c.require(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                  and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or a positive integer")
        c.positive_int("max_tokens")

    def params(self, *, seed: int, stop_token_ids=()) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, seed=seed, stop_token_ids=stop_token_ids)
