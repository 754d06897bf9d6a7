"""The train step: run-to-run bitwise determinism, the on-policy check, micro-batching, master weights, config."""
import copy

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, compute_advantages, token_logprobs


pytestmark = pytest.mark.usefixtures("deterministic_torch")


def make_batch(model, step: int, num_prompts: int = 3, group_size: int = 2, temperature: float = 1.0):
    """On-policy samples for ``step``: random tokens, the model's own logprobs, group advantages of random rewards."""
    gen = torch.Generator().manual_seed(1000 + step)
    vocab = model.config.vocab_size
    prompts, completions = [], []
    for _ in range(num_prompts):
        prompt = torch.randint(vocab, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(group_size):
            n = int(torch.randint(0 if step % 2 else 1, 7, (1,), generator=gen))  # odd steps may have empty ones
            prompts.append(prompt)
            completions.append(torch.randint(vocab, (n,), generator=gen).tolist())
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, temperature)
    rewards = torch.randint(0, 2, (num_prompts, group_size), generator=gen).float()
    adv = compute_advantages(rewards, "grpo").flatten().tolist()
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=a)
            for p, c, lp, a in zip(prompts, completions, lps, adv)]


TEMPERATURE = 0.9  # the rollout's (Trainer(temperature=...))
CONFIG = dict(lr=3e-3, steps=5, warmup_steps=1, min_lr_ratio=0.0, micro_batch_size=4, ppo_epochs=2, clip_high=0.28,
              kl_coef=0.05, kl_estimator="k3")


def run(steps: int = 3, param_dtype=None, max_response_length=None, **overrides):
    model = tiny_model(seed=1)
    ref = copy.deepcopy(model)
    trainer = Trainer(model, TrainConfig(**{**CONFIG, **overrides}), ref_model=ref, param_dtype=param_dtype,
                      temperature=TEMPERATURE, max_response_length=max_response_length)
    metrics = [trainer.train_step(make_batch(model, s, temperature=trainer.temperature)) for s in range(steps)]
    return trainer, metrics


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_two_runs_give_identical_weights_and_metrics(loss_agg):
    a, ma = run(loss_agg=loss_agg, max_response_length=8)
    b, mb = run(loss_agg=loss_agg, max_response_length=8)
    assert ma == mb
    for (na, wa), (nb, wb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb and torch.equal(wa, wb), na
    assert ma[-1]["train/grad_norm"] > 0 and ma[-1]["train/kl"] > 0


def test_kl_is_exactly_zero_before_the_first_update():
    _, metrics = run(steps=1, ppo_epochs=1)  # the reference is a copy of the initial policy
    assert metrics[0]["train/kl"] == 0.0 and metrics[0]["train/rollout_logprob_abs_diff"] == 0.0


def test_on_policy_logprob_diff_is_exactly_zero():
    trainer, metrics = run()
    assert [m["train/rollout_logprob_abs_diff"] for m in metrics] == [0.0, 0.0, 0.0]
    batch = make_batch(trainer.model, 7, temperature=0.9)
    batch[2]["rollout_logprobs"] = [x + 0.5 for x in batch[2]["rollout_logprobs"]]
    assert trainer.train_step(batch)["train/rollout_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-5)


def test_metrics_and_lr():
    _, metrics = run()
    assert [m["train/lr"] for m in metrics] == pytest.approx([3e-3, 3e-3, 3e-3 * 0.5 * (1 + 0.5 ** 0.5)])
    for m in metrics:
        for key in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/clip_frac", "train/lr",
                    "train/rollout_logprob_abs_diff", "loss", "grad_norm"):
            assert isinstance(m[key], float), key
        assert m["loss"] == m["train/loss"] and len(m["loss_per_epoch"]) == 2
        assert 0.0 <= m["train/clip_frac"] <= 1.0 and m["train/entropy"] > 0


def test_micro_batch_size_changes_only_rounding():
    """Gradient accumulation is scaled by whole-batch counts: any micro-batch size gives the same loss and gradient
    up to float rounding (not the same bits: the sums are grouped differently)."""
    for loss_agg in ("token-mean", "seq-mean-token-mean"):
        results = [run(steps=1, ppo_epochs=1, micro_batch_size=mbs, loss_agg=loss_agg) for mbs in (1, 4, 6)]
        ref_trainer, (ref_metrics,) = results[0]
        for trainer, (metrics,) in results[1:]:
            # on-policy at step 0 the loss is -mean(A) ~ 0: compare it absolutely
            assert metrics["train/loss"] == pytest.approx(ref_metrics["train/loss"], abs=1e-6)
            assert metrics["train/grad_norm"] == pytest.approx(ref_metrics["train/grad_norm"], rel=1e-6)
            for g, gr in zip(trainer.optimizer.grads(), ref_trainer.optimizer.grads()):
                torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_logits_chunk_size_changes_no_bit(param_dtype):
    """``logits_chunk_size``: the loss's log-softmax a few rows at a time (and the reference model's logprobs):
    the same metrics and weights, bit for bit, as the unchunked train step (kl_coef > 0, 2 PPO epochs)."""
    a, ma = run(steps=2, param_dtype=param_dtype)
    b, mb = run(steps=2, param_dtype=param_dtype, logits_chunk_size=3)
    assert ma == mb
    for (na, wa), (nb, wb) in zip(a.named_weights(), b.named_weights()):
        assert na == nb and torch.equal(wa, wb), na
    assert ma[-1]["train/kl"] > 0


def test_entropy_bonus_and_dual_clip_in_the_train_step():
    """entropy_coef > 0 changes the update (the entropy is in the loss) and stays reproducible, chunked or not;
    dual_clip changes nothing while no negative-advantage ratio exceeds it (on-policy first epoch: ratio 1)."""
    base, mbase = run(steps=2)
    ent, ment = run(steps=2, entropy_coef=0.01)
    again, magain = run(steps=2, entropy_coef=0.01)
    chunked, mchunked = run(steps=2, entropy_coef=0.01, logits_chunk_size=3)
    assert ment == magain == mchunked and ment != mbase
    for (_, a), (_, b), (_, c), (_, d) in zip(ent.named_weights(), again.named_weights(),
                                              chunked.named_weights(), base.named_weights()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert any(not torch.equal(a, d) for (_, a), (_, d) in zip(ent.named_weights(), base.named_weights()))
    dual, mdual = run(steps=2, dual_clip=3.0)
    assert mdual == mbase
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(dual.named_weights(), base.named_weights()))


def test_bf16_compute_with_float32_master_weights():
    fp32 = dict(tiny_model(seed=1).named_parameters())
    trainer, metrics = run(steps=2, param_dtype=torch.bfloat16)
    assert trainer.model.dtype == torch.bfloat16 and trainer.optimizer.has_master_copies
    masters = dict(trainer.optimizer.named_master_weights())
    for name, w in trainer.named_weights():
        assert w.dtype == torch.bfloat16 and masters[name].dtype == torch.float32
        assert torch.equal(w, masters[name].to(torch.bfloat16))
        assert not torch.equal(masters[name], fp32[name].detach())  # masters moved in float32
    again, metrics_again = run(steps=2, param_dtype=torch.bfloat16)
    assert metrics == metrics_again
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(trainer.named_weights(), again.named_weights()))


