"""The record of one request as it moves through the engine (plain Python, no torch)."""
from __future__ import annotations

import enum

from .params import SamplingParams

PLACEHOLDER = -1  # the token id a sequence carries for a sampled token the host has not read back yet


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
        self.prompt_hashes: list[bytes] | None = None  # the prompt's chain (BlockManager.prompt_chain), made once
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # While the engine overlaps steps, the token sampled in the step in flight is not on the host yet: the
        # sequence carries PLACEHOLDER as its last token and this is its row in that step's sampled output (the
        # runner feeds the real token from the device). None when every token is known.
        self.pending_row: int | None = None
        self.abort_requested = False  # Scheduler.abort while a token was in flight: finish when it is read back

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

    def append_placeholder(self, row: int) -> None:
        """Append the token sampled in the step just launched, before its value is known (see ``pending_row``)."""
        if self.pending_row is not None:
            raise RuntimeError(f"sequence {self.seq_id} already waits for the token of row {self.pending_row}")
        self.append_token(PLACEHOLDER, float("nan"))
        self.pending_row = row

    def resolve_placeholder(self, token_id: int, logprob: float) -> None:
        """Replace the placeholder appended by ``append_placeholder`` with the sampled token and its logprob."""
        if self.pending_row is None:
            raise RuntimeError(f"sequence {self.seq_id} has no placeholder token to resolve")
        self.token_ids[-1] = token_id
        self.output_logprobs[-1] = logprob
        self.pending_row = None

    def drop_placeholder(self) -> None:
        """Remove an unresolved placeholder (an aborted generation)."""
        if self.pending_row is not None:
            self.token_ids.pop()
            self.output_logprobs.pop()
            self.pending_row = None
