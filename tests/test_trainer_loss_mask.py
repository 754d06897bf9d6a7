"""Loss masks (multi-turn samples): a completion token with ``loss_mask`` 0 is context only. It stays in the forward
pass, and nothing else sees it: not the loss, KL, entropy or clip fraction, not the token counts (token-mean's
``num_tokens``, the seq-mean modes' lengths, GSPO's sequence ratio), not the on-policy check. Without a mask, or
with all ones, the step is today's bit for bit; the checks name the sample."""
import copy

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.samples import Sample
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs

pytestmark = pytest.mark.usefixtures("deterministic_torch")

TEMPERATURE = 0.9
BASE = dict(lr=3e-3, steps=5, warmup_steps=0, min_lr_ratio=0.0, micro_batch_size=3, ppo_epochs=2, clip_high=0.28)
# (policy_loss, loss_agg, extra config): every loss and every aggregation, with KL and entropy terms in the loss
MODES = [("ppo_clip", "token-mean", dict(kl_coef=0.05, entropy_coef=0.01, dual_clip=3.0)),
         ("ppo_clip", "seq-mean-token-mean", dict(kl_coef=0.05)),
         ("ppo_clip", "seq-mean-token-sum-norm", dict(kl_coef=0.05, entropy_coef=0.01)),
         ("ppo_clip", "seq-mean-token-sum", {}),
         ("gspo", "seq-mean-token-mean", dict(clip_low=3e-4, clip_high=4e-4, kl_coef=0.05)),
         ("cispo", "token-mean", dict(clip_low=1.0, entropy_coef=0.01))]
MODE_IDS = [f"{p}-{a}" for p, a, _ in MODES]
# completion lengths and masks: a tool span in the middle, one at the start, one fully masked sample, one without
# a mask, an empty completion; seven samples over three micro-batches
SHAPES = [(6, [1, 1, 0, 0, 1, 1]), (5, [0, 0, 1, 1, 1]), (4, None), (5, [0, 0, 0, 0, 0]), (0, []),
          (6, [1, 0, 1, 0, 1, 1]), (3, [1, 1, 1])]


def on_policy_batch(model, seed: int = 0, shapes=SHAPES, advantages=None):
    """Samples with the model's own logprobs at trained tokens and the engine's 0.0 placeholder at masked ones."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(len(shapes))]
    completions = [torch.randint(vocab, (n,), generator=gen).tolist() for n, _ in shapes]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, TEMPERATURE)
    advantages = advantages or [(-1.0) ** i * (1 + i / 4) for i in range(len(shapes))]
    batch = []
    for p, c, lp, (_, m), a in zip(prompts, completions, lps, shapes, advantages):
        lp = lp.tolist() if m is None else [x if keep else 0.0 for x, keep in zip(lp.tolist(), m)]
        batch.append(dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp, advantage=a,
                          loss_mask=m))
    return batch


def make_trainer(**cfg):
    model = tiny_model(seed=1)
    return Trainer(model, TrainConfig(**{**BASE, **cfg}), ref_model=copy.deepcopy(model), temperature=TEMPERATURE,
                   max_response_length=8)


def config(policy_loss, loss_agg, extra):
    return dict(policy_loss=policy_loss, loss_agg=loss_agg, **extra)


def step_and_state(batch, **cfg):
    """One train step: its metrics, the clipped grads it applied and every weight after it."""
    trainer = make_trainer(**cfg)
    metrics = trainer.train_step(batch)
    grads = [g.clone() for g in trainer.optimizer.grads()]
    return metrics, grads, list(trainer.named_weights())


def assert_same_step(a, b):
    (ma, ga, wa), (mb, gb, wb) = a, b
    assert ma == mb
    assert len(ga) == len(gb) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    for (na, xa), (nb, xb) in zip(wa, wb):
        assert na == nb and torch.equal(xa, xb), na


@pytest.mark.parametrize("policy_loss,loss_agg,extra", MODES, ids=MODE_IDS)
def test_no_mask_and_all_ones_give_the_same_bits(policy_loss, loss_agg, extra):
    """All-ones masks (lists, tuples, bools, floats) are the unmasked step bit for bit: loss, grad norm, grads,
    every weight."""
    model = tiny_model(seed=1)
    shapes = [(n, None) for n, _ in SHAPES]
    plain = on_policy_batch(model, shapes=shapes)
    ones = [dict(s, loss_mask=kind([one] * len(s["completion_token_ids"])))
            for s, kind, one in zip(plain, [list, tuple] * 4, [1, True, 1.0, 1, True, 1.0, 1])]
    cfg = config(policy_loss, loss_agg, extra)
    a, b = step_and_state(plain, **cfg), step_and_state(ones, **cfg)
    assert_same_step(a, b)
    assert a[0]["train/grad_norm"] > 0 and a[0]["train/num_tokens"] == sum(n for n, _ in SHAPES)


@pytest.mark.parametrize("policy_loss,loss_agg,extra", MODES, ids=MODE_IDS)
def test_rollout_values_at_masked_positions_change_nothing(policy_loss, loss_agg, extra):
    """The rollout logprobs of masked tokens (any value, even huge or NaN) and the advantage of a fully masked
    sample reach no bit of the step."""
    model = tiny_model(seed=1)
    batch = on_policy_batch(model)
    other = copy.deepcopy(batch)
    gen = torch.Generator().manual_seed(5)
    for s in other:
        mask = s["loss_mask"] or [1] * len(s["completion_token_ids"])
        s["rollout_logprobs"] = [x if keep else float(-30 * torch.rand((), generator=gen))
                                 for x, keep in zip(s["rollout_logprobs"], mask)]
    other[0]["rollout_logprobs"][2] = -1e30  # ratio exp(logp + 1e30) would be inf at a masked token
    other[1]["rollout_logprobs"][0] = float("nan")
    other[3]["advantage"] = 1234.0  # sample 3 is fully masked
    cfg = config(policy_loss, loss_agg, extra)
    a, b = step_and_state(batch, **cfg), step_and_state(other, **cfg)
    assert_same_step(a, b)
    assert a[0]["train/grad_norm"] > 0 and a[0]["train/loss"] != 0


def test_masked_tokens_stay_in_the_forward_pass_as_context():
    """Changing a masked token before a trained one changes the trained token's logprob, hence the step."""
    model = tiny_model(seed=1)
    batch = on_policy_batch(model)
    changed = copy.deepcopy(batch)
    changed[0]["completion_token_ids"][2] = (changed[0]["completion_token_ids"][2] + 1) % model.config.vocab_size
    a = make_trainer().train_step(batch)
    b = make_trainer().train_step(changed)
    assert a["train/loss"] != b["train/loss"]


