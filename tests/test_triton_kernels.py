"""Tests of the Triton kernels (rlrepro.kernels.triton_ops).

Two tiers:

* CPU: the kernels' logic through Triton's interpreter (``TRITON_INTERPRET=1``, float32 only: the interpreter
  computes bf16 wrongly). The checks run in one subprocess with the variable set, since it must be set before
  Triton compiles anything; ``TRITON_INTERPRET=1 python tests/test_triton_kernels.py --interpret [NAME ...]`` runs them directly.
* GPU (``-m gpu``, run by ``scripts/gpu_check.sh`` on the H200): the compiled kernels in bf16/fp16/fp32.

Invariance is asserted bitwise (``torch.equal``) on fresh random inputs; closeness to the float64 references
of ``rlrepro.kernels.reference`` by a relative norm ``|out - ref| / |ref|``.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from _triton_helpers import fresh_seed, gpu, interpreter_test_items, main, needs_cuda, rel_err  # noqa: E402,F401
from rlrepro.kernels import reference as ref  # noqa: E402
from rlrepro.kernels.metadata import AttentionMetadata  # noqa: E402


# ============================================================================================ shared helpers
def assert_rows_invariant(fn, full: torch.Tensor, ms, offsets=(0, 1, 5, 64, 127), what: str = "") -> int:
    """fn(full[off:off+m]) must equal fn(full)[off:off+m] bit for bit, for every m and row offset."""
    expect = fn(full)
    checked = 0
    for m in ms:
        for off in offsets:
            if off + m > full.shape[0]:
                continue
            got = fn(full[off:off + m])
            assert torch.equal(got, expect[off:off + m]), f"{what}: rows differ for M={m} at offset {off}"
            checked += 1
        got = fn(full[:m].clone())
        assert torch.equal(got, expect[:m]), f"{what}: rows differ for a fresh copy of M={m}"
    return checked


def make_paged_case(lens, h, hkv, d, dtype, device, seed_base=0):
    """Random q/k/v for packed sequences of ``lens``."""
    n = sum(lens)
    q = torch.randn(n, h, d, dtype=torch.float32, device=device).to(dtype)
    k = torch.randn(n, hkv, d, dtype=torch.float32, device=device).to(dtype)
    v = torch.randn(n, hkv, d, dtype=torch.float32, device=device).to(dtype)
    return q, k, v


def run_paged(attn, q, k, v, lens, plan, block_size, scale, rng: random.Random):
    """Replay ``plan`` (steps of [(seq, n_new)]) against a NaN-filled paged cache; return the per-token outputs
    in packed order. Each sequence gets randomly placed blocks, so KV addresses differ from the packed layout."""
    device, dtype = q.device, q.dtype
    hkv, d = k.shape[1], k.shape[2]
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    nblocks = [-(-L // block_size) for L in lens]
    pool = list(range(sum(nblocks) + 3))
    rng.shuffle(pool)
    tables, i = [], 0
    for nb in nblocks:
        tables.append(pool[i:i + nb])
        i += nb
    k_cache = torch.full((len(pool), block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    out = torch.full_like(q, float("nan"))
    done = [0] * len(lens)
    for step in plan:
        rows, qlens, slens, btabs = [], [], [], []
        for s, n_new in step:
            rows.extend(range(cu[s] + done[s], cu[s] + done[s] + n_new))
            done[s] += n_new
            qlens.append(n_new)
            slens.append(done[s])
            btabs.append(tables[s])
        meta = AttentionMetadata.paged(qlens, slens, btabs, block_size, device=device)
        idx = torch.tensor(rows, device=device)
        out[idx] = attn(q[idx], k[idx], v[idx], meta, scale, kv_cache=(k_cache, v_cache))
    assert done == list(lens)
    return out


def paged_plans(lens, rng: random.Random):
    """Whole prefill in one step; random chunked prefill interleaved across sequences; prefill half, then decode."""
    everything = [[(s, L) for s, L in enumerate(lens)]]
    chunked, left = [], list(lens)
    while any(left):
        step = []
        for s in range(len(lens)):
            if left[s] and rng.random() < 0.7:
                n = min(left[s], rng.choice([1, 2, 7, 16, 33, 64, 65, 100]))
                step.append((s, n))
                left[s] -= n
        if step:
            chunked.append(step)
    decode = [[(s, max(1, L // 2)) for s, L in enumerate(lens)]]
    pos = [max(1, L // 2) for L in lens]
    while any(p < L for p, L in zip(pos, lens)):
        step = [(s, 1) for s in range(len(lens)) if pos[s] < lens[s]]
        for s, _ in step:
            pos[s] += 1
        decode.append(step)
    return {"one_step": everything, "chunked": chunked, "prefill_then_decode": decode}


def check_attention_invariance(attn, lens, h, hkv, d, dtype, device, block_sizes, tol):
    seed = fresh_seed()
    rng = random.Random(seed)
    q, k, v = make_paged_case(lens, h, hkv, d, dtype, device)
    scale = d ** -0.5
    meta = AttentionMetadata.packed(lens, device=device)
    packed = attn(q, k, v, meta, scale)
    err = rel_err(packed, ref.attention_packed(q.cpu(), k.cpu(), v.cpu(),
                                               AttentionMetadata.packed(lens), scale))
    assert err < tol, f"attention vs float64 reference: rel err {err} (seed {seed})"
    # batch composition: each sequence alone, and the sequences in reverse order
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    for s, L in enumerate(lens):
        alone = attn(q[cu[s]:cu[s + 1]], k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]],
                     AttentionMetadata.packed([L], device=device), scale)
        assert torch.equal(alone, packed[cu[s]:cu[s + 1]]), f"sequence {s} alone differs (seed {seed})"
    order = list(reversed(range(len(lens))))
    idx = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in order]).to(device)
    rev = attn(q[idx], k[idx], v[idx], AttentionMetadata.packed([lens[s] for s in order], device=device), scale)
    assert torch.equal(rev, packed[idx]), f"reordered batch differs (seed {seed})"
    # paged cache: one step, chunked prefill, decode; several block sizes
    for bs in block_sizes:
        for name, plan in paged_plans(lens, rng).items():
            got = run_paged(attn, q, k, v, lens, plan, bs, scale, rng)
            assert torch.equal(got, packed), f"paged ({name}, block_size={bs}) differs from packed (seed {seed})"


# ============================================================================================ CPU: interpreter
INTERP_CHECKS: dict = {}


def interp_check(fn):
    INTERP_CHECKS[fn.__name__] = fn
    return fn


@interp_check
def check_matmul_invariance_fp32():
    from rlrepro.kernels import triton_matmul as mm
    fresh_seed()
    k, n = 72, 40  # K and N tails (K tile 32, N tile 64)
    w = torch.randn(n, k)
    b = torch.randn(n)
    full = torch.randn(200, k)
    e = rel_err(mm.matmul(full, w, b), ref.linear(full, w, b))
    assert e < 1e-6, e
    for tma, ms in ((True, (1, 2, 3, 63, 64, 65, 129, 190)), (False, (1, 5, 64, 65, 130))):
        assert_rows_invariant(lambda x: mm.matmul(x, w, b, use_tma=tma), full, ms, offsets=(0, 3),
                              what=f"matmul tma={tma}")


@interp_check
def check_matmul_configs_fp32():
    """Every 16-bit config's tile geometry (persistent loop, grouped order, subtiled store) computes the product."""
    from dataclasses import replace
    from rlrepro.kernels import triton_matmul as mm
    fresh_seed()
    k, n = 132, 300  # K*4 bytes a multiple of 16, so TMA can run
    w = torch.randn(n, k)
    x = torch.randn(150, k)
    expect = ref.linear(x, w)
    geometries = {(c.block_m, c.block_n, c.subtile): c for c in mm.CONFIGS_16BIT.values()}  # one per tile shape
    for i, cfg in enumerate(geometries.values()):
        tma = i % 2 == 0
        got = mm.matmul(x, w, config=replace(cfg, ctas_per_sm=1), use_tma=tma)
        e = rel_err(got, expect)
        assert e < 1e-6, (cfg.name, tma, e)


