"""The copies of one prompt admitted together share its K/V: a waiting sequence whose next uncached prompt block a
running sequence is computing waits for it (rlrepro.rollout.scheduler), so a GRPO group computes its prompt once.
Outputs stay those of each request run alone, bit for bit."""
import random

import pytest

from rlrepro.rollout.block_manager import BlockManager
from rlrepro.rollout.params import SamplingParams
from rlrepro.rollout.scheduler import Scheduler
from rlrepro.rollout.sequence import Sequence

from test_rollout_scheduler import VOCAB, alone, run


def _groups(num_prompts, copies, length, seed=0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        reqs += [(prompt, SamplingParams(max_tokens=rng.randint(1, 6))) for _ in range(copies)]
    return reqs


def _prefill_tokens(reqs, **kw):
    """The prompt tokens each request computed (chunks that end at or before its prompt's end), and the outputs."""
    computed = {}

    def check(sch, scheduled):
        for x in scheduled:
            if x.start < x.seq.num_prompt_tokens:
                computed[x.seq.seq_id] = computed.get(x.seq.seq_id, 0) + min(x.end, x.seq.num_prompt_tokens) - x.start

    got, sch = run(reqs, check=check, **kw)
    return computed, got, sch


def test_a_group_submitted_together_computes_its_prompt_once():
    reqs = _groups(num_prompts=3, copies=4, length=13)  # block 4: 3 full blocks a copy may share, 1 token it may not
    computed, got, _ = _prefill_tokens(reqs, block_size=4)
    # the first copy of each prompt computes all 13 tokens, each other copy only the last (the block of the last
    # prompt token is never a hit): it was 13 for every copy before
    assert [computed[i] for i in range(12)] == [13, 1, 1, 1] * 3
    assert got == alone(reqs, block_size=4)
    off, got_off, _ = _prefill_tokens(reqs, block_size=4, prefix=False)
    assert [off[i] for i in range(12)] == [13] * 12 and got_off == got


def test_a_waiting_copy_does_not_hold_back_other_prompts():
    reqs = _groups(num_prompts=3, copies=4, length=9)
    steps = []
    run(reqs, block_size=4, check=lambda sch, scheduled: steps.append([x.seq.seq_id for x in scheduled]))
    assert steps[0] == [0, 4, 8]  # each prompt's first copy; the copies follow once its blocks are cached
    assert steps[1][:9] == [0, 1, 2, 3, 4, 5, 6, 7, 8] and steps[1][9:] == [9, 10, 11]


def test_copies_wait_for_a_chunked_prompt_then_share_all_of_it():
    reqs = _groups(num_prompts=1, copies=3, length=30)
    computed, got, sch = _prefill_tokens(reqs, block_size=4, budget=8)  # the prompt takes 4 steps of 8 tokens
    assert [computed[i] for i in range(3)] == [30, 2, 2]  # 28 tokens in 7 shared blocks; 2 in the last block
    assert got == alone(reqs, block_size=4)


@pytest.mark.parametrize("seed", range(6))
def test_shared_groups_under_preemption_and_overlap_give_the_outputs_of_running_alone(seed):
    rng = random.Random(seed)
    reqs = _groups(num_prompts=rng.randint(1, 4), copies=rng.randint(2, 5), length=rng.randint(2, 20), seed=seed)
    rng.shuffle(reqs)  # copies of a prompt interleaved with other prompts
    need = max(-(-(len(p) + sp.max_tokens - 1) // 4) for p, sp in reqs)
    got, _ = run(reqs, num_blocks=need + rng.randint(0, 6), block_size=4, max_num_seqs=rng.randint(1, 8),
                 budget=rng.randint(1, 24), overlap=bool(seed % 2))
    assert got == alone(reqs, block_size=4)


def test_no_wait_when_the_prefix_cache_is_off_or_the_block_is_cached():
    bm = BlockManager(64, 4, enable_prefix_cache=False)
    a, b = (Sequence(i, list(range(10)), SamplingParams(), seed=0) for i in range(2))
    assert not bm.waits_for_prefix(b, {h for h in BlockManager(64, 4).prompt_chain(a)})
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, 8, 100, 1000)
    sch.add(a)
    sch.add(b)
    assert [x.seq.seq_id for x in sch.schedule()] == [0]  # b waits for a's 2 prompt blocks
    assert bm.waits_for_prefix(b, set(bm.pending_prompt_blocks(a)))


def test_engine_group_shares_its_prompt_and_keeps_the_bits():
    import torch

    from rlrepro.model import tiny_model
    from rlrepro.rollout import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model(seed=5, initializer_range=0.3)
        prompt = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
        params = [SamplingParams(temperature=1.0, max_tokens=6, seed=100 + j) for j in range(4)]
        shared = Engine(model, block_size=4).generate([prompt] * 4, params)
        assert [o.num_cached_tokens for o in shared] == [0, 12, 12, 12]
        for o, p in zip(shared, params):
            (one,) = Engine(model, block_size=4, enable_prefix_cache=False).generate([prompt], p)
            assert (o.token_ids, o.logprobs, o.finish_reason) == (one.token_ids, one.logprobs, one.finish_reason)
    finally:
        torch.set_num_threads(threads)
