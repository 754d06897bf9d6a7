"""Every algorithm option of the trainer against an independent float64 reference of its published formula (and of
the reference implementations users compare with: verl's core_algos, slime's ppo_utils, AReaL's decoupled loss),
on edge cases: equal-reward groups, groups of one, all-masked and zero-length rows, ragged lengths in every
aggregation, clip bounds hit exactly, the dual-clip branch, KL estimators at ratio 1 and their gradients, and the
behaviour weights of the off-policy correction. The references below are written out here from the formulas; none
calls rlrepro for an expected value. Tolerances: rlrepro computes in float32 where the inputs are float32.
"""
import math

import pytest
import torch

from rlrepro.trainer.advantages import compute_advantages
from rlrepro.trainer.losses import aggregate, behaviour_weights, clipped_surrogate, kl_penalty, policy_loss

F32 = dict(rtol=2e-5, atol=2e-6)
F64 = dict(rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------ float64 references
def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, sample):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - (1 if sample else 0)))


def ref_advantages(rewards, mode, eps=1e-6, std="population"):
    """The formulas of docs/TRAINER.md "Advantages", over nested lists, in Python floats (float64)."""
    sample = std == "sample"
    out = []
    if mode in ("grpo", "dr_grpo", "rloo"):
        for row in rewards:
            g, m = len(row), _mean(row)
            if mode == "grpo":
                s = _std(row, sample)
                out.append([0.0 if s == 0 else (r - m) / (s + eps) for r in row])
            elif mode == "dr_grpo":
                out.append([0.0 if max(row) == min(row) else r - m for r in row])
            else:
                out.append([r - (sum(row) - r) / (g - 1) for r in row])
        return out
    flat_in = [r for row in rewards for r in row]
    if mode == "reinforce_pp_baseline":
        flat_in = [r - _mean(row) for row in rewards for r in row]
    m, s = _mean(flat_in), _std(flat_in, sample)
    flat = [0.0 if s == 0 else (x - m) / (s + eps) for x in flat_in]
    g = len(rewards[0])
    return [flat[i * g:(i + 1) * g] for i in range(len(rewards))]


def verl_grpo(scores, index, eps=1e-6, norm_by_std=True):
    """verl's compute_grpo_outcome_advantage, written out: torch.std (sample std); a group of one gets mean 0, std 1."""
    groups = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, index):
        xs = groups[i]
        m, sd = (0.0, 1.0) if len(xs) == 1 else (_mean(xs), _std(xs, True))
        out.append((s - m) / (sd + eps) if norm_by_std else s - m)
    return out


def ref_agg(values, lengths, mode, C=None, num_tokens=None, num_seqs=None):
    """Aggregation over ragged rows (``values[i]`` has ``lengths[i]`` real entries); rlrepro's definitions: every
    row counts in S, an empty row adds 0."""
    S = len(lengths) if num_seqs is None else num_seqs
    rows = [values[i][:n] for i, n in enumerate(lengths)]
    if mode == "token-mean":
        n = sum(lengths) if num_tokens is None else num_tokens
        return sum(sum(r) for r in rows) / max(n, 1)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / max(S, 1)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) / C for r in rows) / max(S, 1)
    return sum(sum(r) for r in rows) / max(S, 1)


def ref_ppo_token(lr, a, lo, hi, c=0.0):
    """(pg, d pg / d logp) of PPO's clipped surrogate with dual clip (verl's compute_policy_loss_vanilla), one
    token; the gradient of whichever term is strictly active (a tie: both terms have the same gradient)."""
    r = math.exp(lr)
    un, cl = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    pg, grad = (cl, 0.0) if cl > un else (un, -a * r)
    if c and a < 0 and -a * c < pg:
        pg, grad = -a * c, 0.0
    return pg, grad


def _ragged(seed, lengths, T, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    logp = -torch.rand(len(lengths), T, generator=g, dtype=torch.float64) * 3
    old = logp + scale * torch.randn(len(lengths), T, generator=g, dtype=torch.float64)
    return logp, old, mask


# -------------------------------------------------------------------------------------------------- advantages
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [0.3, -2.0, 5.5, 0.25], [1.0, 1.0, 1.0, 0.0]]


