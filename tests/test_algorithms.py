"""The algorithms of issue 23: RLOO, REINFORCE++ (and -baseline), GRPO's sample std, GSPO, CISPO and verl's
seq-mean-token-sum, each against a case worked out by hand from its paper's formula; cispo's stop-gradient;
today's defaults bit for bit the code path from before the new modes; the refused combinations; and a Trainer
run with each new mode reproducible bit for bit.

Inputs are chosen so that the hand values are exact in float32 where possible (0/1-ish rewards, power-of-two
denominators); the others use a tight tolerance against the formula as written out and say so.
"""
import copy
import math

import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, aggregate, compute_advantages, kl_penalty, pad_sequences, \
    policy_loss, token_logprobs
from rlrepro.trainer.advantages import ADVANTAGE_MODES, min_group_size, uses_std
from rlrepro.trainer.losses import LOSS_AGG_MODES, POLICY_LOSSES, clipped_surrogate, policy_loss_problems

TIGHT = dict(rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------- advantages
def test_rloo_is_the_leave_one_out_baseline_by_hand():
    """A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j (Kool et al. 2019; Ahmadian et al. 2024)."""
    rewards = torch.tensor([[1.0, 2.0, 6.0], [4.0, 4.0, 4.0]])
    # group 0: 1 - (2 + 6)/2 = -3, 2 - (1 + 6)/2 = -1.5, 6 - (1 + 2)/2 = 4.5; group 1: equal rewards -> 0
    want = torch.tensor([[-3.0, -1.5, 4.5], [0.0, 0.0, 0.0]])
    assert torch.equal(compute_advantages(rewards, "rloo"), want)
    # the same as G / (G - 1) * (r - mean) (verl's spelling), to rounding
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    torch.testing.assert_close(compute_advantages(rewards, "rloo"), 1.5 * centered, **TIGHT)
    two = compute_advantages(torch.tensor([[1.0, 0.0]]), "rloo")  # G = 2: r_i - r_other
    assert torch.equal(two, torch.tensor([[1.0, -1.0]]))
    with pytest.raises(ValueError, match="rloo' needs group_size >= 2"):
        compute_advantages(torch.tensor([[1.0], [0.0]]), "rloo")
    assert min_group_size("rloo") == 2 and min_group_size("grpo") == 1 and min_group_size("grpo", "sample") == 2


def test_reinforce_pp_normalises_over_the_whole_batch_by_hand():
    """REINFORCE++ (Hu et al. 2025): A = (r - mean_batch) / (std_batch + eps); no group baseline, so a group of
    equal rewards still gets a non-zero advantage (GRPO would give it 0)."""
    rewards = torch.tensor([[3.0, 3.0], [1.0, 1.0]])
    # batch mean 2, deviations [1, 1, -1, -1], population std 1
    assert torch.equal(ADVANTAGE_MODES["reinforce_pp"](rewards, 0.0), torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    torch.testing.assert_close(compute_advantages(rewards, "reinforce_pp"),
                               torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) / (1 + 1e-6), rtol=0, atol=0)
    assert torch.equal(compute_advantages(rewards, "grpo"), torch.zeros(2, 2))
    # sample std: sqrt(4 / 3), so A = deviation * sqrt(3) / 2
    torch.testing.assert_close(compute_advantages(rewards, "reinforce_pp", std="sample"),
                               torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) * math.sqrt(3) / 2, **TIGHT)
    assert torch.equal(compute_advantages(torch.full((3, 2), 5.0), "reinforce_pp"), torch.zeros(3, 2))


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_normalises_the_batch_by_hand():
    """A' = r - mean_group; A = (A' - mean_batch(A')) / (std_batch(A') + eps) (verl's reinforce_plus_plus_baseline)."""
    rewards = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    # A' = [[-1, 1], [0, 0]]; batch mean 0; population std sqrt(2 / 4), sample std sqrt(2 / 3)
    got = compute_advantages(rewards, "reinforce_pp_baseline", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]) * math.sqrt(2), **TIGHT)
    got = compute_advantages(rewards, "reinforce_pp_baseline", eps=0.0, std="sample")
    torch.testing.assert_close(got, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]) * math.sqrt(1.5), **TIGHT)
    # GRPO scales each group by its own std instead: group 0 -> [-1, 1]
    assert torch.equal(compute_advantages(rewards, "grpo", eps=0.0)[0], torch.tensor([-1.0, 1.0]))