def test_the_on_policy_check_reads_trained_tokens_only():
    """Placeholders (0.0) at masked tokens are no disagreement; unmasked, the same samples are off policy; a
    disagreement at a trained token is reported."""
    model = tiny_model(seed=1)
    batch = on_policy_batch(model)
    assert make_trainer(ppo_epochs=1).train_step(batch)["train/rollout_logprob_abs_diff"] == 0.0
    unmasked = [dict(s, loss_mask=None) for s in batch]
    assert make_trainer(ppo_epochs=1).train_step(unmasked)["train/rollout_logprob_abs_diff"] > 0.1
    off = copy.deepcopy(batch)
    off[5]["rollout_logprobs"][2] += 0.25  # sample 5's token 2 is trained
    diff = make_trainer(ppo_epochs=1).train_step(off)["train/rollout_logprob_abs_diff"]
    assert abs(diff - 0.25) < 1e-5


def _f32(numerator: float, denominator: int) -> float:
    return float(torch.tensor(numerator, dtype=torch.float32) / max(denominator, 1))


@pytest.mark.parametrize("policy_loss,loss_agg", [("ppo_clip", "token-mean"), ("ppo_clip", "seq-mean-token-mean"),
                                                  ("ppo_clip", "seq-mean-token-sum"),
                                                  ("gspo", "seq-mean-token-mean")])
def test_token_counts_are_the_trained_tokens(policy_loss, loss_agg):
    """On policy with advantages +-1 every trained token's pg is exactly -A (ratio 1; GSPO's sequence ratio is 1
    only when the masked placeholders stay out of it), so the loss has a closed form in the trained counts."""
    model = tiny_model(seed=1)
    adv = [(-1.0) ** (i // 2) for i in range(len(SHAPES))]
    batch = on_policy_batch(model, advantages=adv)
    trained = [n if m is None else sum(m) for n, m in SHAPES]
    extra = dict(clip_low=3e-4, clip_high=4e-4) if policy_loss == "gspo" else {}
    m = make_trainer(ppo_epochs=1, micro_batch_size=len(SHAPES), policy_loss=policy_loss, loss_agg=loss_agg,
                     **extra).train_step(batch)
    N, S = sum(trained), len(SHAPES)
    assert m["train/num_tokens"] == N == 18
    token_sum = sum(-a * t for a, t in zip(adv, trained))
    expected = {"token-mean": _f32(token_sum, N),
                "seq-mean-token-mean": _f32(sum(-a for a, t in zip(adv, trained) if t), S),
                "seq-mean-token-sum": _f32(token_sum, S)}[loss_agg]
    assert m["train/loss"] == expected
    assert m["train/pg_loss"] == _f32(token_sum, N)
    assert m["train/clip_frac"] == 0.0 and m["train/rollout_logprob_abs_diff"] == 0.0


def test_a_fully_masked_batch_trains_nothing():
    model = tiny_model(seed=1)
    batch = on_policy_batch(model, shapes=[(4, [0, 0, 0, 0]), (2, [0, 0]), (0, [])])
    trainer = make_trainer(kl_coef=0.05)
    before = [w.clone() for _, w in trainer.named_weights()]
    m = trainer.train_step(batch)
    assert m["train/num_tokens"] == 0 and m["train/loss"] == 0.0 and m["train/grad_norm"] == 0.0
    assert m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/kl"] == 0.0 and m["train/entropy"] == 0.0
    # weight decay is 0 by default and the grads are 0, so AdamW leaves every weight as it was
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, trainer.named_weights()))


