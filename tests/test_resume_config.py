"""reconcile_resume: which differences between a run's recorded config and a resume's requested one are accepted
(and returned as amendments), and which are refused with every difference listed (issue 21 item 2)."""
import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrepro.checks import ConfigError
from rlrepro.orchestration.resume import BIT_NEUTRAL_KEYS, STEPS_KEY, flatten, reconcile_resume, steps_change_problem


def recorded_config(**train) -> dict:
    base = {
        "recipe": "grpo_tiny",
        "run": {"dir": "runs/a", "seed": 1, "resume": False, "device": "cpu", "deterministic": True,
                "save_rollouts": True, "overwrite": False},
        "model": {"path": None, "init": "tiny", "dtype": None, "tiny_overrides": {"hidden_size": 64}},
        "rollout": {"num_workers": 1, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "prefix_cache": True,
                    "num_kv_blocks": None, "gpu_memory_fraction": 0.5, "weight_sync": "auto", "max_restarts": 3,
                    "temperature": 1.0, "max_tokens": 16, "stop_token_ids": [0]},
        "train": {"steps": 20, "lr": 1e-6, "min_lr_ratio": 0.1, "warmup_steps": 2, "backend": "default"},
        "checkpoint": {"every": 5, "keep_last": 3, "save_last": True, "format": "full"},
        "logger": {"wandb": False, "mode": "offline", "progress": True},
        "ray": {"address": None, "num_cpus": None, "colocate": True},
    }
    base["train"].update(train)
    return base


def changed(cfg: dict, **dotted) -> dict:
    out = copy.deepcopy(cfg)
    for key, value in dotted.items():
        *parents, leaf = key.split("__")
        node = out
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


def test_identical_configs_resume_unchanged():
    rec = recorded_config()
    config, amendments = reconcile_resume(rec, copy.deepcopy(rec), completed_step=7)
    assert config == rec and config is not rec
    assert amendments == []


BIT_NEUTRAL_CHANGES = {
    "logger__wandb": True, "logger__mode": "disabled", "checkpoint__every": 2, "checkpoint__keep_last": 9,
    "checkpoint__save_last": False, "run__resume": True, "run__overwrite": True, "run__save_rollouts": False,
    "run__dir": "/abs/runs/a", "ray__address": "127.0.0.1:6379", "ray__num_cpus": 4, "rollout__num_workers": 2,
    "rollout__max_num_seqs": 48, "rollout__max_num_batched_tokens": 333, "rollout__prefix_cache": False,
    "rollout__num_kv_blocks": 100, "rollout__gpu_memory_fraction": 0.3, "rollout__weight_sync": "object_store",
    "rollout__max_restarts": 0, "ray__placement": "split", "ray__num_nodes": 2, "ray__trainer_node": "trainer_node",
    "ray__rollout_node": "rollout_node",
}


def test_bit_neutral_changes_are_applied_and_recorded_as_amendments():
    rec = recorded_config()
    frozen = copy.deepcopy(rec)
    req = changed(rec, **BIT_NEUTRAL_CHANGES)
    config, amendments = reconcile_resume(rec, req, completed_step=4)
    assert config == req
    assert rec == frozen  # the inputs are not changed
    by_key = {a["key"]: a for a in amendments}
    assert set(by_key) == {k.replace("__", ".") for k in BIT_NEUTRAL_CHANGES}
    assert by_key["checkpoint.every"] == {"key": "checkpoint.every", "old": 5, "new": 2, "from_step": 5}
    assert by_key["ray.address"]["old"] is None and by_key["ray.address"]["new"] == "127.0.0.1:6379"
    json.dumps(amendments)  # recordable as they are


def test_other_differences_are_refused_listing_every_one_and_the_fix():
    rec = recorded_config()
    req = changed(rec, train__lr=2e-6, rollout__temperature=0.7, rollout__stop_token_ids=[0, 1],
                  model__tiny_overrides={"hidden_size": 32}, checkpoint__every=1)
    with pytest.raises(ConfigError) as e:
        reconcile_resume(rec, req, completed_step=3)
    msg = str(e.value)
    for line in ("train.lr: 1e-06 -> 2e-06", "rollout.temperature: 1.0 -> 0.7", "rollout.stop_token_ids: [0] -> [0, 1]",
                 "model.tiny_overrides.hidden_size: 64 -> 32"):
        assert line in msg, msg
    assert "4 key(s)" in msg
    assert "checkpoint.every" in msg.split("accepted", 1)[1]  # the allowed one is named as accepted, not refused
    assert "Drop those overrides" in msg and "another run.dir" in msg


def test_keys_on_one_side_only_are_differences():
    rec = recorded_config()
    req = copy.deepcopy(rec)
    req["train"]["advantage_clip"] = 0.0  # a key the recorded run did not have
    del req["rollout"]["max_tokens"]
    with pytest.raises(ConfigError) as e:
        reconcile_resume(rec, req, completed_step=0)
    assert "train.advantage_clip: <absent> -> 0.0" in str(e.value)
    assert "rollout.max_tokens: 16 -> <absent>" in str(e.value)


def test_an_allowed_key_missing_on_one_side_is_set_or_removed():
    rec = recorded_config()
    req = copy.deepcopy(rec)
    req["logger"]["num_table_samples"] = 4
    del req["logger"]["progress"]
    config, amendments = reconcile_resume(rec, req, completed_step=2)
    assert config["logger"] == {"wandb": False, "mode": "offline", "num_table_samples": 4}
    assert {(a["key"], a["old"], a["new"]) for a in amendments} == {
        ("logger.num_table_samples", None, 4), ("logger.progress", True, None)}