def test_named_weights_are_sorted_and_detached():
    trainer = Trainer(tiny_model(seed=0), TrainConfig())
    names = [n for n, _ in trainer.named_weights()]
    assert names == sorted(names) and not any(w.requires_grad for _, w in trainer.named_weights())


@pytest.mark.parametrize("field,value,message", [
    ("micro_batch_size", 0, "train.micro_batch_size=0 must be a positive integer"),
    ("lr", 0.0, "train.lr=0.0 would never change the weights"),
    ("loss_agg", "mean", "train.loss_agg='mean' is not allowed; choose one of"),
    ("kl_estimator", "k5", "train.kl_estimator='k5'"),
    ("clip_low", 1.0, "train.clip_low=1.0 must lie in"),
    ("advantage", "ppo", "train.advantage='ppo' is not allowed"),
    ("adam_beta2", 1.0, "train.adam_beta2=1.0 must lie in"),
    ("logits_chunk_size", -1, "train.logits_chunk_size=-1 must be an integer >= 0"),
    ("dual_clip", 1.0, "train.dual_clip=1.0 must be 0 \\(off\\) or > 1"),
    ("entropy_coef", -0.1, "train.entropy_coef=-0.1 must be a finite number >= 0"),
    ("logits_chunk_size", 2.5, "train.logits_chunk_size=2.5 must be an integer >= 0"),
    ("grad_sync", "megatron", "train.grad_sync='megatron' .* needs train.backend=megatron"),
])
def test_config_errors_name_the_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_config_and_sample_errors():
    with pytest.raises(ValueError, match="max_response_length"):
        Trainer(tiny_model(seed=0), TrainConfig(loss_agg="seq-mean-token-sum-norm"))
    assert TrainConfig(adam_beta1=0.9, adam_beta2=0.95).betas == (0.9, 0.95)
    with pytest.raises(ValueError, match="needs a reference model"):
        Trainer(tiny_model(seed=0), TrainConfig(kl_coef=0.1))
    trainer = Trainer(tiny_model(seed=0), TrainConfig())
    bad = dict(prompt_token_ids=[1], completion_token_ids=[2, 3], rollout_logprobs=[-1.0], advantage=1.0)
    with pytest.raises(ValueError, match="sample 0 has 2 completion tokens but 1 rollout logprobs"):
        trainer.train_step([bad])
    with pytest.raises(ValueError, match="sample 0 has no 'advantage'"):
        trainer.train_step([dict(prompt_token_ids=[1], completion_token_ids=[], rollout_logprobs=[])])
