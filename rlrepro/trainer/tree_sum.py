"""The layout-free sum of a train step's micro-batch gradients (``train.layout_invariant``, issue #26).

The step's micro-batches are the leaves ``0 .. M-1`` of one fixed binary tree, a function of ``M`` alone: the
perfect tree over ``L = 2**ceil(log2 M)`` leaves, leaves ``>= M`` absent. A node is ``combine(left, right)``
with ``combine(a, absent) = a`` (no zeros are added, so padding and skipped micro-batches change no bit) and
``combine(a, b) = a + b`` elementwise otherwise. The root is the step's gradient, whatever computes which leaf:

* the tree is cut into ``S`` aligned subtrees of ``L / S`` leaves (:func:`num_subtrees`: the smallest power of two
  ``>= world_size``, at most ``L``), and rank ``r`` owns the contiguous subtrees :func:`owned_subtrees` gives it,
  hence a contiguous range of leaves (:func:`owned_leaves`);
* inside a subtree a rank adds its leaves in order with a **binary counter** (:class:`PairwiseStack`): at most
  ``log2(L / S) + 1`` partial sums are held at once, and the result is the subtree's node, bit for bit;
* the ``S`` subtree roots are gathered by every rank and the top levels are combined in tree order
  (:func:`combine_level_order`), so every rank holds the same root.

One rank (``S = 1``) computes exactly the same additions as any number of ranks; the same holds for the float
sums of the loss and its metrics (:func:`tree_sum_floats`, which gathers the leaves' few floats and sums them in
the tree on every rank).

**Sharded partial sums** (ZeRO-2 style, :class:`ShardedGradTree`), used instead of the above when the number of
data-parallel ranks ``d > 1`` is a power of two (:func:`shards_partial_sums`). The tree is the same; only who
computes and holds what changes. Rank ``r`` computes the leaves ``r, r + d, r + 2d, ...`` (round robin,
:func:`tree_leaves`), so at micro-step ``s`` the ranks together hold the leaves ``s*d .. s*d + d - 1``: one complete
aligned subtree of the tree padded to ``W = max(L, d)`` leaves (padding a tree with absent leaves changes no node
above them, so its root is the root over ``L``). The flattened parameters (name order) are cut into ``d`` fixed
contiguous shards; at each micro-step every rank sends shard ``j`` of its leaf to rank ``j`` (``all_to_all``, in
rounds of at most ``bucket_numel`` received elements), rank ``j`` combines the ``d`` pieces in the subtree's own
pairing (:func:`combine_level_order`) and pushes that subtree root's shard into a binary counter over the ``W / d``
subtree roots. It holds at most ``log2(W / d) + 1`` partial sums of ``1/d`` of the parameters (``peak_partial_bytes``
reports it). Every element goes through the same additions as in the unsharded tree (elementwise float32 adds:
slicing changes no bit), and a tensor absent from a leaf (no gradient, or a skipped micro-batch) stays absent: the
ranks exchange per-tensor presence flags with the data. :meth:`ShardedGradTree.finish` all-gathers the shards of the
root (byte copies) into full gradients, so the grad norm, the clip and the optimizer see the very tensors
:class:`GradTree` gives.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["num_leaves_padded", "num_subtrees", "owned_subtrees", "owned_leaves", "PairwiseStack",
           "combine_grads", "combine_level_order", "tree_sum", "tree_sum_floats", "GradTree", "ShardedGradTree",
           "shards_partial_sums", "tree_leaves", "make_grad_tree"]


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_leaves_padded(num_leaves: int) -> int:
    """``L``: the tree's width, the smallest power of two ``>= num_leaves`` (1 for 0 or 1 leaves)."""
    return _next_pow2(num_leaves)