@pytest.mark.parametrize("value", [0.1, 0.2, 0.3, 0.7, 1 / 3, 0.45])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_the_value(value):
    # the float32 mean of eight 0.1s is not 0.1: r - mean was ~7e-9, which GRPO divided by ~0 + eps into -0.0075
    # for the whole group; other groups keep their bits
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(6, 8, generator=gen)
    rewards[1] = rewards[4] = value
    for mode in ("grpo", "dr_grpo", "rloo"):
        got = compute_advantages(rewards, mode)
        assert torch.equal(got[[1, 4]], torch.zeros(2, 8)), mode
        mean = rewards.mean(dim=1, keepdim=True)
        plain = {"grpo": (rewards - mean) / (rewards.std(dim=1, keepdim=True, unbiased=False) + 1e-6),
                 "dr_grpo": rewards - mean,
                 "rloo": rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / 7}[mode]
        keep = [0, 2, 3, 5]
        assert torch.equal(got[keep], plain[keep]), mode
    assert torch.equal(compute_advantages(torch.full((3, 8), value), "reinforce_pp"), torch.zeros(3, 8))
    assert torch.equal(compute_advantages(torch.full((3, 8), value), "reinforce_pp_baseline"), torch.zeros(3, 8))


def test_grpo_std_population_is_todays_bits_and_sample_is_trl_and_verl():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (16, 8), generator=gen).float() + torch.rand(16, 8, generator=gen)
    # the old code path, written out: (r - mean) / (std(unbiased=False) + 1e-6) per group
    old = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True, unbiased=False) + 1e-6)
    assert torch.equal(compute_advantages(rewards, "grpo"), old)
    assert torch.equal(compute_advantages(rewards, "grpo", std="population"), old)
    assert TrainConfig().advantage_std == "population" and TrainConfig().advantage == "grpo"
    # sample std by hand: group [1, 0, 1, 0] has sample std sqrt(1/3) -> A = +-sqrt(3)/2
    got = compute_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), "grpo", eps=0.0, std="sample")
    torch.testing.assert_close(got, torch.tensor([[1.0, -1.0, 1.0, -1.0]]) * math.sqrt(3) / 2, **TIGHT)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages(torch.tensor([[1.0]]), "grpo", std="sample")
    with pytest.raises(ValueError, match="divides by no std"):
        compute_advantages(rewards, "dr_grpo", std="sample")
    with pytest.raises(ValueError, match="unknown advantage std"):
        compute_advantages(rewards, "grpo", std="biased")
    assert [m for m in ADVANTAGE_MODES if uses_std(m)] == ["grpo", "reinforce_pp", "reinforce_pp_baseline"]


# ------------------------------------------------------------------------------------------------ aggregation
def test_seq_mean_token_sum_by_hand():
    """verl's seq-mean-token-sum: (1/S) sum_i sum_t x_it."""
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert aggregate(x, mask, "seq-mean-token-sum").item() == 5.0  # (6 + 4) / 2
    # micro-batch shares with the whole batch's S add up to the whole-batch value
    parts = aggregate(x[:1], mask[:1], "seq-mean-token-sum", num_seqs=2) + \
        aggregate(x[1:], mask[1:], "seq-mean-token-sum", num_seqs=2)
    assert parts.item() == 5.0
    # = seq-mean-token-sum-norm times C
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_response_length=4).item() * 4 == 5.0
    assert list(LOSS_AGG_MODES)[-1] == "seq-mean-token-sum"


