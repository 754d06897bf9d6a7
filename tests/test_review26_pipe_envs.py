"""Review 26, environments: env.name=single_turn (one assistant turn, no tools) refuses the tool keys it would
ignore, at config validation (before any work), naming each key and the fix; the keys it does read stay allowed."""
import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config
from rlrepro.envs import EnvConfig
from rlrepro.envs.calculator import CalculatorLimits
from rlrepro.orchestration.config import validate


@pytest.mark.parametrize("override,key", [
    ("env.tools=[python]", "env.tools=['python']"),
    ("env.tool_format=compact", "env.tool_format='compact'"),
    ("env.max_calls_per_turn=2", "env.max_calls_per_turn=2"),
    ("env.on_malformed=end", "env.on_malformed='end'"),
    ("env.malformed_penalty=0.5", "env.malformed_penalty=0.5"),
    ("env.max_observation_chars=10", "env.max_observation_chars=10"),
    ("env.python.max_steps=5", "env.python.max_steps=5"),
    ("env.calculator.max_digits=5", "env.calculator.max_digits=5"),
])
def test_single_turn_refuses_the_tool_keys_it_would_ignore(override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["recipe=grpo_tiny", "env.name=single_turn", override]))
    msg = str(e.value)
    assert msg.startswith(key) and "changes nothing with env.name=single_turn" in msg
    assert "Fix: env.name=tool (or calculator_task)" in msg and f"drop {key.split('=')[0]}" in msg


def test_single_turn_keeps_the_keys_it_reads_and_other_environments_keep_theirs():
    cfg = validate(compose_config(["recipe=grpo_tiny", "env.name=single_turn", "env.max_turns=3",
                                   "env.max_episode_tokens=60", "env.tool_threads=4"]))
    assert cfg.env.env_name == "single_turn" and cfg.env.max_episode_tokens == 60
    assert validate(compose_config(["recipe=grpo_tiny_tool"])).env.tool_format == "compact"  # calculator_task
    EnvConfig(name="tool", tools=["python"], on_malformed="end")
    EnvConfig(fn="pkg.mod:factory", tools=["python"])  # a user factory may read any key
    with pytest.raises(ConfigError, match=r"env\.calculator\.max_chars=10 is set but changes nothing"):
        EnvConfig(name="single_turn", calculator=CalculatorLimits(max_chars=10))
    with pytest.raises(ConfigError, match=r"env\.tool_format='compact' is set but changes nothing"):
        validate(compose_config(["recipe=grpo_tiny_tool", "env.name=single_turn"]))  # the recipe's tool keys
