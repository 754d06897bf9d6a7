"""Session 35, the trainer's algorithms as a demanding verl user sees them: each test failed on the code before its
fix and passes after it (docs/TRAINER.md)."""
import copy

import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs

pytestmark = pytest.mark.usefixtures("deterministic_torch")

TEMPERATURE = 0.9
BASE = dict(lr=3e-3, steps=4, warmup_steps=0, min_lr_ratio=0.0, micro_batch_size=2, clip_high=0.28)


def episode_batch(model, seed: int = 0):
    """Multi-turn-like samples: two policy turns of 5 tokens around a 3-token tool observation (10 trained tokens,
    more than one turn's max_tokens of 6), and a single-turn one; on-policy logprobs, 0.0 at the tool tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    masks = [[1] * 5 + [0] * 3 + [1] * 5, [1] * 4, [1] * 5 + [0] * 3 + [1] * 2]
    prompts = [torch.randint(vocab, (2 + i,), generator=gen).tolist() for i in range(len(masks))]
    completions = [torch.randint(vocab, (len(m),), generator=gen).tolist() for m in masks]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, TEMPERATURE)
    return [dict(prompt_token_ids=p, completion_token_ids=c, loss_mask=m, advantage=a,
                 rollout_logprobs=[x if k else 0.0 for x, k in zip(lp.tolist(), m)])
            for p, c, m, lp, a in zip(prompts, completions, masks, lps, [1.0, -0.5, 0.25])]


def step(max_response_length, **cfg):
    model = tiny_model(seed=1)
    trainer = Trainer(model, TrainConfig(**{**BASE, **cfg}), temperature=TEMPERATURE,
                      max_response_length=max_response_length)
    metrics = trainer.train_step(episode_batch(model))
    return metrics, [w.clone() for _, w in trainer.named_weights()]


# 1. seq-mean-token-sum-norm's constant: the whole response budget, not one turn's max_tokens

def test_a_sample_with_more_trained_tokens_than_the_constant_is_refused_naming_the_key():
    """The reproduction: the orchestration passes rollout.max_tokens (one turn's budget) as C; an episode of two
    turns trained 10 tokens, each weighted 1/6, silently. Now refused before any pass, naming the fix."""
    with pytest.raises(ValueError, match=r"sample 0 has 10 trained tokens.*constant 6.*train\.loss_norm_tokens"):
        step(6, loss_agg="seq-mean-token-sum-norm")


def test_loss_norm_tokens_is_the_constant_bit_for_bit():
    """train.loss_norm_tokens=C is the step with max_response_length=C (the same bits: metrics, every weight), and
    it takes precedence over the rollout's max_tokens."""
    a, wa = step(6, loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=16)
    b, wb = step(16, loss_agg="seq-mean-token-sum-norm")
    c, wc = step(None, loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=16)
    assert a == b == c and a["train/num_tokens"] == 21
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(wa, wb, wc))


def test_loss_norm_tokens_divides_the_token_sums_by_it():
    """The closed form: with every ratio 1 (on-policy), pg = -A per token; the loss is (1/S) sum_i -A_i L_i / C."""
    m, _ = step(6, loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=16)
    expected = -(1.0 * 10 - 0.5 * 4 + 0.25 * 7) / 16 / 3
    assert m["train/loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kw, named", [
    (dict(loss_norm_tokens=16), "changes nothing with train.loss_agg=token-mean"),
    (dict(loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=0), "must be a positive integer"),
    (dict(loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=8.5), "must be a positive integer"),
])
def test_loss_norm_tokens_bad_values_are_refused_when_the_config_is_built(kw, named):
    with pytest.raises(ConfigError, match=r"train\.loss_norm_tokens=.*" + named):
        TrainConfig(**kw)


def test_without_any_constant_the_trainer_names_both_ways_to_give_it():
    with pytest.raises(ValueError, match=r"max_response_length=.*train\.loss_norm_tokens"):
        Trainer(tiny_model(seed=0), TrainConfig(loss_agg="seq-mean-token-sum-norm"))


def test_an_episode_run_with_sum_norm_and_no_constant_is_refused_before_any_work():
    """With env.* the default constant (rollout.max_tokens, one turn) is too small: refused at config time, naming
    the key and the episode budget; with the key set (or single-turn) the config is accepted."""
    from rlrepro.checks import ConfigError
    from rlrepro.cli import compose_config
    from rlrepro.orchestration.config import validate

    agg = "train.loss_agg=seq-mean-token-sum-norm"
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["recipe=grpo_tiny_tool", agg, "env.max_episode_tokens=300"]))
    assert "Fix: set train.loss_norm_tokens=300" in str(e.value) and "an episode (env.*)" in str(e.value)
    s = validate(compose_config(["recipe=grpo_tiny_tool", agg, "env.max_episode_tokens=300",
                                 "train.loss_norm_tokens=300"]))
    assert s.train.loss_norm_tokens == 300
    assert validate(compose_config(["recipe=grpo_tiny", agg])).train.loss_norm_tokens is None