# ----------------------------------------------------------------------------------------------------- losses
def _old_policy_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, loss_agg, max_response_length,
                     kl_coef, ref_logp, kl_estimator, entropy, dual_clip, entropy_coef):
    """The loss as policy_loss computed it before train.policy_loss existed (its body, verbatim in substance)."""
    agg = dict(loss_agg=loss_agg, max_response_length=max_response_length, num_tokens=None, num_seqs=None)
    pg, _ = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high, dual_clip)
    loss = aggregate(pg, mask, **agg)
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * aggregate(entropy, mask, **agg)
    if ref_logp is not None and kl_coef != 0.0:
        loss = loss + kl_coef * aggregate(kl_penalty(logp, ref_logp, kl_estimator), mask, **agg)
    return loss


def _random_batch(seed=0, lengths=(3, 5, 1, 4)):
    gen = torch.Generator().manual_seed(seed)
    logp, mask = pad_sequences([-torch.rand(n, generator=gen) * 3 for n in lengths])
    old, _ = pad_sequences([-torch.rand(n, generator=gen) * 3 for n in lengths])
    ref, _ = pad_sequences([-torch.rand(n, generator=gen) * 3 for n in lengths])
    ent, _ = pad_sequences([torch.rand(n, generator=gen) for n in lengths])
    adv = torch.randn(len(lengths), generator=gen)
    adv[0] = -abs(adv[0]) - 1.0  # a negative advantage, so that the dual clip can bite
    return logp, old, ref, ent, adv, mask


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_clip", [0.0, 1.5])
def test_ppo_clip_is_the_old_loss_bit_for_bit(loss_agg, dual_clip):
    logp, old, ref, ent, adv, mask = _random_batch()
    kw = dict(clip_low=0.2, clip_high=0.28, loss_agg=loss_agg, max_response_length=6, kl_coef=0.05, ref_logp=ref,
              kl_estimator="k3", entropy=ent, dual_clip=dual_clip, entropy_coef=0.01)
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    new = policy_loss(x, old, adv, mask, **kw)  # the default mode
    explicit = policy_loss(logp, old, adv, mask, mode="ppo_clip", **kw)
    want = _old_policy_loss(y, old, adv, mask, **kw)
    assert torch.equal(new.loss, want) and torch.equal(explicit.loss, want)
    new.loss.backward()
    want.backward()
    assert torch.equal(x.grad, y.grad)
    pg, clipped = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    pg_old, clipped_old = clipped_surrogate(logp, old, adv, 0.2, 0.28, dual_clip)
    assert torch.equal(pg, pg_old) and torch.equal(clipped, clipped_old)
    assert TrainConfig().policy_loss == "ppo_clip"


