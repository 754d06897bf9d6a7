"""The decode kernel with FA3's arithmetic in Triton (``rlrepro/kernels/triton_fa3_decode.py``, issue #27).

* CPU: the kernel's logic through Triton's interpreter (``TRITON_INTERPRET=1``, in one subprocess; the plain float
  operations stand in for the PTX ones): close to float64 attention at the 96-position tile boundaries, and the
  same bits whatever the batch, its order, the page size or the page order; the quad-thread column order of the
  row sum.
* GPU (Hopper, flashinfer): ``torch.equal`` with FA3's own kernel (its whole paged prefill of the same rows, and
  its folded decode), output and log-sum-exp, for plain and sharp softmaxes, whatever the launch shape.

``TRITON_INTERPRET=1 python tests/test_fa3_decode.py --interpret [NAME ...]`` runs the CPU checks directly."""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402

from _triton_helpers import fresh_seed, gpu, interpreter_test_items, main, needs_cuda  # noqa: E402

INTERP_CHECKS: dict = {}
_quad_cols = None  # rlrepro.kernels.triton_fa3_decode._quad_cols, imported by the check that needs it
LENS = [1, 2, 95, 96, 97, 191, 192, 193, 300]


def interp_check(fn):
    INTERP_CHECKS[fn.__name__] = fn
    return fn


def paged_case(lens, h, hkv, d, page, dtype, device, seed=0, shuffle=True):
    """q [R, H, D] (one decode query a request), a paged cache holding K/V of ``lens`` positions per request in
    pages of ``page`` (in a shuffled order), seq_lens, block tables, and the packed K/V [sum(lens), Hkv, D]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
    k = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)
    return q.to(device), *place(k, v, lens, page, device, seed if shuffle else None), k, v


def place(k, v, lens, page, device, seed):
    counts = [-(-n // page) for n in lens]
    order = (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)).tolist()
             if seed is not None else list(range(sum(counts))))
    kc = torch.zeros(sum(counts) + 1, page, *k.shape[1:], dtype=k.dtype)
    vc = torch.zeros_like(kc)
    kc[-1] = float("nan")  # a page nobody owns: a read of it would show
    vc[-1] = float("nan")
    bt = torch.full((len(lens), max(counts)), sum(counts), dtype=torch.int32)
    at = start = 0
    for r, n in enumerate(lens):
        for i in range(counts[r]):
            p = order[at]
            at += 1
            bt[r, i] = p
            lo, hi = start + i * page, start + min((i + 1) * page, n)
            kc[p, : hi - lo] = k[lo:hi]
            vc[p, : hi - lo] = v[lo:hi]
        start += n
    return (kc.to(device), vc.to(device)), torch.tensor(lens, dtype=torch.int32, device=device), bt.to(device)


def reference(q, k, v, lens, scale):
    """float64 attention of each request's query over its positions."""
    h, hkv = q.shape[1], k.shape[1]
    out, start = [], 0
    for r, n in enumerate(lens):
        kk = k[start:start + n].double().repeat_interleave(h // hkv, 1)
        vv = v[start:start + n].double().repeat_interleave(h // hkv, 1)
        s = torch.einsum("hd,khd->hk", q[r].double(), kk) * scale
        out.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv))
        start += n
    return torch.stack(out)


# ============================================================================================ CPU: interpreter
@interp_check
def check_close_to_float64_at_the_tile_boundaries():
    from rlrepro.kernels import triton_fa3_decode as T
    q, cache, sl, bt, k, v = paged_case(LENS, 8, 2, 128, 16, torch.float32, "cpu")
    out, lse = T.decode(q, cache, sl, bt, 128 ** -0.5, return_lse=True)
    want = reference(q, k, v, LENS, 128 ** -0.5)
    assert float((out.double() - want).abs().max()) < 1e-5
    start, want_l = 0, []
    for r, n in enumerate(LENS):  # the lse: base 2 of the scaled scores
        s = torch.einsum("hd,khd->hk", q[r].double(), k[start:start + n].double().repeat_interleave(4, 1))
        want_l.append(torch.logsumexp(s * 128 ** -0.5, -1) / math.log(2))
        start += n
    assert float((lse.double() - torch.stack(want_l)).abs().max()) < 1e-5


@interp_check
def check_the_same_bits_alone_reordered_and_in_other_pages():
    """A request's row depends on its own K/V only: not on the batch, its order, the page size or the pages'
    order (the kernel walks positions, never pages)."""
    from rlrepro.kernels import triton_fa3_decode as T
    q, cache, sl, bt, k, v = paged_case(LENS, 8, 2, 128, 16, torch.float32, "cpu")
    out = T.decode(q, cache, sl, bt, 0.1)
    rev = torch.arange(len(LENS) - 1, -1, -1)
    out_rev = T.decode(q[rev].contiguous(), cache, sl[rev].contiguous(), bt[rev].contiguous(), 0.1)
    assert torch.equal(out_rev.flip(0), out)
    for i in (0, 3, 8):
        assert torch.equal(T.decode(q[i:i + 1], cache, sl[i:i + 1], bt[i:i + 1], 0.1)[0], out[i])
    for page, seed in ((4, 1), (64, None), (1, 2)):
        cache2, sl2, bt2 = place(k, v, LENS, page, "cpu", seed)
        assert torch.equal(T.decode(q, cache2, sl2, bt2, 0.1), out), page