@interp_check
def check_matmul_k128_configs_fp32():
    """The experimental 128-wide K tile configs compute the product (TMA and pointer loads, K not a multiple of 128);
    that they give the 64-wide tile's bits is a GPU question (``test_gpu_matmul_k128_configs_give_the_k64_bits``)."""
    from dataclasses import replace
    from rlrepro.kernels import triton_matmul as mm
    fresh_seed()
    k, n = 196, 300
    w = torch.randn(n, k)
    x = torch.randn(70, k)
    expect = ref.linear(x, w)
    for i, cfg in enumerate(mm.CONFIGS_16BIT_K128.values()):
        assert cfg.block_k == 128 and cfg.block_m == 64 and cfg.name not in mm.CONFIGS_16BIT
        got = mm.matmul(x, w, config=replace(cfg, ctas_per_sm=1), use_tma=i % 2 == 0)
        e = rel_err(got, expect)
        assert e < 1e-6, (cfg.name, e)


@interp_check
def check_pick_config():
    from rlrepro.kernels import triton_matmul as mm
    for m in (1, 16, 17, 64, 65, 256, 257, 1024, 4096, 8192):
        for n in (4096, 6144, 24576, 151936):
            cfg = mm.pick_config(m, n, 4096, torch.bfloat16, 132)
            assert cfg.num_warps % 4 == 0 and cfg.block_m >= 64
            # the 128-wide K tile serves 16 < M <= 64 at narrow N only (measured there), never the pieces kernel
            narrow_small = 16 < m <= mm.SMALL_M and -(-n // 256) < mm.SMALL_M_WIDE_N_TILES
            assert cfg.block_k == (128 if narrow_small else mm.BLOCK_K_16BIT), (m, n, cfg.name)
            assert mm.pick_config(m, n, 4096, torch.bfloat16, 132, k128=False).block_k == mm.BLOCK_K_16BIT
    assert all(c.block_k == mm.BLOCK_K_16BIT for c in mm.CONFIGS_16BIT.values())
    saved = os.environ.get("RLREPRO_MATMUL_K128")
    os.environ["RLREPRO_MATMUL_K128"] = "0"  # the 64-wide tile again (same bits; for measuring)
    try:
        assert mm.pick_config(64, 4096, 4096, torch.bfloat16, 132).name == "64x64x64w4s10c1"
    finally:
        del os.environ["RLREPRO_MATMUL_K128"]
        if saved is not None:
            os.environ["RLREPRO_MATMUL_K128"] = saved
    assert mm.pick_config(5000, 4096, 4096, torch.float32, 132) == mm.CONFIG_FP32


@interp_check
def check_rowwise_fp32():
    from rlrepro.kernels import triton_ops as T
    from rlrepro.kernels import triton_rowwise as rw
    fresh_seed()
    # RMSNorm: single-block rows and rows longer than one block (chunked path)
    for d in (96, rw.MAX_ROW_BLOCK + 40):
        rows = 40 if d < 1000 else 3
        x = torch.randn(rows, d) * 3
        w = torch.randn(d)
        assert rel_err(T.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)) < 1e-6
        assert_rows_invariant(lambda t: T.rms_norm(t, w, 1e-6), x, (1, 2, rows - 2), offsets=(0, 2),
                              what=f"rms_norm d={d}")
    # per-head RMSNorm on [N, H, D] column slices of a fused q/k/v product, read in place: the same bits as the
    # contiguous copy it used to make (and as the 2-D call), for single-block and chunked rows
    for d in (24, rw.MAX_ROW_BLOCK + 8):
        qkv = torch.randn(5, 7, d) * 2
        w = torch.randn(d)
        for view in (qkv[:, 1:4], qkv[:, 4:6], qkv.transpose(0, 1)[2:5]):
            out = T.rms_norm(view, w, 1e-6)
            assert out.shape == view.shape and out.is_contiguous()
            assert torch.equal(out, T.rms_norm(view.contiguous(), w, 1e-6))
            assert torch.equal(out.reshape(-1, d), T.rms_norm(view.reshape(-1, d), w, 1e-6))
    # residual add fused into the norm (inference): the same bits as the add then the norm, sum and norm, with a
    # weight of the same or another dtype (bf16 inputs only on the GPU: the interpreter's float32 -> bf16 cast
    # does not round as the GPU's does); unsupported calls are refused with the reason
    for dtype, wdtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
        for shape in ((5, 96), (2, 3, 100)):
            x, r = (torch.randn(*shape) * 3).to(dtype), (torch.randn(*shape) * 3).to(dtype)
            w = torch.randn(shape[-1]).to(wdtype)
            total, normed = rw.add_rms_norm_fwd(x, r, w, 1e-6)
            assert torch.equal(total, x + r) and total.dtype == dtype
            assert torch.equal(normed, T.rms_norm(x + r, w, 1e-6)), (dtype, wdtype, shape)
            s2, n2 = T.add_rms_norm(x, r, w, 1e-6)
            assert torch.equal(s2, total) and torch.equal(n2, normed)
    x = torch.randn(4, rw.MAX_ROW_BLOCK + 8)
    assert not rw.add_rms_norm_supported(x, x) and not rw.add_rms_norm_supported(x[:, :96], x[:, :96])
    try:
        rw.add_rms_norm_fwd(x, x, torch.randn(x.shape[-1]), 1e-6)
        raise AssertionError("a row longer than one block was accepted")
    except ValueError as e:
        assert "rows of at most" in str(e)
    xg = torch.randn(3, 96, requires_grad=True)  # with autograd: the two ops, so gradients flow
    sg, ng = T.add_rms_norm(xg, torch.randn(3, 96), torch.randn(96), 1e-6)
    assert sg.requires_grad and ng.requires_grad
    # log-softmax: several chunks of 4096 and a tail
    x = torch.randn(6, 9000) * 4
    x[1, 5] = 60.0
    out = T.log_softmax(x)
    assert out.dtype == torch.float32
    assert (out.double() - ref.log_softmax(x)).abs().max() < 2e-5
    assert_rows_invariant(T.log_softmax, x, (1, 2, 5), offsets=(0, 1), what="log_softmax")
    x[2, 4096:8192] = float("-inf")  # a whole range of -inf (filtered tokens): its partial sum is 0, not NaN
    out = T.log_softmax(x)
    assert torch.isfinite(out[2, :4096]).all() and (out[2, 4096:8192] == float("-inf")).all()
    assert (out[2, :4096].double() - ref.log_softmax(x[2:3])[0, :4096]).abs().max() < 2e-5
    # SwiGLU, rotary, embedding
    x = torch.randn(33, 2 * 70)
    assert rel_err(T.silu_and_mul(x), ref.silu_and_mul(x)) < 1e-6
    assert_rows_invariant(T.silu_and_mul, x, (1, 2, 17, 33), offsets=(0, 1), what="silu_and_mul")
    xr = torch.randn(9, 5, 24)
    cos, sin = torch.randn(9, 12), torch.randn(9, 12)
    assert rel_err(T.apply_rope(xr, cos, sin), ref.apply_rope(xr, cos, sin)) < 1e-6
    xv = torch.randn(9, 16, 24)[:, 3:8]  # a strided view, as q sliced out of a fused qkv
    assert rel_err(T.apply_rope(xv, cos, sin), ref.apply_rope(xv, cos, sin)) < 1e-6
    w = torch.randn(50, 20)
    ids = torch.randint(0, 50, (3, 7))
    assert torch.equal(T.embedding(ids, w), w[ids])