def num_subtrees(num_leaves: int, world_size: int) -> int:
    """``S``: how many aligned subtrees the tree is cut into for ``world_size`` ranks (a power of two)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return min(_next_pow2(world_size), num_leaves_padded(num_leaves))


def owned_subtrees(num_leaves: int, world_size: int, rank: int) -> range:
    """The subtrees rank ``rank`` owns: a contiguous range of ``[0, S)``, the ranks in order (balanced)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    s = num_subtrees(num_leaves, world_size)
    return range(rank * s // world_size, (rank + 1) * s // world_size)


def owned_leaves(num_leaves: int, world_size: int, rank: int) -> list[int]:
    """The micro-batches rank ``rank`` computes: the leaves ``< num_leaves`` of its subtrees, in order."""
    width = num_leaves_padded(num_leaves) // num_subtrees(num_leaves, world_size)
    sub = owned_subtrees(num_leaves, world_size, rank)
    return list(range(min(sub.start * width, num_leaves), min(sub.stop * width, num_leaves)))


def _combine_values(a, b, combine: Callable):
    if a is None:
        return b
    if b is None:
        return a
    return combine(a, b)


def combine_grads(left: list, right: list) -> list:
    """One node of a gradient tree: per tensor ``left + right`` (in place into ``left``'s tensor); a ``None`` tensor
    (no gradient in that subtree) is absent."""
    out = []
    for a, b in zip(left, right):
        if a is None:
            out.append(b)
        elif b is None:
            out.append(a)
        else:
            out.append(a.add_(b))
    return out


def combine_level_order(roots: Sequence, combine: Callable) -> object:
    """The node above ``len(roots)`` (a power of two) aligned sibling nodes: pairs combined level by level, left to
    right (None = absent)."""
    level = list(roots)
    if len(level) & (len(level) - 1):
        raise ValueError(f"combine_level_order needs a power-of-two number of nodes, got {len(level)}")
    while len(level) > 1:
        level = [_combine_values(level[i], level[i + 1], combine) for i in range(0, len(level), 2)]
    return level[0] if level else None


class PairwiseStack:
    """Binary-counter pairwise summation of consecutive leaves of one aligned subtree. ``push(value)`` the leaves in
    order (None = absent); ``result()`` is the subtree's node (None if every leaf was absent). At most
    ``log2(leaves) + 1`` partial sums are held."""

    def __init__(self, combine: Callable, nbytes: Callable[[object], int] | None = None) -> None:
        self.combine = combine
        self._stack: list[tuple[int, object]] = []  # (level, node), levels strictly decreasing
        self.count = 0
        # accounting (``nbytes``: a node's bytes): the most bytes of partial sums held at once, the pushed one
        # included (combines are in place into the left node, so a push allocates nothing more)
        self.nbytes = nbytes
        self.peak_bytes = 0

    def held_bytes(self) -> int:
        """The bytes of the partial sums held now (0 without ``nbytes``)."""
        return 0 if self.nbytes is None else sum(self.nbytes(node) for _, node in self._stack if node is not None)

    def push(self, value) -> None:
        if self.nbytes is not None:
            held = self.held_bytes() + (0 if value is None else self.nbytes(value))
            self.peak_bytes = max(self.peak_bytes, held)
        level, node = 0, value
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            node = _combine_values(left, node, self.combine)
            level += 1
        self._stack.append((level, node))
        self.count += 1

    def result(self):
        """The node of the ``count`` leaves pushed, ``count`` a power of two (the caller pads with absent leaves)."""
        if self.count & (self.count - 1) or len(self._stack) > 1:
            raise ValueError(f"PairwiseStack.result() needs a power-of-two number of leaves, got {self.count}")
        return self._stack[0][1] if self._stack else None


def tree_sum(leaves: Mapping[int, object], num_leaves: int, combine: Callable) -> object:
    """The reference: the tree's root over ``leaves`` (index -> value; a missing index is absent) in one process."""
    stack = PairwiseStack(combine)
    for k in range(num_leaves_padded(num_leaves)):
        stack.push(leaves.get(k))
    return stack.result()


def _add_floats(max_indices: frozenset):
    def combine(a: list[float], b: list[float]) -> list[float]:
        return [max(x, y) if j in max_indices else x + y for j, (x, y) in enumerate(zip(a, b))]
    return combine


def tree_sum_floats(leaves: Mapping[int, list[float]], num_leaves: int, data_parallel=None, *, width: int,
                    max_indices: Sequence[int] = ()) -> list[float]:
    """The tree sum of per-leaf lists of ``width`` Python floats (float64 adds; entries in ``max_indices`` take the
    max instead). ``leaves``: this rank's leaves (index -> list); with ``data_parallel`` every rank's are gathered
    first, so every rank returns the same floats. All absent: zeros."""
    every = dict(leaves)
    if data_parallel is not None and data_parallel.world_size > 1:
        every = {}
        for part in data_parallel.all_gather_object(dict(leaves)):
            every.update(part)
    root = tree_sum(every, num_leaves, _add_floats(frozenset(max_indices)))
    return [0.0] * width if root is None else list(root)


def _grads_nbytes(leaf: list) -> int:
    return sum(t.numel() * t.element_size() for t in leaf if t is not None)


class GradTree:
    """One train step's gradient tree on one rank: :meth:`push` this rank's leaves (its :func:`owned_leaves`, in
    order; None for a skipped micro-batch), then :meth:`finish` gathers the subtree roots and returns the root,
    the same bits on every rank. A leaf is a list of float32 tensors in a fixed order (None: no gradient)."""

    def __init__(self, num_leaves: int, data_parallel=None) -> None:
        self.num_leaves = num_leaves
        self.data_parallel = data_parallel
        self.world = 1 if data_parallel is None else data_parallel.world_size
        self.rank = 0 if data_parallel is None else data_parallel.rank
        self.subtrees = owned_subtrees(num_leaves, self.world, self.rank)
        self.width = num_leaves_padded(num_leaves) // num_subtrees(num_leaves, self.world)
        self.leaves = owned_leaves(num_leaves, self.world, self.rank)
        self._next = self.subtrees.start * self.width  # the next leaf index expected
        self._stack = PairwiseStack(combine_grads, _grads_nbytes)
        self._roots: list = []
        self.peak_partial_bytes = 0  # the most bytes of float32 partial sums this rank held at once

    takes_float32 = True  # leaves must be float32 (they are added in place)

    def _advance_to(self, leaf: int) -> None:
        while self._next < leaf:
            self._push(None)

    def _push(self, value) -> None:
        held = sum(_grads_nbytes(r) for r in self._roots if r is not None) + self._stack.held_bytes()
        self.peak_partial_bytes = max(self.peak_partial_bytes, held + (0 if value is None else _grads_nbytes(value)))
        self._stack.push(value)
        self._next += 1
        if self._stack.count == self.width:
            self._roots.append(self._stack.result())
            self._stack = PairwiseStack(combine_grads, _grads_nbytes)

    def push(self, leaf: int, value: list | None) -> None:
        if leaf < self._next or leaf not in self.leaves:
            raise ValueError(f"leaf {leaf} pushed out of order or not owned by rank {self.rank} "
                             f"(owned: {self.leaves}, next: {self._next})")
        self._advance_to(leaf)
        self._push(value)

    @torch.no_grad()
    def finish(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The root: every tensor of the step's gradient (zeros of ``like[i]``'s shape where no leaf had one)."""
        self._advance_to(self.subtrees.stop * self.width)
        roots = self._roots
        if len(roots) != len(self.subtrees):
            raise RuntimeError(f"rank {self.rank} built {len(roots)} subtree roots, expected {len(self.subtrees)}")
        if self.world > 1:
            roots = self._gather_roots(roots, like)
        root = combine_level_order(roots, combine_grads)
        if root is None:
            root = [None] * len(like)
        return [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if g is None else g
                for g, t in zip(root, like)]

    def _gather_roots(self, mine: list, like: Sequence[torch.Tensor]) -> list:
        """Every rank's subtree roots, in subtree order, tensor by tensor (at most ``ceil(S / world)`` copies of
        one tensor in flight per rank): byte copies, then the top levels are added alike everywhere."""
        dp = self.data_parallel
        s = num_subtrees(self.num_leaves, self.world)
        per_rank = max(len(owned_subtrees(self.num_leaves, self.world, r)) for r in range(self.world))
        present = [[root is not None and root[i] is not None for i in range(len(like))] for root in mine]
        everyone = dp.all_gather_object(present)  # [rank][subtree][tensor]
        owners = [r for r in range(self.world) for _ in owned_subtrees(self.num_leaves, self.world, r)]
        index_in_rank = [j for r in range(self.world) for j in range(len(owned_subtrees(self.num_leaves, self.world, r)))]
        out: list[list] = [[None] * len(like) for _ in range(s)]
        for i, t in enumerate(like):
            if not any(p[i] for rank_present in everyone for p in rank_present):
                continue
            buf = torch.zeros((per_rank, *t.shape), dtype=torch.float32, device=dp.device)
            for j, root in enumerate(mine):
                if root is not None and root[i] is not None:
                    buf[j].copy_(root[i])
            parts = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(parts, buf, group=dp.group)
            for sub in range(s):
                r, j = owners[sub], index_in_rank[sub]
                if everyone[r][j][i]:
                    out[sub][i] = parts[r][j].to(t.device)
        return [None if all(g is None for g in root) else root for root in out]


# ------------------------------------------------------------------------------------ sharded partial sums (ZeRO-2)

def shards_partial_sums(world_size: int) -> bool:
    """Whether ``world_size`` data-parallel ranks use :class:`ShardedGradTree`: ``> 1`` and a power of two (else
    :class:`GradTree`; the same bits either way)."""
    return world_size > 1 and world_size & (world_size - 1) == 0


def tree_leaves(num_leaves: int, world_size: int, rank: int) -> list[int]:
    """The micro-batches rank ``rank`` computes under ``train.layout_invariant``: round robin (``k % world_size``)
    when the partial sums are sharded (:func:`shards_partial_sums`), else the contiguous :func:`owned_leaves`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if shards_partial_sums(world_size):
        return list(range(rank, num_leaves, world_size))
    return owned_leaves(num_leaves, world_size, rank)


