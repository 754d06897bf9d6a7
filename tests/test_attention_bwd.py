"""Tests of the Triton backward of packed causal attention (``triton_attention.attention_bwd_packed_triton``).

Two tiers, as in tests/test_triton_kernels.py:

* CPU: the kernels' logic through Triton's interpreter (``TRITON_INTERPRET=1``, float32 only), in one subprocess
  with the variable set; ``TRITON_INTERPRET=1 python tests/test_attention_bwd.py --interpret [NAME ...]`` runs the checks directly.
* GPU (``-m gpu``): the compiled kernels in bf16/fp16/fp32 against the torch path ``attention_bwd_packed``.

Reproducibility is asserted bitwise (``torch.equal``); closeness by a relative norm ``|out - ref| / |ref|``.
"""
from __future__ import annotations

import os

import pytest
import torch

from _triton_helpers import (  # noqa: E402,F401
    HAS_CUDA, fresh_seed, gpu, interpreter_test_items, main, needs_cuda, rel_err)
from rlrepro.kernels import reference as ref  # noqa: E402
from rlrepro.kernels.metadata import AttentionMetadata  # noqa: E402


def make_case(lens, h, hkv, d, dtype, device):
    n = sum(lens)

    def r(*shape):
        return torch.randn(*shape, device=device).to(dtype)
    return r(n, h, d), r(n, hkv, d), r(n, hkv, d), r(n, h, d)


def float64_grads(q, k, v, g, lens, scale):
    """Autograd of the float64 reference math (on q's device: float64 runs on the GPU too)."""
    meta = AttentionMetadata.packed(lens, device=q.device)
    xr = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = ref.attention_packed(*xr, meta, scale)
    return torch.autograd.grad(out, xr, g.double())


def check_backward(lens, h, hkv, d, dtype, device, tol_torch, tol_f64, scale=None, f64=True):
    """Triton backward vs the torch path and float64 autograd; bitwise equal on a rerun and per sequence alone."""
    from rlrepro.kernels import triton_attention as A
    seed = fresh_seed()
    scale = d ** -0.5 if scale is None else scale
    q, k, v, g = make_case(lens, h, hkv, d, dtype, device)
    meta = AttentionMetadata.packed(lens, device=device)
    out = A.attention_fwd(q, k, v, meta, scale)
    got = A.attention_bwd_packed_triton(q, k, v, g, meta, scale, out=out)
    for t, x in zip(got, (q, k, v)):
        assert t.dtype == x.dtype and t.shape == x.shape and t.device == x.device
    expect = A.attention_bwd_packed(q, k, v, g, meta, scale)
    e64 = float64_grads(q, k, v, g, lens, scale) if f64 else (None,) * 3
    for name, a, b, c in zip("qkv", got, expect, e64):
        err = rel_err(a, b)
        assert err < tol_torch, f"d{name} vs torch path: rel err {err} (seed {seed}, {lens} {h}/{hkv}x{d} {dtype})"
        if c is not None:
            err = rel_err(a, c)
            assert err < tol_f64, f"d{name} vs float64: rel err {err} (seed {seed}, {lens} {h}/{hkv}x{d} {dtype})"
    again = A.attention_bwd_packed_triton(q, k, v, g, meta, scale, out=out)
    for name, a, b in zip("qkv", got, again):
        assert torch.equal(a, b), f"d{name} differs between two runs (seed {seed})"
    recomputed = A.attention_bwd_packed_triton(q, k, v, g, meta, scale)  # out=None: the forward is rerun
    for name, a, b in zip("qkv", got, recomputed):
        assert torch.equal(a, b), f"d{name} differs with O recomputed (seed {seed})"
    # a sequence's gradients depend only on its own tokens: alone or in the batch, the same bits
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    for s in (0, len(lens) - 1):
        sl = slice(cu[s], cu[s + 1])
        alone = A.attention_bwd_packed_triton(q[sl], k[sl], v[sl], g[sl], AttentionMetadata.packed([lens[s]], device=device),
                                              scale, out=out[sl])
        for name, a, b in zip("qkv", alone, got):
            assert torch.equal(a, b[sl]), f"d{name} of sequence {s} alone differs from the batch (seed {seed})"


