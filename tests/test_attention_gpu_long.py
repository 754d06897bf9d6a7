"""Attention on CUDA at the forward kernel's tile boundaries and at long context (issue #27), and the fast mode's
flashinfer attention (run by scripts/gpu_check.sh on the H200; skipped without CUDA, the flashinfer tests also
without flashinfer).

* packed == each sequence alone == reordered == paged (one step, chunked prefill, decode), bitwise, for lengths on
  both sides of the 64-position KV tiles and the query tiles (32 and 64 tokens at GQA 4: the 128- and 256-row
  tiles, the latter also forced into most calls), where the kernel switches between its mask-free loop over whole
  tiles and its masked loop;
* the tensor-descriptor (TMA) loads give the bits of the pointer loads;
* engine == trainer at an 8k-token context (chunked prefill, paged decode vs the full-sequence forward);
* the Triton backward against a float64 autograd reference; the forward's log-sum-exp (written for the backward)
  changes no output bit; the backward's descriptor loads equal its pointer loads;
* fast mode: flashinfer's ragged / paged-prefill / decode paths agree with the float64 reference to bf16
  tolerance, and the engine's fast mode decodes through CUDA graphs on flashinfer.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from _triton_helpers import fresh_seed, rel_err
from rlrepro import kernels
from rlrepro.kernels import reference as ref
from rlrepro.kernels.metadata import AttentionMetadata
from test_triton_kernels import check_attention_invariance, make_paged_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# around the 64-position KV tiles and the query tiles: 16/32/64 tokens (16-, 128-, 256-row tiles at GQA 4), 16/64/
# 128/256 tokens at MHA
BOUNDARY_LENS = [63, 64, 65, 127, 128, 129, 31, 32, 33, 191, 1, 255, 256, 257]


def _seed() -> int:
    seed = fresh_seed()
    torch.manual_seed(seed)
    return seed


@pytest.mark.parametrize("tiles", ["default", "long"])
@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
def test_gpu_attention_tile_boundaries_bitwise(h, hkv, tiles, monkeypatch):
    """``long``: the 256-row tile takes every call of at least 64 queries that averages 16 a sequence, so the
    packed batch, most sequences alone and the chunks run it while decode steps run the 16- and 64-row tiles."""
    from rlrepro.kernels import triton_attention_fwd as A
    from rlrepro.kernels import triton_ops as T
    _seed()
    if tiles == "long":
        monkeypatch.setattr(A, "LARGE_MIN_TOKENS", 64)
        monkeypatch.setattr(A, "LONG_MIN_QUERIES", 16)
    check_attention_invariance(T.attention, BOUNDARY_LENS, h=h, hkv=hkv, d=128, dtype=torch.bfloat16,
                               device="cuda", block_sizes=(16, 64), tol=2e-2)


def test_gpu_attention_descriptor_loads_equal_pointer_loads(monkeypatch):
    """Descriptor (TMA) and pointer loads give the same bits, in every tile config: the 128-row tiles read packed KV
    by descriptors by default, the 256-row tile ("long") by pointers; here each config is run both ways."""
    from rlrepro.kernels import triton_attention_fwd as A
    seed = _seed()
    lens = [2048, 700, 65, 1, 4100]
    monkeypatch.setattr(A, "DESC_MAX_ROWS", max(c.rows for c in A.ATTENTION_CONFIGS.values()))
    for h, hkv in ((32, 8), (16, 16)):
        q, k, v = make_paged_case(lens, h, hkv, 128, torch.bfloat16, "cuda")
        meta = AttentionMetadata.packed(lens, device="cuda")
        assert A._use_descriptors(k, v) == (torch.cuda.get_device_capability()[0] >= 9)
        # K/V as slices of a fused q|k|v row (the trainer's layout): strided rows, still descriptor-loadable
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        nq, nk = h * 128, hkv * 128
        ks = qkv[:, nq:nq + nk].view(-1, hkv, 128)
        vs = qkv[:, nq + nk:].view(-1, hkv, 128)
        first = None
        for name in ("large", "long"):
            cfg = A.ATTENTION_CONFIGS[name]
            tma = A.attention_fwd(q, k, v, meta, 0.088, config=cfg)
            strided = A.attention_fwd(q, ks, vs, meta, 0.088, config=cfg)
            monkeypatch.setenv("RLREPRO_ATTENTION_TMA", "0")
            ptr = A.attention_fwd(q, k, v, meta, 0.088, config=cfg)
            monkeypatch.delenv("RLREPRO_ATTENTION_TMA")
            assert torch.equal(tma, ptr), f"{name}: descriptor loads differ from pointer loads (h={h}; seed {seed})"
            assert torch.equal(strided, ptr), f"{name}: strided K/V differ (h={h}; seed {seed})"
            first = ptr if first is None else first
            assert torch.equal(ptr, first), f"{name} differs from large (h={h}; seed {seed})"


def test_gpu_engine_equals_trainer_at_8k_context():
    """An 8,200-token prompt, prefilled in chunks and decoded from the paged cache, gives logprobs equal to the
    trainer's full-sequence forward with autograd (the packed kernel, TMA loads) bit for bit."""
    _seed()
    check_engine_equals_trainer_at_8k()


