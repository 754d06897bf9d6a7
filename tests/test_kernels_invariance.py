"""Deterministic-mode kernels on CPU: a row's result is bitwise independent of the batch it is computed in.

Every test draws fresh random inputs and compares with ``torch.equal``; closeness to the float64 reference is
checked separately with a tolerance.
"""
import random

import pytest
import torch

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata
from rlrepro.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16]


def _batched_rows_equal(fn, x_all: torch.Tensor, sizes, probe: int = 0) -> None:
    """fn applied to rows [start:start+m] must give row `start+probe` the same bits as fn on that row alone."""
    alone = fn(x_all[probe:probe + 1])[0]
    for m in sizes:
        for start in {0, max(0, probe - m + 1)}:
            if start > probe or probe >= start + m:
                continue
            out = fn(x_all[start:start + m])
            assert torch.equal(out[probe - start], alone), f"row changed with M={m}, start={start}"


@pytest.mark.parametrize("dtype", DTYPES)
# (64, 131), (1024, 60), (4096, 10): float32 shapes where torch's bmm of one row took another route than of two
@pytest.mark.parametrize("k,n", [(64, 96), (256, 768), (96, 61), (64, 131), (1024, 60), (4096, 10)])
def test_linear_batch_invariant(dtype, k, n):
    torch.manual_seed(random.randrange(1 << 30))
    w = torch.randn(n, k, dtype=dtype)
    x = torch.randn(130, k, dtype=dtype)
    probe = random.randrange(0, 64)
    _batched_rows_equal(lambda t: kernels.linear(t, w), x, [1, 2, 3, 7, 16, 31, 64, 65, 127, 130], probe)
    # the same row at every position of a batch
    row = x[probe:probe + 1]
    alone = kernels.linear(row, w)[0]
    for pos in (0, 5, 17, 63):
        batch = torch.randn(64, k, dtype=dtype)
        batch[pos] = row[0]
        assert torch.equal(kernels.linear(batch, w)[pos], alone)


# a prompt of the tiny model whose bf16 k_proj rows torch's CPU bmm rounded differently in batches of 1-2 rows
# (offsets 7, 8, 19, 20, 41, 42) than in batches of 3 or more, so chunked prefill changed the engine's tokens
BF16_PROMPT = [59, 53, 34, 43, 25, 53, 45, 33, 17, 33, 51, 15, 54, 13, 57, 43, 37, 52, 26, 37, 17, 28, 31, 42, 41, 44,
               58, 50, 22, 5, 20, 39, 7, 31, 37, 40, 21, 54, 12, 15, 1, 46, 17, 7, 45]


def test_bf16_linear_rows_do_not_depend_on_a_small_batch():
    from rlrepro.model import tiny_model
    from rlrepro.rollout import Engine, SamplingParams

    model = tiny_model(seed=3, initializer_range=0.3, dtype=torch.bfloat16)
    with torch.no_grad(), kernels.mode("deterministic"):
        layer = model.model.layers[0]
        h = layer.input_layernorm(model.model.embed_tokens(torch.tensor(BF16_PROMPT)))
        w = layer.self_attn.k_proj.weight
        full = kernels.linear(h, w)
        for m in (1, 2, 3):
            for p in range(len(BF16_PROMPT) - m + 1):
                assert torch.equal(full[p:p + m], kernels.linear(h[p:p + m].clone(), w)), (m, p)
    # end to end: prefill in chunks of 1 or 2 tokens gives the tokens and logprobs of one whole prefill
    sp = SamplingParams(temperature=0.7, top_k=7, max_tokens=6, seed=898667)
    outs = [Engine(model, block_size=8, max_num_batched_tokens=b).generate([BF16_PROMPT], sp)[0] for b in (4096, 2, 1)]
    assert all(o.token_ids == outs[0].token_ids and o.logprobs == outs[0].logprobs for o in outs[1:])


