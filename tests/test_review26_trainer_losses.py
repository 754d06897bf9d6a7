"""Review of the trainer's loss terms (issue #26 review): two defects, each shown against the published formula.

1. ``train.is_correction=mis`` (sequence-level masked IS; Liu, Li et al. 2025, Seq-MIS; verl's ``rollout_rs=sequence``,
   ``rollout_corr_helper.compute_rollout_rejection_mask``) is ``rho_i = exp(sum_t log rho_t)`` over the sequence's
   trained tokens. The token log ratios were clamped to +-20 *before* the sum, so a sequence with one token at +25
   and one at -25 nats got ``rho_i`` of the other tokens alone, and could be kept (or masked) against the formula.
   verl sums the raw token log ratios and bounds only the sum.
2. The KL term (Schulman 2020's k3, ``exp(ref - logp) - 1 - (ref - logp)``) was evaluated at every position, masked
   out afterwards. At a loss-masked token (a tool observation of a multi-turn sample) where the reference is more
   than ~88.7 nats likelier than the policy, ``exp`` overflows to inf: the value is masked out, but the backward of
   the mask gives ``0 * inf = NaN`` at that token, so a token outside the loss made the whole step non-finite.
"""
import math

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.losses import behaviour_weights, policy_loss

pytestmark = pytest.mark.usefixtures("deterministic_torch")


# --- 1. MIS sums the raw token log ratios ------------------------------------------------------------------------

def _seq_mis_reference(prox, behaviour, low, high):
    """verl's sequence rejection / Seq-MIS in float64: rho_i = exp(sum_t (prox - behaviour)), kept iff
    low <= rho_i <= high."""
    log_seq = sum(p - b for p, b in zip(prox, behaviour))
    return (math.exp(log_seq), low <= math.exp(log_seq) <= high)


@pytest.mark.parametrize("prox,behaviour,trained,weight,masked", [
    # log rho = +25, -25.5, +0.5: sum 0 -> rho_i = 1, kept with weight exactly 1 (clamped first: 20 - 20 + 0.5 -> e^0.5)
    ([-1.0, -26.0, -0.5], [-26.0, -0.5, -1.0], [True, True, True], 1.0, False),
    # log rho = +23, -22 and an untrained token: sum 1 -> rho_i = e > 2, masked (clamped first: 20 - 20 = 0 -> kept
    # with weight 1)
    ([-1.0, -23.0, -3.0], [-24.0, -1.0, -90.0], [True, True, False], 0.0, True),
])
def test_mis_sums_the_raw_token_log_ratios(prox, behaviour, trained, weight, masked):
    mask = torch.tensor([trained])
    out = behaviour_weights(torch.tensor([prox]), torch.tensor([behaviour]), mask, correction="mis", mis_low=0.5,
                            mis_high=2.0)
    kept = [(p, b) for p, b, t in zip(prox, behaviour, trained) if t]
    ref_rho, ref_keep = _seq_mis_reference([p for p, _ in kept], [b for _, b in kept], 0.5, 2.0)
    assert ref_keep == (not masked) and (not ref_keep or ref_rho == weight)
    n = sum(trained)
    assert out.weight[mask].tolist() == [weight] * n  # exact: the float32 sums are exact here
    assert out.masked[mask].tolist() == [masked] * n
    assert out.weight[~mask].tolist() == [1.0] * (len(prox) - n) and not out.masked[~mask].any()


def test_mis_in_a_train_step_follows_the_sequence_ratio():
    """A stale sample whose two trained tokens moved by +23.5 and -23.0 nats (T = 0.02 makes the proximal logprob of
    the second token -23.1): rho_i = e^0.5, kept with that weight (verl / Seq-MIS); with the +24.5 variant rho_i =
    e^1.5 > 2, masked. Before the fix both were kept with weight exactly 1.0."""
    temperature = 0.02
    prompt = [3, 5]
    probe = tiny_model(seed=1)
    with torch.no_grad():
        prox = token_logprobs(probe, [prompt], [[5, 49]], temperature)[0].tolist()
    assert prox[1] < -21.0  # the second token's log ratio below is past the old clamp
    for shift, masked in ((23.5, False), (24.5, True)):
        behaviour = [prox[0] - shift, prox[1] + 23.0]  # log rho = +shift, -23.0; both <= 0 as logprobs
        assert max(behaviour) <= 0.0
        rho_ref, keep_ref = _seq_mis_reference(prox, behaviour, 0.5, 2.0)
        assert keep_ref == (not masked)
        trainer = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-3, steps=2, decoupled=True, is_correction="mis"),
                          temperature=temperature)
        m = trainer.train_step([dict(prompt_token_ids=prompt, completion_token_ids=[5, 49], rollout_logprobs=behaviour,
                                     advantage=1.0)])
        assert m["train/is_masked_frac"] == (1.0 if masked else 0.0)
        if masked:
            assert m["train/is_weight_max"] == 0.0 and m["train/is_weight_mean"] == 0.0
        else:
            assert m["train/is_weight_max"] == pytest.approx(rho_ref, rel=1e-5)
            assert m["train/is_weight_mean"] == pytest.approx(rho_ref, rel=1e-5)


