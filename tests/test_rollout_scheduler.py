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
from rlrepro.rollout.sequence import PLACEHOLDER, Sequence, SequenceStatus

VOCAB = 50


def digest(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


class FakeRunner:
    """``execute``: run a step and return its samples. ``launch``: the same, as the engine overlaps steps: a
    sequence's last token may still be a placeholder, whose value comes from the previous step's output (as the
    real runner feeds it from the device)."""

    def __init__(self, num_blocks, block_size):
        self.bs = block_size
        self.slots = {}  # (block, offset) -> (position, prefix digest)
        self.last = []  # the previous launch's output: the "device" values of pending placeholders

    def launch(self, scheduled):
        self.last = self.execute(scheduled)
        return self.last

    def execute(self, scheduled):
        out = []
        bs = self.bs
        for s in scheduled:
            seq = s.seq
            tokens = list(seq.token_ids)
            if seq.pending_row is not None:
                assert tokens[-1] == PLACEHOLDER and s.num_new_tokens == 1, "a placeholder outside a decode"
                tokens[-1] = self.last[seq.pending_row][0]
            else:
                assert PLACEHOLDER not in tokens
            for pos in range(s.start, s.end):
                self.slots[seq.block_table[pos // bs], pos % bs] = (pos, digest(tuple(tokens[: pos + 1])))
            if s.samples:
                kv = [self.slots[seq.block_table[p // bs], p % bs] for p in range(s.end)]
                assert [p for p, _ in kv] == list(range(s.end)), "KV read back from the wrong slots"
                token = digest(tuple(d for _, d in kv), seq.seed) % VOCAB
                out.append((token, -float(token)))
        return out


def run(requests, *, num_blocks=200, block_size=4, max_num_seqs=64, budget=10_000, prefix=True,
        max_model_len=10_000, eos=(), check=None, overlap=False, stats=None, aborts=None):
    """Drive the scheduler to the end. ``overlap``: as the engine does, launch step t+1 before resolving step t
    (``launched`` then ``resolve`` one step late) instead of ``update`` after each step. ``stats["late_rows"]``
    counts sampled rows discarded because their sequence had stopped by the time the step was recorded.
    ``aborts`` = {step index: [request indexes]}: ``Scheduler.abort`` before that step (as ``Engine.abort``
    between steps), for requests not finished or aborted by then."""
    bm = BlockManager(num_blocks, block_size, prefix)
    sch = Scheduler(bm, max_num_seqs, budget, max_model_len, eos)
    runner = FakeRunner(num_blocks, block_size)
    seqs = [Sequence(i, prompt, params, seed=len(prompt)) for i, (prompt, params) in enumerate(requests)]
    for s in seqs:
        sch.add(s)
    pending, step = None, 0
    while sch.has_unfinished() or pending is not None:
        for i in (aborts or {}).get(step, []):
            if not seqs[i].is_finished and not seqs[i].abort_requested:
                sch.abort(seqs[i])
        step += 1
        if not (sch.has_unfinished() or pending is not None):
            break  # the aborts ended the last requests
        scheduled = sch.schedule()
        assert not any(x.seq.abort_requested for x in scheduled), "an aborted sequence was scheduled"
        assert sum(x.num_new_tokens for x in scheduled) <= budget
        assert scheduled or (overlap and pending), "an empty step without a step in flight"
        assert len(sch.running) <= max_num_seqs
        assert [x.seq.seq_id for x in scheduled] == sorted(x.seq.seq_id for x in scheduled)
        if check and scheduled:
            check(sch, scheduled)
        if not overlap:
            sch.update(scheduled, runner.execute(scheduled))
        else:
            out = runner.launch(scheduled) if scheduled else None
            if pending is not None:
                sch.resolve(*pending)
            pending = (sch.launched(scheduled), out) if scheduled else None
            if stats is not None and pending:
                stats["late_rows"] = stats.get("late_rows", 0) + pending[0].count(None)
        bm.check_consistency()
    assert pending is None and sch.num_pending == 0
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
       extra_blocks=st.integers(0, 12), overlap=st.booleans(), eos=st.sampled_from([(), (7,), (3, 11, 19)]))
def test_any_schedule_gives_the_outputs_of_running_alone(seed, n, max_num_seqs, budget, block_size, prefix,
                                                         extra_blocks, overlap, eos):
    rng = random.Random(seed)
    reqs = make_requests(rng, n, shared_prefix_len=10)
    # The smallest legal cache: the largest single request's need, plus a few (so preemption is common).
    need = max(-(-(len(p) + sp.max_tokens - 1) // block_size) for p, sp in reqs)
    got, _ = run(reqs, num_blocks=need + extra_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                 budget=budget, prefix=prefix, overlap=overlap, eos=eos)
    assert got == alone(reqs, block_size=block_size, eos=eos)


@pytest.mark.parametrize("with_eos", [False, True])
def test_overlapped_steps_with_preemption_and_late_stops(with_eos):
    """Steps launched one ahead of their results: preemption of a sequence whose token is still in flight,
    stop tokens found one step late, and length ends never scheduled past max_tokens."""
    rng = random.Random(1)
    reqs = [([rng.randrange(VOCAB) for _ in range(6)], SamplingParams(max_tokens=rng.randint(1, 12)))
            for _ in range(8)]
    eos = ()
    if with_eos:  # a token some request samples before its last one, so its sequence stops early
        early = [t for out, _, _ in alone(reqs) for t in out[:-1]]
        eos = (max(set(early), key=early.count),)
    stats = {"draining": 0}

    def check(sch, scheduled):
        stats["draining"] += bool(sch.draining)
        for x in scheduled:
            assert x.seq.num_output_tokens <= x.seq.params.max_tokens

    got, sch = run(reqs, num_blocks=6, block_size=4, max_num_seqs=8, budget=9, eos=eos, overlap=True, check=check,
                   stats=stats)
    assert sch.num_preemptions > 0 and stats["draining"] > 0
    assert (stats.get("late_rows", 0) > 0) == bool(eos)  # a stopped sequence still ran in the step after its stop token
    assert got == alone(reqs, eos=eos)


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


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 8), max_num_seqs=st.integers(1, 4), budget=st.integers(1, 16),
       extra_blocks=st.integers(0, 8), overlap=st.booleans())
def test_abort_ends_a_request_with_a_prefix_of_its_output_and_changes_no_other(seed, n, max_num_seqs, budget,
                                                                              extra_blocks, overlap):
    """Aborts at random steps (waiting, running, preempted, with a token in flight): an aborted request ends with
    reason "abort" and a prefix of its output alone, or finished before the abort took effect; every other request
    gives its output alone; every block is free at the end."""
    rng = random.Random(seed)
    reqs = make_requests(rng, n, shared_prefix_len=6)
    need = max(-(-(len(p) + sp.max_tokens - 1) // 4) for p, sp in reqs)
    aborts: dict[int, list[int]] = {}
    chosen = rng.sample(range(n), rng.randint(0, n))
    for i in chosen:
        aborts.setdefault(rng.randint(0, 12), []).append(i)
    got, _ = run(reqs, num_blocks=need + extra_blocks, block_size=4, max_num_seqs=max_num_seqs, budget=budget,
                 overlap=overlap, prefix=True, aborts=aborts)
    want = alone(reqs)
    for i, ((tokens, lps, reason), (w_tokens, w_lps, w_reason)) in enumerate(zip(got, want)):
        if i in chosen and reason == "abort":
            assert tokens == w_tokens[:len(tokens)] and lps == w_lps[:len(tokens)]
        else:
            assert (tokens, lps, reason) == (w_tokens, w_lps, w_reason)


def test_abort_of_a_finished_sequence_is_an_error():
    bm = BlockManager(20, 4)
    sch = Scheduler(bm, 4, 100, 100)
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=1), seed=0)
    sch.add(seq)
    sch.update(sch.schedule(), [(5, -1.0)])
    assert seq.finish_reason == "length"
    with pytest.raises(ValueError, match="already finished"):
        sch.abort(seq)
