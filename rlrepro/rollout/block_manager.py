"""Paged KV-cache bookkeeping with a prefix cache (plain Python, no torch).

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence's ``block_table`` lists its blocks
in order; position ``p`` lives in slot ``p % block_size`` of ``block_table[p // block_size]``.

Prefix cache. A block whose ``block_size`` tokens all have computed K/V gets a chained hash,
``H(parent_hash, its token ids)``, so one hash names the block's tokens *and* every token before them. A new
sequence walks its own chain and reuses every leading block it finds, after checking that the block's stored
tokens and parent hash equal its own (a hash collision can then not hand it wrong K/V). Shared blocks are
reference-counted and are never written again: a sequence only writes positions ``>= num_computed_tokens``,
and a hit never covers the sequence's last token (at least one token is always computed, so the step that
finishes the prompt produces logits), so every write lands in a block the writer owns alone. Reused K/V are
bitwise what recomputation would give, because a token's K/V depend only on the tokens before it (the
attention kernels reduce over KV in a fixed order from position 0).

Free blocks: blocks that never held a registered hash are handed out first (FIFO); free blocks that still
carry a hash stay findable and are evicted least-recently-freed first. A sequence's blocks are freed tail
first, so a shared prefix outlives the suffixes that hang off it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from .sequence import Sequence


def hash_block(parent_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Chained 128-bit hash of one full block: BLAKE2b over the parent hash and the token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_parent: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, no hash: handed out first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, hashed: LRU order, oldest first
        self.num_prefix_hits = 0  # blocks reused through the prefix cache (a statistic)

    # ---- counts -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------------------
    def _match_prefix(self, token_ids: list[int]) -> list[tuple[int, bytes]]:
        """Leading cached blocks of ``token_ids`` as (block id, hash), never covering the last token."""
        if not self.enable_prefix_cache:
            return []
        bs = self.block_size
        hits: list[tuple[int, bytes]] = []
        parent: bytes | None = None
        for i in range((len(token_ids) - 1) // bs):
            tokens = token_ids[i * bs:(i + 1) * bs]
            h = hash_block(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_parent[block] != parent or self.block_tokens[block] != tuple(tokens):
                break
            hits.append((block, h))
            parent = h
        return hits

    def prompt_chain(self, seq: Sequence) -> list[bytes]:
        """The chained hashes of ``seq``'s full prompt blocks that a prefix hit may cover (never the block of the
        last prompt token), computed once per sequence: a prompt never changes."""
        if seq.prompt_hashes is None:
            bs, chain, parent = self.block_size, [], None
            for i in range((seq.num_prompt_tokens - 1) // bs):
                parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs])
                chain.append(parent)
            seq.prompt_hashes = chain
        return seq.prompt_hashes

    def waits_for_prefix(self, seq: Sequence, pending: set[bytes] | None) -> bool:
        """Whether ``seq``'s first prompt block missing from the prefix cache is one that ``pending`` (the hashes
        of prompt blocks a running sequence is computing) names: admitted later, it finds that block cached."""
        if not pending or not self.enable_prefix_cache:
            return False
        for h in self.prompt_chain(seq):
            if h not in self.hash_to_block:
                return h in pending
        return False

    def pending_prompt_blocks(self, seq: Sequence) -> list[bytes]:
        """The hashes of ``seq``'s prompt blocks that it holds but has not computed yet (none when the prefix cache
        is off or its prompt is computed)."""
        if not self.enable_prefix_cache or seq.num_computed_tokens >= seq.num_prompt_tokens:
            return []
        return self.prompt_chain(seq)[len(seq.block_hashes):]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (the K/V of old weights are stale). Blocks in use stay allocated; their
        hashes are dropped too, so they are never offered to a later sequence."""
        for block in list(self.hash_to_block.values()):
            self._unregister(block)
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()

    def _unregister(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = self.block_parent[block] = self.block_tokens[block] = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that became full of computed tokens.

        If another block already holds the same tokens, that one stays the cached copy and ``seq``'s block
        stays private (it is freed as a plain block)."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block], self.block_parent[block], self.block_tokens[block] = h, parent, tokens
                self.hash_to_block[h] = block

    # ---- allocation ---------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self._free_plain:
            block = self._free_plain.popleft()
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed cached block
            self._unregister(block)
        else:
            raise RuntimeError("KV cache out of blocks; call can_allocate/can_append first")
        self.ref_counts[block] = 1
        return block

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether blocks for all of ``seq``'s current tokens fit, counting prefix-cache hits."""
        hits = self._match_prefix(seq.token_ids)
        hits_free = sum(1 for block, _ in hits if self.ref_counts[block] == 0)
        num_new = self.num_blocks_for(len(seq)) - len(hits)
        return num_new <= self.num_free_blocks - hits_free

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its current tokens; leading cached blocks are shared, and
        ``seq.num_computed_tokens`` starts after them."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        hits = self._match_prefix(seq.token_ids)
        for block, h in hits:
            if self.ref_counts[block] == 0:
                del self._free_cached[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        self.num_prefix_hits += len(hits)
        for _ in range(self.num_blocks_for(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first) and forget its progress: a preempted sequence recomputes."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the blocks to hold all of ``seq``'s tokens (it grew by sampled tokens) are available."""
        return self.num_blocks_for(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Extend ``seq``'s block table to cover all its tokens (a new block when a decode crosses a boundary)."""
        while len(seq.block_table) < self.num_blocks_for(len(seq)):
            seq.block_table.append(self._take_free_block())

    def is_writable(self, seq: Sequence, start: int, end: int) -> bool:
        """Whether positions ``start..end-1`` of ``seq`` lie in blocks it owns alone and that carry no hash."""
        bs = self.block_size
        for i in range(start // bs, (end - 1) // bs + 1):
            block = seq.block_table[i]
            if self.ref_counts[block] != 1 or self.block_hash[block] is not None:
                return False
        return True

    def check_consistency(self) -> None:
        """Invariants, for tests: every block is either referenced or free (exactly once), and the hash map
        points only at blocks that carry that hash."""
        free = list(self._free_plain) + list(self._free_cached)
        assert len(free) == len(set(free)), "a block is on a free list twice"
        free_set, plain = set(free), set(self._free_plain)
        for b in range(self.num_blocks):
            in_free = b in free_set
            assert (self.ref_counts[b] == 0) == in_free, f"block {b}: ref {self.ref_counts[b]}, free {in_free}"
            if b in plain:
                assert self.block_hash[b] is None, f"plain free block {b} carries a hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} holding another hash"
