"""The config tree: each section is a component's own dataclass, choice lists come from the implementing
modules' registries, old spellings are read with a warning, and a short smoke run just runs."""
import dataclasses

import pytest

from rlrepro.cli import compose_config
from rlrepro.model import tiny_model
from rlrepro.data.config import DataConfig, RewardConfig
from rlrepro.orchestration.config import (ConfigError, ModelConfig, RolloutConfig, RunSchema, migrate_legacy_keys,
                                          to_schema, validate)
from rlrepro.rollout import EngineConfig, SamplingConfig, SamplingParams
from rlrepro.samples import Sample
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.advantages import ADVANTAGE_MODES, register_advantage
from rlrepro.trainer.config import CheckpointConfig, WarmStartConfig
from rlrepro.trainer.losses import KL_ESTIMATORS, LOSS_AGG_MODES


def test_the_schema_is_the_tree_of_the_components_configs():
    hints = {f.name: f.type for f in dataclasses.fields(RunSchema)}
    s = RunSchema()
    assert type(s.train) is TrainConfig and type(s.checkpoint) is CheckpointConfig
    assert type(s.warm_start) is WarmStartConfig and type(s.data) is DataConfig and type(s.reward) is RewardConfig
    assert isinstance(s.rollout, EngineConfig) and isinstance(s.rollout, SamplingConfig)
    assert "trainer" not in hints  # merged into train:
    # the engine's keys are the EngineConfig fields, one place each; the sampling defaults are SamplingParams'
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= {f.name for f in dataclasses.fields(RolloutConfig)}
    defaults = SamplingParams()
    assert (SamplingConfig().temperature, SamplingConfig().top_p, SamplingConfig().top_k,
            SamplingConfig().max_tokens) == (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens)


def test_a_component_receives_its_own_config_object():
    s = to_schema(compose_config(["recipe=grpo_tiny", "rollout.max_num_seqs=48", "train.lr=0.01"]))
    engine = s.rollout.engine
    assert type(engine) is EngineConfig and engine.max_num_seqs == 48 and engine.num_kv_blocks == 512
    assert engine.engine_kwargs()["enable_prefix_cache"] is True  # the Engine argument's own spelling
    assert type(s.train) is TrainConfig and s.train.lr == 0.01 and s.train.betas == (0.9, 0.999)


def test_choices_come_from_the_registries():
    with pytest.raises(ConfigError, match="train.advantage='no_such_estimator' is not allowed"):
        TrainConfig(advantage="no_such_estimator")

    @register_advantage("test_centered_x2")
    def _twice(rewards, eps):
        return 2 * (rewards - rewards.mean(dim=1, keepdim=True))

    try:
        assert TrainConfig(advantage="test_centered_x2").advantage == "test_centered_x2"  # no second list to edit
    finally:
        del ADVANTAGE_MODES["test_centered_x2"]
    assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"} <= set(LOSS_AGG_MODES)
    assert {"k1", "k2", "k3"} <= set(KL_ESTIMATORS)
    with pytest.raises(ConfigError, match="train.loss_agg='sum' is not allowed; choose one of \\['token-mean'"):
        TrainConfig(loss_agg="sum")
    with pytest.raises(ConfigError, match="rollout.weight_sync='nccl' is not allowed"):
        compose_config(["recipe=grpo_tiny", "rollout.weight_sync=nccl"])


def test_old_trainer_spellings_are_read_with_a_warning(capsys):
    cfg = compose_config(["recipe=grpo_tiny", "trainer.grad_sync=ordered", "trainer.tensor_parallel=1"])
    assert cfg.train.grad_sync == "ordered" and "trainer" not in cfg
    err = capsys.readouterr().err
    assert "trainer.grad_sync is now train.grad_sync" in err and "trainer.tensor_parallel is now" in err
    recorded = {"train": {"steps": 3}, "trainer": {"backend": "default", "tensor_parallel": 1}}
    migrated = migrate_legacy_keys(recorded, warn=False)
    assert migrated == {"train": {"steps": 3, "backend": "default", "tensor_parallel": 1}}
    assert to_schema(migrated).train.backend == "default"
    with pytest.raises(ConfigError, match="trainer.foo is not a config key"):
        migrate_legacy_keys({"trainer": {"foo": 1}})


def test_cross_component_rules_stay_in_the_schema():
    with pytest.raises(ConfigError, match="reward.overlong_buffer=12 must be below rollout.max_tokens=12"):
        compose_config(["recipe=grpo_tiny", "reward.overlong_buffer=12"])
    with pytest.raises(ConfigError, match="rollout.weight_sync=cuda_ipc needs trainer and engines on the same"):
        validate(RunSchema(model=ModelConfig(init="tiny"), rollout=RolloutConfig(weight_sync="cuda_ipc")))
    with pytest.raises(ConfigError, match="checkpoint.format=dist .* needs train.backend=megatron"):
        compose_config(["recipe=grpo_tiny", "checkpoint.format=dist"])


def _batch(model, advantages):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10]]
    completions = [[11, 12], [13, 14, 15], [16], [17, 18]]
    lps = token_logprobs(model, prompts, completions, temperature=1.0)
    return [Sample(f"p{i}", 0, p, c, lp.tolist(), advantage=a)
            for i, (p, c, lp, a) in enumerate(zip(prompts, completions, lps, advantages))]


def test_warmup_longer_than_the_run_is_capped_not_refused():
    cfg = TrainConfig(steps=4, warmup_steps=10, lr=1.0, min_lr_ratio=1.0)
    assert cfg.schedule_warmup_steps == 4
    s = to_schema(compose_config(["recipe=grpo_tiny", "train.steps=4"]))  # the recipe's warm-up is 10 steps
    assert s.train.steps == 4 and s.train.warmup_steps == 10
    trainer = Trainer(tiny_model(seed=0), cfg)
    lrs = []
    for _ in range(4):
        lrs.append(trainer.scheduler.get_last_lr())
        trainer.scheduler.step()
    assert lrs == [0.25, 0.5, 0.75, 1.0]  # a warm-up over the 4 steps the run has


def test_advantage_clip_bounds_the_advantages_and_is_off_by_default(one_thread):
    def loss(advantages, **kw):
        trainer = Trainer(tiny_model(seed=0), TrainConfig(lr=1e-3, **kw))
        return trainer.train_step(_batch(trainer.model, advantages))["train/loss"]

    big = [3.0, -3.0, 0.5, -0.5]
    off = loss(big)
    assert loss(big, advantage_clip=5.0) == off  # every |A| <= 5: nothing clipped, the same bits
    tight = loss(big, advantage_clip=1.0)
    assert tight != off
    assert tight == loss([1.0, -1.0, 0.5, -0.5])  # clipping at 1 is the batch with |A| capped at 1