def check_engine_equals_trainer_at_8k(engine_check=None):
    """The 8k engine == trainer check; ``engine_check(engine)`` runs on the engine before it generates."""
    from rlrepro.model import tiny_model
    from rlrepro.rollout import Engine, SamplingParams
    model = tiny_model(seed=3, dtype=torch.bfloat16, initializer_range=0.3, head_dim=128, num_attention_heads=8,
                       num_key_value_heads=2, hidden_size=256, max_position_embeddings=9000).cuda()
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, model.config.vocab_size, (8200,), generator=g).tolist()
    engine = Engine(model, device="cuda", max_num_batched_tokens=1536, num_kv_blocks=1200, max_num_seqs=4,
                    max_model_len=8300)
    if engine_check is not None:
        engine_check(engine)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    outs = engine.generate([prompt, prompt[:5000]], [params, params])
    assert engine.runner.num_graph_steps > 0
    for p, out in zip((prompt, prompt[:5000]), outs):
        ids = torch.tensor([p + out.token_ids], device="cuda")
        with torch.enable_grad():
            logits = model(ids)[0, len(p) - 1:-1].detach()
        want = kernels.token_logprob(logits, torch.tensor(out.token_ids, device="cuda"), 1.0)
        assert torch.equal(torch.tensor(out.logprobs, dtype=torch.float32, device="cuda"), want)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_gpu_attention_backward_vs_float64(dtype, tol):
    from rlrepro.kernels.triton_attention import attention_bwd_packed_triton, attention_fwd
    seed = _seed()
    lens = [1500, 700, 65, 64, 1]
    h, hkv, d = 8, 2, 128
    q, k, v = make_paged_case(lens, h, hkv, d, dtype, "cuda")
    go = torch.randn_like(q)
    scale = d ** -0.5
    meta = AttentionMetadata.packed(lens, device="cuda")
    out = attention_fwd(q, k, v, meta, scale)
    dq, dk, dv = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    o64 = ref.attention_packed(q64, k64, v64, AttentionMetadata.packed(lens), scale)
    o64.backward(go.double().cpu())
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        err = rel_err(got, want)
        assert err < tol, f"{name} vs float64: rel err {err} (seed {seed})"
    again = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_forward_lse_changes_no_bit_and_backward_loads_agree(monkeypatch, dtype):
    """The trainer's forward writes the log-sum-exp, the engine's does not: the outputs are equal bit for bit, the
    lse is the float64 one (base 2); the backward with tensor-descriptor loads equals it with pointer loads, and a
    sequence's gradients alone equal those in the batch, at the backward's tile boundaries (64-position KV tiles,
    16/8-token query tiles, the masked diagonal and tail steps)."""
    import math

    from rlrepro.kernels.triton_attention import attention_bwd_packed_triton, attention_fwd
    seed = _seed()
    lens = [129, 63, 64, 65, 1, 200, 1100]
    h, hkv, d = 32, 8, 128
    q, k, v = make_paged_case(lens, h, hkv, d, dtype, "cuda")
    go = torch.randn_like(q)
    scale = d ** -0.5
    meta = AttentionMetadata.packed(lens, device="cuda")
    out, lse = attention_fwd(q, k, v, meta, scale, return_lse=True)
    assert torch.equal(out, attention_fwd(q, k, v, meta, scale)), f"writing the lse changed the output (seed {seed})"
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    for a, b in zip(cu[:-1], cu[1:]):  # lse64[i, h] = log2 sum_{j <= i} exp(scale * q_i . k_j)
        qs, ks = q[a:b].double(), k[a:b].double().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        want = (torch.logsumexp(s, dim=-1) / math.log(2)).transpose(0, 1)
        assert float((lse[a:b].double() - want).abs().max()) < (1e-4 if dtype == torch.float32 else 5e-2), seed
    grads = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, attention_bwd_packed_triton(q, k, v, go, meta, scale))), \
        f"the backward from the forward's lse differs from one that recomputes it (seed {seed})"
    monkeypatch.setenv("RLREPRO_ATTENTION_TMA", "0")
    ptr = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse)
    monkeypatch.delenv("RLREPRO_ATTENTION_TMA")
    assert all(torch.equal(a, b) for a, b in zip(grads, ptr)), f"descriptor loads differ (seed {seed})"
    for i in (0, len(lens) - 1, 5):
        sl = slice(cu[i], cu[i + 1])
        alone = attention_bwd_packed_triton(*(t[sl].contiguous() for t in (q, k, v, go)),
                                            AttentionMetadata.packed([lens[i]], device="cuda"), scale,
                                            out=out[sl].contiguous(), lse=lse[sl].contiguous())
        assert all(torch.equal(a, b[sl]) for a, b in zip(alone, grads)), f"sequence {i} alone differs (seed {seed})"


