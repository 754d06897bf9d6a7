"""A train step in which no token has loss weight (every completion empty or masked out) takes no update: AdamW's
weight decay and the moments of earlier steps would otherwise move the weights with zero gradients. The weights and
the whole optimizer state stay bit for bit; the LR schedule advances (docs/TRAINER.md, "Steps with nothing to
train")."""
import copy

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs

pytestmark = pytest.mark.usefixtures("deterministic_torch")


def _batch(model, masks, advantages=None):
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (2,), generator=gen).tolist() for _ in masks]
    completions = [torch.randint(vocab, (len(m),), generator=gen).tolist() for m in masks]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, 1.0)
    advantages = advantages or [(-1.0) ** i * (1 + i / 4) for i in range(len(masks))]
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=a, loss_mask=m)
            for p, c, lp, m, a in zip(prompts, completions, lps, masks, advantages)]


def _equal(a, b) -> bool:
    """Exact equality of nested optimizer states (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("ppo_epochs,param_dtype", [(1, None), (2, None), (1, torch.bfloat16)],
                         ids=["one-epoch", "two-epochs", "bf16-masters"])
def test_a_step_with_no_trained_token_leaves_weights_and_optimizer_state_unchanged(ppo_epochs, param_dtype):
    model = tiny_model(seed=1)
    trainer = Trainer(model, TrainConfig(lr=1e-2, steps=6, weight_decay=0.1, ppo_epochs=ppo_epochs, kl_coef=0.05),
                      ref_model=copy.deepcopy(model), param_dtype=param_dtype)
    trainer.train_step(_batch(trainer.model, [[1, 1, 1], [1, 0, 1]]))  # a real step first: AdamW has moments
    weights = {n: w.clone() for n, w in trainer.named_weights()}
    state = copy.deepcopy(trainer.optimizer.state_dict())
    step, lr = trainer.step, trainer.scheduler.get_last_lr()
    m = trainer.train_step(_batch(trainer.model, [[0, 0, 0], [0, 0], []]))
    assert m["train/num_tokens"] == 0 and m["train/loss"] == 0.0 and m["train/grad_norm"] == 0.0
    assert m["loss_per_epoch"] == [0.0] and m["grad_norm_per_epoch"] == [0.0] and m["train/lr"] == lr
    assert all(torch.equal(weights[n], w) for n, w in trainer.named_weights())
    after = trainer.optimizer.state_dict()
    # AdamW's moments and step counts, the master weights: as they were; the groups' lr is the schedule's (below)
    assert _equal(state["adamw"]["state"], after["adamw"]["state"]) and _equal(state["master_weights"],
                                                                               after["master_weights"])
    assert [{k: v for k, v in g.items() if k != "lr"} for g in state["adamw"]["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "lr"} for g in after["adamw"]["param_groups"]]
    assert trainer.step == step + 1  # the LR schedule stays aligned with the run's step number
    assert trainer.scheduler.get_last_lr() != lr


def test_the_next_step_after_an_empty_one_is_the_step_without_it():
    """The skipped step changes nothing but the schedule's position: a trainer that skipped it equals one whose
    schedule was advanced by hand, bit for bit, over the next real step."""
    cfg = TrainConfig(lr=1e-2, steps=6, weight_decay=0.1)
    a, b = Trainer(tiny_model(seed=1), cfg), Trainer(tiny_model(seed=1), cfg)
    real = _batch(a.model, [[1, 1, 1], [1, 0, 1]])
    for t in (a, b):
        t.train_step(real)
    a.train_step(_batch(a.model, [[0, 0], [0]]))
    b.scheduler.step()
    assert a.train_step(real) == b.train_step(real)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights()))
