"""Tensor parallelism with order-fixed reductions, and its single-process emulation.

Megatron-style tensor parallelism (TP) splits each linear layer over ``tp`` ranks:

* **column-parallel** (q/k/v, gate/up, the LM head): rank ``r`` holds output rows ``W[N_r]`` and computes its own
  slice of the output; the full output is the concatenation in rank order (gathering only copies bytes).
* **row-parallel** (o_proj, down_proj): rank ``r`` holds the input columns ``W[:, K_r]`` and computes a *partial*
  output over its K-slice; the output is the sum of the partials. Megatron all-reduces them, which leaves the
  summation order to NCCL. Here every rank **all-gathers** the partials and adds them itself in rank order,
  ``((p_0 + p_1) + p_2) + ...`` with a float32 accumulator cast once to the output dtype, so every rank and every
  run get the same bits.
* **vocab-parallel** log-softmax: each rank holds a vocab shard of the logits; the global max is exact, the
  per-shard ``sum exp(x - max)`` (float32) are gathered and added in rank order.

Autograd. In TP every rank runs the same computation after a gather or a sum (the downstream is replicated), so
every rank holds the same gradient of a gathered/summed tensor. Hence:

=========================  =========================================  ====================================
op                         forward                                    backward
=========================  =========================================  ====================================
:func:`copy_to_tp`         identity (input to a column-parallel op)   order-fixed sum of the ranks' grads
:func:`row_parallel_sum`   gather partials, sum in rank order         identity (each rank keeps the grad)
:func:`gather_stack`       gather, stack ``[tp, ...]``                this rank's slice of the grad
:func:`gather_last_dim`    gather, concatenate along the last dim     this rank's slice of the grad
=========================  =========================================  ====================================

No backward uses an all-reduce; the only reduction (``copy_to_tp``'s) is again gather + rank-order sum.
The "own slice" backward of a gather is right only when the gathered tensor depends on other ranks' data through
``copy_to_tp`` alone (then the cross-rank part of its gradient is summed there); a tensor computed from another
gather's result (e.g. a log-softmax normalised by gathered sums) must not be gathered again with grad.

Emulation. :func:`linear_row_split`, :func:`linear_column_split`, :func:`emulated_log_softmax` and
:func:`emulated_token_logprob` compute, in one process, exactly what ``tp`` ranks compute: each shard's product
with the deterministic kernel on a contiguous copy of the shard (the shape a rank sees), cast to the output
dtype as the rank's kernel returns it, then combined in rank order the same way. This is how the engine
reproduces a TP trainer: ``Qwen3ForCausalLM.set_tensor_parallel_emulation(tp)`` routes the model's linears
through these, and ``tests/test_tp_emulation.py`` checks emulated TP == real TP over gloo with ``torch.equal``.
Column splits are emulated too because a kernel's bits may depend on N: on the CPU,
``kernels.linear(x, W)[:, :n]`` differs from ``kernels.linear(x, W[:n])`` for some shapes.

Works with gloo (CPU tensors) and NCCL (CUDA tensors); ``group=None`` is the default process group.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

__all__ = [
    "shard_range", "ordered_sum", "copy_to_tp", "row_parallel_sum", "gather_stack", "gather_last_dim",
    "vocab_parallel_log_softmax", "vocab_parallel_token_logprob", "linear_row_split", "linear_column_split",
    "emulated_log_softmax", "emulated_token_logprob", "sum_in_rank_order", "column_pieces_linear",
    "row_pieces_linear", "head_group_rms_norm", "column_split_is_one_product",
]


# ------------------------------------------------------------------------------------------------------ helpers

def shard_range(size: int, parts: int, index: int, what: str = "dimension") -> tuple[int, int]:
    """``[start, end)`` of shard ``index`` when ``size`` is split into ``parts`` equal consecutive shards."""
    if parts < 1 or size % parts:
        raise ValueError(f"cannot split {what} of size {size} into {parts} equal tensor-parallel shards; "
                         f"choose a tensor_parallel size that divides {size}")
    if not 0 <= index < parts:
        raise ValueError(f"shard index {index} is outside [0, {parts})")
    step = size // parts
    return index * step, (index + 1) * step


def sum_in_rank_order(parts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``((p_0 + p_1) + p_2) + ...`` with a float32 (float64 if the parts are float64) accumulator, cast to
    ``dtype`` (default: the parts' dtype). The one definition of a TP sum, used by ranks and emulation alike."""
    dtype = dtype or parts[0].dtype
    acc_dtype = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    total = parts[0].to(acc_dtype, copy=True)
    for p in parts[1:]:
        total += p.to(acc_dtype)
    return total.to(dtype)


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


