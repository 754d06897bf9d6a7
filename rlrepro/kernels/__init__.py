"""rlrepro.kernels: the ops the model is built from, each in two modes.

``deterministic`` (default): batch-invariant. A row's result is bitwise independent of how many rows share the
call, of its position among them, and (attention) of how its sequence's KV was chunked or cached.
``fast``: stock torch kernels, for comparison.

On CPU tensors the deterministic ops are torch compositions (:mod:`rlrepro.kernels.cpu`); on CUDA tensors they
are Triton kernels (:mod:`rlrepro.kernels.triton_ops`). Select the mode with ``with kernels.mode("fast"):``.
"""
from __future__ import annotations

import types

import torch

from . import cpu as _cpu
from . import fast as _fast
from ._mode import MODES, current_mode, mode
from .metadata import AttentionMetadata

__all__ = [
    "MODES", "mode", "current_mode", "AttentionMetadata", "linear", "rms_norm", "add_rms_norm", "log_softmax",
    "token_logprob", "silu_and_mul", "apply_rope", "embedding", "attention", "scaled_token_logprob",
    "qk_norm_rope_attention", "scale_logits",
]

_triton_impl: types.ModuleType | None = None


def _triton() -> types.ModuleType:
    global _triton_impl
    if _triton_impl is None:
        try:
            from . import triton_ops
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError(
                "deterministic kernels on CUDA need Triton (pip install triton); "
                "or run with kernels.mode('fast') to use stock kernels") from e
        _triton_impl = triton_ops
    return _triton_impl


def _impl(x: torch.Tensor) -> types.ModuleType:
    if current_mode() == "fast":
        return _fast
    if x.is_cuda:
        return _triton()
    return _cpu


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Like ``F.linear``: x [..., K], weight [N, K] -> [..., N]."""
    return _impl(x).linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, statistics in float32 (as transformers' Qwen3)."""
    return _impl(x).rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s, weight, eps))`` with ``s = x + residual``: bit for bit the add then the norm. The Triton
    implementation does both in one pass when no gradient is needed (inference); with autograd it runs the two."""
    return _impl(x).add_rms_norm(x, residual, weight, eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim; float32 result whatever the input dtype."""
    return _impl(x).log_softmax(x)


def token_logprob(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The chosen-token logprob, the one definition shared by engine and trainer.

    ``log_softmax(logits.float() / t)[i, token_ids[i]]`` with ``t = temperature`` if it is > 0, else 1
    (greedy decoding reports the untempered distribution). Float32, shape ``token_ids.shape``.
    """
    return scaled_token_logprob(scale_logits(logits, temperature), token_ids)


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits.float() / t`` (``t = temperature`` if > 0, else 1), the tempered logits of ``token_logprob``. At
    ``t = 1`` the division is skipped: ``x / 1.0 == x`` exactly in IEEE float32, so the bits are the same and a
    full pass over [rows, vocab] is saved. A NaN temperature is refused (it is not > 0, so it would silently
    report the untempered distribution)."""
    if temperature != temperature:
        raise ValueError(f"temperature={temperature!r} is not a number; pass a float >= 0 (0 = greedy)")
    t = float(temperature) if temperature > 0 else 1.0
    x = logits.float()
    return x if t == 1.0 else x / t


def scaled_token_logprob(scaled: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``token_logprob``'s second half, for a caller that already holds ``logits.float() / t`` (the sampler):
    ``log_softmax(scaled)`` at ``token_ids``. ``scaled`` may also be bfloat16/float16 logits at ``t = 1``: every
    ``log_softmax`` widens exactly to float32 first. Deterministic on CUDA without autograd, only the picked values
    are formed (the log-softmax's own partials and combining code: the same bits, no ``[rows, V]`` write)."""
    impl = _impl(scaled)
    picked = getattr(impl, "picked_log_softmax", None)
    if picked is not None and not (torch.is_grad_enabled() and scaled.requires_grad):
        return picked(scaled, token_ids)
    lp = log_softmax(scaled)
    return lp.gather(-1, token_ids.unsqueeze(-1).long()).squeeze(-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(x[..., :d]) * x[..., d:]`` for x [..., 2d]."""
    return _impl(x).silu_and_mul(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding on x [N, H, D] with per-token cos/sin [N, D/2] (float32)."""
    return _impl(x).apply_rope(x, cos, sin)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _impl(weight).embedding(ids, weight)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
              kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention over packed sequences (no cache) or against a paged KV cache; see ``cpu.attention``."""
    return _impl(q).attention(q, k, v, meta, scale, kv_cache)


def qk_norm_rope_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                           k_norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                           meta: AttentionMetadata, scale: float,
                           kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Qwen3's attention from its fused q|k|v product ``qkv`` [N, (H + 2 Hkv) D]: per-head RMSNorm of q and k,
    rotary on both, then ``attention`` (which writes k and v into ``kv_cache`` when given). Returns [N, H, D].

    It is those ops one after the other. On CUDA, without autograd and with a cache (the engine), the norms, the
    rotary and the cache write run as one Triton pass instead of five launches, with the same bits
    (``triton_attention.qk_norm_rope_cache``; GPU test): in deterministic mode, and in fast mode when flashinfer
    serves its attention (:mod:`.fast`)."""
    n = qkv.shape[0]
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 2 or qkv.shape[1] % heads or num_heads % num_kv_heads:
        raise ValueError(f"qk_norm_rope_attention: qkv of shape {tuple(qkv.shape)} is not [N, ({num_heads} + 2 x "
                         f"{num_kv_heads}) x head_dim] with {num_kv_heads} dividing {num_heads}")
    d = qkv.shape[1] // heads
    if (kv_cache is not None and qkv.is_cuda and not torch.is_grad_enabled() and meta.block_table is not None
            and meta.slot_mapping is not None):
        fast = current_mode() == "fast"
        if not fast or _fast._fi.serves(qkv.device, qkv.dtype, d):
            t = _triton()
            if t.qk_norm_rope_cache_supported(qkv, q_norm_weight, k_norm_weight, kv_cache):
                q = t.qk_norm_rope_cache(qkv, num_heads, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache,
                                         meta)
                if fast:  # the serving-stack fast mode: the same fused pass, then flashinfer (kernels.fast)
                    return _fast._fi.paged(q, meta, scale, kv_cache)
                return t.attention_cached(q, meta, scale, kv_cache)
    nq, nkv = num_heads * d, num_kv_heads * d
    q = rms_norm(qkv[:, :nq].view(n, num_heads, d), q_norm_weight, eps)
    k = rms_norm(qkv[:, nq:nq + nkv].view(n, num_kv_heads, d), k_norm_weight, eps)
    v = qkv[:, nq + nkv:].view(n, num_kv_heads, d)
    return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, meta, scale, kv_cache)