@interp_check
def check_attention_invariance_fp32():
    from rlrepro.kernels import triton_ops as T
    # GQA group 3 (padded to 4), head dim 24 (padded to 32); sequences around the 64-wide KV tile
    check_attention_invariance(T.attention, [70, 5, 1, 66], h=6, hkv=2, d=24, dtype=torch.float32,
                               device="cpu", block_sizes=(4,), tol=1e-5)


@interp_check
def check_attention_invariance_long_tile_fp32():
    """The 256-row tile ("long"; on the GPU bf16 only) forced into every call: its logic at its query blocks' edges
    (64 tokens at GQA 4, 256 at MHA) across packed / alone / reordered / paged / chunked / decode calls."""
    from rlrepro.kernels import triton_ops as T
    os.environ["RLREPRO_ATTENTION_CONFIG"] = "long"
    try:
        check_attention_invariance(T.attention, [65, 5, 1, 130], h=8, hkv=2, d=16, dtype=torch.float32,
                                   device="cpu", block_sizes=(16,), tol=1e-5)
        check_attention_invariance(T.attention, [257, 3], h=2, hkv=2, d=16, dtype=torch.float32, device="cpu",
                                   block_sizes=(32,), tol=1e-5)
    finally:
        del os.environ["RLREPRO_ATTENTION_CONFIG"]