@torch.no_grad()
def ordered_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks, in rank order (all-gather, then :func:`sum_in_rank_order`): the same
    bits on every rank and in every run, unlike ``all_reduce``."""
    if dist.get_world_size(group) == 1:
        return x.detach().clone()
    return sum_in_rank_order(_all_gather(x, group))


# ------------------------------------------------------------------------------------------ autograd primitives

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ordered_sum(grad, ctx.group), None


class _RowParallelSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        return sum_in_rank_order(_all_gather(partial, group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.rank = dist.get_rank(group)
        return torch.stack(_all_gather(x, group))

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank].contiguous(), None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; backward sums the ranks' input grads in rank order. Put it where a replicated tensor
    enters a column-parallel op (each rank's grad covers only its shard of the output)."""
    if dist.get_world_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def row_parallel_sum(partial: torch.Tensor, group=None) -> torch.Tensor:
    """The row-parallel linear's output: the ranks' partial outputs added in rank order (float32 accumulator,
    cast to ``partial.dtype``). Backward: identity."""
    if dist.get_world_size(group) == 1:
        return partial
    return _RowParallelSum.apply(partial, group)


def gather_stack(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[tp, *x.shape]``: every rank's ``x`` in rank order. Backward: this rank's slice of the grad."""
    if dist.get_world_size(group) == 1:
        return x.unsqueeze(0)
    return _GatherStack.apply(x, group)


def gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """The column-parallel gather: the ranks' shards concatenated along the last dim in rank order."""
    if dist.get_world_size(group) == 1:
        return x
    return torch.cat(gather_stack(x, group).unbind(0), dim=-1)


# ------------------------------------------------------------------------------ vocab-parallel log-softmax math

def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    t = float(temperature) if temperature > 0 else 1.0
    return logits.float() / t


def _lse_from_shards(shards: list[torch.Tensor], gather) -> torch.Tensor:
    """``logsumexp`` over all shards, shared by ranks and emulation. ``shards``: the float32 (tempered) logit shards
    this process holds (one on a rank, all in emulation); ``gather(values, grad)`` turns per-held-shard values into
    the list over all shards. Max: exact (any order); ``sum exp(x - max)``: float32 per shard, added in rank order."""
    maxes = gather([s.detach().amax(dim=-1) for s in shards], grad=False)
    m = maxes[0]
    for v in maxes[1:]:
        m = torch.maximum(m, v)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(-1)
    sums = gather([torch.exp(s - m).sum(dim=-1) for s in shards], grad=True)
    total = sums[0]
    for v in sums[1:]:
        total = total + v
    return m + torch.log(total).unsqueeze(-1)


def _rank_gather(group):
    def gather(values: list[torch.Tensor], grad: bool) -> list[torch.Tensor]:
        (v,) = values
        if not grad:
            return _all_gather(v, group)
        return list(gather_stack(v, group).unbind(0))
    return gather


def _local_gather(values: list[torch.Tensor], grad: bool) -> list[torch.Tensor]:
    return values


def vocab_parallel_log_softmax(logits_shard: torch.Tensor, group=None, temperature: float = 1.0) -> torch.Tensor:
    """This rank's vocab shard of ``log_softmax(logits.float() / T)`` (float32, differentiable); the normaliser
    combines the shards' max (exact) and ``sum exp`` (float32, rank order). Equals :func:`emulated_log_softmax`
    bit for bit; it is *not* the bits of ``kernels.log_softmax`` over the whole row (another summation order).

    Autograd note: the result depends on every rank's logits, so it must not be fed to :func:`gather_stack` (whose
    backward keeps only this rank's slice); :func:`vocab_parallel_token_logprob` gathers the raw logit instead."""
    x = _tempered(logits_shard, temperature).contiguous()
    return x - _lse_from_shards([x], _rank_gather(group))


def _select_owner(values: list[torch.Tensor], owner: torch.Tensor) -> torch.Tensor:
    stacked = torch.stack(values, dim=-1)
    return stacked.gather(-1, owner.long().unsqueeze(-1)).squeeze(-1)


def vocab_parallel_token_logprob(logits_shard: torch.Tensor, token_ids: torch.Tensor, group=None,
                                 temperature: float = 1.0) -> torch.Tensor:
    """Float32 logprob of ``token_ids`` (global vocab ids) from vocab-sharded logits: ``x[token] - logsumexp(x)``
    with ``x = logits / T``, the token's logit gathered from its owner rank (a copy), the logsumexp as in
    :func:`vocab_parallel_log_softmax`. Every rank returns the same bits. Differentiable: each rank gets the
    gradient of its own shard (the gathered tensors depend only on their rank's shard)."""
    rank, world = _world(group)
    x = _tempered(logits_shard, temperature).contiguous()
    lse = _lse_from_shards([x], _rank_gather(group)).squeeze(-1)
    vocab_shard = x.shape[-1]
    owner = torch.div(token_ids, vocab_shard, rounding_mode="floor")
    local = torch.where(owner == rank, token_ids - rank * vocab_shard, torch.zeros_like(token_ids)).long()
    picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    if world > 1:
        picked = _select_owner(list(gather_stack(picked, group).unbind(0)), owner)
    return picked - lse


# ---------------------------------------------------------------------------------------------------- emulation

def _kernel_linear():
    from rlrepro import kernels  # this package; imported late because kernels/__init__ does not import tp

    return kernels.linear


_ROW_WHAT = "the input dimension (K) of a row-parallel linear"
_COLUMN_WHAT = "the output dimension (N) of a column-parallel linear"


def linear_row_split(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """What a row-parallel linear over ``parts`` ranks returns: partials over contiguous K-slices, each from the
    deterministic kernel (in the output dtype), added in rank order with :func:`sum_in_rank_order`. On CUDA without
    autograd, one launch of the fused piecewise-K kernel (``triton_pieces.matmul_k_pieces``, the same bits)."""
    if parts > 1 and _fused_usable(x, weight) and not _grad_needed(x, weight):
        _check_split(weight.shape[1], parts, row=True)
        from . import tp_fused

        return tp_fused.row_fused(x, weight, parts)
    return _linear_row_split_per_piece(x, weight, parts)


def linear_column_split(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """What a column-parallel linear over ``parts`` ranks returns after the gather: each rank's output slice from
    the kernel on its contiguous N-shard of the weight, concatenated in rank order. On CUDA without autograd, the
    one whole product (the Triton kernel's element is the same K chain whatever the N tiling: the same bits)."""
    if parts > 1 and _fused_usable(x, weight) and not _grad_needed(x, weight):
        _check_split(weight.shape[0], parts, row=False)
        return _kernel_linear()(x, weight)
    return _linear_column_split_per_piece(x, weight, parts)


def _linear_row_split_per_piece(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """:func:`linear_row_split` piece by piece (CPU, fast mode, autograd; the reference of the fused path)."""
    if parts == 1:
        return _kernel_linear()(x, weight)
    k = weight.shape[1]
    linear = _kernel_linear()
    partials = []
    for r in range(parts):
        a, b = shard_range(k, parts, r, _ROW_WHAT)
        partials.append(linear(x[..., a:b].contiguous(), weight[:, a:b].contiguous()))
    return sum_in_rank_order(partials)


def _linear_column_split_per_piece(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """:func:`linear_column_split` piece by piece (CPU, fast mode, autograd; the reference of the fused path)."""
    if parts == 1:
        return _kernel_linear()(x, weight)
    n = weight.shape[0]
    linear = _kernel_linear()
    outs = []
    for r in range(parts):
        a, b = shard_range(n, parts, r, _COLUMN_WHAT)
        outs.append(linear(x, weight[a:b].contiguous()))
    return torch.cat(outs, dim=-1)


def _split_last(x: torch.Tensor, parts: int) -> list[torch.Tensor]:
    v = x.shape[-1]
    return [x[..., slice(*shard_range(v, parts, r, "the vocabulary"))].contiguous() for r in range(parts)]


def emulated_log_softmax(logits: torch.Tensor, parts: int, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocab float32 log-softmax computed as ``parts`` vocab-parallel ranks compute it (see
    :func:`vocab_parallel_log_softmax`), their shards concatenated."""
    shards = _split_last(_tempered(logits, temperature), parts)
    lse = _lse_from_shards(shards, _local_gather)
    return torch.cat([s - lse for s in shards], dim=-1)


def emulated_token_logprob(logits: torch.Tensor, token_ids: torch.Tensor, parts: int,
                           temperature: float = 1.0) -> torch.Tensor:
    """:func:`vocab_parallel_token_logprob` over ``parts`` ranks, computed in one process (same bits)."""
    shards = _split_last(_tempered(logits, temperature), parts)
    lse = _lse_from_shards(shards, _local_gather).squeeze(-1)
    vocab_shard = shards[0].shape[-1]
    owner = torch.div(token_ids, vocab_shard, rounding_mode="floor")
    local = (token_ids - owner * vocab_shard).long().unsqueeze(-1)
    return _select_owner([s.gather(-1, local).squeeze(-1) for s in shards], owner) - lse


# ------------------------------------------------------------------- layout-invariant pieces (train.tp_partials)
#
# With ``train.layout_invariant`` every row-parallel product is ``P`` K-partials and every column-parallel one ``P``
# N-shards (``P = train.tp_partials``), whatever the TP size ``t`` (which divides ``P``): a rank computes its
# ``P / t`` pieces, the pieces of all ranks are combined in piece order. The forward values are exactly
# :func:`linear_row_split` / :func:`linear_column_split` at ``parts = P`` (what the engine emulates); the backward
# is fixed too: each piece's gradients come from the deterministic kernel's own backward on that piece, a
# column-parallel input gradient is the ``P`` pieces' partials added in piece order (:func:`sum_in_rank_order`,
# across the TP ranks after a gather), a row-parallel one the pieces' slices concatenated; so every gradient has
# the same bits at any TP (tests/test_layout_invariance_tp.py). On CUDA the fast path below has the same forward
# bits and another backward (one Triton product per gradient), again the same bits at any TP
# (tests/test_tp_pieces_fast.py). ``group=None`` here means one process (TP=1).

def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather_pieces(pieces: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Every TP rank's pieces in piece order (rank-major: rank r holds pieces ``r*len(pieces) ...``)."""
    if _group_size(group) == 1:
        return pieces
    return [p for part in _all_gather(torch.stack(pieces), group) for p in part.unbind(0)]


def _piece_grads(pieces, grads, need_x: bool):
    """``(gx, gw)`` of each piece ``(xs, ws, y)`` for output grad ``g``: the kernel's own backward (autograd)."""
    gxs, gws = [], []
    for (xs, ws, y), g in zip(pieces, grads):
        inputs = (ws, xs) if need_x else (ws,)
        out = torch.autograd.grad(y, inputs, g.contiguous())
        gws.append(out[0])
        if need_x:
            gxs.append(out[1])
    return gxs, gws


def _run_pieces(x: torch.Tensor, weight: torch.Tensor, parts: int, row: bool, grad: bool = True) -> list:
    """``(xs, ws, y)`` of each piece, its graph kept for the backward: ``weight``'s N-rows (column) or K-columns
    with the matching slice of ``x`` (row), each a contiguous copy, through the deterministic kernel. ``grad=False``:
    the same kernel calls without graphs (nothing will differentiate them)."""
    linear = _kernel_linear()
    size = weight.shape[1] if row else weight.shape[0]
    what = _ROW_WHAT if row else _COLUMN_WHAT
    pieces = []
    with torch.enable_grad() if grad else contextlib.nullcontext():
        need_x = grad and x.requires_grad
        whole = x.detach().requires_grad_(need_x)
        for r in range(parts):
            a, b = shard_range(size, parts, r, what)
            xs = x.detach()[..., a:b].contiguous().requires_grad_(need_x) if row else whole
            ws = (weight.detach()[:, a:b] if row else weight.detach()[a:b]).contiguous().requires_grad_(grad)
            pieces.append((xs, ws, linear(xs, ws)))
    return pieces


class _ColumnPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, parts, group):
        pieces = _run_pieces(x, weight, parts, row=False)
        ctx.pieces, ctx.group, ctx.need_x = pieces, group, x.requires_grad
        return torch.cat([y.detach() for _, _, y in pieces], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        sizes = [y.shape[-1] for _, _, y in ctx.pieces]
        gxs, gws = _piece_grads(ctx.pieces, grad.split(sizes, dim=-1), ctx.need_x)
        ctx.pieces = None
        gx = sum_in_rank_order(_gather_pieces(gxs, ctx.group)) if ctx.need_x else None
        return gx, torch.cat(gws, dim=0), None, None


class _RowPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, parts, group):
        pieces = _run_pieces(x, weight, parts, row=True)
        ctx.pieces, ctx.need_x = pieces, x.requires_grad
        partials = [y.detach() for _, _, y in pieces]
        ctx.dtype = partials[0].dtype
        return sum_in_rank_order(_gather_pieces(partials, group))

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(ctx.dtype)  # d(sum of the pieces)/d(piece) = 1: each piece gets the output grad
        gxs, gws = _piece_grads(ctx.pieces, [g] * len(ctx.pieces), ctx.need_x)
        ctx.pieces = None
        gx = torch.cat(gxs, dim=-1) if ctx.need_x else None
        return gx, torch.cat(gws, dim=1), None, None


def _direct_norm_grads(x: torch.Tensor):
    """The kernels' rms_norm backward as a function without autograd (``triton_ops.rms_norm_grads``), or None."""
    from rlrepro import kernels

    return getattr(kernels._impl(x), "rms_norm_grads", None)


class _HeadGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, parts, group):
        from rlrepro import kernels

        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.parts, ctx.group = eps, parts, group
        return kernels.rms_norm(x, weight, eps)  # row by row: the same bits split or not

    @staticmethod
    def backward(ctx, grad):
        from rlrepro import kernels

        x, weight = ctx.saved_tensors
        heads = x.shape[-2]
        gxs, gws = [], []
        # the Triton kernels' own backward called directly (the bits of the autograd below, without a graph or a
        # second forward a head group); other kernels: autograd through their rms_norm
        grads = _direct_norm_grads(x)
        for r in range(ctx.parts):
            a, b = shard_range(heads, ctx.parts, r, "the heads of a per-head norm")
            if grads is not None:
                gx, gw = grads(x.detach()[..., a:b, :].contiguous(), weight.detach(), grad[..., a:b, :].contiguous(),
                               ctx.eps)
                gxs.append(gx)
                gws.append(gw)
                continue
            with torch.enable_grad():
                xs = x.detach()[..., a:b, :].contiguous().requires_grad_(True)
                ws = weight.detach().requires_grad_(True)
                y = kernels.rms_norm(xs, ws, ctx.eps)
            gx, gw = torch.autograd.grad(y, (xs, ws), grad[..., a:b, :].contiguous())
            gxs.append(gx)
            gws.append(gw)
        return (torch.cat(gxs, dim=-2), sum_in_rank_order(_gather_pieces(gws, ctx.group)), None, None, None)


def column_pieces_linear(x: torch.Tensor, weight: torch.Tensor, parts: int, group=None) -> torch.Tensor:
    """A column-parallel product as ``parts`` N-pieces of ``weight`` (this rank's shard), concatenated: forward
    :func:`linear_column_split`'s bits; the input gradient is every TP rank's pieces' partials added in piece order
    (replaces :func:`copy_to_tp`: ``x`` is the replicated input). On CUDA (deterministic mode) the fast path below
    computes the same forward bits and its own backward (the same at any TP); without autograd no per-piece graph
    is built."""
    grad = _grad_needed(x, weight)
    if _fused_usable(x, weight):
        _check_split(weight.shape[0], parts, row=False)
        from . import tp_fused

        linear = _kernel_linear()
        return tp_fused.ColumnPiecesFused.apply(x, weight, parts, group, linear) if grad else linear(x, weight)
    if not grad:
        return torch.cat([y for _, _, y in _run_pieces(x, weight, parts, row=False, grad=False)], dim=-1)
    return _ColumnPieces.apply(x, weight, parts, group)


def row_pieces_linear(x: torch.Tensor, weight: torch.Tensor, parts: int, group=None) -> torch.Tensor:
    """A row-parallel product as ``parts`` K-pieces of this rank's slice, the pieces of every TP rank added in piece
    order (float32 accumulator, :func:`sum_in_rank_order`): forward :func:`linear_row_split`'s bits at ``parts x
    TP`` pieces; replicated output. On CUDA (deterministic mode) the fast path below computes the same forward bits
    and its own backward (the same at any TP); without autograd no per-piece graph is built."""
    grad = _grad_needed(x, weight)
    if _fused_usable(x, weight):
        _check_split(weight.shape[1], parts, row=True)
        from . import tp_fused

        return (tp_fused.RowPiecesFused.apply(x, weight, parts, group) if grad
                else tp_fused.row_pieces_forward(x, weight, parts, group))
    if not grad:
        partials = [y for _, _, y in _run_pieces(x, weight, parts, row=True, grad=False)]
        return sum_in_rank_order(_gather_pieces(partials, group))
    return _RowPieces.apply(x, weight, parts, group)


def _column_pieces_per_piece(x: torch.Tensor, weight: torch.Tensor, parts: int, group=None) -> torch.Tensor:
    """:func:`column_pieces_linear` through the per-piece graphs on any device (the fast path's reference)."""
    return _ColumnPieces.apply(x, weight, parts, group)


def _row_pieces_per_piece(x: torch.Tensor, weight: torch.Tensor, parts: int, group=None) -> torch.Tensor:
    """:func:`row_pieces_linear` through the per-piece graphs on any device (the fast path's reference)."""
    return _RowPieces.apply(x, weight, parts, group)


# ------------------------------------------------------------------------------- the pieces on CUDA (fast path)
#
# With the Triton kernels (CUDA, deterministic mode) the pieces come from fewer, larger operations with the same
# forward bits: rlrepro.kernels.tp_fused (the identity it rests on and its backward are described there). Here only
# the choice of path.

_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pieces_impl() -> str:
    """"fused" (default) or "per-piece": ``RLREPRO_TP_PIECES=per-piece`` runs the pieces one by one on CUDA too (the
    same forward bits, other backward bits (cuBLAS per piece), slower; for benchmarks and bisecting)."""
    forced = os.environ.get("RLREPRO_TP_PIECES", "").strip().lower()
    if forced and forced not in ("fused", "per-piece"):
        raise ValueError(f"RLREPRO_TP_PIECES must be 'fused' or 'per-piece', not {forced!r}")
    return forced or "fused"


def _fused_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``kernels.linear`` runs the Triton matmul on these tensors (CUDA, the deterministic mode, a dtype the
    kernel takes): then the fast path has the per-piece path's forward bits (and its own backward, the Triton
    products). Anywhere else the pieces run one by one."""
    if not (x.is_cuda and weight.is_cuda) or x.dtype != weight.dtype or x.dtype not in _FUSED_DTYPES:
        return False
    from ._mode import current_mode

    return current_mode() == "deterministic" and _pieces_impl() == "fused"


def column_split_is_one_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear_column_split` of ``x`` is ``kernels.linear(x, weight)`` itself at any ``parts`` (the
    fast path's identity: CUDA, the deterministic mode), so several column-split linears may share one product."""
    return _fused_usable(x, weight)


def _grad_needed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def _check_split(size: int, parts: int, row: bool) -> None:
    shard_range(size, parts, 0, _ROW_WHAT if row else _COLUMN_WHAT)  # the per-piece path's error, if any


def head_group_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, parts: int, group=None) -> torch.Tensor:
    """``kernels.rms_norm`` over per-head rows ``x [N, heads, D]`` (q_norm / k_norm), whose weight gradient is the
    sum of ``parts`` head-group partials (each the kernel's own backward on its heads) over every TP rank in head
    order, replicated: the same bits at any TP."""
    return _HeadGroupNorm.apply(x, weight, eps, parts, group)