@pytest.mark.parametrize("mode,std", [("grpo", "population"), ("grpo", "sample"), ("dr_grpo", "population"),
                                      ("rloo", "population"), ("reinforce_pp", "population"),
                                      ("reinforce_pp", "sample"), ("reinforce_pp_baseline", "population"),
                                      ("reinforce_pp_baseline", "sample")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_match_the_float64_formula(mode, std, dtype):
    got = compute_advantages(torch.tensor(REWARDS, dtype=dtype), mode=mode, std=std)
    want = torch.tensor(ref_advantages(REWARDS, mode, std=std), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, **(F64 if dtype == torch.float64 else F32))
    again = compute_advantages(torch.tensor(REWARDS, dtype=dtype), mode=mode, std=std)
    assert torch.equal(got, again)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, -7.25, 0.0])
def test_a_group_of_equal_rewards_gets_exactly_zero(mode, value):
    rewards = torch.tensor([[value] * 5, [0.0, 1.0, 0.0, 1.0, 1.0]])
    got = compute_advantages(rewards, mode=mode)
    assert torch.equal(got[0], torch.zeros(5))
    assert got[1].abs().sum() > 0


def test_grpo_with_sample_std_is_verls_grpo_for_groups_of_two_or_more():
    rewards = [[0.0, 1.0, 1.0], [2.0, -1.0, 0.5], [3.0, 3.0, 3.0]]
    flat = [r for row in rewards for r in row]
    index = [i for i, row in enumerate(rewards) for _ in row]
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), mode="grpo", std="sample").flatten()
    torch.testing.assert_close(got, torch.tensor(verl_grpo(flat, index), dtype=torch.float64), **F64)
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), mode="dr_grpo").flatten()
    torch.testing.assert_close(got, torch.tensor(verl_grpo(flat, index, norm_by_std=False), dtype=torch.float64),
                               **F64)


def test_a_group_of_one_gets_advantage_zero_not_verls_raw_reward():
    """A deliberate, documented deviation (docs/TRAINER.md "Advantages"): r - mean over a group of one is 0; verl
    special-cases the group to mean 0, std 1 and gives r / (1 + eps)."""
    rewards = torch.tensor([[0.7], [-1.5]], dtype=torch.float64)
    assert torch.equal(compute_advantages(rewards, mode="grpo"), torch.zeros(2, 1, dtype=torch.float64))
    assert torch.equal(compute_advantages(rewards, mode="dr_grpo"), torch.zeros(2, 1, dtype=torch.float64))
    assert verl_grpo([0.7, -1.5], [0, 1]) == [0.7 / (1 + 1e-6), -1.5 / (1 + 1e-6)]
    for mode, std in (("grpo", "sample"), ("rloo", "population")):
        with pytest.raises(ValueError, match="group_size >= 2"):
            compute_advantages(rewards, mode=mode, std=std)


def test_reinforce_pp_of_a_batch_of_equal_rewards_is_exactly_zero():
    for mode in ("reinforce_pp", "reinforce_pp_baseline"):
        assert torch.equal(compute_advantages(torch.full((3, 4), 0.1), mode=mode), torch.zeros(3, 4))


