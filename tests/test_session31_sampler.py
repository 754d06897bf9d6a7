"""Sampling semantics as a vLLM/SGLang user reads them (session 31): what each SamplingParams field means, its edge
values, which distribution the logprob belongs to, and the same tokens for the same seed whatever the engine does
(docs/ENGINE.md, "Sampling")."""
import math
import random

import numpy as np
import pytest
import torch

from rlrepro import kernels
from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingParams, derive_seed, request_seed
from rlrepro.rollout.sampler import SampleRequest, keep_mask, sample
from rlrepro.rollout.seeds import eval_seed


# ---- fixed on this session's code (each failed before) ------------------------------------------------------------

def test_negative_zero_temperature_is_stored_as_zero():
    p = SamplingParams(temperature=-0.0)
    assert p.greedy
    assert math.copysign(1.0, p.temperature) == 1.0 and repr(p) == repr(SamplingParams(temperature=0.0))


def test_seed_functions_take_numpy_integer_keys_as_the_ints_they_hold():
    key = (np.int64(7), np.int32(3), np.int64(11), np.uint8(2))
    assert request_seed(*key) == request_seed(7, 3, 11, 2)
    assert eval_seed(*key) == eval_seed(7, 3, 11, 2)
    assert derive_seed(np.int64(5), np.int64(9)) == derive_seed(5, 9)
    assert request_seed(7, 3, np.str_("uid"), 2) == request_seed(7, 3, "uid", 2)
    assert request_seed(7, 3, "11", 2) != request_seed(7, 3, 11, 2)  # str and int keys stay distinct
    for bad in (True, np.bool_(True), 1.0, np.float64(1.0), None):
        with pytest.raises(ValueError, match="run_seed must be an int"):
            request_seed(bad, 3, 11, 2)


# ---- semantics that already held, pinned against vLLM's definitions ----------------------------------------------

def _nucleus(probs: list[float], top_p: float) -> set[int]:
    """vLLM's top-p in exact arithmetic: the smallest prefix of the descending order whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


def test_top_p_keeps_the_smallest_set_reaching_p_away_from_the_boundary():
    rng = random.Random(0)
    for trial in range(200):
        v = rng.choice([5, 17, 64])
        row = torch.randn(v, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.5, 2.0, 6.0])
        probs = torch.softmax(row.double(), -1).tolist()
        order = sorted(range(v), key=lambda i: -probs[i])
        cums = np.cumsum([probs[i] for i in order])
        p = rng.uniform(0.01, 0.999)
        if np.min(np.abs(cums - p)) < 1e-6:  # the integer masses resolve ~V * 2**-32 of the top token
            continue
        got = set(torch.nonzero(keep_mask(row, -1, p)).flatten().tolist())
        assert got == _nucleus(probs, p), (trial, p)


def test_filter_edge_values():
    row = torch.tensor([0.5, 3.0, 3.0, -1.0, 2.0, float("-inf")])
    v = row.numel()
    assert keep_mask(row, -1, 1.0).tolist() == [True] * v  # both filters off: -inf stays "kept", weight 0
    assert torch.equal(keep_mask(row, v, 1.0), keep_mask(row, -1, 1.0))
    assert torch.equal(keep_mask(row, 10 ** 9, 1.0), keep_mask(row, -1, 1.0))  # top_k > V is off
    one = [False, True, False, False, False, False]  # the first maximum (lower id on a tie)
    assert keep_mask(row, -1, 1e-12).tolist() == one and keep_mask(row, 1, 1.0).tolist() == one
    assert keep_mask(row, 2, 1.0).tolist() == [False, True, True, False, False, False]
    assert keep_mask(row, 3, 1.0).tolist() == [False, True, True, False, True, False]
    # top-k first, then top-p over the survivors renormalised: tokens 1, 2 tie at half each of the top 2
    assert keep_mask(row, 2, 0.5).tolist() == one
    assert keep_mask(row, 2, 0.5 + 1e-6).tolist() == [False, True, True, False, False, False]


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.3, 1.0, 7.0, 1e30])
def test_extreme_temperatures_give_finite_logprobs_of_the_tempered_unfiltered_distribution(temperature):
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 8).to(torch.bfloat16)
    reqs = [SampleRequest(temperature, k, p, seed, 40 + i) for i, (k, p, seed) in enumerate(
        [(-1, 1.0, 0), (5, 1.0, 1), (-1, 0.3, 2**63 - 1), (2, 0.9, 3), (1, 1.0, 4), (-1, 1e-9, 5)])]
    tokens, lps = sample(logits, reqs)
    assert all(math.isfinite(x) and x <= 0.0 for x in lps)
    want = kernels.token_logprob(logits, torch.tensor(tokens), temperature)  # before top-k / top-p
    assert torch.equal(torch.tensor(lps), want)
    greedy = torch.argmax(logits.float(), -1).tolist()
    assert tokens[4] == greedy[4] and tokens[5] == greedy[5]  # top_k=1 and a tiny top_p are greedy
    if temperature == 1e-5:
        assert tokens == greedy  # the top logits are far apart compared with T: every draw is the maximum


def test_temperature_and_seed_range_errors():
    for t in (1e-6, 9.9e-6, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=t)
    for s in (-1, 2**63, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=s)
    for k in (0, -2, 1.0):
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=k)
    for p in (0.0, 1.0000001, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=p)
    with pytest.raises(TypeError):
        SamplingParams(min_p=0.1)  # not provided: refused, never silently ignored
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_same_seed_same_tokens_whatever_the_engine_does():
    model = tiny_model()
    vocab = model.config.vocab_size
    rng = random.Random(31)
    stem = [rng.randrange(3, vocab) for _ in range(29)]
    prompts = [stem, stem, stem[:13], stem + [4, 5, 6], [rng.randrange(3, vocab) for _ in range(9)], stem[:21]]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=14, ignore_eos=True)
              for t, k, p, s in [(1.0, -1, 1.0, 0), (1.0, -1, 1.0, 1), (0.7, 5, 0.9, 2**63 - 1),
                                 (1e-5, -1, 1.0, 3), (2.0, 10 ** 6, 0.5, 4), (0.0, 3, 0.2, 5)]]
    alone = [Engine(model).generate([q], [sp])[0] for q, sp in zip(prompts, params)]
    assert alone[0].token_ids != alone[1].token_ids  # the same prompt, another seed
    assert alone[0].seed == 0  # seed 0 is a seed, not "none given"
    unseeded = Engine(model, seed=5).generate([stem, stem], SamplingParams(max_tokens=3))
    assert [o.seed for o in unseeded] == [derive_seed(5, 0), derive_seed(5, 1)]
    perm = [3, 0, 5, 1, 4, 2]
    settings = [dict(), dict(max_num_seqs=2, max_num_batched_tokens=3, enable_prefix_cache=False),
                dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=7)]  # the last one preempts
    for kw in settings:
        engine = Engine(model, **kw)
        outs = engine.generate([prompts[i] for i in perm], [params[i] for i in perm])
        for out, i in zip(outs, perm):
            assert out.token_ids == alone[i].token_ids and out.logprobs == alone[i].logprobs, (kw, i)
            assert out.seed == alone[i].seed
    assert engine.stats["num_preemptions"] > 0
