"""Session 34, pipelined rollouts and evaluation as a user coming from AReaL/slime sees them: the dynamic-sampling
keys that only `rollout.dynamic_sampling=true` reads are refused without it (they changed nothing, silently)."""
import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config
from rlrepro.orchestration.config import validate


@pytest.mark.parametrize("override,key", [("rollout.prompts_per_round=3", "rollout.prompts_per_round=3"),
                                          ("rollout.max_generation_rounds=2", "rollout.max_generation_rounds=2"),
                                          ("rollout.on_round_cap=error", "rollout.on_round_cap='error'")])
def test_round_keys_without_dynamic_sampling_are_refused(override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["recipe=grpo_tiny", override]))
    msg = str(e.value)
    assert key in msg and "changes nothing with rollout.dynamic_sampling=false" in msg, msg
    assert "rollout.dynamic_sampling=true" in msg, msg  # the fix


@pytest.mark.parametrize("override", ["rollout.prompts_per_round=3", "rollout.max_generation_rounds=2",
                                      "rollout.on_round_cap=error", "rollout.prompts_per_round=null",
                                      "rollout.max_generation_rounds=4", "rollout.on_round_cap=fill"])
def test_round_keys_with_dynamic_sampling_or_at_their_defaults_are_accepted(override):
    s = validate(compose_config(["recipe=grpo_tiny", "rollout.dynamic_sampling=true", override]))
    assert s.rollout.dynamic_sampling is True
    key, value = override.split("=")
    assert str(getattr(s.rollout, key.split(".")[1])).lower().replace("none", "null") == value
    if value in ("null", "4", "fill"):  # the default: fine without dynamic sampling too
        assert validate(compose_config(["recipe=grpo_tiny", override])).rollout.dynamic_sampling is False
