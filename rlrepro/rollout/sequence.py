"""The record of one request as it moves through the engine (plain Python, no torch)."""
from __future__ import annotations

import enum

from .params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted: holds no KV blocks
    RUNNING = "running"  # admitted: holds blocks for all its tokens so far
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, how many of them have KV in the cache, and the cache blocks that hold them.

    ``token_ids`` is the prompt followed by the generated tokens. ``num_computed_tokens`` counts the leading
    tokens whose K/V are in the cache (computed, or found in the prefix cache). A sequence samples its next
    token in the step that brings ``num_computed_tokens`` up to ``len(token_ids)``; that token sits at position
    ``len(token_ids)``, which keys its sampling noise.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> None:
        self.seq_id = seq_id  # arrival order: the scheduler's priority (lower first)
        self.params = params
        self.seed = seed
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # tokens found in the prefix cache at the last admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the leading full, computed blocks
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
