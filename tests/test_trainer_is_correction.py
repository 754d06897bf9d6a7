"""Off-policy correction (issue #25's trainer half): ``train.decoupled`` clips the PPO ratio against the proximal
policy (the weights at the start of the step) and weights each token by the detached behaviour weight
``pi_prox / pi_behaviour``, truncated (``train.is_correction=tis``) or sequence-masked (``mis``).

Exactness: the defaults run none of the new arithmetic; with synchronous samples (rollout logprobs = the policy's
own) the proximal logprobs are the rollout's bit for bit, every weight is exactly 1.0 and the decoupled step is the
default step bit for bit; stale samples train reproducibly; the truncation and the masking by hand."""
import copy
import math

import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, policy_loss
from rlrepro.trainer import train as train_module
from rlrepro.trainer import updates as updates_module  # the update loop (and its policy_loss call) lives there
from rlrepro.trainer.losses import IS_CORRECTIONS, behaviour_weights, clipped_surrogate

from test_algorithms import _batch as unmasked_on_policy_batch  # 12 samples, the model's own logprobs
from test_trainer_loss_mask import MODES, MODE_IDS, assert_same_step, on_policy_batch, step_and_state

pytestmark = pytest.mark.usefixtures("deterministic_torch")

DECOUPLED = {"none": dict(decoupled=True), "tis": dict(decoupled=True, is_correction="tis"),
             "mis": dict(decoupled=True, is_correction="mis")}
OFF_POLICY_KEYS = {"train/is_weight_mean", "train/is_weight_max", "train/is_truncated_frac", "train/is_masked_frac",
                   "train/behaviour_proximal_kl"}


def stale(batch, seed: int = 7, scale: float = 0.3):
    """The batch with its rollout (behaviour) logprobs moved by seeded noise at every token: an older policy's."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(batch)
    for s in out:
        noise = (torch.rand(len(s["rollout_logprobs"]), generator=gen) * 2 - 1) * scale
        s["rollout_logprobs"] = [x + float(d) for x, d in zip(s["rollout_logprobs"], noise)]
    return out


class Recorder:
    """Wraps the trainer's ``behaviour_weights`` and keeps what it was called with and returned."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(train_module, "behaviour_weights", self)

    def __call__(self, proximal, behaviour, mask, **kw):
        out = behaviour_weights(proximal, behaviour, mask, **kw)
        self.calls.append((proximal.clone(), behaviour.clone(), mask.clone(), out))
        return out


# ------------------------------------------------------------------------------------- (a) the default path
def test_the_defaults_run_none_of_the_new_arithmetic(monkeypatch):
    """With decoupled=false no behaviour weight is computed, the loss gets no weight (not even a multiplication by
    1), the metrics are today's keys; an explicit decoupled=false, is_correction=none is the same step bit for bit."""
    assert TrainConfig().decoupled is False and TrainConfig().is_correction == "none"
    calls = []
    monkeypatch.setattr(train_module, "behaviour_weights", lambda *a, **k: calls.append(a))
    seen = []
    real = updates_module.policy_loss
    monkeypatch.setattr(updates_module, "policy_loss", lambda *a, **k: seen.append(k["is_weight"]) or real(*a, **k))
    model = tiny_model(seed=1)
    batch = stale(on_policy_batch(model))  # off policy: the default loss anchors on these rollout logprobs
    a = step_and_state(batch)
    assert calls == [] and seen and all(w is None for w in seen)
    assert not OFF_POLICY_KEYS & set(a[0])
    b = step_and_state(batch, decoupled=False, is_correction="none", is_cap=2.0, mis_threshold=2.0)
    assert_same_step(a, b)
    assert a[0]["train/clip_frac"] > 0  # the stale ratios reach the clip bounds


def test_policy_loss_without_a_weight_is_the_plain_loss_and_with_ones_the_same_bits():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=gen) * 3
    old = logp + (torch.rand(3, 4, generator=gen) - 0.5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0, 0.5])
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    plain = policy_loss(x, old, adv, mask, **kw)
    ones = policy_loss(y, old, adv, mask, is_weight=torch.ones(3, 4), **kw)
    plain.loss.backward()
    ones.loss.backward()
    assert torch.equal(plain.loss, ones.loss) and torch.equal(x.grad, y.grad) and plain.pg_loss == ones.pg_loss


