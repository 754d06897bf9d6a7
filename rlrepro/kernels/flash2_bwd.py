"""The attention backward on torch's own FlashAttention-2 kernel (``aten._flash_attention_backward``, varlen) in its
deterministic mode: an experiment of issue #27, off unless ``RLREPRO_ATTENTION_BWD=flash2``. Measured on an H200:
rerun-equal, but 0.48-0.66x of the Triton backward (docs/BENCHMARKS.md), so not a default.

Why it may keep the promises. The backward's promise is narrower than the forward's: the gradients of a micro-batch
must be the same bits every time it is computed, on any rank (engine == trainer concerns the forward only, and the
layout-invariant step fixes each micro-batch's composition, issue #26). FA2's backward is deterministic when
``torch.use_deterministic_algorithms(True)`` is on (torch passes ``deterministic`` to FA2, which then adds dQ's
partial sums in a fixed order instead of with atomics); the trainer's ``enable_determinism`` turns it on, and this
module refuses to run without it. What it gives up against rlrepro's Triton backward: a sequence's gradients are
no longer promised equal alone and in another batch (FA2 splits dQ's sums by the batch's shape).

The forward stays rlrepro's (Triton or ``RLREPRO_ATTENTION=fa3``): FA2 recomputes the probabilities from the
forward's output and log-sum-exp, which rlrepro keeps in base 2 of the scaled scores ([N, H]); FA2 reads the
natural log, laid out [H, N] or [B, H, max_len] by its version, which :func:`lse_layout` learns from one small FA2
forward on first use. FA2 serves bf16 and fp16 only: a CUDA call of another dtype is an error (triton_ops).
"""
from __future__ import annotations

import math

import torch

__all__ = ["supported", "lse_layout", "fa2_lse", "attention_bwd"]

LN2 = math.log(2.0)
_LAYOUT: dict = {}


def supported(q: torch.Tensor) -> bool:
    """FA2 serves this backward: CUDA, bf16/fp16, head size a multiple of 8 up to 256."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def lse_layout(device: torch.device) -> str:
    """``"hn"`` ([H, total]) or ``"bhs"`` ([B, H, max_len]): how this torch's FA2 lays out a varlen log-sum-exp."""
    key = (device.type, device.index)
    if key not in _LAYOUT:
        q = torch.zeros(3, 2, 8, dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
        lse = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, True, False, scale=1.0)[1]
        if tuple(lse.shape) == (2, 3):
            _LAYOUT[key] = "hn"
        elif tuple(lse.shape) == (2, 2, 2):
            _LAYOUT[key] = "bhs"
        else:
            raise RuntimeError(f"torch's FA2 returned a varlen log-sum-exp of shape {tuple(lse.shape)} for 2 sequences"
                               " of 1 and 2 tokens, 2 heads: neither [H, N] nor [B, H, max_len]; unset "
                               "RLREPRO_ATTENTION_BWD to use the Triton backward")
    return _LAYOUT[key]


def fa2_lse(lse2: torch.Tensor, meta, layout: str) -> torch.Tensor:
    """rlrepro's log-sum-exp (base 2 of the scaled scores, [N, H] float32) in FA2's convention (natural log)."""
    nat = lse2 * LN2
    if layout == "hn":
        return nat.transpose(0, 1).contiguous()
    b, h = meta.num_seqs, lse2.shape[1]
    out = torch.zeros(b, h, int(meta.max_seq_len), dtype=torch.float32, device=lse2.device)
    pos = meta.positions.to(lse2.device)
    seq = meta.seq_idx.to(lse2.device)
    out[seq, :, pos] = nat
    return out


def _check_deterministic() -> None:
    if not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
        raise RuntimeError("RLREPRO_ATTENTION_BWD=flash2 needs torch.use_deterministic_algorithms(True) without "
                           "warn_only: FA2's backward adds dQ with atomics otherwise (the trainer's "
                           "enable_determinism sets it); or unset RLREPRO_ATTENTION_BWD for the Triton backward")


def attention_bwd(q, k, v, grad_out, meta, scale: float, out: torch.Tensor, lse: torch.Tensor):
    """dq, dk, dv of causal attention over packed sequences (q [N, H, D], k/v [N, Hkv, D]) from the forward's
    ``out`` and base-2 ``lse`` [N, H]."""
    _check_deterministic()
    cu = meta.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    n = int(meta.max_seq_len)
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # philox state: read only with dropout
    dense = [t.contiguous() for t in (grad_out, q, k, v, out)]  # a no-op for the contiguous ones
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        *dense, fa2_lse(lse, meta, lse_layout(q.device)), cu, cu, n, n, 0.0, True, rng, rng, scale=float(scale))
    return dq, dk, dv