def check_autograd_wiring(device, dtype, tol):
    """T.attention's backward takes the Triton path on RLREPRO_ATTENTION_BWD=triton (and on CUDA by default), the
    torch path on =torch; strided inputs (v sliced out of a fused qkv) and a non-contiguous grad work."""
    from rlrepro.kernels import triton_attention as A
    from rlrepro.kernels import triton_ops as T
    seed = fresh_seed()
    lens, h, hkv, d = [7, 1, 70], 4, 2, 16
    n = sum(lens)
    meta = AttentionMetadata.packed(lens, device=device)
    qkv = torch.randn(n, (h + 2 * hkv) * d, device=device).to(dtype)
    g = torch.randn(h, n, d, device=device).to(dtype).transpose(0, 1)  # non-contiguous grad [n, h, d]
    before = os.environ.get("RLREPRO_ATTENTION_BWD")
    grads = {}
    try:
        for impl in ("triton", "torch"):
            os.environ["RLREPRO_ATTENTION_BWD"] = impl
            x = qkv.detach().clone().requires_grad_(True)
            q = x[:, : h * d].view(n, h, d)
            k = x[:, h * d:(h + hkv) * d].reshape(n, hkv, d)
            v = x[:, (h + hkv) * d:].view(n, hkv, d)  # a strided view
            out = T.attention(q, k, v, meta, 0.3)
            grads[impl] = torch.autograd.grad(out, x, g)[0]
    finally:
        if before is None:
            os.environ.pop("RLREPRO_ATTENTION_BWD", None)
        else:
            os.environ["RLREPRO_ATTENTION_BWD"] = before
    err = rel_err(grads["triton"], grads["torch"])
    assert err < tol, f"autograd triton vs torch backward: rel err {err} (seed {seed})"
    q, k, v = (t.contiguous() for t in (qkv[:, : h * d].view(n, h, d), qkv[:, h * d:(h + hkv) * d].view(n, hkv, d),
                                         qkv[:, (h + hkv) * d:].view(n, hkv, d)))
    direct = A.attention_bwd_packed_triton(q, k, v, g.contiguous(), meta, 0.3)
    assert torch.equal(grads["triton"], torch.cat([t.reshape(n, -1) for t in direct], dim=1)), \
        f"autograd's Triton backward differs from a direct call on contiguous copies (seed {seed})"


# ============================================================================================ CPU: interpreter
INTERP_CHECKS: dict = {}


def interp_check(fn):
    INTERP_CHECKS[fn.__name__] = fn
    return fn


LENS_CPU = [1, 5, 70, 130]  # crosses the 64-wide tiles of both kernels


@interp_check
def check_bwd_group2_fp32():
    check_backward(LENS_CPU, 4, 2, 16, torch.float32, "cpu", 1e-5, 1e-5)
    check_backward(LENS_CPU, 4, 2, 24, torch.float32, "cpu", 1e-5, 1e-5)  # D 24 padded to 32


@interp_check
def check_bwd_group1_fp32():
    check_backward(LENS_CPU, 4, 4, 16, torch.float32, "cpu", 1e-5, 1e-5)


@interp_check
def check_bwd_group4_fp32():
    check_backward(LENS_CPU, 4, 1, 24, torch.float32, "cpu", 1e-5, 1e-5)


@interp_check
def check_bwd_group3_fp32():
    check_backward([2, 67], 6, 2, 16, torch.float32, "cpu", 1e-5, 1e-5, scale=0.7)  # group padded to 4


@interp_check
def check_bwd_edge_cases_fp32():
    from rlrepro.kernels import triton_attention as A
    check_backward([1, 2], 2, 1, 16, torch.float32, "cpu", 1e-5, 1e-5)
    # one token alone: dq and dk are exactly 0 in exact math (a softmax over one score): compare absolutely
    q, k, v, g = make_case([1], 2, 1, 16, torch.float32, "cpu")
    dq, dk, dv = A.attention_bwd_packed_triton(q, k, v, g, AttentionMetadata.packed([1]), 0.25)
    e64 = float64_grads(q, k, v, g, [1], 0.25)
    assert float(dq.abs().max()) < 1e-5 and float(dk.abs().max()) < 1e-5, (dq, dk)
    assert rel_err(dv, e64[2]) < 1e-6
    # N == 0: no sequence at all
    empty = AttentionMetadata(cu_seqlens_q=torch.zeros(1, dtype=torch.int64), seq_lens=torch.zeros(0, dtype=torch.int64),
                              positions=torch.zeros(0, dtype=torch.int64), seq_idx=torch.zeros(0, dtype=torch.int64),
                              max_seq_len=0)
    q, k, v, g = make_case([0], 4, 2, 16, torch.float32, "cpu")
    dq, dk, dv = A.attention_bwd_packed_triton(q, k, v, g, empty, 0.25)
    assert dq.shape == (0, 4, 16) and dk.shape == (0, 2, 16) and dv.shape == (0, 2, 16)