# --- 2. KL outside the mask reaches no bit -------------------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_at_a_masked_token_reaches_no_bit(estimator):
    """Position 1 is out of the loss (a tool token): the policy gives it -100, the reference -5 (k3's exp(95)
    overflows float32). Loss and gradient equal those with any other reference value there (torch.equal) and the
    float64 formula over the trained tokens; the masked token's gradient is exactly 0, not NaN."""
    mask = torch.tensor([[True, False, True]])
    adv = torch.tensor([1.0])

    def run(ref_at_masked):
        logp = torch.tensor([[-1.0, -100.0, -0.5]], requires_grad=True)
        ref = torch.tensor([[-1.2, ref_at_masked, -0.4]])
        out = policy_loss(logp, logp.detach(), adv, mask, kl_coef=0.1, ref_logp=ref, kl_estimator=estimator)
        out.loss.backward()
        return out, logp.grad

    out, grad = run(-5.0)
    out_same, grad_same = run(-100.0)
    assert torch.isfinite(grad).all() and grad[0, 1].item() == 0.0
    assert torch.equal(out.loss, out_same.loss) and torch.equal(grad, grad_same) and out.kl == out_same.kl
    lp = torch.tensor([-1.0, -0.5], dtype=torch.float64, requires_grad=True)
    log_r = torch.tensor([-1.2, -0.4], dtype=torch.float64) - lp
    kl = {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": torch.exp(log_r) - 1 - log_r}[estimator]
    ref_loss = (-torch.exp(lp - lp.detach()) + 0.1 * kl).sum() / 2  # token-mean over the 2 trained tokens
    ref_loss.backward()
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad[0, [0, 2]].double(), lp.grad, rtol=1e-6, atol=1e-7)


def _token_with_gap(policy, ref, prompt, prefix, temperature, pick):
    """The next token after ``prompt + prefix`` that ``pick`` chooses from ``ref_logp - policy_logp`` over the vocab."""
    vocab = policy.config.vocab_size
    with torch.no_grad():
        lp = torch.stack([x[-1] for x in token_logprobs(policy, [prompt] * vocab,
                                                        [prefix + [v] for v in range(vocab)], temperature)])
        rp = torch.stack([x[-1] for x in token_logprobs(ref, [prompt] * vocab,
                                                        [prefix + [v] for v in range(vocab)], temperature)])
    gap = rp - lp
    v = int(pick(gap))
    return v, float(gap[v])


def test_a_train_step_with_kl_is_finite_when_a_masked_token_would_overflow_k3():
    """A multi-turn sample [policy token, tool token, policy token] at T = 0.005 with a reference whose logprob at
    the tool token is > 88.7 nats above the policy's: k3 there is inf. The tool token is out of the loss, so the step
    must be finite (before the fix its gradient was NaN and train_step raised FloatingPointError)."""
    temperature = 0.005
    policy, ref = tiny_model(seed=1), tiny_model(seed=2)
    prompt = [3, 5]
    t0, g0 = _token_with_gap(policy, ref, prompt, [], temperature, lambda g: g.abs().argmin())
    t1, g1 = _token_with_gap(policy, ref, prompt, [t0], temperature, lambda g: g.argmax())
    t2, g2 = _token_with_gap(policy, ref, prompt, [t0, t1], temperature, lambda g: g.abs().argmin())
    assert g1 > 89.0 and abs(g0) < 1.0 and abs(g2) < 1.0  # exp(g1) overflows float32; the trained tokens do not
    with torch.no_grad():
        lps = token_logprobs(policy, [prompt], [[t0, t1, t2]], temperature)[0].tolist()
    sample = dict(prompt_token_ids=prompt, completion_token_ids=[t0, t1, t2], rollout_logprobs=[lps[0], 0.0, lps[2]],
                  advantage=1.0, loss_mask=[1, 0, 1])
    other = dict(prompt_token_ids=prompt, completion_token_ids=[t0], rollout_logprobs=lps[:1], advantage=-1.0)
    trainer = Trainer(policy, TrainConfig(lr=1e-3, steps=2, kl_coef=0.1, kl_estimator="k3"), ref_model=ref,
                      temperature=temperature)
    metrics = trainer.train_step([sample, other])
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
    assert math.isfinite(metrics["train/kl"]) and metrics["train/num_tokens"] == 3
    assert all(torch.isfinite(w).all() for _, w in trainer.named_weights())



# --- 3. the config names the fix ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy_loss,extra", [("ppo_clip", {}), ("gspo", dict(loss_agg="seq-mean-token-mean"))])
def test_clip_low_of_one_is_refused_naming_cispo(policy_loss, extra):
    """clip_low=1 (no lower bound) is CISPO's setting only; elsewhere the message names the loss and the fix."""
    from rlrepro.checks import ConfigError
    with pytest.raises(ConfigError, match=rf"train\.clip_low=1\.0 must lie in \[0, 1\) with train\.policy_loss="
                                          rf"{policy_loss}: .*train\.clip_low=0\.2, or set train\.policy_loss=cispo"):
        TrainConfig(policy_loss=policy_loss, clip_low=1.0, **extra)
    assert TrainConfig(policy_loss="cispo", clip_low=1.0).clip_low == 1.0