# ------------------------------------------------------------------------- (b) synchronous samples (K = 0)
@pytest.mark.parametrize("correction", IS_CORRECTIONS)
@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_on_policy_the_proximal_logprobs_are_the_rollouts_and_every_weight_is_one(monkeypatch, correction,
                                                                                    ppo_epochs):
    rec = Recorder(monkeypatch)
    model = tiny_model(seed=3)
    batch = unmasked_on_policy_batch(model, 0, "grpo")
    cfg = dict(lr=3e-3, steps=3, micro_batch_size=5, kl_coef=0.05, ppo_epochs=ppo_epochs)
    base = Trainer(copy.deepcopy(model), TrainConfig(**cfg), ref_model=copy.deepcopy(model))
    dec = Trainer(copy.deepcopy(model), TrainConfig(**cfg, **DECOUPLED[correction]), ref_model=copy.deepcopy(model))
    mb, md = base.train_step(batch), dec.train_step(batch)
    assert len(rec.calls) == 3  # once per micro-batch, in the first epoch only: the proximal policy is fixed
    for proximal, behaviour, mask, out in rec.calls:
        assert torch.equal(proximal[mask], behaviour[mask])  # the trainer's logprobs are the engine's, bit for bit
        assert torch.equal(out.weight, torch.ones_like(out.weight))
        assert not out.truncated.any() and not out.masked.any() and torch.equal(out.kl, torch.zeros_like(out.kl))
    assert md["train/is_weight_mean"] == 1.0 and md["train/is_weight_max"] == 1.0
    assert md["train/is_truncated_frac"] == 0.0 and md["train/is_masked_frac"] == 0.0
    assert md["train/behaviour_proximal_kl"] == 0.0 and md["train/rollout_logprob_abs_diff"] == 0.0
    # the decoupled step is the default one bit for bit: exp(logp - prox) is exp(logp - old) and w = 1.0 is exact
    assert {k: v for k, v in md.items() if k not in OFF_POLICY_KEYS} == mb
    for (na, wa), (nb, wb) in zip(base.named_weights(), dec.named_weights()):
        assert na == nb and torch.equal(wa, wb), na
    assert all(torch.equal(a, b) for a, b in zip(base.optimizer.grads(), dec.optimizer.grads()))
    assert mb["train/grad_norm"] > 0


@pytest.mark.parametrize("policy_loss_name,loss_agg,extra", MODES, ids=MODE_IDS)
def test_on_policy_decoupled_tis_is_the_default_step_with_loss_masks_and_every_loss(policy_loss_name, loss_agg,
                                                                                    extra):
    """Multi-turn samples (masked tokens with 0.0 placeholders), every policy loss and aggregation, two epochs."""
    batch = on_policy_batch(tiny_model(seed=1))
    cfg = dict(policy_loss=policy_loss_name, loss_agg=loss_agg, **extra)
    a = step_and_state(batch, **cfg)
    b = step_and_state(batch, **cfg, **DECOUPLED["tis"])
    assert b[0]["train/is_weight_mean"] == 1.0 and b[0]["train/is_weight_max"] == 1.0
    assert_same_step(a, ({k: v for k, v in b[0].items() if k not in OFF_POLICY_KEYS}, *b[1:]))


# ------------------------------------------------------------------------------------- (c) by hand
def test_tis_truncates_at_the_cap_by_hand():
    proximal = torch.tensor([[math.log(0.5), math.log(4.0), 0.0], [math.log(3.0), 0.0, 0.0]])
    behaviour = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 99.0]])  # 99: padding (outside the mask)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = behaviour_weights(proximal, behaviour, mask, correction="tis", is_cap=2.0)
    assert torch.equal(out.weight, torch.tensor([[float(torch.exp(proximal[0, 0])), 2.0, 1.0], [2.0, 1.0, 1.0]]))
    assert out.truncated.tolist() == [[False, True, False], [True, False, False]]
    assert not out.masked.any()
    none = behaviour_weights(proximal, behaviour, mask, correction="none")
    assert torch.equal(none.weight[mask], torch.exp(proximal[mask]))  # untruncated: ~4 and ~3
    torch.testing.assert_close(out.kl[0, 1], torch.tensor(4.0 - 1.0 - math.log(4.0)))  # k3 = rho - 1 - log rho
    assert out.kl[1, 2] == 0.0