@interp_check
def check_attention_mha_fp32():
    from rlrepro.kernels import triton_attention as A
    from rlrepro.kernels import triton_ops as T
    check_attention_invariance(T.attention, [9, 40], h=2, hkv=2, d=16, dtype=torch.float32, device="cpu",
                               block_sizes=(32,), tol=1e-5)
    lens = [3, 150]  # every tile config (64 and 128 rows) computes the same function
    q, k, v = make_paged_case(lens, 4, 2, 16, torch.float32, "cpu")
    meta = AttentionMetadata.packed(lens)
    expect = ref.attention_packed(q, k, v, meta, 0.3)
    for name, cfg in A.ATTENTION_CONFIGS.items():
        assert rel_err(A.attention_fwd(q, k, v, meta, 0.3, config=cfg), expect) < 1e-5, name


@interp_check
def check_write_kv_cache_and_schedule_cache_fp32():
    from rlrepro.kernels import cpu as C
    from rlrepro.kernels import triton_attention as A
    from rlrepro.kernels import triton_ops as T
    # the one-launch KV write equals the two index_copy_ calls, also from a non-contiguous (fused q/k/v) view
    fresh_seed()
    nb, bs, hkv, d = 6, 4, 3, 20
    qkv = torch.randn(7, 2 + 2 * hkv, d)
    k, v = qkv[:, 2:2 + hkv], qkv[:, 2 + hkv:]
    meta = AttentionMetadata.paged([3, 4], [5, 4], [[2, 0], [5]], bs)
    caches = [(torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)) for _ in range(2)]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    A.write_kv_cache(k, v, caches[0], meta)
    C.write_kv_cache(k, v, caches[1], meta)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    # layers sharing one metadata compute the attention schedule once, with the same result as without
    q = torch.randn(7, 2 * hkv, d)
    first = T.attention(q, k, v, meta, 0.3, caches[0])
    assert any(key[0] == "attention_schedule" for key in meta.cache)
    cached = dict(meta.cache)
    again = T.attention(q, k, v, meta, 0.3, caches[0])
    assert meta.cache.keys() == cached.keys() and all(meta.cache[key] is cached[key] for key in cached)
    fresh = AttentionMetadata.paged([3, 4], [5, 4], [[2, 0], [5]], bs)
    assert torch.equal(first, again) and torch.equal(first, T.attention(q, k, v, fresh, 0.3, caches[0]))