# ------------------------------------------------------------------------------------------------- aggregation
LENGTHS = [5, 0, 2, 7, 1]  # ragged, with a zero-length row


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                  "seq-mean-token-sum"])
def test_aggregation_modes_with_ragged_lengths_and_empty_rows(mode):
    T, C = 8, 9
    vals = torch.randn(len(LENGTHS), T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    vals[torch.arange(T)[None, :] >= torch.tensor(LENGTHS)[:, None]] = float("nan")  # padding must not leak
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    got = aggregate(vals, mask, mode, max_response_length=C)
    want = ref_agg(vals.tolist(), LENGTHS, mode, C=C)
    assert math.isclose(float(got), want, rel_tol=1e-12, abs_tol=1e-15)
    # micro-batches with the whole batch's counts add up to the whole
    parts = sum(float(aggregate(vals[i:i + 2], mask[i:i + 2], mode, max_response_length=C,
                                num_tokens=sum(LENGTHS), num_seqs=len(LENGTHS))) for i in range(0, 5, 2))
    assert math.isclose(parts, want, rel_tol=1e-12, abs_tol=1e-15)
    # all rows masked: 0, not NaN
    assert float(aggregate(vals, torch.zeros_like(mask), mode, max_response_length=C)) == 0.0


# ------------------------------------------------------------------------------------------------------ ppo_clip
@pytest.mark.parametrize("lo,hi,c", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.2, 0.28, 3.0), (0.1, 0.5, 1.5)])
def test_ppo_clip_value_and_gradient_match_the_reference(lo, hi, c):
    g = torch.Generator().manual_seed(2)
    B, T = 6, 9
    lr = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8  # many tokens past every bound
    adv = torch.tensor([1.5, -2.0, 0.0, -0.3, 0.7, -5.0], dtype=torch.float64)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = (logp - lr).detach()
    pg, clipped = clipped_surrogate(logp, old, adv, lo, hi, c)
    pg.sum().backward()
    for i in range(B):
        for t in range(T):
            want, want_grad = ref_ppo_token(float(logp[i, t].detach() - old[i, t]), float(adv[i]), lo, hi, c)
            assert math.isclose(float(pg[i, t].detach()), want, rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(float(logp.grad[i, t]), want_grad, rel_tol=1e-12, abs_tol=1e-15)
            assert bool(clipped[i, t]) == (want_grad == 0.0 and float(adv[i]) != 0.0)


@pytest.mark.parametrize("a", [2.0, -2.0])
def test_a_ratio_exactly_at_a_clip_bound_is_not_clipped_and_keeps_its_full_gradient(a):
    """At ``ratio == 1 + clip_high`` (A > 0) or ``1 - clip_low`` (A < 0) both terms are equal: the surrogate is
    ``-A ratio`` with its gradient ``-A ratio`` (verl's ``gt`` clip fraction does not count it either)."""
    lr = math.log(1.3) if a > 0 else math.log(0.7)
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = (logp - lr).detach()
    r = math.exp(float(logp.detach() - old))
    lo, hi = (0.2, r - 1.0) if a > 0 else (1.0 - r, 0.2)  # exact: 1 + (r - 1) == r, 1 - (1 - r) == r here
    assert 1.0 + hi == r if a > 0 else 1.0 - lo == r
    pg, clipped = clipped_surrogate(logp, old, torch.tensor([a], dtype=torch.float64), lo, hi)
    pg.sum().backward()
    assert float(pg.detach()) == -a * r and not bool(clipped)
    assert math.isclose(float(logp.grad), -a * r, rel_tol=1e-15)
    # clip ranges of 0 at ratio exactly 1: still the full gradient
    logp2 = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    pg2, clipped2 = clipped_surrogate(logp2, logp2.detach().clone(), torch.tensor([a], dtype=torch.float64), 0, 0)
    pg2.sum().backward()
    assert torch.equal(logp2.grad, torch.full((1, 3), -a, dtype=torch.float64)) and not clipped2.any()


def test_dual_clip_bounds_negative_advantages_only():
    ratios = [0.5, 1.0, 2.0, 2.999, 3.0, 3.001, 10.0]
    lr = torch.tensor([[math.log(r) for r in ratios]] * 2, dtype=torch.float64)
    logp = torch.zeros_like(lr, requires_grad=True)
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    pg, clipped = clipped_surrogate(logp, logp.detach() - lr, adv, 0.2, 0.28, 3.0)
    pg.sum().backward()
    pg = pg.detach()
    for t, r in enumerate(ratios):
        neg, neg_grad = ref_ppo_token(math.log(r), -1.0, 0.2, 0.28, 3.0)
        assert math.isclose(float(pg[0, t]), neg, rel_tol=1e-12) and math.isclose(float(logp.grad[0, t]), neg_grad)
        assert float(pg[0, t]) <= 3.0  # bounded by -A c
        pos, pos_grad = ref_ppo_token(math.log(r), 1.0, 0.2, 0.28, 3.0)
        assert math.isclose(float(pg[1, t]), pos, rel_tol=1e-12) and math.isclose(float(logp.grad[1, t]), pos_grad)
    # A < 0: 0.5 < 0.8 is the ordinary clip; 1 < ratio < 3 keeps its gradient (-A ratio > -A 1.28); > 3 dual
    # (exp(log 3) rounds to just above 3, so the token at 3.0 is the reference's call: compare with it)
    want = [ref_ppo_token(float(lr[0, t]), -1.0, 0.2, 0.28, 3.0)[1] == 0.0 for t in range(len(ratios))]
    assert clipped[0].tolist() == want and want[:4] == [True, False, False, False] and want[5:] == [True, True]


# ---------------------------------------------------------------------------------------------------- gspo, cispo
def test_gspo_matches_verls_token_level_form_with_ragged_and_empty_rows():
    """verl: ``s_it = sg(s_i) * pi / sg(pi)``, clipped per token, ``seq-mean-token-mean``; the same value and
    gradient as rlrepro's per-sequence ratio broadcast to the tokens."""
    lengths, T = [4, 0, 1, 6], 6
    logp, old, mask = _ragged(3, lengths, T, scale=0.01)
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0], dtype=torch.float64)
    lo, hi = 3e-3, 4e-3
    leaf = logp.clone().requires_grad_()
    out = policy_loss(leaf, old, adv, mask, clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-mean", mode="gspo")
    out.loss.backward()
    ref = logp.clone().requires_grad_()
    m = mask.double()
    s_log = ((ref - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    s_tok = torch.exp(ref - ref.detach() + s_log.detach()[:, None])
    a = adv[:, None]
    pg = torch.maximum(-a * s_tok, -a * s_tok.clamp(1 - lo, 1 + hi))
    per_seq = (pg * m).sum(-1) / (m.sum(-1) + 1e-300)
    want = per_seq.sum() / len(lengths)  # rlrepro's S counts the empty row (verl's agg_loss would not)
    want.backward()
    torch.testing.assert_close(out.loss.detach(), want.detach(), **F64)
    torch.testing.assert_close(leaf.grad, ref.grad, **F64)


@pytest.mark.parametrize("lo,hi", [(0.2, 0.28), (1.0, 0.5)])
def test_cispo_matches_the_reference_value_and_gradient(lo, hi):
    lengths, T = [3, 5, 0, 2], 5
    logp, old, mask = _ragged(4, lengths, T, scale=0.5)
    adv = torch.tensor([1.0, -2.0, 0.5, -0.25], dtype=torch.float64)
    leaf = logp.clone().requires_grad_()
    out = policy_loss(leaf, old, adv, mask, clip_low=lo, clip_high=hi, mode="cispo")
    out.loss.backward()
    n = sum(lengths)
    want, grad = 0.0, torch.zeros_like(logp)
    for i, L in enumerate(lengths):
        for t in range(L):
            w = min(max(math.exp(float(logp[i, t] - old[i, t])), 1 - lo), 1 + hi)
            want += -w * float(adv[i]) * float(logp[i, t]) / n
            grad[i, t] = -w * float(adv[i]) / n
    assert math.isclose(float(out.loss.detach()), want, rel_tol=1e-12)
    torch.testing.assert_close(leaf.grad, grad, **F64)


# ------------------------------------------------------------------------------------------------ KL and entropy
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_are_exactly_zero_at_ratio_one_with_zero_gradient_for_k2_k3(est):
    logp = torch.tensor([-0.1, -2.5, -7.0, 0.0], requires_grad=True)
    kl = kl_penalty(logp, logp.detach().clone(), est)
    assert (kl == 0).all()
    kl.sum().backward()
    assert torch.equal(logp.grad, torch.ones(4) if est == "k1" else torch.zeros(4))


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_value_and_gradient_match_schulman(est):
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(50, generator=g, dtype=torch.float64) * 4).requires_grad_()
    ref = -torch.rand(50, generator=g, dtype=torch.float64) * 4
    kl = kl_penalty(logp, ref, est)
    kl.sum().backward()
    for x, y, v, d in zip(logp.tolist(), ref.tolist(), kl.tolist(), logp.grad.tolist()):
        lr = y - x  # log(pi_ref / pi)
        want = {"k1": -lr, "k2": lr * lr / 2, "k3": math.exp(lr) - 1 - lr}[est]
        want_d = {"k1": 1.0, "k2": x - y, "k3": 1 - math.exp(lr)}[est]  # d / d logp
        assert math.isclose(v, want, rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(d, want_d, rel_tol=1e-12, abs_tol=1e-15)
        assert est != "k3" or v >= 0


def test_expected_gradient_of_each_kl_estimator_as_a_loss_term():
    """Exactly, over a small categorical pi: the expected gradient of ``kl_coef * k`` with samples from pi (the
    gradient through logp only, as in the loss) is 0 for k1, grad KL(pi || ref) for k2, grad KL(ref || pi) for k3
    (what docs/TRAINER.md states)."""
    theta = torch.tensor([0.3, -1.0, 2.0, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5, 0.2, 0.3], dtype=torch.float64), -1)

    def expected_grad(est):
        logp = torch.log_softmax(theta, -1)
        (grad,) = torch.autograd.grad((logp.exp().detach() * kl_penalty(logp, ref, est)).sum(), theta)
        return grad

    logp = torch.log_softmax(theta, -1)
    (fwd,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)  # KL(pi || ref)
    (rev,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)  # KL(ref || pi)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(5, dtype=torch.float64), **F64)
    torch.testing.assert_close(expected_grad("k2"), fwd, **F64)
    torch.testing.assert_close(expected_grad("k3"), rev, **F64)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                 "seq-mean-token-sum"])
