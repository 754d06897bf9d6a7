"""The ``fast`` mode: what a serving stack runs when determinism is off. Stock torch kernels (cuBLAS/MKL GEMMs,
torch RMSNorm/softmax/SwiGLU) and, on CUDA, flashinfer's attention (FA3 prefill on Hopper, paged decode; the
``.[flashinfer]`` extra, :mod:`.flashinfer_attention`) as SGLang uses it. Not batch-invariant.

Where flashinfer is absent (the log says so once), or for a call it does not serve: with a KV cache on CUDA the
paged Triton kernel (the deterministic one: torch has no paged attention), otherwise torch SDPA. The trainer's
forward with autograd always runs SDPA (flash attention's backward): flashinfer has no backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import flashinfer_attention as _fi
from .cpu import apply_rope, embedding, write_kv_cache  # elementwise / gather ops: one implementation serves both
from .flashinfer_attention import flashinfer_module
from .metadata import AttentionMetadata

__all__ = ["linear", "rms_norm", "add_rms_norm", "log_softmax", "silu_and_mul", "apply_rope", "embedding",
           "attention", "flashinfer_module"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return s, rms_norm(s, weight, eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


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
        qpos = torch.arange(n_kv - n_q, n_kv, device=q.device).unsqueeze(1)
        mask = torch.arange(n_kv, device=q.device).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.to(qs.dtype).transpose(0, 1), vs.to(qs.dtype).transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=h != hkv)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)
