"""The ``fast`` mode: what a serving stack runs when determinism is off. Not batch-invariant.

On CUDA with flashinfer (the ``.[flashinfer]`` extra, :mod:`.flashinfer_attention`), SGLang's choice of kernels:
cuBLAS GEMMs, flashinfer attention (FA3 prefill on Hopper, paged decode, CUDA-graph decode plans), and fused
row-wise kernels (RMSNorm with the residual add, SwiGLU, rotary, log-softmax; the per-head q/k norm + rotary +
cache write in one pass). The row-wise kernels are rlrepro's Triton ones: a row-wise kernel reduces each row by
itself, so batch invariance costs it nothing, and "deterministic vs fast" then measures what determinism costs
(the GEMMs and attention), not unfused norms. The trainer's attention with autograd runs SDPA (flash attention's
backward): flashinfer has no backward.

Without flashinfer (the log says so once) the fast mode is stock torch throughout (cuBLAS/MKL GEMMs, torch
RMSNorm/softmax/SwiGLU, SDPA); with a KV cache on CUDA it runs the paged Triton attention (torch has none).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import flashinfer_attention as _fi
from .cpu import apply_rope as _cpu_rope
from .cpu import embedding, write_kv_cache  # gather ops: one implementation serves both modes
from .flashinfer_attention import flashinfer_module
from .metadata import AttentionMetadata

__all__ = ["linear", "rms_norm", "add_rms_norm", "log_softmax", "silu_and_mul", "apply_rope", "embedding",
           "attention", "flashinfer_module"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _fused(x: torch.Tensor):
    """The Triton row-wise kernels for a CUDA tensor when flashinfer is present (the serving-stack fast mode)."""
    if x.is_cuda and flashinfer_module() is not None:
        from . import triton_ops
        return triton_ops
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (t := _fused(x)) is not None:
        return t.rms_norm(x, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if (t := _fused(x)) is not None:
        return t.add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return s, rms_norm(s, weight, eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    if (t := _fused(x)) is not None:
        return t.log_softmax(x)
    return torch.log_softmax(x.float(), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if (t := _fused(x)) is not None:
        return t.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if (t := _fused(x)) is not None:
        return t.apply_rope(x, cos, sin)
    return _cpu_rope(x, cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
              kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """On CUDA flashinfer where it serves the call (module docstring); else paged on CUDA the Triton paged kernel;
    otherwise per sequence ``F.scaled_dot_product_attention`` over its KV (gathered from the cache when paged)."""
    if q.is_cuda and _fi.supports(q):
        if kv_cache is not None:
            from . import triton_attention
            triton_attention.write_kv_cache(k, v, kv_cache, meta)
            return _fi.paged(q, meta, scale, kv_cache)
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return _fi.ragged_prefill(q, k, v, meta, scale)
    if kv_cache is not None and q.is_cuda:
        from . import triton_ops
        return triton_ops.attention(q, k, v, meta, scale, kv_cache)
    if kv_cache is not None:
        write_kv_cache(k, v, kv_cache, meta)
    h, hkv = q.shape[1], (kv_cache[0].shape[2] if kv_cache is not None else k.shape[1])
    if kv_cache is not None and q.shape[0] == meta.block_table.shape[0]:
        # Decode (one query per sequence): one batched SDPA over each sequence's gathered blocks, with no host
        # reads, so CUDA graphs can capture it like the deterministic path.
        ks = kv_cache[0][meta.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [S, Hkv, W*bs, D]
        vs = kv_cache[1][meta.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)
        mask = torch.arange(ks.shape[2], device=q.device).unsqueeze(0) < meta.seq_lens.unsqueeze(1)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask[:, None, None, :], scale=scale,
                                           enable_gqa=h != hkv)
        return o.squeeze(2)
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    outs = []
    for s in range(len(lens)):
        qs = q[cu[s]:cu[s + 1]]
        n_q, n_kv = qs.shape[0], lens[s]
        if kv_cache is not None:
            nblk = (n_kv + meta.block_size - 1) // meta.block_size
            blocks = meta.block_table[s, :nblk]
            ks = kv_cache[0][blocks].flatten(0, 1)[:n_kv]
            vs = kv_cache[1][blocks].flatten(0, 1)[:n_kv]
        else:
            ks, vs = k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]]
        if n_q == n_kv:  # the whole sequence (the trainer): no mask tensor, so SDPA can take flash attention
            mask, causal = None, True
        else:
            qpos = torch.arange(n_kv - n_q, n_kv, device=q.device).unsqueeze(1)
            mask, causal = torch.arange(n_kv, device=q.device).unsqueeze(0) <= qpos, False
        o = F.scaled_dot_product_attention(  # 4-D [1, H, L, D]: the layout SDPA's flash kernel takes
            qs.transpose(0, 1)[None], ks.to(qs.dtype).transpose(0, 1)[None], vs.to(qs.dtype).transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=h != hkv)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)
