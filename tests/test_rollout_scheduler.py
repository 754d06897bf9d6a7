"""Scheduler + BlockManager driven by a fake model, without torch.

The fake model stores, for each computed position, a digest of the whole prefix up to it in the slot the block
table names (like real K/V, which depend on every earlier token), and picks the next token from the digests it
reads back through the block table. A wrong prefix-cache hit, an overwritten shared block, a lost block after
preemption or a mis-sized chunk changes the output, so every scheduling configuration must reproduce the
outputs of running each request alone.
"""
import hashlib
import random

import pytest
from hypothesis import given, settings, strategies as st

from rlrepro.rollout.block_manager import BlockManager
from rlrepro.rollout.params import SamplingParams
from rlrepro.rollout.scheduler import Scheduler
from rlrepro.rollout.sequence import Sequence, SequenceStatus

VOCAB = 50


def digest(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


class FakeRunner:
    def __init__(self, num_blocks, block_size):
        self.bs = block_size
        self.slots = {}  # (block, offset) -> (position, prefix digest)

    def execute(self, scheduled):
        out = []
        bs = self.bs
        for s in scheduled:
            seq = s.seq
            for pos in range(s.start, s.end):
                self.slots[seq.block_table[pos // bs], pos % bs] = (pos, digest(tuple(seq.token_ids[: pos + 1])))
            if s.samples:
                kv = [self.slots[seq.block_table[p // bs], p % bs] for p in range(s.end)]
                assert [p for p, _ in kv] == list(range(s.end)), "KV read back from the wrong slots"
                token = digest(tuple(d for _, d in kv), seq.seed) % VOCAB
                out.append((token, -float(token)))
        return out


def run(requests, *, num_blocks=200, block_size=4, max_num_seqs=64, budget=10_000, prefix=True,
        max_model_len=10_000, eos=(), check=None):
    bm = BlockManager(num_blocks, block_size, prefix)
    sch = Scheduler(bm, max_num_seqs, budget, max_model_len, eos)
    runner = FakeRunner(num_blocks, block_size)
    seqs = [Sequence(i, prompt, params, seed=len(prompt)) for i, (prompt, params) in enumerate(requests)]
    for s in seqs:
        sch.add(s)
    while sch.has_unfinished():
        scheduled = sch.schedule()
        assert 0 < sum(x.num_new_tokens for x in scheduled) <= budget
        assert len(sch.running) <= max_num_seqs
        assert [x.seq.seq_id for x in scheduled] == sorted(x.seq.seq_id for x in scheduled)
        if check:
            check(sch, scheduled)
        sch.update(scheduled, runner.execute(scheduled))
        bm.check_consistency()
    assert bm.num_free_blocks == num_blocks
    return [(s.output_token_ids, s.output_logprobs, s.finish_reason) for s in seqs], sch


def alone(requests, **kw):
    return [run([r], **kw)[0][0] for r in requests]


def make_requests(rng, n, shared_prefix_len=0):
    base = [rng.randrange(VOCAB) for _ in range(shared_prefix_len)]
    reqs = []
    for _ in range(n):
        prompt = base[: rng.randint(0, shared_prefix_len)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        reqs.append((prompt, SamplingParams(max_tokens=rng.randint(1, 10))))
    return reqs


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 10), max_num_seqs=st.integers(1, 6),
       budget=st.integers(1, 20), block_size=st.sampled_from([1, 2, 4, 16]), prefix=st.booleans(),
       extra_blocks=st.integers(0, 12))
def test_any_schedule_gives_the_outputs_of_running_alone(seed, n, max_num_seqs, budget, block_size, prefix,
                                                         extra_blocks):
    rng = random.Random(seed)
    reqs = make_requests(rng, n, shared_prefix_len=10)
    # The smallest legal cache: the largest single request's need, plus a few (so preemption is common).
    need = max(-(-(len(p) + sp.max_tokens - 1) // block_size) for p, sp in reqs)
    got, _ = run(reqs, num_blocks=need + extra_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                 budget=budget, prefix=prefix)
    assert got == alone(reqs, block_size=block_size)


def test_tiny_cache_forces_preemption_and_recompute():
    rng = random.Random(0)
    reqs = [([rng.randrange(VOCAB) for _ in range(6)], SamplingParams(max_tokens=10)) for _ in range(6)]
    got, sch = run(reqs, num_blocks=5, block_size=4, max_num_seqs=6, budget=8)
    assert sch.num_preemptions > 0
    assert got == alone(reqs)


def test_chunked_prefill_respects_the_budget_and_mixes_with_decodes():
    reqs = [([1] * 3, SamplingParams(max_tokens=6)), ([2] * 30, SamplingParams(max_tokens=2))]
    mixed_steps = []

    def check(sch, scheduled):
        kinds = {x.seq.seq_id: x.num_new_tokens for x in scheduled}
        if kinds.get(0) == 1 and kinds.get(1, 0) > 1:
            mixed_steps.append(kinds)

    got, sch = run(reqs, budget=7, check=check)
    assert mixed_steps, "a decode and a prefill chunk never shared a step"
    assert all(sum(k.values()) <= 7 for k in mixed_steps)
    assert got == alone(reqs)


def test_fcfs_admission_in_arrival_order():
    reqs = [([i] * 5, SamplingParams(max_tokens=3)) for i in range(5)]
    first_steps = []

    def check(sch, scheduled):
        first_steps.append([x.seq.seq_id for x in scheduled])

    run(reqs, max_num_seqs=2, check=check)
    assert first_steps[0] == [0, 1]
    admitted = []
    for step in first_steps:
        admitted += [i for i in step if i not in admitted]
    assert admitted == [0, 1, 2, 3, 4]


def test_max_num_seqs_one_runs_requests_one_after_another():
    reqs = [([i] * 5, SamplingParams(max_tokens=3)) for i in range(3)]

    def check(sch, scheduled):
        assert len(scheduled) == 1

    got, _ = run(reqs, max_num_seqs=1, check=check)
    assert got == alone(reqs)


def test_finish_reasons():
    # the fake model's tokens for this prompt, from an unconstrained run
    prompt = [3, 1, 4, 1, 5]
    (tokens, _, _), = run([(prompt, SamplingParams(max_tokens=10))])[0]
    stop = tokens[4]
    first = tokens.index(stop)
    (out, _, reason), = run([(prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop,)))])[0]
    assert out == tokens[: first + 1] and reason == "stop"
    (out, _, reason), = run([(prompt, SamplingParams(max_tokens=10))], eos=(stop,))[0]
    assert out == tokens[: first + 1] and reason == "stop"
    (out, _, reason), = run([(prompt, SamplingParams(max_tokens=10, ignore_eos=True))], eos=(stop,))[0]
    assert out == tokens and reason == "length"
    (out, _, reason), = run([(prompt, SamplingParams(max_tokens=10, ignore_eos=True,
                                                      stop_token_ids=(stop,)))], eos=(stop,))[0]
    assert out == tokens[: first + 1] and reason == "stop"  # ignore_eos does not ignore stop_token_ids
    (out, _, reason), = run([(prompt, SamplingParams(max_tokens=3))])[0]
    assert out == tokens[:3] and reason == "length"
    (out, _, reason), = run([(prompt, SamplingParams(max_tokens=10))], max_model_len=8)[0]
    assert out == tokens[:3] and reason == "length"  # the context is full at 8 tokens


def test_update_rejects_extra_samples():
    bm = BlockManager(10, 4)
    sch = Scheduler(bm, 4, 100, 100)
    s = Sequence(0, [1, 2], SamplingParams(max_tokens=2), seed=0)
    sch.add(s)
    scheduled = sch.schedule()
    with pytest.raises(RuntimeError, match="more sampled tokens"):
        sch.update(scheduled, [(1, 0.0), (2, 0.0)])


def test_abort_all_frees_every_block():
    bm = BlockManager(20, 4)
    sch = Scheduler(bm, 4, 3, 100)
    seqs = [Sequence(i, [i] * 9, SamplingParams(max_tokens=2), seed=0) for i in range(3)]
    for s in seqs:
        sch.add(s)
    sch.schedule()
    sch.abort_all()
    assert bm.num_free_blocks == 20 and not sch.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)


def test_no_progress_is_an_error_not_a_hang():
    bm = BlockManager(2, 4)
    sch = Scheduler(bm, 4, 100, 100)
    sch.add(Sequence(0, list(range(20)), SamplingParams(max_tokens=2), seed=0))  # needs 5 blocks of 2
    with pytest.raises(RuntimeError, match="no progress"):
        sch.schedule()
