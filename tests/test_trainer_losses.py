"""Losses, advantages, the LR schedule and grad clipping against values worked out by hand.

Inputs are chosen so that the hand values are exact in float32 (ratios of exactly 1, clip bounds 0.75 / 1.25,
power-of-two denominators); the few that are not use a tight tolerance and say so.
"""
import math

import pytest
import torch

from rlrepro.trainer import (aggregate, clip_grad_norm_, compute_advantages, group_advantages, kl_penalty, lr_at,
                             pad_sequences, policy_loss)
from rlrepro.trainer.losses import clipped_surrogate

CLIP = dict(clip_low=0.25, clip_high=0.25)


def _batch():
    """Sample 0 (A=+1): 2 tokens, ratios 1 and e (clipped to 1.25).  pg = [-1, -1.25]
    Sample 1 (A=-1): 4 tokens, ratios 1, 1, 1, 1/e (clipped to 0.75). pg = [1, 1, 1, 0.75]"""
    logp, mask = pad_sequences([torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0, -2.0, -2.0])])
    old, _ = pad_sequences([torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0, -2.0, -1.0])])
    adv = torch.tensor([1.0, -1.0])
    return logp, old, adv, mask


def test_pad_sequences():
    padded, mask = pad_sequences([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], pad_value=-9.0)
    assert torch.equal(padded, torch.tensor([[1.0, 2.0], [3.0, -9.0]]))
    assert torch.equal(mask, torch.tensor([[True, True], [True, False]]))


def test_clipped_surrogate_by_hand():
    logp, old, adv, mask = _batch()
    pg, clipped = clipped_surrogate(logp, old, adv, **CLIP)
    assert torch.equal(pg[mask], torch.tensor([-1.0, -1.25, 1.0, 1.0, 1.0, 0.75]))
    assert clipped[mask].tolist() == [False, True, False, False, False, True]
    # unclipped, ratio != 1: A=+1 at ratio 1/e -> -1/e (A=+1 does not clip below); A=-1 at ratio e -> e
    pg2, clipped2 = clipped_surrogate(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]),
                                      torch.tensor([[1.0, -1.0]]), **CLIP)
    torch.testing.assert_close(pg2, torch.tensor([[-math.exp(-1), math.e]]), rtol=2e-7, atol=0)  # float32 exp
    assert not clipped2.any()


def test_clip_higher_is_asymmetric():
    # ratio e^0.25 ~ 1.284: above DAPO's 1 + 0.28, so clipped there; inside with clip_high=0.5
    logp, old = torch.tensor([[0.25]]), torch.tensor([[0.0]])
    pg, clipped = clipped_surrogate(logp, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    assert clipped.item() and torch.equal(pg, torch.tensor([[-1.28]]))
    pg, clipped = clipped_surrogate(logp, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.5)
    assert not clipped.item() and torch.equal(pg, -torch.exp(torch.tensor([[0.25]])))


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 0.25),                  # (-1 - 1.25 + 1 + 1 + 1 + 0.75) / 6 = 1.5 / 6
    ("seq-mean-token-mean", -0.09375),     # (-2.25 / 2 + 3.75 / 4) / 2 = (-1.125 + 0.9375) / 2
    ("seq-mean-token-sum-norm", 0.09375),  # (-2.25 / 8 + 3.75 / 8) / 2 with max_response_length 8
])
def test_policy_loss_aggregation_by_hand(mode, expected):
    logp, old, adv, mask = _batch()
    out = policy_loss(logp, old, adv, mask, loss_agg=mode, max_response_length=8, **CLIP)
    assert torch.equal(out.loss, torch.tensor(expected))
    assert out.num_tokens == 6
    assert out.clip_frac == pytest.approx(2 / 6, rel=1e-7)
    assert out.pg_loss == 0.25 and out.kl == 0.0 and out.entropy == 0.0


