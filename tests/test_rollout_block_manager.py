"""BlockManager: allocation verbs, prefix-cache hits, ref counts, LRU eviction, the never-write-shared rule."""
import pytest

from rlrepro.rollout import block_manager as bm_mod
from rlrepro.rollout.block_manager import BlockManager, hash_block
from rlrepro.rollout.params import SamplingParams
from rlrepro.rollout.sequence import Sequence

PARAMS = SamplingParams(max_tokens=8)


def seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens), PARAMS, seed=0)


def compute_all(bm, s):
    """What a step that computes all of s's tokens does to the bookkeeping."""
    assert bm.is_writable(s, s.num_computed_tokens, len(s))
    s.num_computed_tokens = len(s)
    bm.cache_computed_blocks(s)


def test_allocate_deallocate_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(0, range(10))  # 3 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5 and a.num_computed_tokens == 0
    b = seq(1, range(100, 121))  # 6 blocks > 5 free
    assert not bm.can_allocate(b)
    bm.deallocate(a)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0
    assert bm.can_allocate(b)
    bm.check_consistency()


def test_append_slots_adds_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(0, range(4))
    bm.allocate(s)
    compute_all(bm, s)
    assert len(s.block_table) == 1
    s.append_token(7, 0.0)  # position 4 needs block 1
    assert bm.can_append(s)
    bm.append_slots(s)
    assert len(s.block_table) == 2
    s.append_token(8, 0.0)
    bm.append_slots(s)
    assert len(s.block_table) == 2
    bm.check_consistency()


def test_prefix_hit_shares_full_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, range(10))
    bm.allocate(a)
    compute_all(bm, a)  # blocks 0, 1 full and hashed; block 2 partial
    assert bm.num_cached_blocks == 2
    b = seq(1, list(range(8)) + [50, 51, 52])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    assert bm.is_writable(b, 8, 11) and not bm.is_writable(b, 7, 11)
    bm.deallocate(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    bm.deallocate(b)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2  # freed but still findable
    c = seq(2, range(9))
    bm.allocate(c)
    assert c.num_computed_tokens == 8  # hit on free cached blocks
    bm.check_consistency()


def test_a_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, range(8))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(1, range(8))  # fully cached: still computes its last block itself
    bm.allocate(b)
    assert b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.is_writable(b, 4, 8)
    compute_all(bm, b)  # the duplicate full block stays private: a's copy remains the cached one
    assert bm.hash_to_block[b.block_hashes[1]] == a.block_table[1]
    assert bm.block_hash[b.block_table[1]] is None
    c = seq(2, range(5))
    bm.allocate(c)
    assert c.num_computed_tokens == 4
    d = seq(3, [0])
    bm.allocate(d)
    assert d.num_computed_tokens == 0
    bm.check_consistency()


def test_no_hits_when_disabled():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_cache=False)
    a = seq(0, range(10))
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 0
    b = seq(1, range(10))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_chained_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(1, [0, 2, 3, 4, 5, 6, 7, 8, 9])  # second block equal to a's, first differs
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(hash_block(None, [1]), [2]) != hash_block(hash_block(None, [3]), [2])


def test_token_equality_check_rejects_a_hash_collision(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: b"same-hash-always")
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, range(9))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(1, range(100, 109))  # every block "hashes" like a's: the token check must refuse the hit
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    c = seq(2, range(9))
    bm.allocate(c)
    assert c.num_computed_tokens == 4  # a real match still hits (block 1's parent check then fails)


def test_lru_eviction_prefers_plain_blocks_then_oldest_cached():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    bm.allocate(a)
    compute_all(bm, a)
    bm.deallocate(a)  # tail first: cached order oldest -> newest = [3,4]-block, [1,2]-block
    assert bm.num_cached_blocks == 2
    b = seq(1, [9, 9, 9, 9, 9, 9, 9])  # 4 blocks: the 4 plain free blocks suffice, nothing is evicted
    bm.allocate(b)
    assert bm.num_cached_blocks == 2
    c = seq(2, [8])  # 1 block: evicts the least recently freed cached block, the [3, 4] one
    bm.allocate(c)
    assert bm.num_cached_blocks == 1
    d = seq(3, [1, 2, 3])  # hits [1, 2] but the one free block is that hit: no room for its second block
    assert not bm.can_allocate(d)
    bm.deallocate(b)
    assert bm.can_allocate(d)
    bm.allocate(d)
    assert d.num_computed_tokens == 2
    bm.check_consistency()


def test_can_allocate_counts_free_cached_hits_once():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    bm.deallocate(a)  # all 3 blocks free, 2 of them cached
    b = seq(1, [1, 2, 3, 4, 6])  # 2 hits (free) + 1 new block: needs all 3
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and bm.num_free_blocks == 0
    c = seq(2, [7])
    assert not bm.can_allocate(c)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(c)


def test_reset_prefix_cache_forgets_everything():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(1, [1, 2, 3, 4, 5])
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 0
    bm.check_consistency()
