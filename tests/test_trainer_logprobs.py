"""Trainer token logprobs: bitwise independent of packing, equal to a plain full-sequence forward."""
import random

import pytest
import torch

from rlrepro import kernels
from rlrepro.model import tiny_model
from rlrepro.trainer import logprobs_and_entropy, token_logprobs
from rlrepro.trainer.logprobs import (_ChunkedTokenLogprob, _completion_logits, entropy,
                                      tempered_log_softmax)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def _samples(vocab: int, n: int, seed: int, max_prompt: int = 9, max_completion: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    completions = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_completion))] for _ in range(n)]
    return prompts, completions


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_packing_order_and_batch_composition_do_not_change_bits(model, temperature):
    prompts, completions = _samples(model.config.vocab_size, 7, seed=11)
    with torch.no_grad():
        together = token_logprobs(model, prompts, completions, temperature)
        alone = [token_logprobs(model, [p], [c], temperature)[0] for p, c in zip(prompts, completions)]
        order = list(reversed(range(7)))
        reversed_ = token_logprobs(model, [prompts[i] for i in order], [completions[i] for i in order], temperature)
        others_p, others_c = _samples(model.config.vocab_size, 5, seed=12)
        mixed = token_logprobs(model, others_p[:2] + prompts[3:5] + others_p[2:],
                               others_c[:2] + completions[3:5] + others_c[2:], temperature)
    for i in range(7):
        assert together[i].dtype == torch.float32 and together[i].shape == (len(completions[i]),)
        assert torch.equal(together[i], alone[i])
        assert torch.equal(together[i], reversed_[order.index(i)])
    assert torch.equal(mixed[2], together[3]) and torch.equal(mixed[3], together[4])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_equals_full_sequence_forward(model, temperature):
    prompts, completions = _samples(model.config.vocab_size, 4, seed=5)
    with torch.no_grad():
        got = token_logprobs(model, prompts, completions, temperature)
        for p, c, lp in zip(prompts, completions, got):
            logits = model(torch.tensor([p + c]))[0]
            want = kernels.token_logprob(logits[len(p) - 1:len(p) + len(c) - 1], torch.tensor(c), temperature)
            assert torch.equal(lp, want)


def test_logprobs_and_entropy_share_the_definition(model):
    prompts, completions = _samples(model.config.vocab_size, 3, seed=8)
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, 0.8)
        lps2, ents = logprobs_and_entropy(model, prompts, completions, 0.8)
        for p, c, a, b, e in zip(prompts, completions, lps, lps2, ents):
            assert torch.equal(a, b)
            logits = model(torch.tensor([p + c]))[0][len(p) - 1:len(p) + len(c) - 1]
            lsm = tempered_log_softmax(logits, 0.8).double()
            torch.testing.assert_close(e.double(), -(lsm.exp() * lsm).sum(-1), rtol=1e-5, atol=1e-6)


def test_grad_flows_and_equals_no_grad_values(model):
    prompts, completions = _samples(model.config.vocab_size, 3, seed=9)
    with torch.no_grad():
        ref = token_logprobs(model, prompts, completions)
    lps = token_logprobs(model, prompts, completions)
    assert all(lp.requires_grad for lp in lps)
    assert all(torch.equal(a.detach(), b) for a, b in zip(lps, ref))
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_empty_completions_and_bad_inputs(model):
    with torch.no_grad():
        out = token_logprobs(model, [[1, 2], [3]], [[], [4, 5]])
        assert out[0].shape == (0,) and out[1].shape == (2,)
        assert torch.equal(out[1], token_logprobs(model, [[3]], [[4, 5]])[0])
        assert [t.shape for t in token_logprobs(model, [[1]], [[]])] == [(0,)]
    with pytest.raises(ValueError, match="empty prompt"):
        token_logprobs(model, [[]], [[1]])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        token_logprobs(model, [[1], [2]], [[1]])