def test_aggregate_by_hand_and_micro_batch_shares():
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert aggregate(x, mask, "token-mean").item() == 2.5                      # 10 / 4
    assert aggregate(x, mask, "seq-mean-token-mean").item() == 3.0             # (6/3 + 4/1) / 2
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_response_length=4).item() == 1.25  # (6/4 + 4/4) / 2
    # micro-batch shares with the whole batch's counts add up to the whole-batch value
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        kw = dict(max_response_length=4, num_tokens=4, num_seqs=2)
        parts = aggregate(x[:1], mask[:1], mode, **kw) + aggregate(x[1:], mask[1:], mode, **kw)
        assert parts.item() == aggregate(x, mask, mode, max_response_length=4).item()
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(x, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss_agg"):
        aggregate(x, mask, "mean")


def test_gradient_by_hand():
    """token-mean: d loss / d logp = -A * ratio / N at unclipped tokens, 0 at clipped ones."""
    logp, old, adv, mask = _batch()
    logp.requires_grad_(True)
    policy_loss(logp, old, adv, mask, **CLIP).loss.backward()
    want = torch.tensor([[-1 / 6, 0.0, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6, 0.0]])
    torch.testing.assert_close(logp.grad, want, rtol=1e-7, atol=0)  # 1/6 is not exact in float32


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -2.0])
    ref = torch.tensor([-2.0, -2.0, -1.0])  # log_r = ref - logp = [-1, 0, 1]
    assert torch.equal(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, 0.0, -1.0]))
    assert torch.equal(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.0, 0.5]))
    k3 = kl_penalty(logp, ref, "k3")  # exp(log_r) - 1 - log_r = [1/e, 0, e - 2]
    assert k3[1].item() == 0.0
    torch.testing.assert_close(k3, torch.tensor([math.exp(-1), 0.0, math.e - 2]), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k4")


def test_kl_penalty_in_the_loss_by_hand():
    logp, mask = pad_sequences([torch.tensor([-1.0, -2.0])])
    ref = torch.tensor([[-2.0, -2.0]])  # k1 = [1, 0]
    out = policy_loss(logp, logp.clone(), torch.tensor([0.0]), mask, kl_coef=0.5, ref_logp=ref, kl_estimator="k1",
                      entropy=torch.tensor([[2.0, 4.0]]))
    assert out.loss.item() == 0.25  # pg = 0 (A = 0); 0.5 * mean([1, 0])
    assert out.kl == 0.5 and out.entropy == 3.0
    reported_only = policy_loss(logp, logp.clone(), torch.tensor([0.0]), mask, kl_coef=0.0, ref_logp=ref,
                                kl_estimator="k2")
    assert reported_only.loss.item() == 0.0 and reported_only.kl == 0.25
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, torch.tensor([0.0]), mask, kl_coef=0.1)


def test_dual_clip_by_hand():
    """Dual clip c = 3: a negative-advantage token whose ratio exceeds c is bounded at -A * c (and gets no
    gradient); positive advantages and ratios below c are untouched."""
    logp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0), 0.0]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])  # per token
    pg, no_grad = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    plain, plain_no_grad = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # token 0: A=-1, ratio 5 -> max(5, 1.2) = 5 without dual clip, bounded at 3 with it
    # token 1: A=-1, ratio 2 -> 2 (below 3: untouched); token 2: A=+1, ratio 5 -> -1.2 (clipped as usual)
    # token 3: A=-2, ratio 1 -> 2 (below the bound 6)
    torch.testing.assert_close(plain, torch.tensor([[5.0, 2.0, -1.2, 2.0]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(pg, torch.tensor([[3.0, 2.0, -1.2, 2.0]]), rtol=1e-6, atol=0)
    assert no_grad.tolist() == [[True, False, True, False]] and plain_no_grad.tolist() == [[False, False, True, False]]
    x = logp.clone().requires_grad_(True)
    clipped_surrogate(x, old, adv, dual_clip=3.0)[0].sum().backward()
    assert x.grad[0, 0].item() == 0.0 and x.grad[0, 1].item() != 0.0
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(ValueError, match="dual_clip must be 0"):
            clipped_surrogate(logp, old, adv, dual_clip=bad)
    logp_b, old_b, adv_b, mask_b = _batch()  # no ratio above 3 there: the loss is unchanged bit for bit
    assert torch.equal(policy_loss(logp_b, old_b, adv_b, mask_b, dual_clip=3.0, **CLIP).loss,
                       policy_loss(logp_b, old_b, adv_b, mask_b, **CLIP).loss)


@pytest.mark.parametrize("mode", ["ppo_clip", "gspo", "cispo"])
def test_a_huge_log_ratio_gives_a_finite_loss_and_no_nan_gradient(mode):
    """A token ~94 nats likelier now than under the behaviour policy: exp would overflow float32 (inf, and NaN
    gradients through 0 * inf even where a clip bound is active). The log ratio is bounded at +-20 as verl's is,
    so the loss is finite, a PPO token gets no gradient, and everything inside the bound keeps its bits."""
    from rlrepro.trainer.losses import LOG_RATIO_BOUND, behaviour_weights
    agg = dict(loss_agg="seq-mean-token-mean") if mode == "gspo" else {}
    clip = dict(clip_low=3e-4, clip_high=4e-4) if mode == "gspo" else {}
    mask = torch.ones(1, 2, dtype=torch.bool)
    for adv in (1.0, -1.0):
        for dual in ((0.0, 3.0) if mode == "ppo_clip" else (0.0,)):
            logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
            out = policy_loss(logp, torch.tensor([[-1.0, -95.0]]), torch.tensor([adv]), mask, mode=mode,
                              dual_clip=dual, **agg, **clip)
            out.loss.backward()
            assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all(), (adv, dual, logp.grad)
            if mode == "ppo_clip":  # (CISPO keeps every token's gradient: its weight is clipped, not the term)
                assert logp.grad[0, 1].item() == 0.0
    w = behaviour_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -95.0]]), mask)
    assert torch.isfinite(w.weight).all() and w.weight[0, 1] == torch.exp(torch.tensor(LOG_RATIO_BOUND))
    logp, old, adv, mask = _batch()  # every log ratio within the bound: the same bits as exp of the raw difference
    ratio = torch.exp(logp - old)
    pg, _ = clipped_surrogate(logp, old, adv.unsqueeze(-1), **CLIP)
    assert torch.equal(pg, torch.maximum(-adv.unsqueeze(-1) * ratio,
                                         -adv.unsqueeze(-1) * torch.clamp(ratio, 0.75, 1.25)))