@interp_check
def check_autograd_wiring_fp32():
    check_autograd_wiring("cpu", torch.float32, 1e-5)


@interp_check
def check_forward_lse_fp32():
    """``attention_fwd(..., return_lse=True)``: the same output, and each row's log2-sum-exp of the scaled scores."""
    import math

    from rlrepro.kernels import triton_attention as A
    lens, h, hkv, d = [1, 70, 130], 4, 2, 16
    q, k, v, _ = make_case(lens, h, hkv, d, torch.float32, "cpu")
    meta = AttentionMetadata.packed(lens)
    out, lse = A.attention_fwd(q, k, v, meta, 0.3, return_lse=True)
    assert torch.equal(out, A.attention_fwd(q, k, v, meta, 0.3)) and lse.shape == (sum(lens), h)
    a = 0
    for L in lens:
        s = torch.einsum("ihd,jhd->hij", q[a:a + L].double(), k[a:a + L].double().repeat_interleave(h // hkv, 1)) * 0.3
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        want = (torch.logsumexp(s, dim=-1) / math.log(2)).transpose(0, 1)
        assert float((lse[a:a + L].double() - want).abs().max()) < 1e-5
        a += L
    with pytest.raises(ValueError, match="lse was given without"):
        A.attention_bwd_packed_triton(q, k, v, q, meta, 0.3, lse=lse)


interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS, drop_env=("RLREPRO_ATTENTION_BWD",))


def test_backward_choice(monkeypatch):
    """CPU tensors default to the torch backward, CUDA ones to Triton; the variable forces either, or fails loudly."""
    from rlrepro.kernels import triton_ops as T
    x = torch.zeros(1)
    monkeypatch.delenv("RLREPRO_ATTENTION_BWD", raising=False)
    assert T._attention_bwd_impl(x) == "torch"
    if HAS_CUDA:
        assert T._attention_bwd_impl(x.cuda()) == "triton"
    for forced in ("torch", "triton", "Torch"):
        monkeypatch.setenv("RLREPRO_ATTENTION_BWD", forced)
        assert T._attention_bwd_impl(x) == forced.lower()
    monkeypatch.setenv("RLREPRO_ATTENTION_BWD", "flash")
    with pytest.raises(ValueError, match="RLREPRO_ATTENTION_BWD"):
        T._attention_bwd_impl(x)


# ============================================================================================ GPU
LENS_GPU = [1, 63, 64, 65, 300, 1000]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_bwd_qwen_shape(dtype):
    """H=32, Hkv=8, D=128 (Qwen3-8B's attention): close to the torch path and float64, bitwise reproducible."""
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    check_backward(LENS_GPU, 32, 8, 128, dtype, "cuda", tol, tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,hkv,d", [(16, 16, 64), (12, 4, 96), (16, 1, 128), (8, 2, 256), (4, 2, 80)])
def test_gpu_bwd_shapes(dtype, h, hkv, d):
    """Every tile config (head dims 64..256, padded ones too) and GQA groups 1..16 compile and compute the gradient."""
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    check_backward([1, 129, 200, 17], h, hkv, d, dtype, "cuda", tol, tol)


@gpu
@needs_cuda
def test_gpu_bwd_long_sequence():
    check_backward([4000, 3], 8, 2, 128, torch.bfloat16, "cuda", 2e-2, 2e-2, f64=False)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_autograd_wiring(dtype):
    check_autograd_wiring("cuda", dtype, 2e-2 if dtype == torch.bfloat16 else 1e-5)


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