def check_qk_norm_rope_cache_equal(device, dtype, n, h, hkv, d, nb=40, bs=16) -> None:
    """The one-pass q/k norm + rotary + cache write equals rms_norm, apply_rope and the KV write in turn: q and
    both caches bit for bit (random cache slots, a q|k|v view with a row stride, cos/sin of random positions)."""
    from rlrepro import kernels
    from rlrepro.kernels import triton_attention as A
    from rlrepro.kernels import triton_ops as T
    seed = fresh_seed()
    wide = torch.randn(n, (h + 2 * hkv) * d + 8, device=device).to(dtype) * 3
    qkv = wide[:, :(h + 2 * hkv) * d]  # a row stride other than the row's length, as a sliced product can have
    wq = (1 + 0.2 * torch.randn(d, device=device)).to(dtype)
    wk = (1 + 0.2 * torch.randn(d, device=device)).to(dtype)
    ang = torch.rand(n, d // 2, device=device) * 50
    cos, sin = ang.cos(), ang.sin()
    table = [torch.randperm(nb).tolist()]  # the sequence's blocks scattered over the pool

    def meta():
        return AttentionMetadata.paged([n], [n], table, bs, device=device)
    caches = [(torch.randn(nb, bs, hkv, d, device=device).to(dtype),
               torch.randn(nb, bs, hkv, d, device=device).to(dtype)) for _ in range(2)]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    if dtype == torch.float32 and device == "cuda":  # not served on the GPU in float32 (see the function)
        assert not A.qk_norm_rope_cache_supported(qkv, wq, wk, caches[0])
        return
    q = A.qk_norm_rope_cache(qkv, h, wq, wk, 1e-6, cos, sin, caches[0], meta())
    nq, nkv = h * d, hkv * d
    q_sep = T.apply_rope(T.rms_norm(qkv[:, :nq].view(n, h, d), wq, 1e-6), cos, sin)
    k_sep = T.apply_rope(T.rms_norm(qkv[:, nq:nq + nkv].view(n, hkv, d), wk, 1e-6), cos, sin)
    A.write_kv_cache(k_sep, qkv[:, nq + nkv:].view(n, hkv, d), caches[1], meta())
    assert torch.equal(q, q_sep), f"q differs (seed {seed})"
    assert torch.equal(caches[0][0], caches[1][0]), f"k cache differs (seed {seed})"
    assert torch.equal(caches[0][1], caches[1][1]), f"v cache differs (seed {seed})"
    # through the dispatcher (no autograd, a cache): the same attention output as the op-by-op composition
    with torch.no_grad():
        fused = kernels.qk_norm_rope_attention(qkv, h, hkv, wq, wk, 1e-6, cos, sin, meta(), 0.3, caches[0])
    with torch.enable_grad():  # autograd on: the composition
        plain = kernels.qk_norm_rope_attention(qkv, h, hkv, wq, wk, 1e-6, cos, sin, meta(), 0.3, caches[1])
    assert torch.equal(fused, plain.detach()), f"attention output differs (seed {seed})"


@interp_check
def check_qk_norm_rope_cache_fp32():
    for h, hkv, d in ((4, 2, 16), (6, 3, 20), (2, 2, 8)):  # d = 20: a head that is not a power of two
        check_qk_norm_rope_cache_equal("cpu", torch.float32, 9, h, hkv, d, nb=5, bs=4)


def _grad_pairs(device, dtype):
    """(name, fn under test, float64 reference fn, inputs) for every differentiable op."""
    from rlrepro.kernels import triton_ops as T
    lens = [9, 1, 20]
    n = sum(lens)
    meta = AttentionMetadata.packed(lens, device=device)
    meta_cpu = AttentionMetadata.packed(lens)
    ids = torch.randint(0, 30, (n,), device=device)
    ids[3] = ids[7] = ids[11] = 5  # repeated ids accumulate
    cos, sin = torch.randn(n, 8, device=device), torch.randn(n, 8, device=device)

    def r(*shape):
        return torch.randn(*shape, device=device).to(dtype)
    return [
        ("linear", lambda x, w, b: T.linear(x, w, b), lambda x, w, b: ref.linear(x, w, b),
         [r(2, 5, 24), r(40, 24), r(40)]),
        ("rms_norm", lambda x, w: T.rms_norm(x, w, 1e-6), lambda x, w: ref.rms_norm(x, w, 1e-6), [r(7, 48), r(48)]),
        ("log_softmax", T.log_softmax, ref.log_softmax, [r(5, 300)]),
        ("silu_and_mul", T.silu_and_mul, ref.silu_and_mul, [r(6, 2 * 40)]),
        ("apply_rope", lambda x: T.apply_rope(x, cos, sin), lambda x: ref.apply_rope(x, cos.cpu(), sin.cpu()),
         [r(n, 3, 16)]),
        ("embedding", lambda w: T.embedding(ids, w), lambda w: w[ids.cpu()], [r(30, 12)]),
        ("attention", lambda q, k, v: T.attention(q, k, v, meta, 0.3),
         lambda q, k, v: ref.attention_packed(q, k, v, meta_cpu, 0.3), [r(n, 4, 16), r(n, 2, 16), r(n, 2, 16)]),
    ]


def check_grads(device, dtype, tol):
    fresh_seed()
    for name, fn, ref_fn, inputs in _grad_pairs(device, dtype):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*xs)
        g_out = torch.randn_like(out, dtype=torch.float32).to(out.dtype)
        grads = torch.autograd.grad(out, xs, g_out)
        grads2 = torch.autograd.grad(fn(*xs), xs, g_out)
        xr = [t.detach().cpu().double().requires_grad_(True) for t in inputs]
        expect = torch.autograd.grad(ref_fn(*xr), xr, g_out.cpu().double())
        for i, (g, g2, e) in enumerate(zip(grads, grads2, expect)):
            assert g.dtype == inputs[i].dtype and g.shape == inputs[i].shape, (name, i)
            assert torch.equal(g, g2), f"{name}: gradient {i} differs between two runs"
            err = rel_err(g, e)
            assert err < tol, f"{name}: gradient {i} rel err {err}"


