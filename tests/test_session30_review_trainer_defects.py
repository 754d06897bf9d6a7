"""Session 30 review of rlrepro/trainer: defects reproduced first, then fixed.

1. ``load_checkpoint`` refused a restore whose named generators did not match the checkpoint's only after it had
   loaded the model, optimizer and scheduler and reset the global RNGs: the refused load left a half-loaded trainer.
2. ``train_step`` named the wrong sample for an empty prompt (its index within the micro-batch, not the batch), and
   a token id outside the vocabulary failed in the embedding without naming any sample.
3. ``train.kl_estimator`` set with ``train.kl_coef=0`` was accepted and did nothing (no reference model is built).
Also: float64 hand references of every loss variant and aggregation against ``policy_loss``.
"""
import math
import random

import numpy as np
import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.checkpoint import load_checkpoint
from rlrepro.trainer.losses import pad_sequences, policy_loss

pytestmark = pytest.mark.usefixtures("deterministic_torch")


def _batch(model):
    prompts, comps = [[1, 2], [4], [7, 8], [3]], [[3, 5], [6], [9, 10, 11], [2]]
    lps = token_logprobs(model, prompts, comps)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=a)
            for p, c, lp, a in zip(prompts, comps, lps, [1.0, -0.5, 0.25, 0.5])]


def test_refused_generator_restore_leaves_model_optimizer_and_rngs_untouched(tmp_path):
    gens = {"t": torch.Generator().manual_seed(3), "n": np.random.default_rng(5), "p": random.Random(7)}
    src = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-2, micro_batch_size=2))
    src.train_step(_batch(src.model))
    path = src.save_checkpoint(tmp_path, 1, generators=gens)
    dst = Trainer(tiny_model(seed=2), TrainConfig(lr=1e-2, micro_batch_size=2))
    weights = [w.clone() for _, w in dst.named_weights()]
    rng, py = torch.get_rng_state(), random.getstate()
    with pytest.raises(ValueError, match="generators"):
        dst.load_checkpoint(path, generators={"t": gens["t"]})
    with pytest.raises(TypeError, match="numpy generator"):
        load_checkpoint(path, model=dst.model, generators={**gens, "n": random.Random(0)})
    assert all(torch.equal(a, b) for a, (_, b) in zip(weights, dst.named_weights()))
    assert dst.optimizer.inner.state == {} and dst.step == 0
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py
    # the right generators still restore every stream
    expect = (torch.rand(2, generator=gens["t"]), gens["n"].random(), gens["p"].random())
    dst.load_checkpoint(path, generators=gens)
    got = (torch.rand(2, generator=gens["t"]), gens["n"].random(), gens["p"].random())
    assert torch.equal(expect[0], got[0]) and expect[1:] == got[1:]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(src.named_weights(), dst.named_weights()))


def test_empty_prompt_names_the_batch_index():
    model = tiny_model(seed=1)
    batch = _batch(model)
    batch[3] = dict(prompt_token_ids=[], completion_token_ids=[5], rollout_logprobs=[-1.0], advantage=1.0)
    with pytest.raises(ValueError, match=r"^sample 3 has an empty prompt"):
        Trainer(model, TrainConfig(micro_batch_size=2)).train_step(batch)


@pytest.mark.parametrize("field,ids", [("completion_token_ids", [9, 10, 60]), ("prompt_token_ids", [-1, 8])])
def test_token_id_outside_the_vocabulary_names_the_sample(field, ids):
    model = tiny_model(seed=1)
    batch = _batch(model)
    batch[2] = {**batch[2], field: ids}
    before = [w.clone() for _, w in sorted(model.named_parameters())]
    with pytest.raises(ValueError, match=rf"sample 2 has token id {ids[-1] if ids[-1] >= 60 else ids[0]}, outside"):
        Trainer(model, TrainConfig(micro_batch_size=2)).train_step(batch)
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, sorted(model.named_parameters())))


