"""Session 34 review of the algorithm layer (rlrepro/trainer/advantages.py, losses.py, train.py), as a user coming
from verl / slime / AReaL: defects reproduced first, then fixed.

1. ``compute_advantages`` / ``group_advantages`` took any ``eps``: ``eps=0`` (verl's ``epsilon`` may be set so)
   turned a group of equal rewards into NaN advantages (0 / 0; docs promise exactly 0), and a REINFORCE++ batch of
   equal rewards too; a negative ``eps`` flipped the sign of every advantage of a group with std < |eps| (a
   sign-flipped update, silently); NaN / inf made every advantage NaN / 0.
2. ``compute_advantages(std="sample")`` with ``grpo`` and a group of one failed naming ``unbiased=False``, an
   argument the caller never passed, instead of ``std``.
3. ``policy_loss`` / ``clipped_surrogate`` took any clip range and coefficient: ``clip_high < 0`` inverted the clamp
   (``clamp(r, 0.8, 0.5)`` is 0.5 everywhere), so on-policy every positive-advantage token sat on a clip bound and
   got no gradient, silently; ``clip_low > 1`` gave a negative lower bound; NaN coefficients gave a NaN loss.
   ``TrainConfig`` refused these for the CLI; the documented Python API did not.
4. ``behaviour_weights(correction="tis")`` took any ``is_cap``: ``is_cap=-1`` weighed every token -1 (the policy
   loss negated, even on synchronous samples whose weights the docs promise are exactly 1), NaN gave NaN weights;
   and a cap below 1 set the weight outside ``mask`` (documented "exactly 1.0 outside mask") to the cap.
5. ``Trainer(temperature=inf)`` was accepted by the ">= 0" check (logits / inf: a uniform policy).
Float64 references are written out here from the formulas; none calls rlrepro for an expected value.
"""
import math
import re

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer
from rlrepro.trainer.advantages import compute_advantages, group_advantages
from rlrepro.trainer.losses import behaviour_weights, clipped_surrogate, pad_sequences, policy_loss

pytestmark = pytest.mark.usefixtures("deterministic_torch")

REWARDS = [[1.0, 1.0, 1.0, 1.0], [0.1, 0.1, 0.1, 0.1], [0.0, 1.0, 0.0, 1.0], [0.3, 0.7, 0.2, 0.9]]


def _ref_group(row, eps, sample):
    """GRPO in float64: ``(r - mean) / (std + eps)``; a group of equal rewards 0 (docs/TRAINER.md, "Advantages")."""
    m = sum(row) / len(row)
    if all(x == row[0] for x in row):
        return [0.0] * len(row)
    s = math.sqrt(sum((x - m) ** 2 for x in row) / (len(row) - (1 if sample else 0)))
    return [(x - m) / (s + eps) for x in row]


# ----------------------------------------------------------------------------------------------- 1. eps
@pytest.mark.parametrize("std", ["population", "sample"])
def test_grpo_with_eps_zero_gives_equal_groups_exactly_zero_and_others_the_formula(std):
    got = compute_advantages(torch.tensor(REWARDS), "grpo", eps=0.0, std=std)
    assert not torch.isnan(got).any(), got
    assert torch.equal(got[:2], torch.zeros(2, 4))  # the documented promise: exactly 0, whatever eps
    want = torch.tensor([_ref_group(r, 0.0, std == "sample") for r in REWARDS[2:]], dtype=torch.float64)
    torch.testing.assert_close(got[2:].double(), want, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("value", [0.1, 1.0, 0.0])
@pytest.mark.parametrize("mode", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_batch_of_equal_rewards_with_eps_zero_is_exactly_zero(mode, value):
    got = compute_advantages(torch.full((3, 4), value), mode, eps=0.0)
    assert torch.equal(got, torch.zeros(3, 4)), got


def test_group_advantages_with_eps_zero_gives_equal_groups_exactly_zero():
    got = group_advantages(torch.tensor(REWARDS), eps=0.0)
    assert torch.equal(got[:2], torch.zeros(2, 4)), got


@pytest.mark.parametrize("eps", [1e-6, 0.0, 0.5])
@pytest.mark.parametrize("std", ["population", "sample"])
def test_grpo_bits_are_the_documented_expression(eps, std):
    """Where it was defined, the fix changes no bit: ``centered / (std + eps)``, the equal rows exactly 0."""
    r = torch.tensor(REWARDS[2:])
    want = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=std == "sample") + eps)
    got = compute_advantages(torch.tensor(REWARDS), "grpo", eps=eps, std=std)
    assert torch.equal(got[2:], want)
    b = torch.tensor(REWARDS).view(-1)
    want_b = ((b - b.mean()) / (b.std(unbiased=std == "sample") + eps)).view(4, 4)
    assert torch.equal(compute_advantages(torch.tensor(REWARDS), "reinforce_pp", eps=eps, std=std), want_b)