@interp_check
def check_grads_fp32():
    check_grads("cpu", torch.float32, 1e-5)


interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)


def test_attention_backward_matches_reference_cpu():
    """The packed-attention backward is torch code: check it on CPU without Triton too."""
    from rlrepro.kernels import triton_attention as A
    fresh_seed()
    lens = [13, 1, 40]
    n = sum(lens)
    meta = AttentionMetadata.packed(lens)
    q, k, v = torch.randn(n, 6, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    g = torch.randn(n, 6, 8)
    dq, dk, dv = A.attention_bwd_packed(q, k, v, g, meta, 0.4, max_scores_bytes=2000)  # forces head chunks
    xr = [t.double().requires_grad_(True) for t in (q, k, v)]
    expect = torch.autograd.grad(ref.attention_packed(*xr, meta, 0.4), xr, g.double())
    for got, e in zip((dq, dk, dv), expect):
        assert rel_err(got, e) < 1e-5


def test_attention_config_choice(monkeypatch):
    """Which tile config a call gets (speed only; the GPU test below checks that all give the same bits)."""
    from rlrepro.kernels import triton_attention as A
    monkeypatch.delenv("RLREPRO_ATTENTION_CONFIG", raising=False)
    pick = A.pick_attention_config
    assert pick(64, 64, 4) is A.ATTENTION_CONFIGS["decode"]  # a decode step: one query per sequence
    assert pick(256, 64, 4) is A.ATTENTION_CONFIGS["decode"]  # up to 16 rows / 4 heads = 4 queries each
    assert pick(257, 64, 4) is A.ATTENTION_CONFIGS["small"]  # a mixed step
    assert pick(64, 64, 32) is A.ATTENTION_CONFIGS["small"]  # 32 heads per KV head do not fit 16 rows
    assert pick(64) is A.ATTENTION_CONFIGS["small"]  # sequence count unknown
    for dtype in (torch.float32, torch.float16):  # decode's bits are proven for bf16 only
        assert pick(64, 64, 4, dtype) is A.ATTENTION_CONFIGS["small"]
    assert pick(A.LARGE_MIN_TOKENS, A.LARGE_MIN_TOKENS, 4) is A.ATTENTION_CONFIGS["large"]  # decodes + a chunk
    # long query runs (prefill, the trainer): the 256-row tile, from LONG_MIN_QUERIES queries a sequence on average
    assert pick(A.LARGE_MIN_TOKENS, 1, 4) is A.ATTENTION_CONFIGS["long"]
    n = 16 * A.LONG_MIN_QUERIES
    assert pick(n, 16, 4) is A.ATTENTION_CONFIGS["long"]
    assert pick(n, 17, 4) is A.ATTENTION_CONFIGS["large"]
    assert pick(n, 0, 4) is A.ATTENTION_CONFIGS["large"]  # sequence count unknown
    for dtype in (torch.float32, torch.float16):  # bf16 only, as "decode"
        assert pick(n, 1, 4, dtype) is A.ATTENTION_CONFIGS["large"]
    assert pick(n, 1, 4, head_dim=A.LONG_MAX_HEAD_DIM) is A.ATTENTION_CONFIGS["long"]
    assert pick(n, 1, 4, head_dim=A.LONG_MAX_HEAD_DIM + 1) is A.ATTENTION_CONFIGS["large"]  # would not fit
    monkeypatch.setenv("RLREPRO_ATTENTION_CONFIG", "large3")
    assert pick(1, 1, 4) is A.ATTENTION_CONFIGS["large3"]
    monkeypatch.setenv("RLREPRO_ATTENTION_CONFIG", "huge")
    with pytest.raises(ValueError, match="RLREPRO_ATTENTION_CONFIG='huge'.*decode"):
        pick(1, 1, 4)


# ============================================================================================ GPU
def _cuda_seed():
    return fresh_seed()  # (seeds CUDA too)


MATMUL_MS = list(range(1, 300)) + [383, 384, 385, 511, 512, 513, 767, 768, 769, 1023, 1024, 1025, 2047, 2048,
                                   2049, 3000, 4095, 4096, 4097]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [2088, 1003])  # 2088: TMA kernel, crosses large-config choices; 1003: pointer kernel
