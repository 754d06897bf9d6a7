"""Engine API review: bad arguments give a clear error instead of being silently reinterpreted."""
import pytest

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, initializer_range=0.3)


def test_max_model_len_zero_is_an_error_not_the_model_default(model):
    # `max_model_len or default` turned 0 into the model's max_position_embeddings (1024) without a word
    with pytest.raises(ValueError, match="Engine max_model_len must be a positive integer, got 0"):
        Engine(model, max_model_len=0, num_kv_blocks=8)
    assert Engine(model, num_kv_blocks=8).max_model_len == model.config.max_position_embeddings


@pytest.mark.parametrize("name,value", [("enable_prefix_cache", "false"), ("deterministic", "no"),
                                        ("enable_cuda_graphs", "off"), ("fuse_projections", 0)])
def test_boolean_engine_arguments_reject_non_bools(model, name, value):
    # bool("false") is True: the string silently turned the prefix cache on
    with pytest.raises(ValueError, match=f"Engine {name} must be True or False.*, got {value!r}"):
        Engine(model, num_kv_blocks=8, **{name: value})
    assert Engine(model, num_kv_blocks=8, enable_prefix_cache=False).block_manager.enable_prefix_cache is False


def test_abort_with_a_bool_does_not_abort_request_one(model):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    p = SamplingParams(temperature=0.0, max_tokens=3)
    ids = [engine.add_request([1, 2, 3], p) for _ in range(2)]
    with pytest.raises(ValueError, match="abort: True is not an unfinished request"):
        engine.abort(True)  # True == 1 as a dict key
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(ids[0], "length"), (ids[1], "length")]


def test_add_request_errors_name_the_id_the_request_would_get(model):
    engine = Engine(model, block_size=4, num_kv_blocks=16, max_model_len=32)
    p = SamplingParams(temperature=0.0, max_tokens=2)
    assert engine.add_request([1, 2], p) == 0
    assert engine.add_request([3, 4], p) == 1
    with pytest.raises(ValueError, match=r"^request 2: the prompt is empty"):
        engine.add_request([], p)
    with pytest.raises(ValueError, match=r"^request 2: token id 99 is not an integer in \[0, 60\)"):
        engine.add_request([1, 99], p)
    assert engine.add_request([5], p) == 2  # the failed calls consumed no id
    while engine.has_unfinished():
        engine.step()


def test_sampling_config_rejects_a_bool_top_p():
    with pytest.raises(ConfigError, match=r"rollout.top_p=True must lie in \(0, 1\]"):
        SamplingConfig(top_p=True)
    assert SamplingConfig(top_p=1).params(seed=0).top_p == 1.0
