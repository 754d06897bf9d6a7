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
   behind it (strict FCFS). A waiting sequence whose next uncached prompt block a running sequence is computing
   (the copies of one prompt submitted together) is skipped until that block is cached, then shares it.

Overlap (``launched`` / ``resolve``): the engine launches step t+1 before it reads step t's sampled tokens back.
``launched(step)`` records a step as soon as it is on the device (computed counts advance; every sampling
sequence gets a placeholder token, whose value the runner feeds from the device); ``resolve(rows, sampled)``
fills the placeholders in once the values are on the host, and finishes sequences. A sequence that will end by
length whatever it samples moves to ``draining`` at launch, so it is never scheduled past ``max_tokens``; one that
samples a stop token is found one step late, and its row in the step in flight is discarded. ``update`` is the
two back to back (no overlap).

None of these choices can change a token: a token's logits depend only on the tokens before it (batch-invariant
kernels, canonical KV order), and its sampling noise only on (seed, position, token id). See docs/ENGINE.md.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: positions ``start .. end - 1``, fixed when the step is scheduled."""

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)  # the sequence's num_computed_tokens when the step was scheduled
    samples: bool = field(init=False)  # the step brings the sequence to its end: its last row gives the next token

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == len(self.seq)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


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
        self.draining: list[Sequence] = []  # end by length at their pending token: hold blocks, never scheduled
        # copies of a prompt wait for its blocks a running copy computes (schedule); off only to measure it
        # (benchmarks/bench_group_prefill.py): the bits are the same either way
        self.share_in_step = True
        self.num_pending = 0  # placeholder tokens not yet resolved
        self.num_preemptions = 0
        self.num_steps = 0

    # ---- queues -------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.draining)

    def abort_all(self) -> None:
        """Drop every request and free its blocks (after an error mid-generation)."""
        for seq in self.running + self.draining:
            self.block_manager.deallocate(seq)
        for seq in self.running + self.draining + self.waiting:
            seq.drop_placeholder()
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.running, self.waiting, self.draining = [], [], []
        self.num_pending = 0

    def abort(self, seq: Sequence) -> bool:
        """Finish one unfinished sequence with reason ``"abort"``, keeping the tokens it has. Returns True if it is
        finished now (its blocks freed); False if a token of it is still in flight: it is then never scheduled
        again and finishes (reason ``"abort"``, that token kept) when ``resolve`` reads the token back."""
        if seq.status is SequenceStatus.FINISHED:
            raise ValueError(f"sequence {seq.seq_id} has already finished ({seq.finish_reason})")
        if seq.pending_row is not None:
            seq.abort_requested = True
            if seq in self.running:  # holds its blocks until the token is read back; never scheduled again
                self.running.remove(seq)
                self.draining.append(seq)
            return False  # (a preempted one stays in `waiting`: schedule() skips it while its token is pending)
        if seq in self.waiting:  # holds no blocks
            self.waiting.remove(seq)
        else:
            (self.draining if seq in self.draining else self.running).remove(seq)
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return True

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
        # prompt blocks that running sequences are computing: a waiting sequence whose next uncached block is one
        # of them waits a step (or a few, for a chunked prompt) and then finds it cached, as SGLang's in-batch
        # prefix sharing does: a GRPO group's copies, submitted together, compute their prompt once
        pending = {h for seq in self.running for h in bm.pending_prompt_blocks(seq)} if self.share_in_step else None
        j = 0
        while (j < len(self.waiting) and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
               and self.waiting[j].pending_row is None):
            seq = self.waiting[j]
            if bm.waits_for_prefix(seq, pending):
                j += 1  # skipped this step, not a blocker: the ones behind it may be admitted
                continue
            if not bm.can_allocate(seq):
                break  # strict FCFS: it blocks the ones behind it
            self.waiting.pop(j)
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            if pending is not None:
                pending.update(bm.pending_prompt_blocks(seq))
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        scheduled.sort(key=lambda s: s.seq.seq_id)
        for s in scheduled:
            if not bm.is_writable(s.seq, s.start, s.end):  # the prefix-cache contract; cheap, so always checked
                raise RuntimeError(f"scheduler bug: sequence {s.seq.seq_id} would write positions "
                                   f"{s.start}..{s.end - 1} into a shared or cached block")
        if scheduled:
            self.num_steps += 1
        elif (self.waiting or self.running) and not self.draining and not self.num_pending:
            raise RuntimeError(f"scheduler made no progress with {len(self.waiting)} waiting and "
                               f"{len(self.running)} running sequences; the KV cache is too small for the head "
                               "request (the engine checks this up front, so this is a bug)")
        return scheduled

    def update(self, scheduled: list[ScheduledSeq], sampled: Seq[tuple[int, float]]) -> list[Sequence]:
        """Record a finished step: ``launched`` and ``resolve`` back to back. ``sampled`` holds one (token,
        logprob) per sampling entry, in order. Returns the sequences that finished."""
        return self.resolve(self.launched(scheduled), sampled)

    def launched(self, scheduled: list[ScheduledSeq]) -> list[Sequence | None]:
        """Record a step that is on the device but whose sampled tokens are not known yet.

        Advances ``num_computed_tokens``, registers newly full blocks with the prefix cache, and gives every
        sampling sequence a placeholder token. Returns the step's sampled rows in order: the sequence of each,
        or None for a sequence that finished (a stop token read back late) since the step was scheduled; pass
        the list to ``resolve`` with the sampled values."""
        bm = self.block_manager
        rows: list[Sequence | None] = []
        for s in scheduled:
            seq = s.seq
            if seq.status is SequenceStatus.FINISHED:
                if s.samples:
                    rows.append(None)
                continue
            if seq.num_computed_tokens != s.start or seq.status is not SequenceStatus.RUNNING:
                raise RuntimeError(f"scheduler bug: sequence {seq.seq_id} changed between scheduling and launch")
            seq.num_computed_tokens = s.end
            bm.cache_computed_blocks(seq)  # full blocks hold computed positions only: never a placeholder
            if not s.samples:
                continue
            seq.append_placeholder(len(rows))
            rows.append(seq)
            self.num_pending += 1
            if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
                self.running.remove(seq)  # ends by length whatever the token is: schedule it no more
                self.draining.append(seq)
        return rows

    def resolve(self, rows: Seq[Sequence | None], sampled: Seq[tuple[int, float]]) -> list[Sequence]:
        """Fill in a launched step's sampled tokens (``rows`` from ``launched``) and finish sequences.

        Returns the sequences that finished."""
        if len(sampled) != len(rows):
            more = "more" if len(sampled) > len(rows) else "fewer"
            raise RuntimeError(f"{more} sampled tokens ({len(sampled)}) than sampling sequences in the step "
                               f"({len(rows)})")
        bm = self.block_manager
        finished = []
        for seq, (token, logprob) in zip(rows, sampled):
            if seq is None:
                continue
            seq.resolve_placeholder(token, logprob)
            self.num_pending -= 1
            reason = "abort" if seq.abort_requested else self.finish_reason(seq, token)
            if reason is None:
                if seq in self.draining:
                    raise RuntimeError(f"scheduler bug: draining sequence {seq.seq_id} did not finish")
                continue
            if seq.status is SequenceStatus.WAITING:  # preempted since its step was launched: holds no blocks
                self.waiting.remove(seq)
            else:
                (self.draining if seq in self.draining else self.running).remove(seq)
                bm.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            finished.append(seq)
        return finished

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None
