"""Attention metadata: how the flat token batch maps to sequences, positions and KV-cache slots.

One record serves both callers. The trainer packs whole sequences (every token is a query, the KV are the
same tokens, no cache). The engine runs a mix of prefill chunks and decode steps against a paged KV cache: the
queries of sequence ``s`` are its last ``q_len[s]`` positions, and its KV live in cache blocks listed in
``block_table[s]``. The attention kernels reduce over KV positions ``0..pos`` in fixed tiles in both cases,
which is why a token's output does not depend on which caller computed it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to ``device`` without making the host wait for the device's queue.

    A plain ``.to("cuda")`` synchronises with the stream, which would stall an engine that launches its next step
    while the current one runs. To CUDA the tensor goes through pinned memory (torch's caching host allocator keeps
    the pinned block until the copy has run) with ``non_blocking=True``; elsewhere it is a plain ``.to``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, through ``to_device`` (no host-device sync)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _int_list(name: str, values) -> list[int]:
    """``values`` as a list of Python ints; ValueError naming ``name`` for anything else (a float length would be
    truncated by ``torch.tensor(..., dtype=int64)``, a bool taken as 0/1). numpy / torch integer scalars are fine."""
    out = []
    for v in values:
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(v.__index__())
        except (AttributeError, TypeError):
            raise ValueError(f"{name} must hold integers, got {v!r} in {list(values)!r}") from None
    return out


@dataclass(frozen=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [S+1] int64: queries of sequence s are rows cu[s]:cu[s+1] of the batch
    seq_lens: torch.Tensor  # [S] int64: KV length of sequence s including this step's tokens
    positions: torch.Tensor  # [N] int64: absolute position of each query token
    seq_idx: torch.Tensor  # [N] int64: sequence of each query token
    max_seq_len: int  # python int, so kernels need no device sync
    slot_mapping: torch.Tensor | None = None  # [N] int64: flat cache slot (block * block_size + offset) per new token
    block_table: torch.Tensor | None = None  # [S, max_blocks] int64: cache blocks of each sequence, in order
    block_size: int = 0
    # Derived device tensors that every layer's kernels would otherwise recompute from the same metadata (e.g.
    # the attention kernels' program schedule), keyed by their maker; filled lazily, never part of equality.
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_paged(self) -> bool:
        return self.block_table is not None

    @staticmethod
    def packed(seq_lens: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Whole sequences packed back to back (trainer, full-sequence forward): no cache, queries == keys."""
        seq_lens = _int_list("seq_lens", seq_lens)
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"packed attention needs at least one sequence, each of length >= 1; got {seq_lens}")
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        positions = torch.arange(int(cu[-1])) - cu[:-1][seq_idx]
        return AttentionMetadata(
            cu_seqlens_q=to_device(cu, device), seq_lens=to_device(lens, device),
            positions=to_device(positions, device), seq_idx=to_device(seq_idx, device), max_seq_len=max(seq_lens))

    @staticmethod
    def paged(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """A mixed engine step: sequence s computes its positions seq_lens[s]-query_lens[s] .. seq_lens[s]-1."""
        query_lens, seq_lens = _int_list("query_lens", query_lens), _int_list("seq_lens", seq_lens)
        if len(query_lens) != len(seq_lens) or len(block_tables) != len(seq_lens):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        if not seq_lens:
            raise ValueError("paged attention needs at least one sequence; got empty query_lens, seq_lens and "
                             "block_tables (skip the step when nothing is scheduled)")
        (block_size,) = _int_list("block_size", [block_size])
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        ql = torch.tensor(query_lens, dtype=torch.int64)
        sl = torch.tensor(seq_lens, dtype=torch.int64)
        if bool((ql < 1).any()) or bool((ql > sl).any()):
            raise ValueError(f"need 1 <= query_len <= seq_len; got query_lens={query_lens} seq_lens={seq_lens}")
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(ql, 0, out=cu[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(query_lens)), ql)
        positions = torch.arange(int(cu[-1])) - cu[:-1][seq_idx] + (sl - ql)[seq_idx]
        width = max(len(t) for t in block_tables)
        table = torch.zeros(len(block_tables), width, dtype=torch.int64)
        for s, blocks in enumerate(block_tables):
            if len(blocks) * block_size < seq_lens[s]:
                raise ValueError(f"sequence {s} has {len(blocks)} blocks of {block_size} for {seq_lens[s]} tokens; "
                                 f"its block table needs at least {-(-seq_lens[s] // block_size)} blocks")
            table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        if bool((table < 0).any()):  # indexing would wrap a negative id round to a block from the cache's end
            raise ValueError(f"block ids must be >= 0; got block_tables={[list(t) for t in block_tables]}")
        slots = table[seq_idx, positions // block_size] * block_size + positions % block_size
        return AttentionMetadata(
            cu_seqlens_q=to_device(cu, device), seq_lens=to_device(sl, device),
            positions=to_device(positions, device), seq_idx=to_device(seq_idx, device), max_seq_len=max(seq_lens),
            slot_mapping=to_device(slots, device), block_table=to_device(table, device), block_size=block_size)