def _loss_and_grads(model, prompts, completions, weights, chunk_rows):
    model.zero_grad(set_to_none=True)
    lps, ents = logprobs_and_entropy(model, prompts, completions, 0.8, chunk_rows=chunk_rows)
    loss = sum((lp * w).sum() for lp, w in zip(lps, weights))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return [lp.detach() for lp in lps], ents, grads


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 23])
def test_chunked_log_softmax_keeps_logprobs_and_the_gradient(model, chunk_rows, deterministic_torch):
    """``chunk_rows``: the float32 log-softmax a few logits rows at a time (forward, and again in the backward).
    Logprobs, entropies and every parameter's gradient are the unchunked bits on CPU (the same ops on the same
    rows; CUDA: tests/test_trainer_gpu.py, where the entropy's row sum is equal only to rounding)."""
    prompts, completions = _samples(model.config.vocab_size, 5, seed=21)
    weights = [torch.linspace(-1.0, 1.0, len(c)) for c in completions]
    lp0, ent0, g0 = _loss_and_grads(model, prompts, completions, weights, 0)
    lp1, ent1, g1 = _loss_and_grads(model, prompts, completions, weights, chunk_rows)
    lp2, ent2, g2 = _loss_and_grads(model, prompts, completions, weights, chunk_rows)
    assert sum(len(c) for c in completions) > chunk_rows  # the chunked path ran
    for a, b, c in zip(lp0, lp1, lp2):
        assert torch.equal(a, b) and torch.equal(b, c)
    for a, b, c in zip(ent0, ent1, ent2):
        assert torch.equal(a, b) and torch.equal(b, c)
    for name in g0:
        assert torch.equal(g1[name], g0[name]) and torch.equal(g1[name], g2[name]), name
    assert any(bool(g.abs().sum() > 0) for g in g0.values())
    with torch.no_grad():
        chunked = token_logprobs(model, prompts, completions, 0.8, chunk_rows=chunk_rows)
    assert all(torch.equal(a, b) for a, b in zip(chunked, lp0))


def test_token_logprobs_chunked_refuses_a_gradient(model):
    prompts, completions = _samples(model.config.vocab_size, 2, seed=4)
    with pytest.raises(ValueError, match="has no backward"):
        token_logprobs(model, prompts, completions, chunk_rows=1)


@pytest.mark.parametrize("chunk_rows", [0, 3])
def test_entropy_with_grad_is_the_entropy_and_differentiable(model, chunk_rows, deterministic_torch):
    """``entropy_grad=True`` (an entropy bonus): the same values as the detached metric, with a gradient that
    matches a float64 autograd of the definition, chunked or not."""
    prompts, completions = _samples(model.config.vocab_size, 4, seed=31)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        _, metric = logprobs_and_entropy(model, prompts, completions, 0.8)
    lps, ents = logprobs_and_entropy(model, prompts, completions, 0.8, chunk_rows=chunk_rows, entropy_grad=True)
    assert all(e.requires_grad for e in ents)
    assert all(torch.equal(a.detach(), b) for a, b in zip(ents, metric))
    logits, _, _ = _completion_logits(model, prompts, completions)
    leaf = logits.detach().double().requires_grad_(True)
    lsm = torch.log_softmax(leaf / 0.8, dim=-1)
    (-(lsm.exp() * lsm).sum(-1)).sum().backward()
    want = leaf.grad
    rows = logits.detach().requires_grad_(True)
    if chunk_rows:
        _, ent = _ChunkedTokenLogprob.apply(rows, torch.zeros(rows.shape[0], dtype=torch.long), 0.8, chunk_rows, True)
    else:
        ent = entropy(tempered_log_softmax(rows, 0.8))
    ent.sum().backward()
    torch.testing.assert_close(rows.grad.double(), want, rtol=1e-4, atol=1e-6)
    torch.stack([e.sum() for e in ents]).sum().backward()
    assert model.head_weight().grad is not None and bool(model.head_weight().grad.abs().sum() > 0)
    model.zero_grad(set_to_none=True)


def test_entropy_gradient_is_the_same_chunked_or_not(model, deterministic_torch):
    prompts, completions = _samples(model.config.vocab_size, 5, seed=33)
    grads = []
    for chunk_rows in (0, 4):
        model.zero_grad(set_to_none=True)
        lps, ents = logprobs_and_entropy(model, prompts, completions, 0.8, chunk_rows=chunk_rows, entropy_grad=True)
        (sum(lp.sum() for lp in lps) - 0.5 * sum(e.sum() for e in ents)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_entropy_is_the_tensor_zeros_form_bit_for_bit():
    """``entropy`` zeroes the log with a scalar 0.0: the same values and gradient, bit for bit, as the form with a
    ``zeros_like`` tensor it replaced (rows with -inf log-probs included), in float32 and float64."""
    def with_zeros_tensor(log_probs):
        p = log_probs.exp()
        return -(p * torch.where(p > 0, log_probs, torch.zeros_like(log_probs))).sum(dim=-1)

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(37, 1000, generator=gen, dtype=dtype) * 8
        x[3, :500] = -float("inf")
        log_probs = torch.log_softmax(x, dim=-1)
        a, b = log_probs.clone().requires_grad_(True), log_probs.clone().requires_grad_(True)
        ours, theirs = entropy(a), with_zeros_tensor(b)
        g = torch.randn(37, generator=gen, dtype=dtype)
        (ga,), (gb,) = torch.autograd.grad(ours, a, g), torch.autograd.grad(theirs, b, g)
        assert torch.equal(ours, theirs) and torch.equal(ga, gb) and not torch.isnan(ga).any()