def test_gpu_matmul_batch_invariant(dtype, n):
    from rlrepro.kernels import triton_matmul as mm
    seed = _cuda_seed()
    k = 1032 if n == 1003 else 1024
    w = torch.randn(n, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    full = torch.randn(4100, k, device="cuda").to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(mm.matmul(full[:700], w, b), ref.linear(full[:700].cpu(), w.cpu(), b.cpu())) < tol
    ms = MATMUL_MS if dtype != torch.float32 else MATMUL_MS[::7] + MATMUL_MS[-9:]
    checked = assert_rows_invariant(lambda x: mm.matmul(x, w, b), full, ms, what=f"matmul {dtype} n={n} seed={seed}")
    assert checked > len(ms)


@gpu
@needs_cuda
def test_gpu_matmul_all_configs_agree_and_use_wgmma():
    """Proof that tile M/N sizes, warps, stages, grid and TMA-vs-pointer loads leave each element's K reduction
    unchanged: every config gives the same bits, and every one compiles to Hopper wgmma."""
    from rlrepro.kernels import triton_matmul as mm
    seed = _cuda_seed()
    dtype = torch.bfloat16
    k, n = 4096, 1536
    w = torch.randn(n, k, device="cuda").to(dtype)
    x = torch.randn(333, k, device="cuda").to(dtype)
    expect = mm.matmul(x, w)
    for name, cfg in mm.CONFIGS_16BIT.items():
        for tma in (True, False):
            got = mm.matmul(x, w, config=cfg, use_tma=tma)
            assert torch.equal(got, expect), f"config {name} (tma={tma}) differs (seed {seed})"
    _assert_16bit_matmuls_use_wgmma()


def _assert_16bit_matmuls_use_wgmma():
    """On Hopper, every compiled 16-bit matmul kernel in Triton's cache runs wgmma (never mma.sync)."""
    from rlrepro.kernels import triton_matmul as mm
    if torch.cuda.get_device_capability()[0] != 9:
        return
    for fn in (mm._mm_tma_kernel, mm._mm_ptr_kernel):
        ptxs = [kern.asm["ptx"] for cache in fn.device_caches.values() for kern in cache[0].values()]
        assert ptxs, "no compiled kernels found in Triton's cache"
        for ptx in ptxs:
            if ".bf16" in ptx or ".f16" in ptx:
                assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx


@gpu
@needs_cuda
def test_gpu_matmul_k128_configs_give_the_k64_bits():
    """The experimental 128-wide K tile configs against the shipped 64-wide tile: the same bits (``torch.equal``) at
    decode-sized M and the Qwen3-8B projections' K, TMA and pointer loads, and wgmma. Passing is what would let the
    small-M choice take them (``triton_matmul.CONFIGS_16BIT_K128``)."""
    from rlrepro.kernels import triton_matmul as mm
    seed = _cuda_seed()
    dtype = torch.bfloat16
    for k, n in ((4096, 1536), (12288, 4096), (4096, 24576)):
        w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
        for m in (1, 7, 16, 64):
            x = torch.randn(m, k, device="cuda").to(dtype)
            expect = mm.matmul(x, w, config=mm.CONFIGS_16BIT["64x128x64w4s8c1"])
            assert torch.equal(mm.matmul(x, w), expect), f"the shipped small-M configs differ (seed {seed})"
            for name, cfg in mm.CONFIGS_16BIT_K128.items():
                for tma in (True, False):
                    got = mm.matmul(x, w, config=cfg, use_tma=tma)
                    assert torch.equal(got, expect), f"{name} (tma={tma}) at {m}x{k}x{n} differs (seed {seed})"
    _assert_16bit_matmuls_use_wgmma()


@gpu
@needs_cuda
def test_gpu_rowwise_batch_invariant():
    from rlrepro.kernels import triton_ops as T
    seed = _cuda_seed()
    ms = list(range(1, 140)) + [255, 256, 257, 1000]
    x = torch.randn(1100, 4096, device="cuda").to(torch.bfloat16) * 2
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    assert rel_err(T.rms_norm(x[:64], w, 1e-6), ref.rms_norm(x[:64].cpu(), w.cpu(), 1e-6)) < 1e-2
    assert_rows_invariant(lambda t: T.rms_norm(t, w, 1e-6), x, ms, what=f"rms_norm seed={seed}")
    r = torch.randn(1100, 4096, device="cuda").to(torch.bfloat16)
    total, normed = T.add_rms_norm(x, r, w, 1e-6)  # the inference-fused add + norm == the add, then the norm
    assert torch.equal(total, x + r) and torch.equal(normed, T.rms_norm(x + r, w, 1e-6)), f"seed={seed}"
    xs = torch.randn(1100, 2 * 3072, device="cuda").to(torch.bfloat16)
    assert rel_err(T.silu_and_mul(xs[:64]), ref.silu_and_mul(xs[:64].cpu())) < 1e-2
    assert_rows_invariant(T.silu_and_mul, xs, ms, what="silu_and_mul")
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(300, 151936, device="cuda") * 4).to(dtype)
        out = T.log_softmax(logits[:8])
        assert out.dtype == torch.float32
        assert (out.double().cpu() - ref.log_softmax(logits[:8].cpu())).abs().max() < 1e-4
        assert_rows_invariant(T.log_softmax, logits, list(range(1, 70)) + [127, 128, 129, 257],
                              what=f"log_softmax {dtype}")
    q = torch.randn(600, 8, 128, device="cuda").to(torch.bfloat16)
    cos, sin = torch.randn(600, 64, device="cuda"), torch.randn(600, 64, device="cuda")
    assert rel_err(T.apply_rope(q, cos, sin), ref.apply_rope(q.cpu(), cos.cpu(), sin.cpu())) < 1e-2
    full = T.apply_rope(q, cos, sin)
    for m in (1, 7, 64, 65, 300):
        assert torch.equal(T.apply_rope(q[5:5 + m], cos[5:5 + m], sin[5:5 + m]), full[5:5 + m])
    emb = torch.randn(1000, 256, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 1000, (3, 77), device="cuda")
    assert torch.equal(T.embedding(ids, emb), emb[ids])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_qk_norm_rope_cache_equals_separate_ops(dtype):
    """bfloat16/float16: equal bits; float32: refused (not served), so the engine runs the separate kernels."""
    for n, h, hkv, d in ((64, 32, 8, 128), (300, 32, 8, 128), (1, 4, 2, 16), (77, 6, 3, 64)):
        check_qk_norm_rope_cache_equal("cuda", dtype, n, h, hkv, d, nb=max(40, n // 16 + 1))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_attention_packed_paged_chunked_equal(dtype):
    from rlrepro.kernels import triton_ops as T
    _cuda_seed()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    lens = [300, 129, 64, 1, 77] if dtype == torch.bfloat16 else [130, 1, 65]
    check_attention_invariance(T.attention, lens, h=8, hkv=2, d=128, dtype=dtype, device="cuda",
                               block_sizes=(16, 256), tol=tol)


@gpu
@needs_cuda
def test_gpu_attention_configs_agree(monkeypatch):
    """The 16-, 64- and 128-row attention tiles give the same bits, so the tile may follow the call's size: with a
    low switch-over, packed / chunked / decode calls mix both configs and still agree bitwise."""
    from rlrepro.kernels import triton_attention_fwd as A  # LARGE_MIN_TOKENS is read there
    from rlrepro.kernels import triton_ops as T
    seed = _cuda_seed()
    lens = [300, 129, 1, 77]
    for h, hkv in ((8, 2), (32, 8), (16, 16)):  # GQA groups of 4 (Qwen3-8B) and 1
        q, k, v = make_paged_case(lens, h, hkv, 128, torch.bfloat16, "cuda")
        meta = AttentionMetadata.packed(lens, device="cuda")
        outs = {name: A.attention_fwd(q, k, v, meta, 0.09, config=cfg) for name, cfg in A.ATTENTION_CONFIGS.items()}
        first = next(iter(outs.values()))
        for name, out in outs.items():
            assert torch.equal(out, first), f"attention config {name} differs (h={h}, hkv={hkv}; seed {seed})"
    monkeypatch.setattr(A, "LARGE_MIN_TOKENS", 64)
    check_attention_invariance(T.attention, lens, h=8, hkv=2, d=128, dtype=torch.bfloat16, device="cuda",
                               block_sizes=(16,), tol=2e-2)


@gpu
@needs_cuda
def test_gpu_long_tile_refuses_what_does_not_fit(monkeypatch):
    """The 256-row tile forced on float32 (or heads over 128) would not fit in shared memory: a clear error."""
    from rlrepro.kernels import triton_attention_fwd as A
    lens = [300]
    meta = AttentionMetadata.packed(lens, device="cuda")
    q, k, v = make_paged_case(lens, 8, 2, 128, torch.float32, "cuda")
    monkeypatch.setenv("RLREPRO_ATTENTION_CONFIG", "long")
    with pytest.raises(ValueError, match="RLREPRO_ATTENTION_CONFIG='long'.*16-bit.*choose 'large'"):
        A.attention_fwd(q, k, v, meta, 0.1)


@gpu
@needs_cuda
def test_gpu_attention_through_dispatch():
    """kernels.attention on CUDA in deterministic mode reaches the Triton kernel and agrees with fast mode."""
    from rlrepro import kernels
    _cuda_seed()
    lens = [50, 200]
    meta = AttentionMetadata.packed(lens, device="cuda")
    q, k, v = make_paged_case(lens, 4, 4, 64, torch.bfloat16, "cuda")
    det = kernels.attention(q, k, v, meta, 0.125)
    with kernels.mode("fast"):
        fast = kernels.attention(q, k, v, meta, 0.125)
    assert rel_err(det, fast) < 2e-2


@gpu
@needs_cuda
def test_gpu_grads():
    check_grads("cuda", torch.float32, 1e-4)
    check_grads("cuda", torch.bfloat16, 3e-2)


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
