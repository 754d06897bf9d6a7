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
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["num_leaves_padded", "num_subtrees", "owned_subtrees", "owned_leaves", "PairwiseStack",
           "combine_grads", "combine_level_order", "tree_sum", "tree_sum_floats", "GradTree"]


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

    def __init__(self, combine: Callable) -> None:
        self.combine = combine
        self._stack: list[tuple[int, object]] = []  # (level, node), levels strictly decreasing
        self.count = 0

    def push(self, value) -> None:
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
        self._stack = PairwiseStack(combine_grads)
        self._roots: list = []

    def _advance_to(self, leaf: int) -> None:
        while self._next < leaf:
            self._push(None)

    def _push(self, value) -> None:
        self._stack.push(value)
        self._next += 1
        if self._stack.count == self.width:
            self._roots.append(self._stack.result())
            self._stack = PairwiseStack(combine_grads)

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
        import torch.distributed as dist

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