def test_gspo_sequence_ratio_and_clip_by_hand():
    """s_i = exp(mean_t(logp - old_logp)); pg_i = max(-A_i s_i, -A_i clip(s_i, 1 - 0.2, 1 + 0.28)) (Zheng et al.
    2025), one value per sequence, aggregated seq-mean-token-mean: (1/S) sum_i pg_i."""
    # seq 0 (A = +1): log ratios [ln 2, 0] -> s = sqrt(2) ~ 1.414 > 1.28: clipped, pg = -1.28, no gradient
    # seq 1 (A = -1): log ratios [0, 0, 0, -0.4] -> s = exp(-0.1) inside [0.8, 1.28]: pg = exp(-0.1)
    logp, mask = pad_sequences([torch.tensor([math.log(2.0) - 1.0, -1.0]), torch.tensor([-2.0, -2.0, -2.0, -2.4])])
    old, _ = pad_sequences([torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0, -2.0, -2.0])])
    adv = torch.tensor([1.0, -1.0])
    x = logp.clone().requires_grad_(True)
    out = policy_loss(x, old, adv, mask, mode="gspo", loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
    s1 = math.exp(-0.1)
    torch.testing.assert_close(out.loss, torch.tensor((-1.28 + s1) / 2), **TIGHT)
    assert out.clip_frac == pytest.approx(2 / 6, rel=1e-7)  # both tokens of the clipped sequence
    out.loss.backward()
    # d/d logp_t of (1/S)(-A_1 s_1) = (1/2) s_1 (1/4) for each token of seq 1; seq 0 is clipped
    torch.testing.assert_close(x.grad, torch.tensor([[0.0, 0.0, 0.0, 0.0], [s1 / 8] * 4]), **TIGHT)
    # the token-level PPO ratio clips other tokens: token 0 of seq 0 (ratio 2) and the last of seq 1 (e^-0.4 < 0.8)
    _, token_clipped = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    assert token_clipped[mask].tolist() == [True, False, False, False, False, True]


def test_gspo_with_the_papers_small_clip_range_by_hand():
    """clip_low = 3e-4, clip_high = 4e-4 (GSPO §5.1): a mean log ratio of 1e-3 is clipped at 1 + 4e-4."""
    logp, mask = pad_sequences([torch.tensor([-1.0 + 2e-3, -1.0]), torch.tensor([-1.0, -1.0 + 2e-4])])
    old = torch.full_like(logp, -1.0)
    out = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, mode="gspo", loss_agg="seq-mean-token-mean",
                      clip_low=3e-4, clip_high=4e-4)
    s1 = math.exp((2e-4 + 0.0) / 2)  # inside [1 - 3e-4, 1 + 4e-4]
    torch.testing.assert_close(out.loss, torch.tensor((-(1 + 4e-4) - s1) / 2), rtol=1e-6, atol=0)
    assert out.clip_frac == 0.5


def test_gspo_on_policy_gradient_is_grpos_sequence_mean_gradient():
    """At ratio 1 every s_i = 1 and d loss / d logp_t = -A_i / (S L_i): the gradient of GRPO's
    seq-mean-token-mean surrogate (to rounding: other ops)."""
    logp, _, _, _, adv, mask = _random_batch(1)
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    policy_loss(x, logp, adv, mask, mode="gspo", loss_agg="seq-mean-token-mean").loss.backward()
    policy_loss(y, logp, adv, mask, loss_agg="seq-mean-token-mean").loss.backward()
    lengths = mask.sum(dim=1, keepdim=True).float()
    torch.testing.assert_close(x.grad, torch.where(mask, -adv[:, None] / (4 * lengths), 0.0), **TIGHT)
    torch.testing.assert_close(x.grad, y.grad, **TIGHT)


def test_cispo_by_hand_and_its_stop_gradient():
    """pg = -sg(clip(ratio, 1 - 0.2, 1 + 0.28)) * A * logp (MiniMax-M1 §3.1); d loss / d logp = -w A / N."""
    # seq 0 (A = +1): ratios [e^0.5 -> w 1.28, 1 -> w 1]; seq 1 (A = -1): ratio e^-1 -> w 0.8
    logp, mask = pad_sequences([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0])])
    old, _ = pad_sequences([torch.tensor([-1.5, -2.0]), torch.tensor([-2.0])])
    adv = torch.tensor([1.0, -1.0])
    x = logp.clone().requires_grad_(True)
    out = policy_loss(x, old, adv, mask, mode="cispo", clip_low=0.2, clip_high=0.28)
    # pg = [-1.28 * 1 * -1, -1 * 1 * -2, -0.8 * -1 * -3] = [1.28, 2, -2.4]; token mean
    torch.testing.assert_close(out.loss, torch.tensor((1.28 + 2.0 - 2.4) / 3), **TIGHT)
    assert out.clip_frac == pytest.approx(2 / 3, rel=1e-7)  # the weights of tokens 0 and 2 were clipped
    out.loss.backward()
    want = torch.tensor([[-1.28 / 3, -1.0 / 3], [0.8 / 3, 0.0]])
    torch.testing.assert_close(x.grad, want, **TIGHT)
    # the stop-gradient: the weight is a constant; the same loss with a detached weight written out by hand
    y = logp.clone().requires_grad_(True)
    weight = torch.tensor([[1.28, 1.0], [0.8, 1.0]])
    (torch.where(mask, -weight * adv[:, None] * y, 0.0).sum() / 3).backward()
    assert torch.equal(x.grad, y.grad)
    # PPO gives clipped tokens no gradient; CISPO keeps every token's
    z = logp.clone().requires_grad_(True)
    policy_loss(z, old, adv, mask, clip_low=0.2, clip_high=0.28).loss.backward()
    assert z.grad[0, 0].item() == 0.0 and x.grad[0, 0].item() != 0.0
    # clip_low = 1: no lower bound (the paper's setting): seq 1 keeps its weight e^-1
    w = policy_loss(logp, old, adv, mask, mode="cispo", clip_low=1.0, clip_high=0.28)
    torch.testing.assert_close(w.loss, torch.tensor((1.28 + 2.0 - 3 * math.exp(-1)) / 3), **TIGHT)
    assert w.clip_frac == pytest.approx(1 / 3, rel=1e-7)


