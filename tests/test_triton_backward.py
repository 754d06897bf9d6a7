"""Tests of the Triton backward kernels of RMSNorm, SwiGLU and rotary (``triton_rowwise.rms_norm_bwd``,
``silu_and_mul_bwd``, ``apply_rope_bwd``, reached through the autograd functions of ``triton_ops``).

Two tiers, as in tests/test_triton_kernels.py:

* CPU: the kernels' logic through Triton's interpreter (``TRITON_INTERPRET=1``; float32 and float16: the
  interpreter computes bf16 wrongly), in one subprocess with the variable set;
  ``TRITON_INTERPRET=1 python tests/test_triton_backward.py --interpret [NAME ...]`` runs the checks directly.
* GPU (``-m gpu``): the compiled kernels in bf16 at Qwen3-8B sizes.

Each backward is compared with the float32 torch composition it replaces (``RLREPRO_ROWWISE_BWD=torch``) and with
float64 autograd of ``rlrepro.kernels.reference``, by a relative norm ``|out - ref| / |ref|``, and with itself run
to run, bitwise (``torch.equal``).
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import pytest
import torch

from _triton_helpers import (  # noqa: E402,F401
    HAS_TRITON, fresh_seed, gpu, interpreter_test_items, main, needs_cuda, rel_err)
from rlrepro.kernels import reference as ref  # noqa: E402

EPS = 1e-6


@contextmanager
def rowwise_bwd(impl: str):
    before = os.environ.get("RLREPRO_ROWWISE_BWD")
    os.environ["RLREPRO_ROWWISE_BWD"] = impl
    try:
        yield
    finally:
        if before is None:
            del os.environ["RLREPRO_ROWWISE_BWD"]
        else:
            os.environ["RLREPRO_ROWWISE_BWD"] = before


def _ops(device):
    """name -> (fn under test, float64 reference fn, number of differentiable inputs); rope's cos/sin are extra
    inputs that get no gradient."""
    from rlrepro.kernels import triton_ops as T
    return {
        "rms_norm": (lambda x, w: T.rms_norm(x, w, EPS), lambda x, w: ref.rms_norm(x, w, EPS), 2),
        "silu_and_mul": (T.silu_and_mul, ref.silu_and_mul, 1),
        "apply_rope": (T.apply_rope, ref.apply_rope, 1),
    }


def make_inputs(name, shape, dtype, device):
    """Inputs for op ``name``; ``shape`` is x's shape (rope: [N, H, D])."""
    def r(*s, scale=1.0):
        return (torch.randn(*s, device=device) * scale).to(dtype)
    if name == "rms_norm":
        return [r(*shape, scale=2.0), (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)]
    if name == "silu_and_mul":
        return [r(*shape, scale=2.0)]
    n, _, d = shape
    return [r(*shape), torch.randn(n, d // 2, device=device), torch.randn(n, d // 2, device=device)]


def grads(name, inputs, g_out, impl, need=None, device="cpu"):
    """Gradients of op ``name`` w.r.t. its differentiable inputs (those flagged in ``need``) under ``impl``."""
    fn, _, n_diff = _ops(device)[name]
    need = need or [True] * n_diff
    xs = [t.detach().clone().requires_grad_(i < n_diff and need[i]) for i, t in enumerate(inputs)]
    wanted = [x for i, x in enumerate(xs) if i < n_diff and need[i]]
    with rowwise_bwd(impl):
        return torch.autograd.grad(fn(*xs), wanted, g_out)


def float64_grads(name, inputs, g_out, device="cpu"):
    _, ref_fn, n_diff = _ops(device)[name]
    xs = [t.detach().double().requires_grad_(i < n_diff) for i, t in enumerate(inputs)]
    return torch.autograd.grad(ref_fn(*xs), xs[:n_diff], g_out.double())


def check_op(name, shape, dtype, tol_torch, tol_ref, device="cpu", g_transform=None):
    """The Triton backward against the torch one and float64, two runs bitwise; dtypes and shapes as the inputs."""
    fresh_seed()
    inputs = make_inputs(name, shape, dtype, device)
    fn, _, n_diff = _ops(device)[name]
    out_shape = fn(*inputs).shape
    g_out = torch.randn(out_shape, device=device).to(dtype)
    if g_transform is not None:
        g_out = g_transform(g_out)
    new = grads(name, inputs, g_out, "triton")
    again = grads(name, inputs, g_out, "triton")
    old = grads(name, inputs, g_out, "torch")
    expect = float64_grads(name, inputs, g_out, device)
    for i, (a, b, c, e) in enumerate(zip(new, again, old, expect)):
        what = f"{name} {tuple(shape)} {dtype}: gradient {i}"
        assert a.dtype == inputs[i].dtype and a.shape == inputs[i].shape, f"{what}: {a.dtype} {tuple(a.shape)}"
        assert torch.equal(a, b), f"{what} differs between two runs"
        assert rel_err(a, c) < tol_torch, f"{what}: rel err {rel_err(a, c)} against the torch path"
        assert rel_err(a, e) < tol_ref, f"{what}: rel err {rel_err(a, e)} against float64"
    return new


# ============================================================================================ CPU: interpreter
INTERP_CHECKS: dict = {}


def interp_check(fn):
    INTERP_CHECKS[fn.__name__] = fn
    return fn


# x shapes: odd row lengths (not powers of two), rows not a multiple of any block, leading dims
SHAPES = {
    "rms_norm": [(7, 48), (3, 5, 37), (2, 3, 4, 24), (1, 1100)],
    "silu_and_mul": [(6, 2 * 40), (3, 5, 2 * 37), (2, 2, 3, 2 * 2100)],  # 2100 > the 2048 column block
    "apply_rope": [(9, 3, 20), (5, 1, 6), (2, 600, 16)],  # 600 heads of 16: two head blocks of 512, the last partial
}


@interp_check
def check_backward_fp32():
    for name, shapes in SHAPES.items():
        for shape in shapes:
            check_op(name, shape, torch.float32, 1e-5, 1e-5)


@interp_check
def check_backward_fp16():
    for name, shapes in SHAPES.items():
        for shape in shapes[:2]:
            check_op(name, shape, torch.float16, 2e-3, 3e-3)


@interp_check
def check_rms_norm_tiles_and_partials():
    """RMSNorm's split into programs: shrink the program cap and tile so that small shapes take every path (several
    tiles per program, a last program with rows past the end, [rows, D] tiles, one-row tiles), and each split stays
    close to the torch path and float64; the split is a function of the shape only."""
    from rlrepro.kernels import triton_rowwise as rw
    saved = rw.RMS_BWD_MAX_PROGRAMS, rw.RMS_BWD_TILE
    try:
        for progs, tile in [(4, 64), (3, 32), (5, 4096), (1, 128)]:
            rw.RMS_BWD_MAX_PROGRAMS, rw.RMS_BWD_TILE = progs, tile
            for shape in [(37, 24), (2, 11, 20), (13, 48)]:
                block, block_r, rpp, n = rw._rms_norm_bwd_split(math.prod(shape[:-1]), shape[-1])
                assert rpp % block_r == 0 and n <= progs
                check_op("rms_norm", shape, torch.float32, 1e-5, 1e-5)
    finally:
        rw.RMS_BWD_MAX_PROGRAMS, rw.RMS_BWD_TILE = saved


@interp_check
def check_rms_norm_one_input_grad():
    """Only x or only the weight requiring a gradient: the other output is not computed, the one asked is the same
    bits as when both are."""
    fresh_seed()
    inputs = make_inputs("rms_norm", (3, 7, 40), torch.float32, "cpu")
    g_out = torch.randn(3, 7, 40)
    gx, gw = grads("rms_norm", inputs, g_out, "triton")
    (gx_only,) = grads("rms_norm", inputs, g_out, "triton", need=[True, False])
    (gw_only,) = grads("rms_norm", inputs, g_out, "triton", need=[False, True])
    assert torch.equal(gx, gx_only) and torch.equal(gw, gw_only)


@interp_check
def check_non_contiguous_grads():
    """Gradients that arrive transposed, sliced or expanded give the bits of their contiguous copies."""
    from rlrepro.kernels import triton_rowwise as rw
    fresh_seed()
    x, w = make_inputs("rms_norm", (6, 40), torch.float32, "cpu")
    g = torch.randn(40, 6).t()
    assert not g.is_contiguous()
    for got, expect in zip(rw.rms_norm_bwd(x, w, g, EPS), rw.rms_norm_bwd(x, w, g.contiguous(), EPS)):
        assert torch.equal(got, expect)
    g_exp = torch.randn(1, 40).expand(6, 40)  # stride 0 over rows
    for got, expect in zip(rw.rms_norm_bwd(x, w, g_exp, EPS), rw.rms_norm_bwd(x, w, g_exp.contiguous(), EPS)):
        assert torch.equal(got, expect)
    xs = torch.randn(5, 2 * 24)
    gs = torch.randn(5, 48)[:, ::2]  # last-dim stride 2
    assert torch.equal(rw.silu_and_mul_bwd(xs, gs), rw.silu_and_mul_bwd(xs, gs.contiguous()))
    cos, sin = torch.randn(7, 8), torch.randn(7, 8)
    gr = torch.randn(3, 7, 16).transpose(0, 1)
    assert torch.equal(rw.apply_rope_bwd(gr, cos, sin), rw.apply_rope_bwd(gr.contiguous(), cos, sin))
    # through autograd, with the non-contiguous gradient checked against the torch path and float64 too
    check_op("rms_norm", (6, 40), torch.float32, 1e-5, 1e-5, g_transform=lambda t: t.t().contiguous().t())
    check_op("silu_and_mul", (4, 2 * 24), torch.float32, 1e-5, 1e-5,
             g_transform=lambda t: torch.cat((t, t), -1)[:, ::2])
    check_op("apply_rope", (7, 3, 16), torch.float32, 1e-5, 1e-5,
             g_transform=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1))


@interp_check
def check_empty_inputs():
    """Zero rows (or heads): empty gradients of the right shapes and dtypes, a zero weight gradient."""
    from rlrepro.kernels import triton_rowwise as rw
    for dtype in (torch.float32, torch.float16):
        x, w = torch.randn(0, 3, 24).to(dtype), torch.randn(24).to(dtype)
        gx, gw = rw.rms_norm_bwd(x, w, torch.randn(0, 3, 24).to(dtype), EPS)
        assert gx.shape == x.shape and gx.dtype == dtype and torch.equal(gw, torch.zeros_like(w))
        x = torch.randn(0, 2 * 8).to(dtype)
        gx = rw.silu_and_mul_bwd(x, torch.randn(0, 8).to(dtype))
        assert gx.shape == x.shape and gx.dtype == dtype
        for shape in [(0, 3, 8), (4, 0, 8)]:
            gx = rw.apply_rope_bwd(torch.randn(*shape).to(dtype), torch.randn(shape[0], 4), torch.randn(shape[0], 4))
            assert gx.shape == shape and gx.dtype == dtype
    x = torch.randn(3, 0)  # a last dim of 0 (silu's d = 0)
    assert rw.silu_and_mul_bwd(x, torch.randn(3, 0)).shape == (3, 0)


interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS, drop_env=("RLREPRO_ROWWISE_BWD",))