def test_kl_and_entropy_terms_enter_with_the_same_aggregation(agg):
    lengths, T, C = [3, 0, 5, 1], 5, 6
    logp, old, mask = _ragged(6, lengths, T)
    ref = old - 0.2
    ent = torch.rand(4, T, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    adv = torch.tensor([1.0, 0.5, -1.0, 2.0], dtype=torch.float64)
    kw = dict(loss_agg=agg, max_response_length=C, clip_low=0.2, clip_high=0.28)
    base = policy_loss(logp, old, adv, mask, **kw)
    full = policy_loss(logp, old, adv, mask, kl_coef=0.05, ref_logp=ref, kl_estimator="k3", entropy=ent,
                       entropy_coef=0.01, **kw)
    lr = (ref - logp).tolist()
    k3 = [[math.exp(x) - 1 - x for x in row] for row in lr]
    want = float(base.loss) + 0.05 * ref_agg(k3, lengths, agg, C=C) - 0.01 * ref_agg(ent.tolist(), lengths, agg, C=C)
    assert math.isclose(float(full.loss), want, rel_tol=1e-12)


# ---------------------------------------------------------------------------------------- off-policy correction
def test_behaviour_weights_match_the_reference():
    lengths, T = [4, 0, 3, 2, 5], 5
    prox, beh, mask = _ragged(8, lengths, T, scale=0.4)
    prox[3, :2], beh[3, :2] = 0.0, math.log(2) / 2  # log rho_seq exactly log(0.5): the mis lower bound, inclusive
    for corr in ("none", "tis", "mis"):
        bw = behaviour_weights(prox, beh, mask, correction=corr, is_cap=1.3, mis_low=0.5, mis_high=1.6)
        for i, L in enumerate(lengths):
            log_seq = sum(float(prox[i, t] - beh[i, t]) for t in range(L))
            seq = math.exp(log_seq)
            for t in range(T):
                rho = math.exp(float(prox[i, t] - beh[i, t]))
                if t >= L:
                    want = 1.0
                elif corr == "none":
                    want = rho
                elif corr == "tis":
                    want = min(rho, 1.3)
                else:
                    want = seq if math.log(0.5) <= log_seq <= math.log(1.6) else 0.0
                assert math.isclose(float(bw.weight[i, t]), want, rel_tol=1e-12), (corr, i, t)
        again = behaviour_weights(prox, beh, mask, correction=corr, is_cap=1.3, mis_low=0.5, mis_high=1.6)
        assert torch.equal(bw.weight, again.weight)
    same = behaviour_weights(prox, prox.clone(), mask, correction="mis")
    assert torch.equal(same.weight, torch.ones_like(prox))
