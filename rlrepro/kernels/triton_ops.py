"""Deterministic (batch-invariant) kernels for CUDA tensors, in Triton: the ops ``kernels.__init__`` dispatches to.

Signatures are those of :mod:`rlrepro.kernels.cpu`. Forward passes are Triton kernels whose per-row results do
not depend on the rows sharing the call (see ``triton_matmul``, ``triton_rowwise``, ``triton_attention``).
Backward passes are deterministic: Triton kernels for RMSNorm, SwiGLU and rotary (``triton_rowwise``;
``RLREPRO_ROWWISE_BWD=torch`` selects the float32 torch compositions instead), fixed-shape cuBLAS products, torch
reductions, a sorted segment sum for the embedding and, for attention, two Triton kernels without atomics
(``triton_attention.attention_bwd_packed_triton``; ``RLREPRO_ATTENTION_BWD=torch`` selects the float32 torch
recomputation instead): reproducible run to run, though not batch-invariant, which training does not need.
The paged-cache path of ``attention`` is inference only and has no backward.
"""
from __future__ import annotations

import os

import torch

from . import fa3_attention as _fa3
from . import flash2_bwd as _flash2
from . import triton_attention as _attn
from . import triton_matmul as _mm
from . import triton_rowwise as _rw
from .metadata import AttentionMetadata

__all__ = ["linear", "rms_norm", "add_rms_norm", "log_softmax", "silu_and_mul", "apply_rope", "embedding",
           "attention"]