def test_kl_estimator_without_kl_term_is_refused():
    with pytest.raises(ConfigError, match="kl_estimator.*changes nothing with train.kl_coef=0"):
        TrainConfig(kl_estimator="k1")
    assert TrainConfig(kl_estimator="k2", kl_coef=0.01).kl_estimator == "k2"
    assert TrainConfig().kl_estimator == "k3"


# --- hand-written float64 references of the documented formulas ------------------------------------------------

def _data():
    g = torch.Generator().manual_seed(0)
    lens = [3, 1, 4, 0]
    lp = [torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 1 for n in lens]
    old = [x + torch.randn(x.shape, generator=g, dtype=torch.float64) * 0.4 for x in lp]
    ref = [x + torch.randn(x.shape, generator=g, dtype=torch.float64) * 0.2 for x in lp]
    ent = [torch.rand(x.shape, generator=g, dtype=torch.float64) for x in lp]
    adv = [1.0, -0.7, -0.3, 0.5]
    return lens, lp, old, ref, ent, adv


def _agg(per, mode, c):
    s = len(per)
    if mode == "token-mean":
        return sum(map(sum, per)) / sum(map(len, per))
    if mode == "seq-mean-token-mean":
        return sum(sum(p) / len(p) for p in per if p) / s
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(p) / c for p in per) / s
    return sum(map(sum, per)) / s


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"]


@pytest.mark.parametrize("mode,loss", [(m, x) for m in _AGGS for x in ("ppo_clip", "ppo_dual", "cispo")]
                         + [("seq-mean-token-mean", "gspo")])
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_policy_loss_equals_the_documented_formula_in_float64(mode, loss, kl):
    lens, lp, old, ref, ent, adv = _data()
    lo, hi, dual, c, kc, ec = 0.2, 0.28, 1.3, 5, 0.1, 0.01
    pg = []
    for i, n in enumerate(lens):
        a, row = adv[i], []
        s = math.exp(sum(float(lp[i][t] - old[i][t]) for t in range(n)) / n) if n else 1.0
        for t in range(n):
            r = math.exp(float(lp[i][t] - old[i][t]))
            if loss == "cispo":
                row.append(-_clip(r, 1 - lo, 1 + hi) * a * float(lp[i][t]))
            elif loss == "gspo":
                row.append(max(-a * s, -a * _clip(s, 1 - lo, 1 + hi)))
            else:
                v = max(-a * r, -a * _clip(r, 1 - lo, 1 + hi))
                row.append(min(v, -a * dual) if loss == "ppo_dual" and a < 0 else v)
        pg.append(row)
    d = [[float(ref[i][t] - lp[i][t]) for t in range(n)] for i, n in enumerate(lens)]
    est = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(x) - 1 - x}[kl]
    kls = [[est(x) for x in row] for row in d]
    ents = [[float(e) for e in row] for row in ent]
    expect = _agg(pg, mode, c) + kc * _agg(kls, mode, c) - ec * _agg(ents, mode, c)
    (L, m), (O, _), (R, _), (E, _) = (pad_sequences(x) for x in (lp, old, ref, ent))
    out = policy_loss(L, O, torch.tensor(adv, dtype=torch.float64), m, clip_low=lo, clip_high=hi, loss_agg=mode,
                      max_response_length=c, kl_coef=kc, ref_logp=R, kl_estimator=kl, entropy=E, entropy_coef=ec,
                      dual_clip=dual if loss == "ppo_dual" else 0.0, mode="ppo_clip" if loss == "ppo_dual" else loss)
    assert math.isclose(float(out.loss), expect, rel_tol=1e-12, abs_tol=1e-14)
    if loss == "ppo_dual":  # the dual bound is active at some token, so the reference exercises it
        plain = policy_loss(L, O, torch.tensor(adv, dtype=torch.float64), m, clip_low=lo, clip_high=hi,
                            loss_agg=mode, max_response_length=c)
        assert plain.pg_loss != out.pg_loss
