"""The sampler: counter-based noise, batch invariance, top-k/top-p sets, the logprob definition, seeds."""
import math

import pytest
import torch

from rlrepro import kernels
from rlrepro.rollout import derive_seed, request_seed
from _sampler_reference import one_row_reference_mask
from rlrepro.rollout.sampler import (GAMMA, MIX1, MIX2, ROW_SALT, SampleRequest, exact_log, gumbel_noise,
                                     keep_mask, keep_masks, noise_bits, sample, sample_on_device)

M64 = (1 << 64) - 1


def py_mix64(z):
    z &= M64
    z = ((z ^ (z >> 30)) * (MIX1 & M64)) & M64
    z = ((z ^ (z >> 27)) * (MIX2 & M64)) & M64
    return z ^ (z >> 31)


def py_bits(seed, position, token):
    row = py_mix64(py_mix64(seed ^ (ROW_SALT & M64)) + position * (GAMMA & M64))
    return py_mix64(row + (token + 1) * (GAMMA & M64))


def test_int64_hash_equals_the_unbounded_integer_definition():
    seeds = [0, 1, 12345, 2**62 + 7, 2**63 - 1]
    positions = [0, 1, 17, 40959, 2**31 + 3]
    bits = noise_bits(torch.tensor(seeds), torch.tensor(positions), 50)
    for r, (s, p) in enumerate(zip(seeds, positions)):
        want = [py_bits(s, p, v) for v in range(50)]
        got = [b & M64 for b in bits[r].tolist()]
        assert got == want


def test_exact_log_is_accurate():
    x = torch.cat([torch.logspace(-300, 300, 2001, dtype=torch.float64),
                   torch.linspace(0.5, 2.0, 1001, dtype=torch.float64),
                   torch.tensor([2.0**-52, 1 - 2.0**-53, 1.0, 1e-16], dtype=torch.float64)])
    err = (exact_log(x) - torch.log(x)).abs()
    assert float(err.max()) < 5e-11  # absolute; the noise needs ~1e-8, float32 logits resolve 6e-8
    near_one = torch.tensor([1 - 2.0**-52, 1 + 2.0**-52, 1 - 1e-10], dtype=torch.float64)
    assert torch.allclose(exact_log(near_one), torch.log(near_one), rtol=1e-12, atol=0)  # -log(u) near u=1
    assert float(exact_log(torch.tensor([1.0], dtype=torch.float64))) == 0.0


def test_noise_of_a_row_does_not_depend_on_the_batch():
    vocab = 1000
    seeds = torch.tensor([5, 6, 7, 5, 9, 2**63 - 1])
    positions = torch.tensor([3, 3, 100, 3, 0, 77])
    batch = gumbel_noise(seeds, positions, vocab)
    for r in range(len(seeds)):
        alone = gumbel_noise(seeds[r:r + 1], positions[r:r + 1], vocab)
        assert torch.equal(alone[0], batch[r])
    assert torch.equal(batch[0], batch[3])  # same key, same noise
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[0], gumbel_noise(
        torch.tensor([5]), torch.tensor([4]), vocab)[0])  # seed and position both matter
    odd = gumbel_noise(seeds, positions, 997)
    assert torch.equal(odd, batch[:, :997])  # the vocabulary size does not change a token's noise


def test_gumbel_max_samples_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 20000
    counts = torch.zeros(5)
    noise = gumbel_noise(torch.full((n,), 42), torch.arange(n), 5)
    choice = torch.argmax(logits.double() + noise, dim=-1)
    counts = torch.bincount(choice, minlength=5).double()
    expected = torch.softmax(logits.double(), -1)[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 4 degrees of freedom: p ~ 5e-5; the draw is deterministic, so this never flakes


def test_greedy_takes_the_first_maximum():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    reqs = [SampleRequest(0.0, -1, 1.0, seed=0, position=0)] * 2
    tokens, logprobs = sample(logits, reqs)
    assert tokens == [1, 0]
    want = kernels.token_logprob(logits, torch.tensor([1, 0]), 0.0)
    assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), want)


def test_keep_mask_tie_handling():
    row = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    assert keep_mask(row, 2, 1.0).tolist() == [False, True, True, False, False]  # ties: lower id first
    assert keep_mask(row, 1, 1.0).tolist() == [False, True, False, False, False]
    assert keep_mask(row, 10, 1.0).all()
    # top-p: each 3.0 has probability ~0.32; mass before the 2nd is 0.32 < 0.5, before the 3rd 0.64 >= 0.5
    assert keep_mask(row, -1, 0.5).tolist() == [False, True, True, False, False]
    assert keep_mask(row, -1, 0.01).tolist() == [False, True, False, False, False]  # first always kept
    # top-k then top-p over the survivors' renormalised mass
    assert keep_mask(row, 3, 0.7).tolist() == [False, True, True, True, False]