@pytest.mark.parametrize("eps", [-1e-6, -1.0, float("nan"), float("inf"), float("-inf"), True, "1e-6", None])
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_a_bad_eps_is_refused_naming_it(mode, eps):
    with pytest.raises(ValueError, match=r"eps=.*finite number >= 0.*1e-06"):
        compute_advantages(torch.tensor(REWARDS), mode, eps=eps)


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_group_advantages_refuses_a_bad_eps(eps):
    with pytest.raises(ValueError, match=r"eps="):
        group_advantages(torch.tensor(REWARDS), eps=eps)


def test_a_negative_eps_no_longer_flips_the_sign_silently():
    """The reproduction: eps=-1 turned [1, 0, 1, 0] (std 0.5) into advantages of the opposite sign."""
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    with pytest.raises(ValueError):
        compute_advantages(r, "grpo", eps=-1.0)
    assert compute_advantages(r, "grpo")[0, 0] > 0


# ----------------------------------------------------------------------------- 2. the sample std, group of one
def test_grpo_sample_std_of_a_group_of_one_names_std():
    with pytest.raises(ValueError, match=r"std='sample'.*group_size >= 2.*std='population'") as err:
        compute_advantages(torch.tensor([[1.0], [0.0]]), "grpo", std="sample")
    assert "unbiased" not in str(err.value)
    # population std: a group of one has advantage 0 (documented)
    assert torch.equal(compute_advantages(torch.tensor([[1.0], [0.0]]), "grpo"), torch.zeros(2, 1))


# -------------------------------------------------------------------------------- 3. the loss's clip ranges
def _tensors():
    logp, mask = pad_sequences([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])])
    return logp, logp.clone(), torch.tensor([1.0, -1.0]), mask


BAD = [(dict(clip_high=-0.5), "clip_high=-0.5"), (dict(clip_high=float("nan")), "clip_high=nan"),
       (dict(clip_high=float("inf")), "clip_high=inf"), (dict(clip_low=-0.1), "clip_low=-0.1"),
       (dict(clip_low=1.5), "clip_low=1.5"), (dict(clip_low=1.0), "clip_low=1.0"),
       (dict(clip_low=float("nan")), "clip_low=nan"), (dict(kl_coef=float("nan")), "kl_coef=nan"),
       (dict(kl_coef=-0.1), "kl_coef=-0.1"), (dict(entropy_coef=float("inf")), "entropy_coef=inf"),
       (dict(entropy_coef=-0.01), "entropy_coef=-0.01")]


@pytest.mark.parametrize("mode", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("kw, named", BAD)
def test_policy_loss_refuses_a_bad_clip_range_or_coefficient_naming_it(mode, kw, named):
    logp, old, adv, mask = _tensors()
    extra = dict(loss_agg="seq-mean-token-mean") if mode == "gspo" else {}
    with pytest.raises(ValueError, match=re_named(named)):
        policy_loss(logp, old, adv, mask, mode=mode, ref_logp=logp.detach(), entropy=torch.zeros_like(logp),
                    **extra, **kw)


def re_named(named):
    return re.escape(named) + r"\b"


@pytest.mark.parametrize("kw, named", BAD[:7])
def test_cispo_takes_clip_low_one_only_and_refuses_the_rest(kw, named):
    logp, old, adv, mask = _tensors()
    if kw == dict(clip_low=1.0):  # MiniMax-M1's "no lower bound": allowed with cispo (as TrainConfig)
        out = policy_loss(logp, old, adv, mask, mode="cispo", clip_low=1.0, clip_high=0.28)
        # float64: -w A logp, w = clip(1, 0, 1.28) = 1, token mean over 3 tokens
        want = -(1.0 * -1.0 + 1.0 * -2.0 + (-1.0) * -0.5) / 3
        assert abs(float(out.loss) - want) < 1e-6
        return
    with pytest.raises(ValueError, match=re_named(named)):
        policy_loss(logp, old, adv, mask, mode="cispo", **kw)


def test_negative_clip_high_used_to_freeze_positive_advantages_on_policy():
    """The reproduction: on-policy (ratio 1), clip_high=-0.5 made every A > 0 token a clipped one (clip_frac 1 for
    them, no gradient). Now refused; with a valid clip_high the same tokens are unclipped and get d pg / d logp =
    -A (float64: -1 for A = 1)."""
    logp, old, adv, mask = _tensors()
    with pytest.raises(ValueError, match=r"clip_high=-0\.5"):
        clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=-0.5)
    x = logp.clone().requires_grad_(True)
    pg, clipped = clipped_surrogate(x, old, adv, clip_low=0.2, clip_high=0.28)
    assert not clipped[mask].any()
    pg[mask].sum().backward()
    assert torch.equal(x.grad[0], torch.tensor([-1.0, -1.0]))