# ----------------------------------------------------------------------------------------------- linear
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        k = x.shape[-1]
        out = _mm.matmul(x.reshape(-1, k), weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, weight.shape[0])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(g2, weight).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = torch.mm(g2.t(), x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.float().sum(0).to(g2.dtype)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _Linear.apply(x, weight, bias)


def _rowwise_bwd_impl() -> str:
    """"triton" (default) or "torch" (the float32 torch compositions): RLREPRO_ROWWISE_BWD=torch|triton selects the
    backward of RMSNorm, SwiGLU and rotary."""
    forced = os.environ.get("RLREPRO_ROWWISE_BWD", "").strip().lower()
    if forced and forced not in ("torch", "triton"):
        raise ValueError(f"RLREPRO_ROWWISE_BWD must be 'torch' or 'triton', not {forced!r}")
    return forced or "triton"


# ----------------------------------------------------------------------------------------------- RMSNorm
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rw.rms_norm_fwd(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = rms_norm_grads(x, weight, grad, ctx.eps, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return gx, gw, None


def rms_norm_grads(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, need_gx: bool = True,
                   need_gw: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of :func:`rms_norm` for the output gradient ``grad``: what its autograd backward returns,
    without building a graph or running the forward again (``rlrepro.kernels.tp``'s per-head-group norm)."""
    if _rowwise_bwd_impl() == "triton" and _rw.rms_norm_bwd_supported(x.shape[-1]):
        return _rw.rms_norm_bwd(x, weight, grad, eps, need_gx, need_gw)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    gf = grad.float()
    gx = gw = None
    if need_gw:
        normed = y.to(x.dtype).float()
        gw = (gf * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    if need_gx:
        gy = gf * weight.float()
        gx = (rstd * (gy - y * (gy * y).mean(-1, keepdim=True))).to(x.dtype)
    return gx, gw


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    grad = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad)
    if not grad and _rw.add_rms_norm_supported(x, residual):
        return _rw.add_rms_norm_fwd(x, residual, weight, eps)
    s = x + residual
    return s, rms_norm(s, weight, eps)


# ----------------------------------------------------------------------------------------------- log-softmax
class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = _rw.log_softmax_fwd(x)
        ctx.save_for_backward(out)
        ctx.in_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        g = grad.float()
        return (g - torch.exp(out) * g.sum(-1, keepdim=True)).to(ctx.in_dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _LogSoftmax.apply(x)


def picked_log_softmax(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x)`` at one id a row, without autograd and without the ``[rows, V]`` result: the same bits
    (``triton_rowwise.picked_log_softmax``)."""
    return _rw.picked_log_softmax(x, ids)


# ----------------------------------------------------------------------------------------------- SwiGLU
class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _rw.silu_and_mul_fwd(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if _rowwise_bwd_impl() == "triton":
            return _rw.silu_and_mul_bwd(x, grad)
        d = x.shape[-1] // 2
        gate, up = x[..., :d].float(), x[..., d:].float()
        gf = grad.float()
        sig = torch.sigmoid(gate)
        d_up = gf * gate * sig
        d_gate = gf * up * sig * (1.0 + gate * (1.0 - sig))
        return torch.cat((d_gate, d_up), dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _SiluAndMul.apply(x)


# ----------------------------------------------------------------------------------------------- rotary
class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rw.apply_rope_fwd(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if _rowwise_bwd_impl() == "triton":
            return _rw.apply_rope_bwd(grad.to(ctx.x_dtype), cos, sin), None, None
        d = grad.shape[-1] // 2
        c = cos.to(ctx.x_dtype).float().unsqueeze(1)
        s = sin.to(ctx.x_dtype).float().unsqueeze(1)
        g1, g2 = grad[..., :d].float(), grad[..., d:].float()
        gx = torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), dim=-1).to(ctx.x_dtype)
        return gx, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _Rope.apply(x, cos, sin)


# ----------------------------------------------------------------------------------------------- embedding
class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        ctx.w_dtype = weight.dtype
        return _rw.embedding_fwd(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, _rw.embedding_bwd(ids, grad, ctx.num_embeddings, ctx.w_dtype)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _Embedding.apply(ids, weight)


# ----------------------------------------------------------------------------------------------- attention
def _attention_bwd_impl(q: torch.Tensor) -> str:
    """"triton" (CUDA default) or "torch" (CPU default); RLREPRO_ATTENTION_BWD=torch|triton forces one, and
    ``flash2`` (the experiment of ``kernels/flash2_bwd.py``) runs torch's FA2 backward on CUDA. The rule is
    ``RLREPRO_ATTENTION=fa3``'s: CPU calls keep the reference path, and a CUDA call the kernel cannot serve is an
    error naming why (a silent fallback would give other bits than asked for)."""
    forced = os.environ.get("RLREPRO_ATTENTION_BWD", "").strip().lower()
    if forced == "flash2":
        if not q.is_cuda:
            return "torch"
        if not _flash2.supported(q):
            raise RuntimeError(f"RLREPRO_ATTENTION_BWD=flash2: torch's FA2 backward does not serve {q.dtype} with "
                               f"head size {q.shape[-1]} (bf16/fp16, head size a multiple of 8 up to 256); unset it "
                               "to use the Triton backward")
        return "flash2"
    if forced in ("torch", "triton"):
        return forced
    if forced:
        raise ValueError(f"RLREPRO_ATTENTION_BWD must be 'torch', 'triton' or 'flash2', not {forced!r}")
    return "triton" if q.is_cuda else "torch"


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta, scale):
        want_lse = any(ctx.needs_input_grad[:3]) and _attention_bwd_impl(q) in ("triton", "flash2")
        fwd = _fa3.packed if _fa3.usable(q) else _attn.attention_fwd  # RLREPRO_ATTENTION=fa3: FA3's bits
        if want_lse:
            # out and the log-sum-exp: the Triton backward's delta = rowsum(dO * O) and softmax statistics
            out, lse = fwd(q, k, v, meta, scale, return_lse=True)
        else:
            out, lse = fwd(q, k, v, meta, scale), None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = meta
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        impl = _attention_bwd_impl(q)
        if impl == "flash2":
            dq, dk, dv = _flash2.attention_bwd(q, k, v, grad, ctx.meta, ctx.scale, out, lse)
        elif impl == "triton":
            dq, dk, dv = _attn.attention_bwd_packed_triton(q, k, v, grad, ctx.meta, ctx.scale, out=out, lse=lse)
        else:
            dq, dk, dv = _attn.attention_bwd_packed(q, k, v, grad, ctx.meta, ctx.scale)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
              kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention, same semantics as ``cpu.attention`` (read its docstring); KV tile 64 on CUDA."""
    if kv_cache is None:
        if meta.block_table is not None:
            raise ValueError("attention: metadata has a block table but no kv_cache was given")
        return _PackedAttention.apply(q, k, v, meta, scale)
    if meta.block_table is None or meta.slot_mapping is None:
        raise ValueError("attention: a kv_cache needs paged metadata (AttentionMetadata.paged)")
    k_cache, v_cache = kv_cache
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"attention: KV cache is {k_cache.dtype}/{v_cache.dtype} but q is {q.dtype}")
    _attn.write_kv_cache(k, v, kv_cache, meta)
    return attention_cached(q, meta, scale, kv_cache)


def attention_cached(q: torch.Tensor, meta: AttentionMetadata, scale: float,
                     kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The paged path of ``attention`` after the new tokens' k/v are in the cache (inference only)."""
    k_cache, v_cache = kv_cache
    nb, bs, hkv, d = k_cache.shape
    with torch.no_grad():  # inference path: the cache is state, not part of a graph
        if _fa3.usable(q):
            return _fa3.paged(q.detach(), meta, scale, kv_cache)
        return _attn.attention_fwd(q.detach(), k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d),
                                   meta, scale)


qk_norm_rope_cache = _attn.qk_norm_rope_cache
qk_norm_rope_cache_supported = _attn.qk_norm_rope_cache_supported
