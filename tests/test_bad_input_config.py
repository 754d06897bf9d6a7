"""Bad recipe overrides, tried systematically: any value for any key is either rejected at composition with a
ConfigError that names the key, or accepted, and then nothing that only runs after work has started (the trainer
actor, the engine, the sampler, the warm start) rejects it. No Ray, no model: fast."""
import math
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rlrepro.cli import _all_keys, compose_config
from rlrepro.orchestration.config import ConfigError, RunSchema

# every leaf key of the schema (dict-valued keys take any mapping: tiny_overrides, synthetic.kwargs)
_SCHEMA = OmegaConf.structured(RunSchema)
KEYS = sorted(k for k in _all_keys(_SCHEMA)
              if not OmegaConf.is_dict(OmegaConf.select(_SCHEMA, k)) and k != "recipe")

_SAFE = string.ascii_letters + string.digits + "_-./ "
VALUES = st.one_of(
    st.integers(min_value=-(10 ** 12), max_value=10 ** 12),
    st.sampled_from([0, 1, 2, -1, 2 ** 63, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.0, -0.0, 1e-9, 0.5, 1.0, 1.5, float("nan"), float("inf"), -float("inf")]),
    st.booleans(),
    st.none(),
    st.text(alphabet=_SAFE, max_size=12),
    st.sampled_from(["[1, 2]", "{a: 1}", "''", "yes", "1e400", "0x10", "1_000", "True"]),
)


def render(value) -> str:
    """The hydra override text of a Python value (strings from the raw list are passed through as typed)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if value in ("[1, 2]", "{a: 1}", "''", "yes", "1e400", "0x10", "1_000", "True"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def downstream_accepts(cfg) -> None:
    """What checks a value only after work has started: it must accept every config compose_config accepted."""
    import dataclasses

    from rlrepro.orchestration.config import to_schema
    from rlrepro.rollout import EngineConfig, request_seed
    from rlrepro.rollout.engine import _positive_int
    from rlrepro.trainer import TrainConfig

    s = to_schema(cfg)
    TrainConfig(**dataclasses.asdict(s.train))  # the trainer actor's copy of its config
    s.rollout.sampling.params(seed=request_seed(s.run.seed, 1, "uid", 0))  # every request's SamplingParams
    engine = EngineConfig.of(s.rollout).engine_kwargs()
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        _positive_int(name, engine[name])
    if engine["max_model_len"] is not None:
        assert _positive_int("max_model_len", engine["max_model_len"]) >= 2  # the engine needs 2
    if engine["num_kv_blocks"] is not None:
        _positive_int("num_kv_blocks", engine["num_kv_blocks"])
    ws = s.warm_start
    if ws.steps > 0:
        assert isinstance(ws.batch_size, int) and ws.batch_size >= 1
        assert math.isfinite(ws.lr) and ws.lr > 0
        assert isinstance(ws.seed, int)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_override_is_rejected_naming_the_key_or_accepted_everywhere(key, value):
    override = f"{key}={render(value)}"
    try:
        cfg = compose_config(["recipe=grpo_tiny", override])
    except ConfigError as e:
        assert key in str(e), f"{override}: the error does not name {key}: {e}"
        return
    downstream_accepts(cfg)


@pytest.mark.parametrize("override,needle", [
    ("train.lr=nan", "train.lr=nan"),
    ("train.lr=inf", "train.lr=inf"),
    ("train.lr=0", "train.lr=0"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("train.adam_beta2=1", "train.adam_beta2"),
    ("train.clip_low=1", "train.clip_low"),
    ("rollout.temperature=nan", "rollout.temperature"),
    ("rollout.temperature=1e-9", "rollout.temperature"),
    ("rollout.max_restarts=-1", "rollout.max_restarts"),
    ("rollout.num_kv_blocks=0", "rollout.num_kv_blocks"),
    ("train.on_nonfinite=ignore", "train.on_nonfinite"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("rollout.gpu_memory_fraction=0", "rollout.gpu_memory_fraction"),
    ("data.limit=0", "data.limit"),
    ("train.steps=2.5", "train.steps"),
    ("run.resume=maybe", "run.resume"),
])
def test_examples_name_the_value_and_the_fix(override, needle):
    with pytest.raises(ConfigError, match=None) as ei:
        compose_config(["recipe=grpo_tiny", override])
    assert needle in str(ei.value)


def test_keys_inside_mapping_valued_keys_need_no_plus():
    """env.kwargs (the environment's own options), data.synthetic.kwargs: a key inside the mapping, or the whole
    mapping, set as any other key (hydra alone wants +env.kwargs.digits=3, since the recipe's mapping lacks it)."""
    from rlrepro.cli import compose_config

    for override in ("env.kwargs.digits=3", "env.kwargs={digits: 3}", "+env.kwargs.digits=3"):
        cfg = compose_config(["recipe=grpo_tiny", "env.name=calculator_task", override])
        assert dict(cfg.env.kwargs) == {"digits": 3}, override
    assert dict(compose_config(["recipe=grpo_tiny_tool", "data.synthetic.kwargs={digits: 3}"]).data.synthetic.kwargs) \
        == {"digits": 3}


def test_env_keys_without_an_environment_are_refused():
    """env.* configures episodes; with env.name and env.fn null the run is single-turn and they would change
    nothing, so they are refused naming the fix (a verl user writes env.max_turns=3 and expects multi-turn)."""
    from rlrepro.cli import compose_config

    for override, key in (("env.max_turns=3", "env.max_turns=3"), ("env.tools=[python]", "env.tools=['python']"),
                          ("env.calculator.max_chars=9", "env.calculator.max_chars=9")):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)} is set but changes nothing: env.name and env.fn "
                                              r"are null.*Set env.name=tool"):
            compose_config(["recipe=grpo_tiny", override])
    compose_config(["recipe=grpo_tiny", "env.name=tool", "env.max_turns=3", "env.tools=[python]"])


@pytest.mark.parametrize("override,name", [("rollout.n=8", "rollout.group_size"),
                                           ("data.train_batch_size=64", "rollout.prompts_per_step"),
                                           ("algorithm.adv_estimator=grpo", "train.advantage"),
                                           ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                            "train.micro_batch_size")])
def test_verl_spellings_are_answered_with_rlrepros_key(override, name):
    with pytest.raises(ConfigError, match=rf"is not a config key; rlrepro's name for it is {re.escape(name)}"):
        compose_config(["recipe=grpo_tiny", override])