def test_mis_masks_whole_sequences_outside_the_bounds_by_hand():
    """rho_i = exp(sum_t log rho_t) over the trained tokens; kept sequences weigh rho_i on every token, masked ones
    0; bounds [1/2, 2] by default, a lower bound of 0 keeps every small ratio."""
    log_rho = torch.tensor([[0.25, 0.25, 0.0],    # rho = e^0.5 ~ 1.65: kept
                            [0.5, 0.5, 0.0],      # e^1 ~ 2.72 > 2: masked
                            [-1.0, 0.0, 0.0],     # e^-1 ~ 0.37 < 0.5: masked
                            [0.5, 7.0, 0.0]])     # 7.0 at a token outside the mask (a tool token): e^0.5, kept
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    behaviour = torch.full((4, 3), -2.0)
    out = behaviour_weights(behaviour + log_rho, behaviour, mask, correction="mis", mis_low=0.5, mis_high=2.0)
    e_half = torch.exp(((behaviour + log_rho)[0, :2] - behaviour[0, :2]).sum())
    assert torch.equal(out.weight[0], torch.stack([e_half, e_half, torch.tensor(1.0)]))
    assert out.weight[1].tolist() == [0.0, 0.0, 1.0] and out.weight[2].tolist() == [0.0, 1.0, 1.0]
    assert out.masked.tolist() == [[False] * 3, [True, True, False], [True, False, False], [False] * 3]
    assert not out.truncated.any()
    torch.testing.assert_close(out.weight[3, 0], torch.tensor(math.exp(0.5)))
    assert out.weight[3, 1] == 1.0
    no_low = behaviour_weights(behaviour + log_rho, behaviour, mask, correction="mis", mis_low=0.0, mis_high=2.0)
    assert no_low.masked.tolist()[2] == [False] * 3
    torch.testing.assert_close(no_low.weight[2, 0], torch.tensor(math.exp(-1.0)))


def test_the_decoupled_loss_by_hand():
    """pg = w * max(-A r, -A clip(r)) with r = exp(logp - prox); w detached, so d pg / d logp = w * d surr."""
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    prox = torch.tensor([[-1.2, -0.5]])
    weight = torch.tensor([[2.0, 0.25]])
    adv = torch.tensor([1.0])
    out = policy_loss(logp, prox, adv, torch.ones(1, 2, dtype=torch.bool), clip_low=0.2, clip_high=0.2,
                      is_weight=weight)
    surr, _ = clipped_surrogate(logp.detach(), prox, adv, 0.2, 0.2)
    # r0 = e^0.2 ~ 1.22 > 1.2: clipped to 1.2 (no gradient); r1 = 1: unclipped, d(-A r)/d logp = -1
    assert torch.equal(out.loss, (weight * surr).sum() / 2)
    out.loss.backward()
    assert logp.grad.tolist() == [[0.0, -0.25 / 2]]


@pytest.mark.parametrize("correction,metric", [("tis", "train/is_truncated_frac"), ("mis", "train/is_masked_frac")])
def test_a_train_step_whose_every_token_is_truncated_or_masked(correction, metric):
    """Behaviour logprobs 1 nat below the proximal ones at every trained token: tis weighs every token by the cap
    (2, a power of two: the loss and gradient norm are exactly twice the synchronous step's, whose weights are 1);
    mis masks every sequence of two or more tokens (rho_i = e^L > 2) and a length-1 one too (e > 2)."""
    model = tiny_model(seed=1)
    batch = on_policy_batch(model)
    cfg = dict(ppo_epochs=1, max_grad_norm=0.0, **DECOUPLED[correction])
    lowered = copy.deepcopy(batch)
    for s in lowered:
        keep = s["loss_mask"] or [1] * len(s["rollout_logprobs"])
        s["rollout_logprobs"] = [x - 1.0 if k else x for x, k in zip(s["rollout_logprobs"], keep)]
    sync, _, _ = step_and_state(batch, **cfg)
    off, _, weights = step_and_state(lowered, **cfg)
    assert off[metric] == 1.0 and off["train/rollout_logprob_abs_diff"] > 0.99
    torch.testing.assert_close(off["train/behaviour_proximal_kl"], math.e - 2.0, rtol=1e-5, atol=1e-6)
    if correction == "tis":
        assert off["train/is_weight_mean"] == 2.0 and off["train/is_weight_max"] == 2.0
        assert off["train/loss"] == 2 * sync["train/loss"] and off["train/grad_norm"] == 2 * sync["train/grad_norm"]
    else:
        assert off["train/is_weight_mean"] == 0.0 and off["train/is_weight_max"] == 0.0
        assert off["train/loss"] == 0.0 and off["train/grad_norm"] == 0.0  # nothing is learnt from masked sequences
        initial = dict(tiny_model(seed=1).named_parameters())
        assert all(torch.equal(w, initial[n]) for n, w in weights)


