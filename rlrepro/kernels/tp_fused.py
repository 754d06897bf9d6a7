"""The layout-invariant pieces of :mod:`rlrepro.kernels.tp` on CUDA in the deterministic mode (``train.tp_partials``):
the per-piece path's forward bits from fewer, larger operations, and a backward of one Triton product per gradient.

With the Triton kernels (CUDA, deterministic mode) every element of ``triton_matmul.matmul`` is one float32 chain
over K from k = 0, whatever the M/N tiling, so

* a column-parallel forward is the one product over this rank's whole shard: its N-slices *are* the pieces' bits;
* a row-parallel forward is ``triton_pieces.matmul_k_pieces``: one launch running each piece's K chain (the same
  loop, from the piece's first column), rounding it, and adding the rounded partials in piece order in float32.

The same identity (a slice of a ``triton_matmul.matmul`` output has the bits of the product on the sliced operand)
gives the backward without per-piece products: each gradient is ONE Triton product reading the stored operands as
their transposes (``triton_pieces.linear_grad_input`` / ``linear_grad_weight``: no transposed copies), and a piece's
gradient is its slice:

* row-parallel (``weight [N, K_shard]``): ``grad_x = g @ weight`` and ``grad_w = g^T @ x``, the pieces' K-slices
  of the two products over the shard (the concatenation the per-piece graphs make);
* column-parallel (``weight [N_shard, K]``): ``grad_w = g^T @ x``, the pieces' N-rows of one product; ``grad_x``
  the pieces' partials ``g_r @ weight_r`` (reduction over N split at the pieces) rounded and added in piece order:
  one ``triton_pieces.linear_grad_input_n_pieces`` launch (over TP ranks: the partials stacked, gathered, added by
  ``triton_pieces.ordered_sum``, the same float32 additions).

So a rank's gradients at any TP dividing ``P`` are slices of (or, for the column ``grad_x``, the same sum as) the
TP=1 ones. These bits are not the per-piece path's (whose backward is ``torch.mm``, cuBLAS): the layout-invariant
backward is promised equal across TP, not equal to the per-piece path. Its forward keeps the per-piece bits (the
engine emulates the forward).

:mod:`rlrepro.kernels.tp` dispatches here and passes its kernel's linear in (``ColumnPiecesFused``'s ``linear``:
what ``tp._kernel_linear`` gives, which tests replace to run this path through Triton's interpreter); this module
imports nothing of tp (no import circle).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ColumnPiecesFused", "RowPiecesFused", "row_pieces_forward", "row_fused", "column_grad_input_partials",
           "ordered_sum_cuda"]


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every TP rank's ``x`` in rank order (byte copies)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return parts


def ordered_sum_cuda(parts: list[torch.Tensor]) -> torch.Tensor:
    from . import triton_pieces

    return triton_pieces.ordered_sum(parts)


def row_fused(x: torch.Tensor, weight: torch.Tensor, parts: int, stack: bool = False) -> torch.Tensor:
    """The ``parts`` K-pieces of ``x @ weight^T`` in one launch: their sum in piece order ``[..., N]``, or the
    rounded partials ``[parts, ..., N]`` (``stack``)."""
    from . import triton_pieces

    out = triton_pieces.matmul_k_pieces(x.reshape(-1, x.shape[-1]), weight, parts, stack=stack)
    return out.reshape(*((parts,) if stack else ()), *x.shape[:-1], weight.shape[0])


def row_pieces_forward(x: torch.Tensor, weight: torch.Tensor, parts: int, group) -> torch.Tensor:
    if _group_size(group) == 1:
        return row_fused(x, weight, parts)
    gathered = _gather(row_fused(x, weight, parts, stack=True), group)  # every rank's [parts, ..., N]
    return ordered_sum_cuda([p for part in gathered for p in part.unbind(0)])


def _triton_mm():
    from . import triton_pieces

    return triton_pieces


def column_grad_input_partials(g2d: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``[parts, M, K]``: this shard's pieces' input-gradient partials ``g_r @ weight_r`` (each rounded to the
    dtype), in one launch: what a TP rank gathers."""
    return _triton_mm().linear_grad_input_n_pieces(g2d, weight, parts, stack=True)


def _column_grad_input(g2d: torch.Tensor, weight: torch.Tensor, parts: int, group) -> torch.Tensor:
    """The column-parallel input gradient ``[M, K]``: every TP rank's pieces' partials added in piece order in
    float32 (one launch at TP=1; over ranks the stacked partials gathered and added by ``ordered_sum``)."""
    if _group_size(group) == 1:
        return _triton_mm().linear_grad_input_n_pieces(g2d, weight, parts)
    gathered = _gather(column_grad_input_partials(g2d, weight, parts), group)
    return ordered_sum_cuda([p for part in gathered for p in part.unbind(0)])


class ColumnPiecesFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, parts, group, linear):
        ctx.save_for_backward(x, weight)
        ctx.parts, ctx.group = parts, group
        return linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        g2d = grad.to(x.dtype).reshape(-1, weight.shape[0])
        gx = gw = None
        if need_x:
            gx = _column_grad_input(g2d, weight, ctx.parts, ctx.group).reshape(x.shape)
        if need_w:
            gw = _triton_mm().linear_grad_weight(g2d, x.reshape(-1, x.shape[-1]))
        return gx, gw, None, None, None


class RowPiecesFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, parts, group):
        ctx.save_for_backward(x, weight)
        ctx.parts = parts
        return row_pieces_forward(x, weight, parts, group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        g2d = grad.to(x.dtype).reshape(-1, weight.shape[0])  # each piece gets the output grad
        mm = _triton_mm()
        gx = mm.linear_grad_input(g2d, weight).reshape(x.shape) if need_x else None
        gw = mm.linear_grad_weight(g2d, x.reshape(-1, x.shape[-1])) if need_w else None
        return gx, gw, None, None