def test_bool_and_int_are_not_the_same_value():
    rec = recorded_config()
    with pytest.raises(ConfigError, match=r"run\.seed: 1 -> true"):
        reconcile_resume(rec, changed(rec, run__seed=True), completed_step=0)


def test_keys_are_generic_dotted_paths():
    # a recorded config from before the trainer: section was merged into train: differs from today's on both
    # spellings: the caller migrates the recorded config's old spellings first
    rec = recorded_config()
    old = copy.deepcopy(rec)
    old["trainer"] = {"backend": old["train"].pop("backend")}
    with pytest.raises(ConfigError) as e:
        reconcile_resume(old, rec, completed_step=0)
    assert 'trainer.backend: "default" -> <absent>' in str(e.value)
    assert 'train.backend: <absent> -> "default"' in str(e.value)


# ------------------------------------------------------------------------------------------------ train.steps
def test_longer_run_is_allowed_when_the_lr_is_constant_after_warm_up():
    rec = recorded_config(min_lr_ratio=1.0, warmup_steps=3)
    config, amendments = reconcile_resume(rec, changed(rec, train__steps=50), completed_step=20)
    assert config["train"]["steps"] == 50
    assert amendments == [{"key": STEPS_KEY, "old": 20, "new": 50, "from_step": 21}]


def test_longer_run_is_refused_when_the_cosine_would_change():
    rec = recorded_config(min_lr_ratio=0.1, warmup_steps=2)
    with pytest.raises(ConfigError) as e:
        reconcile_resume(rec, changed(rec, train__steps=40), completed_step=20)
    msg = str(e.value)
    assert "train.steps: 20 -> 40" in msg and "LR" in msg and "min_lr_ratio=1" in msg
    assert "step 4 would get LR" in msg  # the first step after the 2-step warm-up whose rate differs


def test_a_warm_up_capped_at_the_old_length_changes_with_the_length():
    # the schedule's warm-up is min(train.warmup_steps, train.steps): 3 steps in a 3-step run, 5 in a longer one,
    # so even a constant-after-warm-up schedule gives the recorded steps other rates
    rec = recorded_config(steps=3, min_lr_ratio=1.0, warmup_steps=5)
    with pytest.raises(ConfigError, match="step 1 would get LR"):
        reconcile_resume(rec, changed(rec, train__steps=10), completed_step=3)
    # the reason and the fix are named (it said "only a schedule constant after its warm-up", which this one is)
    assert "warm-up of 5 steps was cut short at its train.steps=3" in steps_change_problem(rec, 4, 3)
    assert "train.steps=4 (run.resume=false)" in steps_change_problem(rec, 4, 3)
    rec = recorded_config(steps=6, min_lr_ratio=1.0, warmup_steps=5)
    assert steps_change_problem(rec, 10, 6) is None


def test_a_run_cannot_be_shortened_below_its_completed_steps():
    rec = recorded_config(min_lr_ratio=1.0)
    with pytest.raises(ConfigError, match="12 steps are already done"):
        reconcile_resume(rec, changed(rec, train__steps=10), completed_step=12)
    config, _ = reconcile_resume(rec, changed(rec, train__steps=12), completed_step=12)
    assert config["train"]["steps"] == 12


def test_steps_change_and_another_change_together_list_both():
    rec = recorded_config(min_lr_ratio=0.5)
    with pytest.raises(ConfigError) as e:
        reconcile_resume(rec, changed(rec, train__steps=30, train__lr=1e-5), completed_step=5)
    assert "train.steps: 20 -> 30 (" in str(e.value) and "train.lr: 1e-06 -> 1e-05" in str(e.value)


def _scheduler_rates(lr, warmup, ratio, steps, n):
    import torch

    from rlrepro.trainer.config import TrainConfig
    from rlrepro.trainer.optim import WarmupCosineLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = WarmupCosineLR(opt, base_lr=lr, warmup_steps=TrainConfig(steps=steps, warmup_steps=warmup)
                           .schedule_warmup_steps, total_steps=steps, min_lr_ratio=ratio)
    rates = []
    for _ in range(n):
        rates.append(opt.param_groups[0]["lr"])
        sched.step()
    return rates


@settings(max_examples=60, deadline=None)
@given(lr=st.sampled_from([1e-6, 3e-4, 1.0]), warmup=st.integers(0, 12), ratio=st.sampled_from([0.0, 0.1, 1.0]),
       old=st.integers(1, 15), new=st.integers(1, 25), done=st.integers(0, 15))
def test_allowed_exactly_when_the_trainers_scheduler_gives_every_step_the_same_rate(lr, warmup, ratio, old, new,
                                                                                   done):
    done = min(done, old)
    rec = recorded_config(steps=old, lr=lr, warmup_steps=warmup, min_lr_ratio=ratio)
    problem = steps_change_problem(rec, new, done)
    same = _scheduler_rates(lr, warmup, ratio, old, new) == _scheduler_rates(lr, warmup, ratio, new, new)
    assert (problem is None) == (same and new >= done), problem


# ------------------------------------------------------------------------------------------------ the real schema
def test_every_bit_neutral_pattern_and_schedule_key_names_a_key_of_the_run_schema():
    from omegaconf import OmegaConf

    from rlrepro.orchestration.config import RunSchema

    keys = [k for k, _ in flatten(OmegaConf.to_container(OmegaConf.structured(RunSchema), resolve=True))]
    from fnmatch import fnmatchcase

    for pattern in BIT_NEUTRAL_KEYS:
        assert any(fnmatchcase(k, pattern) for k in keys), f"{pattern} matches no key of the run schema"
    for key in (STEPS_KEY, "train.lr", "train.warmup_steps", "train.min_lr_ratio"):
        assert key in keys, key
