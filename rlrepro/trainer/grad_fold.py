"""The layout-free sum of a train step's micro-batch gradients (``train.layout_invariant``, issue #26).

The step's gradient is the **fold** of its micro-batch gradients in micro-batch order: ``g = l_a``, then
``g += l_b``, ``g += l_c``, ... over the micro-batches that have a gradient (per tensor: the first present leaf is
widened to float32, every later one added to it; an absent leaf or tensor is skipped, never added as a zero, so
``-0.0`` stays ``-0.0``). That is a pure function of the micro-batches (their composition is fixed by sample order,
``train.micro_batch_size`` and ``train.micro_batch_tokens``), whoever computes them, and it is exactly what one
rank does without the option: the optimizer's
:meth:`~rlrepro.trainer.optim.MasterWeightAdamW.accumulate_grads` (or autograd's own in-place accumulation for
float32 parameters) adds each micro-batch's gradient into one float32 accumulator in the same order.
So at one data-parallel rank the option changes nothing at all (no time, no memory, not a bit), and a run recorded
at one GPU without it is the run with it.

With ``d > 1`` data-parallel ranks (any ``d``), :class:`ShardedGradFold` computes the same fold with the
accumulator sharded over the ranks (ZeRO-2 style). Rank ``r`` computes the micro-batches ``r, r + d, r + 2d, ...``
(round robin, as without the option), so at micro-step ``s`` the ranks together hold the leaves
``s*d .. s*d + d - 1``, consecutive in the fold. The flattened parameters (name order) are cut into ``d`` fixed
contiguous shards; each rank sends shard ``j`` of its leaf to rank ``j`` (``all_to_all``, in rounds of at most
``bucket_numel`` received elements, in the parameters' dtype when they share one: a bf16 gradient travels as bf16),
and rank ``j`` adds the ``d`` pieces into its float32 accumulator shard in rank order, i.e. in leaf order: every
element goes through the very additions of the one-rank fold (elementwise adds: slicing changes no bit). Ranks
exchange per-tensor presence flags with the data, so an absent tensor stays absent. :meth:`ShardedGradFold.finish`
all-gathers the accumulator's shards (byte copies) into full float32 gradients, and the grad norm, the clip and
the optimizer see the very tensors one rank computes.

The loss and metric floats of the micro-batches are folded the same way (:func:`fold_floats`: every leaf's few
floats gathered, added in leaf order from ``0.0``, the running sums of the one-rank step).

Why a fold and not a balanced tree: both are fixed by the micro-batches alone, but a balanced tree evaluated on one
rank has to hold ``log2(micro-batches) + 1`` float32 partial gradients (measured on an H200 at the Qwen3-8B width:
x1.34 peak memory, +10-17 % step time at DP=1), while the fold holds the one accumulator a plain step holds. Its
rounding error grows with the number of micro-batches instead of its logarithm; with tens of micro-batches a step
that is ``~1e-6`` relative either way, as in any gradient-accumulating trainer.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["fold_floats", "ShardedGradFold", "fold_leaves"]


def fold_leaves(num_leaves: int, world_size: int, rank: int) -> list[int]:
    """The micro-batches rank ``rank`` computes: round robin, ``k % world_size == rank`` (as without the option)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    return list(range(rank, num_leaves, world_size))


def fold_floats(leaves: Mapping[int, Sequence[float]], num_leaves: int, data_parallel=None, *, width: int,
                max_indices: Sequence[int] = ()) -> list[float]:
    """The fold of per-leaf lists of ``width`` Python floats in leaf order, from ``0.0`` (float64 adds; entries in
    ``max_indices`` take the running max instead). ``leaves``: this rank's leaves (index -> list; a missing index is
    absent); with ``data_parallel`` every rank's are gathered first, so every rank returns the same floats."""
    every = dict(leaves)
    if data_parallel is not None and data_parallel.world_size > 1:
        every = {}
        for part in data_parallel.all_gather_object(dict(leaves)):
            every.update(part)
    maxes = frozenset(max_indices)
    total = [0.0] * width
    for k in range(num_leaves):
        if k in every:
            total = [max(t, v) if j in maxes else t + v for j, (t, v) in enumerate(zip(total, every[k]))]
    return total