def test_valid_edges_are_still_accepted():
    logp, old, adv, mask = _tensors()
    for kw in (dict(clip_low=0.0, clip_high=0.0), dict(clip_low=0.999, clip_high=10.0), dict(kl_coef=0.0),
               dict(entropy_coef=0.0)):
        out = policy_loss(logp, old, adv, mask, **kw)
        # on-policy PPO: pg = -A per token, token mean over 3 tokens = -(1 + 1 - 1) / 3
        assert abs(float(out.loss) - (-1.0 / 3)) < 1e-6, kw
    TrainConfig(clip_low=0.0, clip_high=0.0)


# ------------------------------------------------------------------------------------------ 4. TIS's cap
@pytest.mark.parametrize("cap", [-1.0, 0.0, float("nan"), float("inf"), True])
def test_tis_refuses_a_cap_that_is_not_a_positive_finite_number(cap):
    prox, mask = pad_sequences([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])])
    with pytest.raises(ValueError, match=r"is_cap=.*finite number > 0"):
        behaviour_weights(prox, prox.clone(), mask, correction="tis", is_cap=cap)


def test_tis_weights_of_synchronous_samples_are_exactly_one_and_the_cap_where_truncated():
    prox, mask = pad_sequences([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])])
    w = behaviour_weights(prox, prox.clone(), mask, correction="tis", is_cap=0.5).weight
    assert torch.equal(w, torch.tensor([[0.5, 0.5], [0.5, 1.0]]))  # rho = 1 > cap 0.5; padding exactly 1
    w = behaviour_weights(prox, prox.clone(), mask, correction="tis", is_cap=2.0).weight
    assert torch.equal(w, torch.ones(2, 2))
    # the other corrections do not read is_cap
    assert torch.equal(behaviour_weights(prox, prox.clone(), mask, correction="none", is_cap=-1.0).weight,
                       torch.ones(2, 2))


# --------------------------------------------------------------------------------------- 5. the temperature
@pytest.mark.parametrize("t", [float("inf"), float("nan"), -0.5])
def test_trainer_refuses_a_non_finite_temperature_naming_it(t):
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0"):
        Trainer(tiny_model(seed=0), TrainConfig(micro_batch_size=2), temperature=t)


def test_trainer_takes_zero_and_positive_temperatures():
    for t in (0, 0.0, 0.7, 1):
        assert Trainer(tiny_model(seed=0), TrainConfig(micro_batch_size=2), temperature=t).temperature == float(t)


@pytest.mark.parametrize("key,verl,ours", [("kl_estimator", "low_var_kl", "k3"), ("kl_estimator", "kl", "k1"),
                                           ("kl_estimator", "mse", "k2"), ("policy_loss", "vanilla", "ppo_clip"),
                                           ("advantage", "reinforce_plus_plus", "reinforce_pp")])
def test_verl_spellings_are_refused_naming_ours(key, verl, ours):
    """A user from verl writes its names (``low_var_kl``, ``vanilla``, ``reinforce_plus_plus``): the error names
    the key, the value and our name for it; an unknown value still gets the list alone."""
    from rlrepro.trainer.config import TrainConfig

    extra = {"kl_coef": 0.001} if key == "kl_estimator" else {}
    with pytest.raises(Exception) as e:
        TrainConfig(**{key: verl}, **extra).validate()
    msg = str(e.value)
    assert f"train.{key}={verl!r}" in msg and f"it is verl's name for {ours}; set train.{key}={ours}" in msg, msg
    with pytest.raises(Exception) as e:
        TrainConfig(**{key: "nonsense"}, **extra).validate()
    assert "choose one of" in str(e.value) and "verl" not in str(e.value)


def test_every_policy_loss_conflict_is_named_at_once():
    """gspo with a dual clip and the default token-mean: only the first conflict was named, so fixing it revealed
    the next; both are named now, each with its key, value and fix."""
    from rlrepro.trainer.config import TrainConfig

    with pytest.raises(Exception) as e:
        TrainConfig(policy_loss="gspo", dual_clip=3.0).validate()
    msg = str(e.value)
    assert msg.startswith("train.dual_clip=3.0 cannot be used with train.policy_loss=gspo"), msg
    assert "set train.dual_clip=0; and train.loss_agg='token-mean' cannot be used with train.policy_loss=gspo" in msg
    assert msg.endswith("set train.loss_agg=seq-mean-token-mean"), msg