# ------------------------------------------------------------------------- (d) stale samples, reproducible
@pytest.mark.parametrize("overrides", [
    DECOUPLED["none"], DECOUPLED["tis"], dict(DECOUPLED["tis"], is_cap=1.1), DECOUPLED["mis"],
    dict(DECOUPLED["mis"], mis_threshold=1.5, mis_threshold_lower=0.0),
    dict(DECOUPLED["tis"], policy_loss="gspo", loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4),
    dict(DECOUPLED["mis"], policy_loss="cispo", clip_low=1.0, clip_high=0.02, entropy_coef=0.01),
], ids=["none", "tis", "tis-cap1.1", "mis", "mis-1.5-nolow", "gspo-tis", "cispo-mis"])
def test_two_runs_on_stale_samples_are_bitwise_identical(overrides):
    def run():
        model = tiny_model(seed=3)
        trainer = Trainer(model, TrainConfig(lr=3e-3, steps=3, micro_batch_size=5, ppo_epochs=2, kl_coef=0.05,
                                             **overrides), ref_model=copy.deepcopy(model))
        metrics = [trainer.train_step(stale(unmasked_on_policy_batch(model, s, "grpo"), seed=s)) for s in range(3)]
        return trainer, metrics

    (a, ma), (b, mb) = run(), run()
    assert ma == mb
    for (na, wa), (nb, wb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb and torch.equal(wa, wb), na
    assert all(m["train/rollout_logprob_abs_diff"] > 0 and m["train/behaviour_proximal_kl"] > 0 for m in ma)
    assert all(m["train/is_weight_max"] != 1.0 for m in ma)
    if overrides.get("is_cap") == 1.1:
        assert any(0 < m["train/is_truncated_frac"] < 1 for m in ma)
    if overrides.get("mis_threshold") == 1.5:
        assert any(0 < m["train/is_masked_frac"] < 1 for m in ma)


def test_the_behaviour_weights_do_not_depend_on_the_micro_batching():
    """Batch-invariant logprobs make the proximal logprobs, hence every weight, the same bits for any
    micro_batch_size: the max and the truncated count are equal."""
    model = tiny_model(seed=3)
    batch = stale(unmasked_on_policy_batch(model, 0, "grpo"))
    got = []
    for mbs in (1, 5, 12):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(micro_batch_size=mbs, **DECOUPLED["tis"], is_cap=1.1))
        got.append(trainer.train_step(batch))
    assert len({(m["train/is_weight_max"], m["train/is_truncated_frac"]) for m in got}) == 1


# ------------------------------------------------------------------------------------- (e) config errors
@pytest.mark.parametrize("kw,message", [
    (dict(decoupled="yes"), r"train\.decoupled='yes' must be true or false"),
    (dict(decoupled=True, is_correction="seq"), r"train\.is_correction='seq' is not allowed"),
    (dict(is_correction="tis"), r"train\.is_correction='tis' needs train\.decoupled=true"),
    (dict(is_correction="mis"), r"train\.is_correction='mis' needs train\.decoupled=true"),
    (dict(decoupled=True, is_correction="tis", is_cap=0.0), r"train\.is_cap=0\.0 must be > 0"),
    (dict(decoupled=True, is_correction="tis", is_cap=-1.0), r"train\.is_cap=-1\.0 must be a finite number"),
    (dict(decoupled=True, is_correction="tis", is_cap=float("inf")), r"train\.is_cap=inf must be a finite"),
    (dict(decoupled=True, is_correction="mis", mis_threshold=1.0), r"train\.mis_threshold=1\.0 must be > 1"),
    (dict(decoupled=True, is_correction="mis", mis_threshold_lower=1.0), r"train\.mis_threshold_lower=1\.0 must lie"),
    (dict(decoupled=True, is_correction="mis", mis_threshold_lower=-0.1), r"train\.mis_threshold_lower=-0\.1 must be"),
    (dict(decoupled=True, is_cap=3.0), r"train\.is_cap=3\.0 changes nothing with train\.is_correction=none"),
    (dict(decoupled=True, is_correction="tis", mis_threshold=4.0), r"train\.mis_threshold=4\.0 changes nothing"),
    (dict(decoupled=True, is_correction="mis", is_cap=3.0), r"train\.is_cap=3\.0 changes nothing"),
    (dict(mis_threshold_lower=0.1), r"train\.mis_threshold_lower=0\.1 changes nothing"),
])
def test_config_errors_name_the_key(kw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kw)