def _pieces(sizes: Sequence[int], offsets: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """The tensors overlapping the flat range ``[start, stop)``: ``(tensor, lo, hi, at)``, tensor ``i``'s flat
    elements ``lo:hi`` at offset ``at`` of the range (``offsets`` ascending: a bisection finds the first one, so a
    round costs the tensors it touches, not all of a model's hundreds)."""
    out = []
    i = max(0, bisect.bisect_right(offsets, start) - 1)
    while i < len(sizes) and offsets[i] < stop:
        n, off = sizes[i], offsets[i]
        lo, hi = max(start, off), min(stop, off + n)
        if lo < hi:
            out.append((i, lo - off, hi - off, lo - start))
        i += 1
    return out


class ShardedGradFold:
    """The micro-batch fold (module docstring) with its float32 accumulator sharded over the data-parallel ranks.
    :meth:`push` this rank's :func:`fold_leaves` in order (None, or a None tensor: absent), then :meth:`finish`
    returns the full sum on every rank. Collectives: every rank takes part in every micro-step's exchange (a leaf it
    does not push is exchanged as absent when it pushes a later one or calls :meth:`finish`), so no other
    collective of the group may come between the first push and :meth:`finish`, and every rank calls it.

    ``like``: the parameters (the gradients' shapes and dtype, name order). ``bucket_numel`` (default: the group's
    ``bucket_numel``): the most elements a rank receives per exchange round. ``data_parallel`` None: one rank
    (``d = 1``, no collectives; the one-rank fold, used by tests as the reference)."""

    def __init__(self, num_leaves: int, data_parallel, like: Sequence[torch.Tensor], *,
                 bucket_numel: int | None = None) -> None:
        self.num_leaves = num_leaves
        self.data_parallel = dp = data_parallel
        self.world = d = 1 if dp is None else dp.world_size
        self.rank = 0 if dp is None else dp.rank
        self.device = like[0].device if dp is None else dp.device
        self.shapes = [tuple(t.shape) for t in like]
        self.devices = [t.device for t in like]
        self.sizes = [t.numel() for t in like]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        dtypes = {t.dtype for t in like}
        # the exchange's dtype: the gradients' own when the parameters share one (widened on the receiving side,
        # exactly), else float32 (every float dtype widens exactly into it)
        self.send_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        total = sum(self.sizes)
        self.bounds = [(j * total // d, (j + 1) * total // d) for j in range(d)]  # shard j: flat [a, b)
        numel = bucket_numel if bucket_numel is not None else (getattr(dp, "bucket_numel", None) or 1 << 26)
        self.chunk = max(1, numel // d)  # per sender and round: a rank receives at most d * chunk elements
        longest = max(b - a for a, b in self.bounds)
        self.rounds = -(-longest // self.chunk)
        self.steps = -(-num_leaves // d)  # micro-steps
        a, b = self.bounds[self.rank]
        self.my_pieces = _pieces(self.sizes, self.offsets, a, b)  # (tensor, lo, hi, at in my shard)
        self.leaves = fold_leaves(num_leaves, d, self.rank)
        self._step = 0  # the next micro-step
        self._acc: torch.Tensor | None = None  # my float32 shard of the running sum (allocated at the first leaf)
        self._acc_present = [False] * len(self.my_pieces)
        self._present_any = [False] * len(like)  # whether any leaf had tensor i (every rank knows it)
        self.peak_partial_bytes = 0  # the float32 accumulator shard, once allocated
        self.exchange_peak_bytes = 0  # the most bytes of send + receive buffers at once

    # --- leaves ------------------------------------------------------------------------------------------------
    def push(self, leaf: int, value: list | None) -> None:
        if leaf not in self.leaves or (leaf - self.rank) // self.world < self._step:
            raise ValueError(f"leaf {leaf} pushed out of order or not owned by rank {self.rank} "
                             f"(owned: {self.leaves}, next: {self._step * self.world + self.rank})")
        self._advance_to((leaf - self.rank) // self.world)
        self._micro_step(value)

    def _advance_to(self, step: int) -> None:
        while self._step < step:
            self._micro_step(None)

    def _check_dtype(self, value: list) -> None:
        for i, g in enumerate(value):
            if g is not None and g.dtype != self.send_dtype and self.send_dtype != torch.float32:
                raise ValueError(f"ShardedGradFold: tensor {i}'s gradient is {g.dtype}, its parameter "
                                 f"{self.send_dtype}: a leaf's gradients must have their parameters' dtype")

    @torch.no_grad()
    def _micro_step(self, value: list | None) -> None:
        """Exchange this micro-step's leaves by shard and add my shard of each to the accumulator, in leaf order."""
        d, n = self.world, len(self.sizes)
        if value is not None:
            self._check_dtype(value)
        mine = [value is not None and value[i] is not None for i in range(n)]
        if d > 1:
            flags = torch.tensor(mine, dtype=torch.uint8, device=self.device)
            parts = [torch.empty_like(flags) for _ in range(d)]
            dist.all_gather(parts, flags, group=self.data_parallel.group)
            present = [[bool(x) for x in p.tolist()] for p in parts]  # [rank][tensor]
        else:
            present = [mine]
        self._step += 1
        for i in range(n):
            self._present_any[i] = self._present_any[i] or any(p[i] for p in present)
        if not any(any(p) for p in present):  # every leaf of the micro-step absent: nothing to exchange or add
            return
        a, b = self.bounds[self.rank]
        piece_present = [[p[i] for (i, *_) in self.my_pieces] for p in present]  # [rank][piece]
        # per piece, the rank whose leaf starts the sum there (a copy, later ones add); decided before the rounds
        # (a piece may span several rounds)
        first: list[int | None] = []
        for k in range(len(self.my_pieces)):
            owners = [q for q in range(d) if piece_present[q][k]]
            first.append(owners[0] if owners and not self._acc_present[k] else None)
        if self._acc is None and b > a and any(q is not None for q in first):
            self._acc = torch.empty(b - a, dtype=torch.float32, device=self.device)
            self.peak_partial_bytes = self._acc.numel() * self._acc.element_size()
        # the fast path: every rank had every tensor of my shard, and the accumulator is wholly set or wholly empty
        all_acc, no_acc = all(self._acc_present), not any(self._acc_present)
        dense = all(all(p) for p in piece_present) and (all_acc or no_acc)
        flat = None if value is None else [None if g is None else g.detach().reshape(-1) for g in value]
        for c in range(self.rounds):
            # what each rank j receives this round: its shard's elements [a_j + c*chunk, ...)
            spans = [(ja + c * self.chunk, min(jb, ja + (c + 1) * self.chunk)) for ja, jb in self.bounds]
            lengths = [max(0, hi - lo) for lo, hi in spans]
            send = torch.empty(sum(lengths), dtype=self.send_dtype, device=self.device)
            if flat is not None:
                at = 0
                for (lo, hi), length in zip(spans, lengths):
                    for i, tlo, thi, pos in _pieces(self.sizes, self.offsets, lo, hi):
                        if flat[i] is not None:
                            send[at + pos:at + pos + thi - tlo].copy_(flat[i][tlo:thi])
                    at += length
            mine_len = lengths[self.rank]
            if d > 1:
                recv = torch.empty(d * mine_len, dtype=self.send_dtype, device=self.device)
                self.exchange_peak_bytes = max(self.exchange_peak_bytes,
                                               send.element_size() * (send.numel() + recv.numel()))
                dist.all_to_all_single(recv, send, output_split_sizes=[mine_len] * d, input_split_sizes=lengths,
                                       group=self.data_parallel.group)
            else:
                recv = send
                self.exchange_peak_bytes = max(self.exchange_peak_bytes, send.element_size() * send.numel())
            if self._acc is None or mine_len == 0:
                continue
            base = c * self.chunk  # this round's offset in my shard
            acc = self._acc[base:base + mine_len]
            rows = [recv[q * mine_len:(q + 1) * mine_len] for q in range(d)]
            if dense:  # one add per leaf over the whole round
                for q, row in enumerate(rows):
                    if q == 0 and no_acc:  # the step's first leaves: nothing in the accumulator yet
                        acc.copy_(row)
                    else:
                        acc.add_(row)
                continue
            for k, (i, tlo, thi, at) in enumerate(self.my_pieces):
                lo, hi = max(at, base), min(at + thi - tlo, base + mine_len)
                if lo >= hi:
                    continue
                for q in range(d):
                    if not piece_present[q][k]:
                        continue
                    if q == first[k]:
                        self._acc[lo:hi].copy_(rows[q][lo - base:hi - base])
                    else:
                        self._acc[lo:hi].add_(rows[q][lo - base:hi - base])
        for k in range(len(self.my_pieces)):
            self._acc_present[k] = self._acc_present[k] or any(p[k] for p in piece_present)

    # --- the sum ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, like: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The sum, full, on every rank: every tensor of the step's gradient (float32 zeros where no leaf had one),
        from every rank's shard (all-gathered, byte copies, in rounds of ``chunk`` elements per rank)."""
        self._advance_to(self.steps)
        d = self.world
        out = [torch.empty(s, dtype=torch.float32, device=self.device) if p else None
               for s, p in zip(self.shapes, self._present_any)]
        flat_out = [None if t is None else t.view(-1) for t in out]
        for c in range(self.rounds if any(self._present_any) else 0):
            spans = [(ja + c * self.chunk, min(jb, ja + (c + 1) * self.chunk)) for ja, jb in self.bounds]
            width = max(max(0, hi - lo) for lo, hi in spans)  # the gather's equal size (shorter ones padded)
            a, _ = self.bounds[self.rank]
            lo, hi = spans[self.rank]
            piece = torch.empty(width, dtype=torch.float32, device=self.device)
            if self._acc is not None and hi > lo:
                piece[:hi - lo].copy_(self._acc[lo - a:hi - a])
            if d > 1:
                parts = [torch.empty_like(piece) for _ in range(d)]
                dist.all_gather(parts, piece, group=self.data_parallel.group)
            else:
                parts = [piece]
            for (plo, phi), part in zip(spans, parts):
                for i, tlo, thi, pos in _pieces(self.sizes, self.offsets, plo, phi):
                    if flat_out[i] is not None:
                        flat_out[i][tlo:thi].copy_(part[pos:pos + thi - tlo])
        self._acc = None
        return [torch.zeros(s, dtype=torch.float32, device=dev) if t is None else t.to(dev)
                for t, s, dev in zip(out, self.shapes, self.devices)]
