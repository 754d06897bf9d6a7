"""Continuous batching with chunked prefill and preemption by recompute (plain Python, no torch).

Each ``schedule()`` builds one engine step under two limits: at most ``max_num_seqs`` admitted sequences and at
most ``max_num_batched_tokens`` tokens. Priority is arrival order (``seq_id``, assigned in submission order),
never wall-clock time:

1. Admitted sequences, lowest ``seq_id`` first, each get ``min(its uncomputed tokens, budget left)`` tokens:
   one for a decode, a chunk for a prompt still being prefilled. A decode that needs a new KV block and finds
   none preempts the admitted sequence with the highest ``seq_id`` (possibly itself): its blocks are freed and
   it waits to recompute its prompt *and* generated tokens later.
2. Then waiting sequences, lowest ``seq_id`` first, are admitted while seats, budget and blocks last (none in a
   step that preempted, so a victim does not bounce straight back). Admission allocates blocks for all the
   sequence's tokens at once, reusing prefix-cache hits; a waiting sequence that does not fit blocks the ones
   behind it (strict FCFS).

None of these choices can change a token: a token's logits depend only on the tokens before it (batch-invariant
kernels, canonical KV order), and its sampling noise only on (seed, position, token id). See docs/ENGINE.md.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # compute positions num_computed_tokens .. num_computed_tokens + num_new_tokens - 1

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this step brings the sequence to its end, so its last row's logits give the next token."""
        return self.end == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Seq[int] = ()) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 2:
            raise ValueError(f"need max_num_seqs >= 1, max_num_batched_tokens >= 1, max_model_len >= 2; got "
                             f"{max_num_seqs}, {max_num_batched_tokens}, {max_model_len}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by seq_id
        self.running: list[Sequence] = []  # sorted by seq_id
        self.num_preemptions = 0
        self.num_steps = 0

    # ---- queues -------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> None:
        """Drop every request and free its blocks (after an error mid-generation)."""
        for seq in self.running:
            self.block_manager.deallocate(seq)
        for seq in self.running + self.waiting:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.running, self.waiting = [], []

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # ---- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """The next step's work, in ``seq_id`` order. Empty only when nothing is left to do."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            while not bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself, so every sequence after it is gone too
            bm.append_slots(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while (self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
               and bm.can_allocate(self.waiting[0])):
            seq = self.waiting.pop(0)
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        scheduled.sort(key=lambda s: s.seq.seq_id)
        for s in scheduled:
            if not bm.is_writable(s.seq, s.start, s.end):  # the prefix-cache contract; cheap, so always checked
                raise RuntimeError(f"scheduler bug: sequence {s.seq.seq_id} would write positions "
                                   f"{s.start}..{s.end - 1} into a shared or cached block")
        if not scheduled and self.has_unfinished():
            raise RuntimeError(f"scheduler made no progress with {len(self.waiting)} waiting and "
                               f"{len(self.running)} running sequences; the KV cache is too small for the head "
                               "request (the engine checks this up front, so this is a bug)")
        self.num_steps += 1
        return scheduled

    def update(self, scheduled: list[ScheduledSeq], sampled: Seq[tuple[int, float]]) -> list[Sequence]:
        """Record a step: advance ``num_computed_tokens``, append the sampled tokens (one per sampling entry,
        in order), finish sequences. Returns the sequences that finished."""
        bm = self.block_manager
        sampled_iter = iter(sampled)
        finished = []
        for s in scheduled:
            seq = s.seq
            samples = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            bm.cache_computed_blocks(seq)
            if not samples:
                continue
            token, logprob = next(sampled_iter)
            seq.append_token(token, logprob)
            reason = self.finish_reason(seq, token)
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                bm.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        if next(sampled_iter, None) is not None:
            raise RuntimeError("more sampled tokens than sampling sequences in the step")
        return finished

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None