def test_a_sample_record_with_a_loss_mask_is_accepted():
    model = tiny_model(seed=1)
    dicts = on_policy_batch(model)
    samples = [Sample(prompt_uid="p", sample_index=i, prompt_token_ids=d["prompt_token_ids"],
                      completion_token_ids=d["completion_token_ids"], rollout_logprobs=d["rollout_logprobs"],
                      advantage=d["advantage"], loss_mask=d["loss_mask"]) for i, d in enumerate(dicts)]
    assert make_trainer().train_step(samples) == make_trainer().train_step(dicts)


@pytest.mark.parametrize("mask,match", [([1, 1], "3 completion tokens but a loss_mask of 2 entries"),
                                        ([1, 1, 1, 1], "3 completion tokens but a loss_mask of 4 entries"),
                                        ([1, 2, 0], r"values \[2\]"), ([1, 0.5, 0], r"values \[0.5\]"),
                                        ([-1, 0, 0], r"values \[-1\]"), (["1", 0, 1], r"values \['1'\]"),
                                        ([None, 0, 1], r"values \[None\]"), ("101", "type str"),
                                        (7, "type int")])
def test_a_bad_loss_mask_is_refused_naming_the_sample(mask, match):
    model = tiny_model(seed=1)
    batch = on_policy_batch(model, shapes=[(2, [1, 0]), (3, [1, 0, 1])])
    batch[1]["loss_mask"] = mask
    trainer = make_trainer()
    with pytest.raises(ValueError, match=f"sample 1 .*{match}"):
        trainer.train_step(batch)
    assert trainer.step == 0


def test_megatron_trainer_honours_the_mask_as_the_default_trainer_does():
    """The megatron backend runs Trainer.train_step (its hooks only move gradients): at TP=1 on CPU its masked step
    is the default trainer's bit for bit."""
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups

    batch = on_policy_batch(tiny_model(seed=1))
    cfg = TrainConfig(**BASE, kl_coef=0.05)
    plain = make_trainer(kl_coef=0.05)
    tp_model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), single_process_groups())
    mtrainer = MegatronTrainer(tp_model, cfg, ref_model=copy.deepcopy(tp_model), temperature=TEMPERATURE,
                               max_response_length=8)
    a, b = plain.train_step(batch), mtrainer.train_step(batch)
    assert a == b and a["train/num_tokens"] == 18 and a["train/rollout_logprob_abs_diff"] == 0.0
    for (na, wa), (nb, wb) in zip(plain.named_weights(), mtrainer.named_weights()):
        assert na == nb and torch.equal(wa, wb), na


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masks_on_cuda_with_bf16_compute():
    """On CUDA (Triton kernels, bf16 compute, float32 masters): all ones is the unmasked step, masked values change
    nothing, and the placeholders are no on-policy disagreement."""
    def run(batch):
        model = tiny_model(seed=1).to("cuda")
        ref = copy.deepcopy(model).to(torch.bfloat16)
        trainer = Trainer(model, TrainConfig(**BASE, kl_coef=0.05, entropy_coef=0.01), ref_model=ref,
                          param_dtype=torch.bfloat16, temperature=TEMPERATURE)
        metrics = trainer.train_step(batch)
        return metrics, {n: w.to("cpu", copy=True) for n, w in trainer.named_weights()}

    model = tiny_model(seed=1).to("cuda").to(torch.bfloat16)
    masked = on_policy_batch(model)
    perturbed = copy.deepcopy(masked)
    perturbed[0]["rollout_logprobs"][2], perturbed[1]["rollout_logprobs"][0] = -1e30, float("nan")
    plain = [dict(s, loss_mask=None) for s in on_policy_batch(model, shapes=[(n, None) for n, _ in SHAPES])]
    ones = [dict(s, loss_mask=[1] * len(s["completion_token_ids"])) for s in plain]
    for a, b in ((masked, perturbed), (plain, ones)):
        (ma, wa), (mb, wb) = run(a), run(b)
        assert ma == mb and all(torch.equal(wa[n], wb[n]) for n in wa)
    m = run(masked)[0]
    assert m["train/num_tokens"] == 18 and m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0
