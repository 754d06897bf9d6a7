"""Session 29 review of the config tree and the CLI: values accepted at set-up that failed later (or silently
changed the run), each now refused (or accepted) before any work starts."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from rlrepro.checks import ConfigError
from rlrepro.cli import cmd_train, compose_config
from rlrepro.orchestration.config import ModelConfig, RolloutConfig, RunSchema, validate
from rlrepro.rollout import SamplingConfig, SamplingParams
from rlrepro.trainer import TrainConfig


# ------------------------------------------------------------------ numpy scalars in configs built in code
@pytest.mark.parametrize("kw", [dict(max_tokens=np.int64(64)), dict(top_k=np.int32(5)),
                                dict(temperature=np.float32(0.5)), dict(top_p=np.float32(0.5))])
def test_sampling_config_takes_numpy_scalars_like_sampling_params(kw):
    cfg = SamplingConfig(**kw)  # SamplingParams takes them; the config did not
    (name, value), = kw.items()
    got = getattr(cfg, name)
    assert type(got) in (int, float) and got == value
    assert cfg.params(seed=0) == SamplingParams(**kw, seed=0)


def test_numpy_values_still_checked():
    with pytest.raises(ConfigError, match=r"rollout\.max_tokens=0 must be a positive integer"):
        SamplingConfig(max_tokens=np.int64(0))
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        SamplingConfig(temperature=np.bool_(True))


def test_run_schema_with_numpy_values_writes_its_config_yaml():
    # np.float64 is a float and passed the checks, then OmegaConf refused it when config.yaml was written
    s = validate(RunSchema(model=ModelConfig(init="tiny"),
                           rollout=RolloutConfig(temperature=np.float64(0.7), max_tokens=np.int64(16)),
                           train=TrainConfig(lr=np.float64(1e-4))))
    assert type(s.rollout.temperature) is float and type(s.rollout.max_tokens) is int and type(s.train.lr) is float
    text = OmegaConf.to_yaml(OmegaConf.structured(s))
    assert "temperature: 0.7" in text and "max_tokens: 16" in text


def test_plain_dict_with_numpy_values():
    # was: "bad config: Value 'int64' is not a supported primitive type" (no key named)
    s = validate({"model": {"init": "tiny"}, "rollout": {"max_tokens": np.int64(64)}})
    assert type(s.rollout.max_tokens) is int and s.rollout.max_tokens == 64


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize("item", ["~run", "~eval", "~rollout.temperature"])
def test_deleting_a_schema_key_is_refused(item):
    # ~run was accepted: the schema's defaults came back in silence (seed 0, and a run written into the
    # literal directory runs/${recipe})
    with pytest.raises(ConfigError, match="would delete"):
        compose_config(["recipe=grpo_tiny", item])


def test_deleting_a_key_inside_a_mapping_still_works():
    cfg = compose_config(["recipe=grpo_tiny", "~model.tiny_overrides.num_hidden_layers"])
    assert "num_hidden_layers" not in cfg.model.tiny_overrides


def test_empty_run_dir_is_refused(tmp_path, monkeypatch, capsys):
    # run.dir= (an unset shell variable) wrote the whole run into the current directory
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"run\.dir='' must name the run directory"):
        compose_config(["recipe=grpo_tiny", "run.dir="])
    assert cmd_train(["recipe=grpo_tiny", "run.dir=", "train.steps=1"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_misspelt_tiny_override_fails_at_composition(tmp_path):
    # was a TypeError traceback from Qwen3Config once run.dir (and its .lock) had been made
    with pytest.raises(ConfigError, match=r"model\.tiny_overrides\.hiden_size .*model\.tiny_overrides\.hidden_size"):
        compose_config(["recipe=grpo_tiny", "model.tiny_overrides.hiden_size=32", f"run.dir={tmp_path / 'r'}"])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("item", ["model.tiny_overrides.num_hidden_layers=0",
                                  "model.tiny_overrides.num_attention_heads=3"])
def test_bad_tiny_override_value_fails_at_composition(item):
    with pytest.raises(ConfigError, match=r"model\.tiny_overrides=.*does not make a tiny model"):
        compose_config(["recipe=grpo_tiny", item])


def test_good_tiny_override_accepted():
    cfg = compose_config(["recipe=grpo_tiny", "model.tiny_overrides.hidden_size=32"])
    assert cfg.model.tiny_overrides.hidden_size == 32


def test_tiny_override_without_tiny_init_is_refused(tmp_path):
    # silently ignored: the weights come from model.path
    with pytest.raises(ConfigError, match=r"tiny_overrides\.hidden_size is not used with model\.init=pretrained"):
        compose_config(["recipe=grpo_tiny", "model.init=pretrained", f"model.path={tmp_path}",
                        "model.tiny_overrides.hidden_size=32"])


def test_clearing_the_tiny_overrides_with_another_init_is_allowed(tmp_path):
    # model.tiny_overrides={} clears the recipe's mapping when switching to a pretrained model (tests and users do it)
    cfg = compose_config(["recipe=grpo_tiny", "model.init=pretrained", f"model.path={tmp_path}",
                          "model.tiny_overrides={}"])
    assert cfg.model.init == "pretrained"


def test_the_driver_runs_every_rule_for_a_python_caller(tmp_path):
    # GRPODriver ran only each component's own checks (to_schema): a rule across components passed and failed late
    from rlrepro.orchestration.config import to_schema
    from rlrepro.orchestration.driver import GRPODriver

    schema = to_schema(compose_config(["recipe=grpo_tiny", f"run.dir={tmp_path / 'r'}"]))
    schema.reward.overlong_buffer = schema.rollout.max_tokens
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer=.* must be below rollout\.max_tokens"):
        GRPODriver(schema)
    assert not (tmp_path / "r").exists()