@pytest.mark.parametrize("mode,agg", [("gspo", "seq-mean-token-mean"), ("cispo", "token-mean"),
                                      ("cispo", "seq-mean-token-sum")])
def test_new_losses_take_kl_and_entropy_terms(mode, agg):
    """loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy) for every policy loss."""
    logp, old, ref, ent, adv, mask = _random_batch(2)
    base = policy_loss(logp, old, adv, mask, mode=mode, loss_agg=agg)
    full = policy_loss(logp, old, adv, mask, mode=mode, loss_agg=agg, kl_coef=0.1, ref_logp=ref, entropy=ent,
                       entropy_coef=0.01)
    want = base.loss + 0.1 * aggregate(kl_penalty(logp, ref, "k3"), mask, agg) - 0.01 * aggregate(ent, mask, agg)
    torch.testing.assert_close(full.loss, want, **TIGHT)
    assert full.kl > 0 and full.entropy > 0


# --------------------------------------------------------------------------------------------- refused settings
@pytest.mark.parametrize("kw,message", [
    (dict(policy_loss="gspo"), r"train.loss_agg='token-mean' cannot be used with train.policy_loss=gspo: .*"
                               r"mean over sequences.*set train.loss_agg=seq-mean-token-mean"),
    (dict(policy_loss="gspo", loss_agg="seq-mean-token-sum"), r"train.loss_agg='seq-mean-token-sum' cannot"),
    (dict(policy_loss="gspo", loss_agg="seq-mean-token-mean", dual_clip=3.0),
     r"train.dual_clip=3.0 cannot be used with train.policy_loss=gspo: .*no dual clip; set train.dual_clip=0"),
    (dict(policy_loss="cispo", dual_clip=3.0), r"train.dual_clip=3.0 cannot be used with train.policy_loss=cispo: "
                                               r"CISPO's IS weight .* bounded above"),
    (dict(policy_loss="sapo"), r"train.policy_loss='sapo' is not allowed; choose one of \['ppo_clip', 'gspo', "
                               r"'cispo'\]"),
    (dict(clip_low=1.0), r"train.clip_low=1.0 must lie in \[0, 1\)"),
    (dict(advantage="dr_grpo", advantage_std="sample"), r"train.advantage_std='sample' changes nothing with "
                                                        r"train.advantage=dr_grpo"),
    (dict(advantage="rloo", advantage_std="sample"), r"train.advantage_std='sample' changes nothing"),
    (dict(advantage_std="unbiased"), r"train.advantage_std='unbiased' is not allowed"),
])
def test_impossible_combinations_are_refused_naming_the_keys(kw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kw)