def _quad_cols_kernel():
    """A kernel writing ``_quad_cols``' eight [16, 4] outputs side by side (module level: the interpreter looks
    the helper up in the kernel's globals)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, o_ptr):
        r = tl.arange(0, 16)
        c = tl.arange(0, 32)
        q = tl.arange(0, 4)
        x = tl.load(x_ptr + r[:, None] * 32 + c[None, :])
        c0, c1, c2, c3, c4, c5, c6, c7 = _quad_cols(x, 16)
        base = o_ptr + r[:, None] * 32 + q[None, :]
        tl.store(base, c0)
        tl.store(base + 4, c1)
        tl.store(base + 8, c2)
        tl.store(base + 12, c3)
        tl.store(base + 16, c4)
        tl.store(base + 20, c5)
        tl.store(base + 24, c6)
        tl.store(base + 28, c7)
    return kernel


@interp_check
def check_the_quad_threads_own_columns_8j_2q_i():
    """The row sum's split: piece column 8 j + 2 q + i goes to quad thread q, in the order (j, i)."""
    global _quad_cols
    from rlrepro.kernels.triton_fa3_decode import _quad_cols
    x = torch.arange(16 * 32, dtype=torch.float32).view(16, 32)
    o = torch.zeros(16, 32)
    _quad_cols_kernel()[(1,)](x, o)
    for n in range(8):  # n = 2 j + i
        j, i = divmod(n, 2)
        for q in range(4):
            assert torch.equal(o[:, 4 * n + q], x[:, 8 * j + 2 * q + i]), (n, q)


interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)


def test_errors_name_the_shape():
    from rlrepro.kernels import triton_fa3_decode as T
    q = torch.zeros(2, 8, 96)
    cache = (torch.zeros(1, 16, 2, 96), torch.zeros(1, 16, 2, 96))
    with pytest.raises(ValueError, match="head size 96"):
        T.decode(q, cache, torch.ones(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 0.1)
    q = torch.zeros(2, 64, 128)
    cache = (torch.zeros(1, 16, 2, 128), torch.zeros(1, 16, 2, 128))
    with pytest.raises(ValueError, match="64 query heads over 2 KV heads"):
        T.decode(q, cache, torch.ones(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 0.1)


def test_scale_log2_is_rounded_as_fa3_rounds_it():
    """FA3 multiplies the float32 scale by the float32 log2(e) on the device: one float32 product (torch's float32
    multiply here), which for some scales differs from the float64 product rounded once."""
    from rlrepro.kernels.triton_fa3_decode import scale_log2

    def device(scale):
        return float(torch.tensor(scale, dtype=torch.float32) * torch.tensor(math.log2(math.e), dtype=torch.float32))
    for scale in (128 ** -0.5, 64 ** -0.5, 0.01, 0.3):
        assert scale_log2(scale) == device(scale)
    assert device(0.01) != float(torch.tensor(0.01 * math.log2(math.e), dtype=torch.float32))  # the case tells


def test_the_fa3_mode_decodes_on_it_at_head_size_128_only():
    from rlrepro.kernels import fa3_attention as F3
    assert F3.triton_decode(128, 32, 8) and F3.triton_decode(128, 16, 1)
    assert not F3.triton_decode(64, 32, 8) and not F3.triton_decode(256, 32, 8)
    assert not F3.triton_decode(128, 64, 2)  # 32 heads a group: over the 16-row tile


# ============================================================================================ GPU (Hopper)
def _fa3(monkeypatch):
    from rlrepro.kernels import flashinfer_attention as FI
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3 needs a Hopper GPU")
    fi = FI.flashinfer_module()
    if fi is None:
        pytest.skip("flashinfer is not installed (pip install 'rlrepro[flashinfer]')")
    return fi


@pytest.mark.parametrize("sharp", [1.0, 8.0], ids=["plain", "sharp"])
@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
@gpu
@needs_cuda
def test_gpu_fa3_decode_has_fa3s_bits(h, hkv, sharp, monkeypatch):
    """Each request's decode row == the same row of FA3's whole causal paged prefill (its paged kernel, the one
    ``RLREPRO_ATTENTION=fa3`` runs for prefill), output and log-sum-exp, for every launch shape."""
    from rlrepro.kernels import triton_fa3_decode as T
    fi = _fa3(monkeypatch)
    fresh_seed()
    lens = LENS + [1000, 2049, 3001]
    d, page, scale = 128, 16, 128 ** -0.5
    q_all = (torch.randn(sum(lens), h, d) * sharp).to(torch.bfloat16)
    _, cache, sl, bt, k, v = paged_case(lens, h, hkv, d, page, torch.bfloat16, "cuda", seed=3)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    counts = [-(-n // page) for n in lens]
    indptr = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    indices = torch.cat([bt[r, :counts[r]] for r in range(len(lens))]).to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in lens], dtype=torch.int32, device="cuda")
    w.plan(cu, indptr, indices, last, h, hkv, d, page, causal=True, sm_scale=scale, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    full, full_lse = w.run(q_all.cuda(), cache, return_lse=True)
    rows = cu[1:] - 1  # each request's last position: its decode row
    q = q_all.cuda()[rows].contiguous()
    for warps, stages in ((4, 3), (1, 2), (8, 3)):
        out, lse = T.decode(q, cache, sl, bt, scale, return_lse=True, num_warps=warps, num_stages=stages)
        assert torch.equal(out, full[rows]), (warps, stages)
        assert torch.equal(lse, full_lse[rows]), (warps, stages)


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