def test_linear_backward_matches_autograd_reference_and_repeats_exactly():
    """The CPU linear's own backward: gradients close to F.linear's, bit-identical on a second call, the input
    gradient of a row independent of its batch, and no [M, K, N] buffer (this shape would need ~20 GB)."""
    torch.manual_seed(1)
    w = torch.randn(40000, 64, requires_grad=True)
    x = torch.randn(2000, 64, requires_grad=True)
    g = torch.randn(2000, 40000)

    def grads(xx):
        xx = xx.detach().requires_grad_(True)
        w.grad = None
        kernels.linear(xx, w).backward(g[:xx.shape[0]])
        return xx.grad, w.grad.clone()

    gx, gw = grads(x)
    gx2, gw2 = grads(x)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2)
    rx, rw = torch.autograd.grad(torch.nn.functional.linear(x, w), (x, w), g)
    # sums of 40,000 (gx) and 2,000 (gw) products of unit normals: entries of size ~200 and ~45
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=2e-2)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=5e-3)
    gx_small, _ = grads(x[:7])
    assert torch.equal(gx_small, gx[:7])


def test_stock_linear_is_not_batch_invariant_but_fast_mode_is_close():
    """The reason the deterministic path exists; also checks the fast mode is the stock one."""
    torch.manual_seed(0)
    w = torch.randn(768, 256)
    x = torch.randn(300, 256)
    with kernels.mode("fast"):
        changed = any(not torch.equal(kernels.linear(x[:m], w)[0], kernels.linear(x[:1], w)[0])
                      for m in range(1, 300, 7))
    assert changed
    torch.testing.assert_close(kernels.linear(x, w).double(), ref.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_invariant_and_close(dtype):
    torch.manual_seed(random.randrange(1 << 30))
    x = torch.randn(257, 384, dtype=dtype) * 3
    w = torch.randn(384, dtype=dtype)
    _batched_rows_equal(lambda t: kernels.rms_norm(t, w, 1e-6), x, [1, 2, 8, 33, 128, 257], probe=random.randrange(8))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6).double(), ref.rms_norm(x, w, 1e-6), rtol=tol, atol=tol)


@pytest.mark.parametrize("vocab", [61, 5000, 151936])
def test_log_softmax_and_token_logprob_invariant(vocab):
    torch.manual_seed(random.randrange(1 << 30))
    rows = 40 if vocab > 10000 else 200
    x = torch.randn(rows, vocab) * 4
    _batched_rows_equal(kernels.log_softmax, x, [1, 2, 9, rows // 2, rows], probe=1)
    ids = torch.randint(0, vocab, (rows,))
    full = kernels.token_logprob(x, ids, temperature=0.7)
    for i in (0, 1, rows - 1):
        assert torch.equal(kernels.token_logprob(x[i:i + 1], ids[i:i + 1], temperature=0.7)[0], full[i])
    assert full.dtype == torch.float32
    expected = ref.log_softmax(x.double() / 0.7).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-5)


def test_token_logprob_greedy_reports_untempered():
    x = torch.randn(3, 11)
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(kernels.token_logprob(x, ids, 0.0), kernels.token_logprob(x, ids, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_invariant_and_close(dtype):
    torch.manual_seed(random.randrange(1 << 30))
    x = torch.randn(300, 2 * 173, dtype=dtype) * 4
    _batched_rows_equal(kernels.silu_and_mul, x, [1, 2, 3, 5, 77, 150, 300], probe=random.randrange(3))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernels.silu_and_mul(x).double(), ref.silu_and_mul(x), rtol=tol, atol=tol)


def test_stock_silu_rounds_by_position_which_is_why_it_is_composed():
    """F.silu's vectorised body and scalar tail disagree in the last bit for some inputs."""
    torch.manual_seed(0)
    x = torch.randn(4000) * 5
    full = torch.nn.functional.silu(x)
    single = torch.stack([torch.nn.functional.silu(x[i:i + 1])[0] for i in range(4000)])
    assert not torch.equal(full, single)
    ours_full = kernels.silu_and_mul(torch.stack([x, torch.ones_like(x)], -1).reshape(1, -1, 2).transpose(1, 2)
                                     .reshape(1, -1))[0]
    ours_single = torch.cat([kernels.silu_and_mul(torch.tensor([[v, 1.0]]))[0] for v in x.tolist()])
    assert torch.equal(ours_full, ours_single)


def test_rope_and_embedding_invariant():
    torch.manual_seed(random.randrange(1 << 30))
    x = torch.randn(100, 4, 32)
    cos, sin = torch.randn(100, 16), torch.randn(100, 16)
    out = kernels.apply_rope(x, cos, sin)
    for i in (0, 50, 99):
        assert torch.equal(kernels.apply_rope(x[i:i + 1], cos[i:i + 1], sin[i:i + 1])[0], out[i])
    torch.testing.assert_close(out.double(), ref.apply_rope(x, cos, sin), rtol=1e-5, atol=1e-5)
    w = torch.randn(50, 8)
    ids = torch.randint(0, 50, (30,))
    assert torch.equal(kernels.embedding(ids, w), w[ids])


def _rand_qkv(n, h=4, hkv=2, d=16, dtype=torch.float32):
    return (torch.randn(n, h, d, dtype=dtype), torch.randn(n, hkv, d, dtype=dtype),
            torch.randn(n, hkv, d, dtype=dtype))


@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 4), (6, 1)])
def test_attention_packed_close_to_reference(h, hkv):
    torch.manual_seed(random.randrange(1 << 30))
    lens = [1, 7, 33, 64, 90]
    meta = AttentionMetadata.packed(lens)
    q, k, v = _rand_qkv(sum(lens), h, hkv)
    out = kernels.attention(q, k, v, meta, 0.25)
    torch.testing.assert_close(out.double(), ref.attention_packed(q, k, v, meta, 0.25), rtol=1e-5, atol=1e-5)
    with kernels.mode("fast"):
        fast = kernels.attention(q, k, v, meta, 0.25)
    torch.testing.assert_close(fast.double(), ref.attention_packed(q, k, v, meta, 0.25), rtol=1e-5, atol=1e-5)