# ============================================================================================ CPU: plain
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_rms_norm_split_depends_on_the_shape_only():
    """Every row in exactly one program, at most RMS_BWD_MAX_PROGRAMS programs, whole tiles per program, the tile
    within RMS_BWD_TILE elements; the Qwen3-8B shapes split as intended."""
    from rlrepro.kernels import triton_rowwise as rw
    for r in list(range(1, 70)) + [1023, 1024, 1025, 2047, 3072, 3 * 700, 24576, 98304, 98305, 10 ** 6]:
        for d in (1, 24, 37, 128, 1000, 4096, 8192):
            block, block_r, rpp, n = rw._rms_norm_bwd_split(r, d)
            assert (block, block_r, rpp, n) == rw._rms_norm_bwd_split(r, d)
            assert n <= rw.RMS_BWD_MAX_PROGRAMS and (n - 1) * rpp < r <= n * rpp, (r, d)
            assert rpp % block_r == 0 and block >= d and block_r * block <= max(rw.RMS_BWD_TILE, block)
    assert rw._rms_norm_bwd_split(3072, 4096) == (4096, 1, 3, 1024)  # hidden-size norms: one row per tile
    assert rw._rms_norm_bwd_split(3072 * 32, 128) == (128, 32, 96, 1024)  # q norm: 32-row tiles, 3 per program
    assert rw._rms_norm_bwd_split(3072 * 8, 128) == (128, 32, 32, 768)  # k norm


