"""Session 29 review of rlrepro/trainer: four defects, each reproduced first.

1. ``save_checkpoint(..., keep_last=N)`` pruned the N newest complete checkpoints *of the directory*: saving a step
   below a newer one (a trainer resumed from an older checkpoint) deleted the checkpoint it had just written and
   returned the path of a directory that no longer existed.
2. ``extra_state`` holding a value ``torch.load(weights_only=True)`` cannot read (a numpy scalar such as a data
   cursor ``np.int64``, a numpy array, a dataclass, a Path) was written without complaint; every checkpoint of the
   run was then refused at resume as "damaged or tampered with", with the advice to delete it.
3. ``Trainer.train_step``: a non-finite rollout logprob at a *trained* token made the loss NaN and the step failed
   with "non-finite loss ... Fix: lower train.lr" (under ``train.on_nonfinite=skip`` every such step was skipped
   silently); a float token id (3.7) was truncated to 3 by ``torch.tensor(..., dtype=long)`` and trained on.
4. ``compute_advantages`` turned a NaN / inf reward into NaN advantages for its group (REINFORCE++: for the whole
   batch) silently; the trainer then blamed "sample 0", whose own reward was fine.
"""
import copy
import math
import os

import numpy as np
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, compute_advantages, token_logprobs
from rlrepro.trainer.advantages import ADVANTAGE_MODES
from rlrepro.trainer.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("deterministic_torch")


def _samples(model):
    prompts, completions, advs = [[1, 2], [4], [7, 8]], [[3, 5], [6], [9, 10, 11]], [1.0, -0.5, 0.25]
    lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=a)
            for p, c, lp, a in zip(prompts, completions, lps, advs)]


def _trainer(model):
    return Trainer(model, TrainConfig(lr=1e-3, steps=10, micro_batch_size=2))


# --- 1. keep_last never deletes the checkpoint just written ----------------------------------------------------

def test_keep_last_keeps_the_checkpoint_just_written_below_a_newer_one(tmp_path):
    model = tiny_model(seed=3)
    trainer = _trainer(model)
    batch = _samples(model)
    for step in (2, 4, 6):
        trainer.train_step(batch)
        trainer.save_checkpoint(tmp_path, step, extra_state={"step": step}, keep_last=3)
    # resume from the oldest and save the next step with keep_last=2 (before the fix: step 3 deleted at once)
    resumed = _trainer(tiny_model(seed=3))
    resumed.load_checkpoint(tmp_path / "step_000002")
    resumed.train_step(batch)
    path = resumed.save_checkpoint(tmp_path, 3, extra_state={"step": 3}, keep_last=2)
    assert path.is_dir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 6]  # the one written and the newest other
    check = _trainer(tiny_model(seed=5))
    assert check.load_checkpoint(path) == {"step": 3}
    for (n, a), (_, b) in zip(resumed.named_weights(), check.named_weights()):
        assert torch.equal(a, b), n


def test_keep_last_in_order_is_unchanged(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, extra_state={"s": step}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]


# --- 2. extra_state that could never be loaded is refused when saving --------------------------------------------

@pytest.mark.parametrize("value,kind", [(np.int64(5), "numpy.int64"), (np.arange(3), "numpy.ndarray"),
                                        (os.path.realpath, "builtin")])
def test_extra_state_that_cannot_be_loaded_is_refused_and_the_previous_checkpoint_is_kept(tmp_path, value, kind):
    first = save_checkpoint(tmp_path, 1, extra_state={"cursor": 4})
    before = {f.name: f.read_bytes() for f in first.iterdir()}
    with pytest.raises(ValueError) as e:
        save_checkpoint(tmp_path, 2, extra_state={"cursor": 5, "bad": value}, keep_last=1)
    msg = str(e.value)
    assert "extra_state['bad']" in msg and kind.split(".")[0] in msg and "weights_only" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # nothing partial, nothing pruned
    assert {f.name: f.read_bytes() for f in first.iterdir()} == before
    assert load_checkpoint(first, restore_rng=False).extra_state == {"cursor": 4}


def test_plain_extra_state_still_round_trips(tmp_path):
    extra = {"cursor": 5, "order": torch.arange(4), "names": ["a", "b"], "nested": {"x": (1.5, None)}}
    path = save_checkpoint(tmp_path, 1, extra_state=extra)
    back = load_checkpoint(path, restore_rng=False).extra_state
    assert torch.equal(back.pop("order"), extra["order"])
    assert back == {k: v for k, v in extra.items() if k != "order"}


# --- 3. train samples: finite rollout logprobs at trained tokens, integer token ids ------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rollout_logprob_at_a_trained_token_is_named(bad):
    model = tiny_model(seed=3)
    batch = _samples(model)
    batch[2]["rollout_logprobs"][1] = bad
    trainer = _trainer(model)
    before = [t.clone() for _, t in trainer.named_weights()]
    with pytest.raises(ValueError, match=r"sample 2 has rollout logprob -?(nan|inf) at completion token 1"):
        trainer.train_step(batch)
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, trainer.named_weights()))


def test_non_finite_rollout_logprob_at_a_masked_token_is_still_ignored():
    model = tiny_model(seed=3)
    batch = _samples(model)
    batch[2]["loss_mask"] = [1, 0, 1]
    plain = _trainer(copy.deepcopy(model)).train_step(batch)
    batch[2]["rollout_logprobs"][1] = float("nan")
    masked = _trainer(copy.deepcopy(model)).train_step(batch)
    assert masked["loss"] == plain["loss"] and masked["grad_norm"] == plain["grad_norm"]
    assert math.isfinite(masked["loss"])


def test_float_token_ids_are_refused_and_numpy_ints_train_bit_for_bit():
    model = tiny_model(seed=3)
    batch = _samples(model)
    floats = copy.deepcopy(batch)
    floats[1]["completion_token_ids"] = [6.7]
    with pytest.raises(ValueError, match=r"sample 1 has completion token 6\.7 \(float\); token ids must be integers"):
        _trainer(copy.deepcopy(model)).train_step(floats)
    as_numpy = copy.deepcopy(batch)
    for s in as_numpy:
        s["prompt_token_ids"] = np.array(s["prompt_token_ids"], dtype=np.int64)
        s["completion_token_ids"] = torch.tensor(s["completion_token_ids"])
    a, b = _trainer(copy.deepcopy(model)), _trainer(copy.deepcopy(model))
    ma, mb = a.train_step(batch), b.train_step(as_numpy)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights()))


# --- 4. advantages refuse non-finite rewards, naming the entry ---------------------------------------------------

@pytest.mark.parametrize("mode", sorted(ADVANTAGE_MODES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_is_named(mode, bad):
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, bad, 0.0]])
    with pytest.raises(ValueError, match=r"rewards\[1, 2\] \(prompt 1, sample 2\) is (nan|inf); rewards must be"):
        compute_advantages(rewards, mode=mode)


def test_finite_rewards_keep_their_bits():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]])
    adv = compute_advantages(rewards, mode="grpo")
    centred = rewards[0] - rewards[0].mean()
    assert torch.equal(adv[0], centred / (rewards[0].std(unbiased=False) + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))