def test_entropy_bonus_by_hand():
    logp, mask = pad_sequences([torch.tensor([-1.0, -2.0]), torch.tensor([-1.5])])
    ent = torch.tensor([[2.0, 4.0], [3.0, 0.0]], requires_grad=True)
    out = policy_loss(logp, logp.clone(), torch.tensor([0.0, 0.0]), mask, entropy=ent, entropy_coef=0.1)
    torch.testing.assert_close(out.loss, torch.tensor(-0.1 * 3.0))  # pg = 0; token-mean entropy (2 + 4 + 3) / 3
    out.loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]]))
    assert out.entropy == 3.0
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy"):
        policy_loss(logp, logp, torch.tensor([0.0, 0.0]), mask, entropy_coef=0.1)


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 4.0, 0.0, 4.0]])
    # population std: group 0 mean 0.5 std 0.5, group 1 mean 2 std 2
    assert torch.equal(group_advantages(rewards, eps=0.0),
                       torch.tensor([[1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, -1.0, 1.0]]))
    assert torch.equal(group_advantages(rewards, normalize_std=False),  # Dr. GRPO
                       torch.tensor([[0.5, -0.5, 0.5, -0.5], [-2.0, 2.0, -2.0, 2.0]]))
    assert torch.equal(compute_advantages(rewards, "dr_grpo"), group_advantages(rewards, normalize_std=False))
    # sample std (TRL / verl): group 0 std = sqrt(1/3)
    torch.testing.assert_close(group_advantages(rewards[:1], eps=0.0, unbiased=True),
                               torch.tensor([[1.0, -1.0, 1.0, -1.0]]) * math.sqrt(0.75), rtol=1e-6, atol=0)
    # equal rewards -> exactly 0, with the default eps
    assert torch.equal(compute_advantages(torch.full((2, 3), 7.0), "grpo"), torch.zeros(2, 3))
    assert torch.equal(group_advantages(torch.tensor([[3.0]])), torch.zeros(1, 1))  # a group of one
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="advantage mode"):
        compute_advantages(rewards, "ppo")


def test_lr_schedule_by_hand():
    kw = dict(base_lr=1.0, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    got = [lr_at(s, **kw) for s in range(8)]
    c = math.cos(math.pi / 4)
    want = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 0.1, 0.1]
    assert got == pytest.approx(want, rel=1e-15)
    assert lr_at(0, base_lr=2.0, warmup_steps=0, total_steps=4) == 2.0
    assert lr_at(4, base_lr=2.0, warmup_steps=0, total_steps=4) == 0.0


def test_clip_grad_norm_by_hand():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    assert clip_grad_norm_(grads, 10.0) == 5.0
    assert torch.equal(grads[0], torch.tensor([3.0, 0.0]))  # below the limit: untouched
    assert clip_grad_norm_(grads, 0.0) == 5.0  # disabled
    assert clip_grad_norm_(grads, 1.0) == 5.0
    torch.testing.assert_close(torch.cat([grads[0], grads[1].flatten()]), torch.tensor([0.6, 0.0, 0.8]),
                               rtol=1e-6, atol=0)  # scaled by 1 / (5 + 1e-6)