def test_possible_combinations_are_accepted():
    TrainConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4, kl_coef=0.1,
                entropy_coef=0.01)
    TrainConfig(policy_loss="cispo", clip_low=1.0, clip_high=2.0, loss_agg="seq-mean-token-sum", entropy_coef=0.01)
    TrainConfig(policy_loss="ppo_clip", dual_clip=3.0, loss_agg="seq-mean-token-sum")
    for adv in ("grpo", "reinforce_pp", "reinforce_pp_baseline"):
        TrainConfig(advantage=adv, advantage_std="sample")
    TrainConfig(advantage="rloo")
    assert policy_loss_problems("ppo_clip", loss_agg="token-mean", dual_clip=3.0) == []
    with pytest.raises(ValueError, match="dual_clip=3.0 cannot be used with train.policy_loss=cispo"):
        logp, old, _, _, adv, mask = _random_batch()
        policy_loss(logp, old, adv, mask, mode="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(logp, old, adv, mask, mode="reinforce")


def test_the_command_line_refuses_them_too():
    from rlrepro.cli import compose_config

    with pytest.raises(ConfigError, match="train.loss_agg='token-mean' cannot be used with train.policy_loss=gspo"):
        compose_config(["recipe=grpo_tiny", "train.policy_loss=gspo"])
    cfg = compose_config(["recipe=grpo_tiny", "train.policy_loss=gspo", "train.loss_agg=seq-mean-token-mean",
                          "train.clip_low=3e-4", "train.clip_high=4e-4", "train.advantage=rloo"])
    assert cfg.train.policy_loss == "gspo" and cfg.train.advantage == "rloo" and cfg.train.advantage_std == "population"


# ---------------------------------------------------------------------------------------- the train step, twice
def _batch(model, step, advantage, std="population"):
    gen = torch.Generator().manual_seed(500 + step)
    vocab = model.config.vocab_size
    prompts, completions = [], []
    for _ in range(3):
        prompt = torch.randint(vocab, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(4):
            prompts.append(prompt)
            completions.append(torch.randint(vocab, (int(torch.randint(1, 7, (1,), generator=gen)),),
                                             generator=gen).tolist())
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, 1.0)
    rewards = torch.randint(0, 3, (3, 4), generator=gen).float()
    adv = compute_advantages(rewards, advantage, std=std).flatten().tolist()
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=a)
            for p, c, lp, a in zip(prompts, completions, lps, adv)]


def _run(advantage="grpo", std="population", steps=3, **overrides):
    model = tiny_model(seed=3)
    cfg = TrainConfig(**{**dict(lr=3e-3, steps=steps, micro_batch_size=5, ppo_epochs=2, kl_coef=0.05,
                                advantage=advantage, advantage_std=std), **overrides})
    trainer = Trainer(model, cfg, ref_model=copy.deepcopy(model))
    metrics = [trainer.train_step(_batch(model, s, advantage, std)) for s in range(steps)]
    return trainer, metrics


@pytest.mark.usefixtures("deterministic_torch")
@pytest.mark.parametrize("overrides", [
    dict(policy_loss="gspo", loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4),
    dict(policy_loss="cispo", clip_low=1.0, clip_high=0.02, entropy_coef=0.01),
    dict(loss_agg="seq-mean-token-sum", dual_clip=3.0),
    dict(advantage="rloo"),
    dict(advantage="reinforce_pp", std="sample"),
    dict(advantage="reinforce_pp_baseline"),
    dict(std="sample"),
], ids=["gspo", "cispo", "seq-mean-token-sum", "rloo", "reinforce_pp", "reinforce_pp_baseline", "grpo_sample"])
def test_a_trainer_run_with_each_new_mode_is_bitwise_reproducible(overrides):
    a, ma = _run(**overrides)
    b, mb = _run(**overrides)
    assert ma == mb
    for (na, wa), (nb, wb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb and torch.equal(wa, wb), na
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in ma)
    assert ma[-1]["train/grad_norm"] > 0
    if "policy_loss" in overrides:  # the second PPO epoch is off-policy: the clip bounds are reached
        assert max(m["train/clip_frac"] for m in ma) > 0
        base, mbase = _run(**{k: v for k, v in overrides.items() if k not in ("policy_loss", "clip_low")})
        assert any(not torch.equal(wa, wb) for (_, wa), (_, wb) in zip(a.named_weights(), base.named_weights()))