def make_grad_tree(num_leaves: int, data_parallel, like: Sequence[torch.Tensor]):
    """The step's gradient tree on this rank: :class:`ShardedGradTree` when :func:`shards_partial_sums`, else
    :class:`GradTree`. Push the leaves :func:`tree_leaves` gives, in order."""
    world = 1 if data_parallel is None else data_parallel.world_size
    if shards_partial_sums(world):
        return ShardedGradTree(num_leaves, data_parallel, like)
    return GradTree(num_leaves, data_parallel)


def _pieces(sizes: Sequence[int], offsets: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """The tensors overlapping the flat range ``[start, stop)``: ``(tensor, lo, hi, at)``, tensor ``i``'s flat
    elements ``lo:hi`` at offset ``at`` of the range."""
    out = []
    for i, (n, off) in enumerate(zip(sizes, offsets)):
        lo, hi = max(start, off), min(stop, off + n)
        if lo < hi:
            out.append((i, lo - off, hi - off, lo - start))
    return out


class _Shard:
    """A node of the tree restricted to this rank's shard: a flat float32 buffer and, per tensor piece of the
    shard, whether any leaf below had that tensor (an absent piece's elements are never read)."""
    __slots__ = ("buf", "present")

    def __init__(self, buf: torch.Tensor, present: list[bool]) -> None:
        self.buf, self.present = buf, present


class ShardedGradTree:
    """:class:`GradTree`'s root with the partial sums sharded over the data-parallel ranks (module docstring,
    "Sharded partial sums"); the same interface: :meth:`push` this rank's :func:`tree_leaves` in order (None or a
    None tensor: absent), :meth:`finish` returns the full root on every rank. Leaves may be in any float dtype
    (bf16 gradients are widened exactly into the float32 send buffer). Collectives: every rank of the group takes
    part in every micro-step's exchange (a leaf it does not push is exchanged as absent when it pushes a later one
    or calls :meth:`finish`), so no other collective of the group may come between the first push and
    :meth:`finish`, and every rank calls :meth:`finish`.

    ``like``: the parameters (the gradients' shapes, name order). ``bucket_numel`` (default: the group's
    ``bucket_numel``): the most elements a rank receives per exchange round. ``data_parallel`` None: one rank
    (``d = 1``, no collectives; the same root as :func:`tree_sum`)."""

    takes_float32 = False

    def __init__(self, num_leaves: int, data_parallel, like: Sequence[torch.Tensor], *,
                 bucket_numel: int | None = None) -> None:
        self.num_leaves = num_leaves
        self.data_parallel = dp = data_parallel
        self.world = d = 1 if dp is None else dp.world_size
        self.rank = 0 if dp is None else dp.rank
        if d & (d - 1):
            raise ValueError(f"ShardedGradTree needs a power-of-two number of ranks, got {d} (use GradTree)")
        self.device = like[0].device if dp is None else dp.device
        self.shapes = [tuple(t.shape) for t in like]
        self.devices = [t.device for t in like]
        self.sizes = [t.numel() for t in like]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        total = sum(self.sizes)
        self.bounds = [(j * total // d, (j + 1) * total // d) for j in range(d)]  # shard j: flat [a, b)
        numel = bucket_numel if bucket_numel is not None else (getattr(dp, "bucket_numel", None) or 1 << 26)
        self.chunk = max(1, numel // d)  # per sender and round: a rank receives at most d * chunk elements
        longest = max(b - a for a, b in self.bounds)
        self.rounds = -(-longest // self.chunk)
        self.width = max(num_leaves_padded(num_leaves), d)  # W: the tree padded to whole micro-steps
        self.steps = self.width // d  # micro-steps: subtree roots pushed into the stack
        a, b = self.bounds[self.rank]
        self.my_pieces = _pieces(self.sizes, self.offsets, a, b)  # (tensor, lo, hi, at in my shard)
        self.leaves = list(range(self.rank, num_leaves, d))
        self._step = 0  # the next micro-step
        self._stack = PairwiseStack(self._combine, lambda node: node.buf.numel() * node.buf.element_size())
        self._present_any = [False] * len(like)  # whether any leaf had tensor i (every rank knows it)
        self.exchange_peak_bytes = 0  # the most bytes of send + receive buffers at once

    @property
    def peak_partial_bytes(self) -> int:
        """The most bytes of float32 partial sums (shards of subtree roots) this rank held at once."""
        return self._stack.peak_bytes

    # --- combining nodes of this rank's shard ----------------------------------------------------------------
    def _combine(self, left: _Shard, right: _Shard) -> _Shard:
        """``left + right`` piece by piece, in place into ``left`` (a piece absent on one side is the other's)."""
        if all(left.present) and all(right.present):
            left.buf.add_(right.buf)
            return left
        for k, (_, tlo, thi, at) in enumerate(self.my_pieces):
            if not right.present[k]:
                continue
            if left.present[k]:
                left.buf[at:at + thi - tlo].add_(right.buf[at:at + thi - tlo])
            else:
                left.buf[at:at + thi - tlo].copy_(right.buf[at:at + thi - tlo])
                left.present[k] = True
        return left

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

    @torch.no_grad()
    def _micro_step(self, value: list | None) -> None:
        """Exchange this micro-step's leaves by shard and push my shard of their subtree's root."""
        d, n = self.world, len(self.sizes)
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
        if not any(any(p) for p in present):  # every leaf of the subtree absent: so is its root (no exchange)
            self._stack.push(None)
            return
        a, b = self.bounds[self.rank]
        piece_present = [[p[i] for (i, *_) in self.my_pieces] for p in present]  # [rank][piece]
        node_present = [any(p[k] for p in piece_present) for k in range(len(self.my_pieces))]
        node = _Shard(torch.empty(b - a, dtype=torch.float32, device=self.device), node_present) \
            if any(node_present) else None
        dense = all(all(p) for p in piece_present)
        flat = None if value is None else [None if g is None else g.detach().reshape(-1) for g in value]
        for c in range(self.rounds):
            # what each rank j receives this round: its shard's elements [a_j + c*chunk, ...)
            spans = [(ja + c * self.chunk, min(jb, ja + (c + 1) * self.chunk)) for ja, jb in self.bounds]
            lengths = [max(0, hi - lo) for lo, hi in spans]
            send = torch.empty(sum(lengths), dtype=torch.float32, device=self.device)
            if flat is not None:
                at = 0
                for (lo, hi), length in zip(spans, lengths):
                    for i, tlo, thi, pos in _pieces(self.sizes, self.offsets, lo, hi):
                        if flat[i] is not None:
                            send[at + pos:at + pos + thi - tlo].copy_(flat[i][tlo:thi])
                    at += length
            mine_len = lengths[self.rank]
            if d > 1:
                recv = torch.empty(d * mine_len, dtype=torch.float32, device=self.device)
                self.exchange_peak_bytes = max(self.exchange_peak_bytes, 4 * (send.numel() + recv.numel()))
                dist.all_to_all_single(recv, send, output_split_sizes=[mine_len] * d, input_split_sizes=lengths,
                                       group=self.data_parallel.group)
            else:
                recv = send
                self.exchange_peak_bytes = max(self.exchange_peak_bytes, 4 * send.numel())
            if node is None or mine_len == 0:
                continue
            rows = [recv[q * mine_len:(q + 1) * mine_len] for q in range(d)]
            base = c * self.chunk  # this round's offset in my shard
            if dense:  # every rank had every tensor: one combine over the whole round
                node.buf[base:base + mine_len].copy_(combine_level_order(rows, _add_))
                continue
            for k, (i, tlo, thi, at) in enumerate(self.my_pieces):
                lo, hi = max(at, base), min(at + thi - tlo, base + mine_len)
                if lo >= hi or not node_present[k]:
                    continue
                vals = [rows[q][lo - base:hi - base] if piece_present[q][k] else None for q in range(d)]
                node.buf[lo:hi].copy_(combine_level_order(vals, _add_))
        self._stack.push(node)

    # --- the root ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, like: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The root, full, on every rank: every tensor of the step's gradient (float32 zeros where no leaf had
        one), from every rank's shard (all-gathered, byte copies, in rounds of ``chunk`` elements per rank)."""
        self._advance_to(self.steps)
        root = self._stack.result()
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
            if root is not None and hi > lo:
                piece[:hi - lo].copy_(root.buf[lo - a:hi - a])
            if d > 1:
                parts = [torch.empty_like(piece) for _ in range(d)]
                dist.all_gather(parts, piece, group=self.data_parallel.group)
            else:
                parts = [piece]
            for (plo, phi), part in zip(spans, parts):
                for i, tlo, thi, pos in _pieces(self.sizes, self.offsets, plo, phi):
                    if flat_out[i] is not None:
                        flat_out[i][tlo:thi].copy_(part[pos:pos + thi - tlo])
        return [torch.zeros(s, dtype=torch.float32, device=dev) if t is None else t.to(dev)
                for t, s, dev in zip(out, self.shapes, self.devices)]


def _add_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.add_(b)