def test_rowwise_bwd_env_is_checked():
    from rlrepro.kernels import triton_ops as T
    with rowwise_bwd("bogus"):
        with pytest.raises(ValueError, match="RLREPRO_ROWWISE_BWD"):
            T._rowwise_bwd_impl()
    for impl in ("torch", "triton", "TRITON "):
        with rowwise_bwd(impl):
            assert T._rowwise_bwd_impl() == impl.strip().lower()


# ============================================================================================ GPU
GPU_SHAPES = [
    ("rms_norm", (3072, 4096)),  # input / post-attention / final norm
    ("rms_norm", (3072, 32, 128)),  # q norm (per head)
    ("silu_and_mul", (3072, 2 * 12288)),
    ("apply_rope", (3072, 32, 128)),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("name,shape", GPU_SHAPES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in GPU_SHAPES])
def test_gpu_backward_bf16(name, shape):
    """bf16 at Qwen3-8B sizes (3072-token micro-batches): close to float64 and to the torch path, bitwise run to
    run (five runs)."""
    fresh_seed()
    inputs = make_inputs(name, shape, torch.bfloat16, "cuda")
    fn, _, _ = _ops("cuda")[name]
    g_out = torch.randn(fn(*inputs).shape, device="cuda").to(torch.bfloat16)
    first = grads(name, inputs, g_out, "triton")
    for _ in range(4):
        for a, b in zip(first, grads(name, inputs, g_out, "triton")):
            assert torch.equal(a, b), f"{name} {shape}: differs between runs"
    old = grads(name, inputs, g_out, "torch")
    expect = float64_grads(name, inputs, g_out, "cuda")
    for i, (a, c, e) in enumerate(zip(first, old, expect)):
        assert a.dtype == torch.bfloat16 and a.shape == inputs[i].shape
        err_ref, err_old, err_torch_ref = rel_err(a, e), rel_err(a, c), rel_err(c, e)
        assert err_ref < 2e-2, f"{name} {shape}: gradient {i} rel err {err_ref} against float64"
        assert err_old < 2e-2, f"{name} {shape}: gradient {i} rel err {err_old} against the torch path"
        assert err_ref < 1.5 * err_torch_ref + 1e-3, (name, shape, i, err_ref, err_torch_ref)


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
