"""Batch-invariant kernels composed from torch ops, for the CPU.

Each op computes a row the same way whatever else is in the call:

* ``linear``: one ``bmm`` of ``[M, 1, K] x [K, N]`` with the weight broadcast, so every row is its own
  ``1 x K x N`` product (in float32: bf16 / fp16 operands are widened, and the result rounded once). Stock
  ``F.linear`` folds the rows into one GEMM whose blocking follows ``M``.
* ``silu_and_mul``: ``x / (1 + exp(-x))`` from separate ops. Stock ``F.silu`` rounds differently in its
  vectorised body and its scalar tail, and where the tail falls depends on the tensor's size.
* reductions (RMSNorm, log-softmax) run over the last, contiguous dimension, which torch reduces per row.
* attention: see :func:`attention`.

Rows longer than 32,768 elements are not covered for the reductions: torch may split such a row across threads.
"""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata

KV_TILE = 32  # KV positions reduced per step of the online softmax; fixed, so the reduction order is too


def _rowwise_matmul(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2d [M, K] @ weight[N, K]^T`` one row at a time: a batched matmul of M ``[1, K] x [K, N]`` products,
    whose per-row result does not depend on M. One operand layout for every M (bmm picks its GEMM by strides).
    bf16 / fp16 operands are widened to float32 (exactly), multiplied there and rounded once: torch's CPU bmm in
    those dtypes rounds a row differently when the batch has 1-2 rows than when it has 3 or more (torch 2.13). In
    float32 a batch of one row differs from two or more for some shapes (K=64 with N=131, K=1024 with N=60): one
    row is computed as a batch of two copies."""
    if x2d.dtype in (torch.bfloat16, torch.float16):
        return _rowwise_matmul(x2d.float(), weight.float()).to(x2d.dtype)
    m, k = x2d.shape
    if m == 1:  # a batch of one takes another GEMM route (float32 rows differ for some K, N): run it as two
        return _rowwise_matmul(x2d.expand(2, k), weight)[:1]
    n = weight.shape[0]
    rows = x2d.reshape(m, 1, k).contiguous()
    return torch.bmm(rows, weight.t().unsqueeze(0).expand(m, k, n)).reshape(m, n)


class _Linear(torch.autograd.Function):
    """Batch-invariant forward; backward with the input gradient row by row as well (batch-invariant) and the
    weight gradient as one ``grad^T @ x`` matmul: deterministic for a given shape, and it never materialises
    the per-row ``[M, K, N]`` gradient of an expanded weight (for a 151,936-token vocabulary that is ~100 GB)."""

    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        return _rowwise_matmul(x2d, weight)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = _rowwise_matmul(grad, weight.t()) if ctx.needs_input_grad[0] else None
        gw = grad.t().mm(x2d) if ctx.needs_input_grad[1] else None
        return gx, gw


def _check_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x of shape {tuple(x.shape)} and weight of shape {tuple(weight.shape)} are not "
                         "[..., K] and [N, K]; pass the weight as [out_features, in_features] (F.linear's layout)")
    if x.dtype != weight.dtype and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear: x is {x.dtype} but the weight is {weight.dtype}; cast one to the other's dtype "
                         "(e.g. model.to(dtype)) before the call")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` row by row (:func:`_rowwise_matmul`). The weight is used in its contiguous [N, K] layout
    whatever its strides (a no-op for a contiguous weight): the GEMM route follows the operand's strides, so a
    weight held as a transposed view would otherwise give other bits than the same values stored contiguously."""
    _check_linear(x, weight)
    weight = weight.contiguous()
    k = x.shape[-1]
    n = weight.shape[0]
    x2d = x.reshape(-1, k)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _Linear.apply(x2d, weight)
    else:
        out = _rowwise_matmul(x2d, weight)
    out = out.reshape(*x.shape[:-1], n)
    if bias is not None:
        out = out + bias
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return s, rms_norm(s, weight, eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x of shape {tuple(x.shape)} is not [..., 2d] (gate | up); its last dim "
                         "must be even: concatenate the gate and up projections")
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return gate / (1.0 + torch.exp(-gate)) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding. x: [N, H, D]; cos, sin: [N, D/2] float32 for each token's position."""
    d = x.shape[-1] // 2
    c = cos.to(x.dtype).unsqueeze(1)
    s = sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``. On the CPU the ids are range-checked first: indexing wraps a negative id round to the end
    of the table (``-1`` reads the last row) where ``F.embedding`` refuses it. (Fast mode on CUDA uses this
    function too; it is not checked there, which would make the host wait for the device.)"""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype in (torch.bool, torch.uint8):
        raise ValueError(f"embedding: token ids must be an integer tensor (not a mask), got {ids.dtype}; pass "
                         "them as int64")
    if not ids.is_cuda and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"embedding: token ids must lie in [0, {weight.shape[0]}); got min {lo}, max {hi}")
    return weight[ids]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata) -> None:
    k_cache, v_cache = kv_cache
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d).index_copy_(0, meta.slot_mapping, k.detach().to(k_cache.dtype))
    v_cache.view(nb * bs, hkv, d).index_copy_(0, meta.slot_mapping, v.detach().to(v_cache.dtype))


def kv_rows(meta: AttentionMetadata, kv_pos: torch.Tensor) -> torch.Tensor:
    """Row of the flat KV tensor holding position ``kv_pos[i, t]`` of query i's sequence (any value if invalid)."""
    last = (meta.seq_lens[meta.seq_idx] - 1).unsqueeze(1)
    pos = torch.minimum(kv_pos.clamp(min=0), last)  # invalid positions read the sequence's last row, then masked
    if meta.block_table is None:
        return meta.cu_seqlens_q[meta.seq_idx].unsqueeze(1) + pos
    blocks = meta.block_table[meta.seq_idx.unsqueeze(1), pos // meta.block_size]
    return blocks * meta.block_size + pos % meta.block_size


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                     kv_cache: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Shape checks (host-side sizes only) whose failures would otherwise surface as a reshape error mid-loop."""
    if q.dim() != 3 or k.dim() != 3 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [N, H, D], "
                         "[N, Hkv, D], [N, Hkv, D]")
    n, h, d = q.shape
    if k.shape[0] != n or k.shape[2] != d or h % k.shape[1]:
        raise ValueError(f"attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} need the same N and D, and Hkv "
                         f"({k.shape[1]}) dividing H ({h})")
    if meta.positions.shape[0] != n:
        raise ValueError(f"attention: {n} query tokens but the metadata describes {meta.positions.shape[0]}; "
                         "build the AttentionMetadata for this batch")
    if kv_cache is not None:
        for name, c in zip(("key", "value"), kv_cache):
            if c.dim() != 4 or tuple(c.shape[2:]) != (k.shape[1], d):
                raise ValueError(f"attention: the {name} cache has shape {tuple(c.shape)}, not [num_blocks, "
                                 f"block_size, {k.shape[1]}, {d}] for k/v of shape {tuple(k.shape)}")
        if meta.slot_mapping is None or meta.block_table is None:
            raise ValueError("attention with a kv_cache needs paged metadata (slot_mapping and block_table): "
                             "build it with AttentionMetadata.paged")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
              kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention, q: [N, H, D], k and v: [N, Hkv, D] for the same N new tokens.

    With ``kv_cache`` ([num_blocks, block_size, Hkv, D] each) the new k/v are first written at
    ``meta.slot_mapping`` and the keys come from the cache; without it the batch holds whole sequences.
    Every query at position p reduces over KV positions 0..p in tiles of ``KV_TILE``, tile 0 first, with an
    online softmax in float32. Tiles past p leave the state untouched, so the output depends only on the
    sequence's tokens up to p, never on the batch, the chunking or where the KV came from.
    """
    _check_attention(q, k, v, meta, kv_cache)
    n, h, d = q.shape
    out_dtype = q.dtype
    if kv_cache is not None:
        write_kv_cache(k, v, kv_cache, meta)
        hkv = kv_cache[0].shape[2]
        k_flat = kv_cache[0].view(-1, hkv, d)
        v_flat = kv_cache[1].view(-1, hkv, d)
    else:
        hkv = k.shape[1]
        k_flat, v_flat = k, v
    group = h // hkv
    qf = q.float().reshape(n * h, 1, d).contiguous()
    m = torch.full((n * h, 1), float("-inf"), device=q.device)
    l_sum = torch.zeros(n * h, 1, device=q.device)
    acc = torch.zeros(n * h, 1, d, device=q.device)
    tile = torch.arange(KV_TILE, device=q.device)
    pos = meta.positions.unsqueeze(1)  # [N, 1]
    for start in range(0, meta.max_seq_len, KV_TILE):
        kv_pos = start + tile.unsqueeze(0)  # [1, T]
        valid = kv_pos <= pos  # [N, T]
        if not bool(valid.any()):
            break
        rows = kv_rows(meta, kv_pos.expand(n, -1))
        vmask = valid.unsqueeze(-1).unsqueeze(-1)
        kt = torch.where(vmask, k_flat[rows].float(), 0.0)  # [N, T, Hkv, D]
        vt = torch.where(vmask, v_flat[rows].float(), 0.0)
        if group > 1:
            kt = kt.repeat_interleave(group, dim=2)
            vt = vt.repeat_interleave(group, dim=2)
        # bmm picks its GEMM by operand strides, and reshape returns a strided view for n == 1: force one layout
        kt = kt.permute(0, 2, 3, 1).reshape(n * h, d, KV_TILE).contiguous()
        vt = vt.permute(0, 2, 1, 3).reshape(n * h, KV_TILE, d).contiguous()
        s = torch.bmm(qf, kt).reshape(n * h, KV_TILE) * scale
        hvalid = valid.repeat_interleave(h, dim=0)  # [N*H, T]
        s = torch.where(hvalid, s, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = torch.where(hvalid, torch.exp(s - m_new), 0.0)
        alpha = torch.exp(m - m_new)
        active = hvalid.any(dim=-1, keepdim=True)  # a row with no valid key in this tile keeps its state exactly
        l_sum = torch.where(active, l_sum * alpha + p.sum(dim=-1, keepdim=True), l_sum)
        acc = torch.where(active.unsqueeze(-1), acc * alpha.unsqueeze(-1) + torch.bmm(p.unsqueeze(1), vt), acc)
        m = torch.where(active, m_new, m)
    return (acc.reshape(n, h, d) / l_sum.reshape(n, h, 1)).to(out_dtype)
