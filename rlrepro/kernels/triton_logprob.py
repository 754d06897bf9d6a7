"""The trainer's token logprob, entropy and logprob gradient over ``[rows, vocab]`` logits, fused (CUDA, Triton).

The loss needs three things from each row of logits: the chosen token's logprob, the entropy (a metric) and, in
the backward, the logprob's gradient. Through torch ops they cost a float32 ``[rows, vocab]`` log-softmax written
and read again, five entropy passes, and in the backward the log-softmax recomputed, a scattered one-hot, an exp,
a product, a difference, a scale and a cast: about 30 bytes of traffic per logit each way (Qwen3's vocab of
151,936 makes that most of a long-sequence train step outside the matmuls). Here:

* forward: the log-softmax's own range partials (:func:`.triton_rowwise.lse_partials`), then one pass that forms
  each row's log-sum-exp by the log-softmax's own code (``_row_lse``), takes the chosen token's ``x - lse`` and
  the row's entropy partials, and keeps the log-sum-exp for the backward;
* backward: one elementwise pass, ``grad = (onehot(t) - exp(x/T - lse)) * g / T`` written in the logits' dtype.

**The bits.** The logprob is ``x_t - lse`` with ``lse`` from the same partials and the same combining code as
:func:`rlrepro.kernels.token_logprob` (the engine's): the same bits. The backward evaluates the torch autograd
chain of ``log_softmax(logits.float() / T).gather(t)`` operation for operation, in float32, without contraction
(``enable_fp_fusion=False``): the one-hot is ``0 + g`` (``gather``'s backward adds into zeros), the row sum of the
one-hot is ``0 + g`` too, ``exp`` is libdevice's ``expf`` (torch's CUDA exp), and a Python-float temperature is
applied as torch does on CUDA, a product with the float32 reciprocal; ``tests/test_token_logprob_fused.py`` checks
on the GPU that logprobs and gradients are ``torch.equal`` to the torch path's. The entropy is a fixed-order sum of
fixed ranges: a row's value does not depend on the other rows (torch's row sum picks its order by the row count),
but its last bits are not those of the torch path's.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_rowwise as _rw

try:  # Triton >= 3.2
    from triton.language.extra import libdevice as _libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice as _libdevice

__all__ = ["token_logprob_entropy", "token_logprob_grad", "reciprocal_temperature"]


@triton.jit
def _lp_entropy_kernel(x_ptr, t_ptr, m_ptr, s_ptr, lp_ptr, lse_ptr, ent_ptr, V, stride_x, P,
                       P_P: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, p): the row's lse, its chosen token's logprob (from the program whose range holds it), and the
    range's entropy partial ``sum p * log p`` (``p == 0`` counts 0)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lse = _rw._row_lse(m_ptr, s_ptr, row, P, P_P)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    lp = x - lse
    p = tl.exp(lp)
    tl.store(ent_ptr + row * P + part, tl.sum(p * tl.where(mask & (p > 0), lp, 0.0), axis=0))
    t = tl.load(t_ptr + row)
    tl.store(lp_ptr + row + cols * 0, lp, mask=mask & (cols == t))
    if part == 0:
        tl.store(lse_ptr + row, lse)


@triton.jit
def _neg_row_sum_kernel(x_ptr, out_ptr, P, P_P: tl.constexpr):
    """out[row] = -(the row's P partials summed in one fixed order)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, P_P)
    v = tl.load(x_ptr + row * P + i, mask=i < P, other=0.0)
    tl.store(out_ptr + row, -tl.sum(v, axis=0))


@triton.jit
def _lp_grad_kernel(x_ptr, t_ptr, g_ptr, lse_ptr, out_ptr, V, stride_x, stride_o, inv_t,
                    HAS_T: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, p): the gradient of the chosen token's logprob over range p, as torch's autograd forms it."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_T:
        x = x * inv_t  # logits.float() / T: torch multiplies by the float32 reciprocal of a Python float
    if LIBDEVICE_EXP:
        e = _libdevice.exp(x - tl.load(lse_ptr + row))  # exp(log_softmax) as torch.exp computes it (expf)
    else:  # Triton's interpreter, which has no libdevice (numpy's exp either way)
        e = tl.exp(x - tl.load(lse_ptr + row))
    g = tl.load(g_ptr + row) + 0.0  # the one nonzero of gather's backward, and the row sum of that one-hot
    t = tl.load(t_ptr + row)
    grad = tl.where(cols == t, g, 0.0) - e * g  # _LogSoftmax.backward: g - exp(out) * g.sum(-1)
    if HAS_T:
        grad = grad * inv_t
    tl.store(out_ptr + row * stride_o + cols, grad.to(out_ptr.dtype.element_ty), mask=mask)


def reciprocal_temperature(temperature: float) -> float | None:
    """``None`` when ``temperature`` leaves the logits as they are (``<= 0`` or 1, as ``kernels.scale_logits``),
    else the float32 ``1 / T`` that torch's CUDA division by a Python float multiplies with."""
    t = float(temperature) if temperature > 0 else 1.0
    if t == 1.0:
        return None
    return (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(t, dtype=torch.float32)).item()


def _check(rows_v: tuple[int, ...], targets: torch.Tensor) -> None:
    if len(rows_v) != 2 or targets.shape != (rows_v[0],):
        raise ValueError(f"fused token logprob: logits {tuple(rows_v)} and targets {tuple(targets.shape)} are not "
                         "[rows, vocab] and [rows]")


def token_logprob_entropy(scaled: torch.Tensor, targets: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor,
                          lse: torch.Tensor) -> None:
    """For float32 tempered logits ``scaled`` [rows, V] (``kernels.scale_logits``): write each row's chosen-token
    logprob into ``lp``, its entropy into ``ent`` and its log-sum-exp into ``lse`` (float32 [rows] each)."""
    _check(tuple(scaled.shape), targets)
    rows, v = scaled.shape
    if rows == 0:
        return
    if v == 0:
        raise ValueError("fused token logprob: a vocabulary of 0 columns has no token to score")
    x2 = scaled if scaled.stride(-1) == 1 else scaled.contiguous()
    m, s = _rw.lse_partials(x2)
    parts = m.shape[1]
    part_ent = torch.empty_like(m)
    p_p = triton.next_power_of_2(parts)
    warps = _rw._row_warps(_rw.LSM_BLOCK)
    _lp_entropy_kernel[(rows, parts)](x2, targets, m, s, lp, lse, part_ent, v, x2.stride(0), parts, P_P=p_p,
                                      BLOCK=_rw.LSM_BLOCK, num_warps=warps)
    _neg_row_sum_kernel[(rows,)](part_ent, ent, parts, P_P=p_p, num_warps=1)


def token_logprob_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_lp: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """The gradient, in ``logits``' dtype and shape, of ``sum(grad_lp * token_logprob(logits, targets, T))``
    given the rows' log-sum-exps ``lse`` of the tempered logits (from :func:`token_logprob_entropy`)."""
    _check(tuple(logits.shape), targets)
    rows, v = logits.shape
    out = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    if rows == 0 or v == 0:
        return out
    x2 = logits if logits.stride(-1) == 1 else logits.contiguous()
    inv_t = reciprocal_temperature(temperature)
    block = _rw.LSM_BLOCK
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _lp_grad_kernel[(rows, triton.cdiv(v, block))](
        x2, targets, grad_lp.float().contiguous(), lse, out, v, x2.stride(0), out.stride(0),
        1.0 if inv_t is None else inv_t, HAS_T=inv_t is not None, LIBDEVICE_EXP=not interpreted,
        BLOCK=block, num_warps=_rw._row_warps(block), enable_fp_fusion=False)
    return out