# ------------------------------------------------------------------------------------------ fast mode: flashinfer
def _flashinfer():
    from rlrepro.kernels.flashinfer_attention import flashinfer_module
    fi = flashinfer_module()
    if fi is None:
        pytest.skip("flashinfer is not installed (pip install 'rlrepro[flashinfer]')")
    return fi


def test_gpu_fast_mode_flashinfer_paths_match_reference():
    from rlrepro.kernels import flashinfer_attention as FA
    _flashinfer()
    seed = _seed()
    lens = [700, 65, 1, 300]
    h, hkv, d = 32, 8, 128
    q, k, v = make_paged_case(lens, h, hkv, d, torch.bfloat16, "cuda")
    scale = d ** -0.5
    meta = AttentionMetadata.packed(lens, device="cuda")
    want = ref.attention_packed(q.cpu(), k.cpu(), v.cpu(), AttentionMetadata.packed(lens), scale)
    assert FA.supports(q)
    with torch.no_grad(), kernels.mode("fast"):
        got = kernels.attention(q, k, v, meta, scale)
    assert meta.cache.get(("flashinfer", "planned"))[1] == "ragged"
    assert rel_err(got, want) < 2e-2, f"ragged prefill (seed {seed})"
    # paged: prefill the first 60 % of each sequence, then one chunk with the rest, then decode the last token
    bs = 16
    nb = sum(-(-n // bs) for n in lens) + 1
    cache = (torch.zeros(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16),
             torch.zeros(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16))
    tables, b0 = [], 0
    for n in lens:
        tables.append(list(range(b0, b0 + -(-n // bs))))
        b0 += len(tables[-1])
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    outs = torch.empty_like(want)
    splits = [[0, max(1, int(n * 0.6)), n - 1, n] if n > 2 else [0, n] for n in lens]
    kinds = []  # the flashinfer path each step took
    for step in range(3):
        qs, ks, vs, qlens, kvlens, slots, rows = [], [], [], [], [], [], []
        for s, n in enumerate(lens):
            if step + 1 >= len(splits[s]):
                continue
            a, b = splits[s][step], splits[s][step + 1]
            if a == b:
                continue
            sl = slice(cu[s] + a, cu[s] + b)
            qs.append(q[sl]), ks.append(k[sl]), vs.append(v[sl])
            qlens.append(b - a), kvlens.append(b)
            slots += [tables[s][p // bs] * bs + p % bs for p in range(a, b)]
            rows.append((s, a, b))
        pm = AttentionMetadata.paged(qlens, kvlens, [tables[s] for s, _, _ in rows], bs, "cuda")
        assert pm.slot_mapping.tolist() == slots
        with torch.no_grad(), kernels.mode("fast"):
            o = kernels.attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), pm, scale, cache)
        kinds.append(pm.cache[("flashinfer", "planned")][1])
        off = 0
        for s, a, b in rows:
            outs[cu[s] + a:cu[s] + b] = o[off:off + b - a].cpu().to(outs.dtype)
            off += b - a
    assert kinds == ["paged_prefill", "paged_prefill", "decode"]
    assert rel_err(outs, want) < 2e-2, f"paged prefill / decode (seed {seed})"


def test_gpu_fast_mode_engine_decodes_on_flashinfer_graphs():
    from rlrepro.model import tiny_model
    from rlrepro.rollout import Engine, SamplingParams
    _flashinfer()
    _seed()
    model = tiny_model(seed=3, dtype=torch.bfloat16, initializer_range=0.3, head_dim=128, num_attention_heads=8,
                       num_key_value_heads=2, hidden_size=256).cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 300, 40, 129)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    det = Engine(model, device="cuda", num_kv_blocks=256).generate(prompts, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns: it must not happen
        fast = Engine(model, device="cuda", deterministic=False, num_kv_blocks=256)
    assert fast.runner._fi_graphs, "fast mode did not plan flashinfer decode graphs"
    outs = fast.generate(prompts, params)
    assert fast.runner.num_graph_steps > 0
    # not bitwise (fast mode): greedy tokens agree with the deterministic engine for most positions, and every
    # logprob is close to the deterministic one where the tokens agree
    agree = sum(a == b for o, r in zip(outs, det) for a, b in zip(o.token_ids, r.token_ids))
    assert agree >= 0.75 * sum(len(r.token_ids) for r in det)
    first = [o.logprobs[0] for o in outs], [r.logprobs[0] for r in det]
    assert max(abs(a - b) for a, b in zip(*first)) < 0.05


def test_gpu_fast_graph_decode_plans_without_waiting_and_stays_right():
    """The fast mode's decode plan stages the page table without making the host wait for the device's queue;
    back-to-back plans while the GPU is busy (the host runs ahead, as the engine does) must give the outputs of
    plans made on an idle GPU: flashinfer's pinned staging buffer is not overwritten before its copy ran."""
    from rlrepro.kernels.flashinfer_attention import GraphDecode
    _flashinfer()
    _seed()
    b, page, h, hkv, d, blocks = 8, 16, 8, 2, 128, 96
    kc = torch.randn(blocks, page, hkv, d, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    g = torch.Generator().manual_seed(5)
    cases = []
    for _ in range(12):
        lens = torch.randint(1, 6 * page, (b,), generator=g).tolist()
        perm = torch.randperm(blocks, generator=g).tolist()
        tables = [perm[6 * r:6 * r + 6] for r in range(b)]
        cases.append((lens, tables, torch.randn(b, h, d, generator=g).to(torch.bfloat16).cuda()))
    gd = GraphDecode(b, b * 6, h, hkv, d, page, torch.bfloat16, torch.device("cuda"), d ** -0.5)
    want = []
    for lens, tables, q in cases:
        gd.plan(lens, tables)
        torch.cuda.synchronize()
        want.append(gd.wrapper.run(q, (kc, vc)).clone())
        torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    got = []
    for lens, tables, q in cases:
        for _ in range(4):
            busy = (busy @ busy).clamp_(-1, 1)  # long device work queued ahead of the plan's copies
        gd.plan(lens, tables)
        got.append(gd.wrapper.run(q, (kc, vc)))
    torch.cuda.synchronize()
    for i, (a, w) in enumerate(zip(got, want)):
        assert torch.equal(a, w), i