def test_batched_keep_masks_equal_one_row_masks():
    """Filtering many rows at once gives each row the mask it gets alone (bitwise: ``torch.equal``), whatever
    the other rows and their filters; ties (values rounded to a coarse grid) break toward the lower token id."""
    gen = torch.Generator().manual_seed(7)
    v = 3001
    for trial in range(6):
        r = [1, 3, 16, 5, 70, 2][trial]  # 70: two sorts of FILTER_ROWS = 64 and 6
        scaled = (torch.randn(r, v, generator=gen) * 4).round(decimals=1) / [1.0, 0.7, 1.3][trial % 3]
        ks = [int(x) for x in torch.randint(-1, 40, (r,), generator=gen)]
        ks = [k if k != 0 else -1 for k in ks]
        ps = [[1.0, 0.9, 0.95, 0.3, 0.123456789][int(i)] for i in torch.randint(0, 5, (r,), generator=gen)]
        masks = keep_masks(scaled, ks, ps)
        assert masks.shape == (r, v) and masks.dtype == torch.bool
        for i in range(r):
            want = one_row_reference_mask(scaled[i], ks[i], ps[i])
            assert torch.equal(masks[i], want), (trial, i, ks[i], ps[i])
            assert torch.equal(keep_mask(scaled[i], ks[i], ps[i]), want)
            if ks[i] > 0:
                assert int(masks[i].sum()) <= ks[i]
    with pytest.raises(ValueError, match="2 rows but 1 top_k"):
        keep_masks(torch.zeros(2, 5), [1], [1.0, 1.0])
    with pytest.raises(ValueError, match="exact in float64 up to 2097152"):
        keep_masks(torch.zeros(1, 2 ** 21 + 1), [-1], [0.9])


def test_sampled_tokens_respect_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(64, 40) * 3
    for top_k, top_p in [(1, 1.0), (3, 1.0), (-1, 0.3), (5, 0.6)]:
        reqs = [SampleRequest(0.8, top_k, top_p, seed=s, position=10) for s in range(64)]
        tokens, _ = sample(logits, reqs)
        for r, tok in enumerate(tokens):
            assert keep_mask(logits[r] / 0.8, top_k, top_p)[tok]
        if top_k == 1:
            assert tokens == torch.argmax(logits, -1).tolist()


def test_sample_is_row_invariant_and_reports_token_logprob():
    torch.manual_seed(1)
    logits = torch.randn(9, 33, dtype=torch.bfloat16)
    reqs = [SampleRequest(t, k, p, seed=100 + r, position=5 + r)
            for r, (t, k, p) in enumerate([(1.0, -1, 1.0), (0.0, -1, 1.0), (0.7, 4, 1.0), (1.3, -1, 0.9),
                                           (1.0, 2, 0.5), (0.7, -1, 1.0), (0.0, 3, 0.2), (2.0, -1, 1.0),
                                           (1.0, -1, 1.0)])]
    tokens, logprobs = sample(logits, reqs)
    for r in range(9):
        tok1, lp1 = sample(logits[r:r + 1], reqs[r:r + 1])
        assert tok1 == [tokens[r]] and lp1 == [logprobs[r]]
        want = kernels.token_logprob(logits[r:r + 1], torch.tensor([tokens[r]]), reqs[r].temperature)
        assert torch.equal(torch.tensor([logprobs[r]], dtype=torch.float32), want)
    assert sample(logits[:0], []) == ([], [])


def test_request_seed_is_pure_and_63_bit():
    a = request_seed(1, 2, "uid-3", 4)
    assert a == request_seed(1, 2, "uid-3", 4)
    assert 0 <= a < 2**63
    others = {request_seed(1, 2, "uid-3", 5), request_seed(1, 3, "uid-3", 4), request_seed(2, 2, "uid-3", 4),
              request_seed(1, 2, "uid-4", 4), request_seed(1, 2, 3, 4)}
    assert a not in others and len(others) == 5
    assert request_seed(1, 2, 3, 4) != request_seed(1, 2, "3", 4)
    assert derive_seed(0, 1) != derive_seed(0, 2) != derive_seed(1, 1)
    # pinned values: a change here silently changes every sampled rollout
    assert request_seed(0, 0, 0, 0) == int.from_bytes(__import__("hashlib").sha256(
        b'["rlrepro.request",0,0,0,0]').digest()[:8], "big") >> 1
    with pytest.raises(ValueError, match="prompt_uid"):
        request_seed(0, 0, 1.5, 0)
    with pytest.raises(ValueError, match="step"):
        request_seed(0, True, 1, 0)


def test_noise_is_the_same_on_every_float_path():
    # exact_log uses + - * / only: computing a vector in one call or element by element gives the same bits
    x = torch.rand(257, dtype=torch.float64) * 50 + 1e-12
    whole = exact_log(x)
    pieces = torch.cat([exact_log(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(whole, pieces)
    assert not math.isnan(float(whole.sum()))


@pytest.mark.parametrize("lean", ["0", "1"])
def test_half_precision_logits_sample_as_their_float32_copy(monkeypatch, lean):
    """At t = 1 without filters the sampler hands bfloat16/float16 logits over unconverted
    (``RLREPRO_SAMPLER_LEAN=1``) or as a float32 copy (``0``): the same tokens and logprob bits either way, and the
    same as the float32 logits themselves; with a filter or another temperature the float32 path runs."""
    monkeypatch.setenv("RLREPRO_SAMPLER_LEAN", lean)
    torch.manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(6, 300) * 4).to(dtype)
        plain = [SampleRequest(1.0, -1, 1.0, seed=r, position=5 + r) for r in range(6)]
        mixed = [SampleRequest([1.0, 0.7, 1.0][r % 3], [-1, -1, 20][r % 3], 1.0, seed=r, position=r) for r in range(6)]
        for reqs in (plain, mixed):
            got, want = sample_on_device(logits, reqs), sample_on_device(logits.float(), reqs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (dtype, reqs)
            assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