def test_attention_sequence_independent_of_batch_companions():
    rng = random.Random()
    torch.manual_seed(rng.randrange(1 << 30))
    target_len = 75
    q, k, v = _rand_qkv(target_len)
    alone = kernels.attention(q, k, v, AttentionMetadata.packed([target_len]), 0.3)
    for trial in range(6):
        before = [rng.randint(1, 40) for _ in range(rng.randint(0, 3))]
        after = [rng.randint(1, 120) for _ in range(rng.randint(0, 3))]
        lens = before + [target_len] + after
        qa, ka, va = _rand_qkv(sum(lens))
        off = sum(before)
        qa[off:off + target_len], ka[off:off + target_len], va[off:off + target_len] = q, k, v
        out = kernels.attention(qa, ka, va, AttentionMetadata.packed(lens), 0.3)
        assert torch.equal(out[off:off + target_len], alone), f"trial {trial}: lens={lens}"


@pytest.mark.parametrize("block_size", [4, 16])
def test_attention_paged_chunked_equals_packed(block_size):
    """Prefill in random chunks then decode token by token against a paged cache with a scattered block table,
    alongside other sequences: every token equals the packed full-sequence result, bitwise."""
    rng = random.Random()
    torch.manual_seed(rng.randrange(1 << 30))
    length = 70
    q, k, v = _rand_qkv(length)
    full = kernels.attention(q, k, v, AttentionMetadata.packed([length]), 0.25)
    num_blocks = 64
    kc = torch.full((num_blocks, block_size, 2, 16), float("nan"))  # stale garbage must never leak in
    vc = torch.full((num_blocks, block_size, 2, 16), float("nan"))
    blocks = rng.sample(range(num_blocks // 2), (length + block_size - 1) // block_size)
    other_blocks = [b for b in range(num_blocks // 2, num_blocks)][: (40 + block_size - 1) // block_size]
    done, outs = 0, []
    other_done = 0
    while done < length:
        step = min(length - done, rng.choice([1, 1, 3, 8, 13, 32]))
        other_step = min(40 - other_done, rng.choice([0, 1, 5])) if other_done < 40 else 0
        qs, ks, vs = [q[done:done + step]], [k[done:done + step]], [v[done:done + step]]
        qlens, slens, tables = [step], [done + step], [blocks]
        if other_step:
            oq, ok, ov = _rand_qkv(other_step)
            qs.insert(0, oq), ks.insert(0, ok), vs.insert(0, ov)
            qlens.insert(0, other_step), slens.insert(0, other_done + other_step), tables.insert(0, other_blocks)
        meta = AttentionMetadata.paged(qlens, slens, tables, block_size)
        out = kernels.attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), meta, 0.25, (kc, vc))
        outs.append(out[other_step:])
        done += step
        other_done += other_step
    assert torch.equal(torch.cat(outs), full)


def test_mode_context_manager_restores_on_error():
    assert kernels.current_mode() == "deterministic"
    with pytest.raises(RuntimeError):
        with kernels.mode("fast"):
            assert kernels.current_mode() == "fast"
            raise RuntimeError("boom")
    assert kernels.current_mode() == "deterministic"
    with pytest.raises(ValueError, match="unknown kernel mode"):
        with kernels.mode("fastest"):
            pass


def test_fast_paged_attention_decode_and_chunks_close_to_reference():
    """Fast mode's batched decode path (one query per sequence) and its per-sequence path agree with float64."""
    torch.manual_seed(random.randrange(1 << 30))
    bs, lens = 8, [5, 30, 17]
    qkv = [_rand_qkv(n) for n in lens]
    kc, vc = torch.zeros(16, bs, 2, 16), torch.zeros(16, bs, 2, 16)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with kernels.mode("fast"):
        prefill = AttentionMetadata.paged([n - 1 for n in lens], [n - 1 for n in lens], tables, bs)
        kernels.attention(torch.cat([q[:-1] for q, _, _ in qkv]), torch.cat([k[:-1] for _, k, _ in qkv]),
                          torch.cat([v[:-1] for _, _, v in qkv]), prefill, 0.25, (kc, vc))
        decode = AttentionMetadata.paged([1, 1, 1], lens, tables, bs)
        out = kernels.attention(torch.cat([q[-1:] for q, _, _ in qkv]), torch.cat([k[-1:] for _, k, _ in qkv]),
                                torch.cat([v[-1:] for _, _, v in qkv]), decode, 0.25, (kc, vc))
    for i, (q, k, v) in enumerate(qkv):
        expected = ref.attention_dense(q[-1:], k, v, torch.tensor([lens[i] - 1]), 0.25)
        torch.testing.assert_close(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-5)


def test_qk_norm_rope_attention_is_the_composition_and_checks_its_shape():
    """``kernels.qk_norm_rope_attention`` on CPU: the per-head norms, rotary and attention of the model's unfused
    path, bit for bit; a q|k|v width that is not (H + 2 Hkv) heads is refused with the shapes named."""
    from rlrepro.kernels import AttentionMetadata
    g = torch.Generator().manual_seed(0)
    n, h, hkv, d = 7, 4, 2, 8
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g)
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 9
    cos, sin = ang.cos(), ang.sin()
    meta = AttentionMetadata.packed([3, 4])
    got = kernels.qk_norm_rope_attention(qkv, h, hkv, wq, wk, 1e-6, cos, sin, meta, 0.3)
    q = kernels.apply_rope(kernels.rms_norm(qkv[:, :h * d].view(n, h, d), wq, 1e-6), cos, sin)
    k = kernels.apply_rope(kernels.rms_norm(qkv[:, h * d:(h + hkv) * d].view(n, hkv, d), wk, 1e-6), cos, sin)
    want = kernels.attention(q, k, qkv[:, (h + hkv) * d:].view(n, hkv, d), meta, 0.3)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="is not"):
        kernels.qk_norm_rope_attention(qkv[:, :-1], h, hkv, wq, wk, 1e-6, cos, sin, meta, 0.3)