def test_possible_settings_are_accepted():
    assert TrainConfig(decoupled=True).mis_bounds == (0.5, 2.0)
    assert TrainConfig(decoupled=True, is_correction="tis", is_cap=1.5).is_cap == 1.5
    cfg = TrainConfig(decoupled=True, is_correction="mis", mis_threshold=4.0, mis_threshold_lower=0.0)
    assert cfg.mis_bounds == (0.0, 4.0)
    assert TrainConfig(decoupled=True, is_correction="mis", mis_threshold=4.0).mis_bounds == (0.25, 4.0)
    for mode in ("gspo", "cispo"):
        extra = dict(loss_agg="seq-mean-token-mean") if mode == "gspo" else dict(clip_low=1.0)
        TrainConfig(decoupled=True, is_correction="tis", policy_loss=mode, **extra)
    with pytest.raises(ValueError, match="unknown is_correction"):
        behaviour_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), correction="x")


def test_the_command_line_takes_the_keys_and_refuses_the_same():
    from rlrepro.cli import compose_config
    from rlrepro.orchestration.config import to_schema

    cfg = to_schema(compose_config(["recipe=grpo_tiny", "train.decoupled=true", "train.is_correction=mis",
                                    "train.mis_threshold=4", "train.mis_threshold_lower=0"])).train
    assert cfg.decoupled is True and cfg.is_correction == "mis" and cfg.mis_bounds == (0.0, 4.0)
    with pytest.raises(ConfigError, match=r"train\.is_correction='tis' needs train\.decoupled=true"):
        compose_config(["recipe=grpo_tiny", "train.is_correction=tis"])


# --------------------------------------------------------------------------------------- data parallel
DP_CONFIG = dict(lr=3e-3, steps=3, micro_batch_size=3, ppo_epochs=2, decoupled=True, is_correction="tis", is_cap=1.1)


def _dp_train(data_parallel=None):
    model = tiny_model(seed=3)
    trainer = Trainer(model, TrainConfig(**DP_CONFIG), data_parallel=data_parallel)
    return [trainer.train_step(stale(unmasked_on_policy_batch(model, s, "grpo"), seed=s)) for s in range(2)]


def _dp_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    from _dist import gloo_process_group
    from rlrepro.trainer import DataParallel

    with gloo_process_group(rank, world_size, port):
        torch.save(_dp_train(DataParallel()), f"{out_path}.rank{rank}")


@pytest.mark.slow
def test_two_gloo_ranks_report_the_whole_batchs_correction(tmp_path):
    """The metric terms are summed (and the max taken) over the ranks: at the first step (same weights as one rank;
    later the gradient sum's grouping differs, docs/TRAINER.md) the counts and the max equal one rank's."""
    from _dist import spawn_ranks

    ranks = spawn_ranks(_dp_worker, 2, out=str(tmp_path / "dp"))
    assert ranks[0] == ranks[1]
    for dp, one in zip(ranks[0][:1], _dp_train()[:1]):
        assert dp["train/is_weight_max"] == one["train/is_weight_max"]
        assert dp["train/is_truncated_frac"] == one["train/is_truncated_frac"] > 0
        assert dp["train/is_weight_mean"] == pytest.approx(one["train/is_weight_mean"], rel=1e-12)
        assert dp["train/behaviour_proximal_kl"] == pytest.approx(one["train/behaviour_proximal_kl"], rel=1e-9)
