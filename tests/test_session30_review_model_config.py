"""Session 30 review: config.json fields with odd values, and Sample record round trips."""
import json

import pytest
import torch

from rlrepro.model import Qwen3Config, load_pretrained, save_pretrained, tiny_model
from rlrepro.samples import Sample, Turn

BASE = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def _cfg(**kw):
    raw = dict(BASE)
    raw.update(kw)
    return Qwen3Config.from_dict(raw)


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_a_non_boolean_tie_word_embeddings_is_refused(value):
    # the string "false" is truthy: the model tied its LM head and loading skipped lm_head.weight, silently
    with pytest.raises(ValueError, match=f"tie_word_embeddings must be true or false, got {value!r}"):
        _cfg(tie_word_embeddings=value)


def test_null_tie_word_embeddings_is_untied_and_booleans_are_kept():
    assert _cfg(tie_word_embeddings=None).tie_word_embeddings is False
    assert _cfg(tie_word_embeddings=True).tie_word_embeddings is True
    assert _cfg().tie_word_embeddings is False


def test_string_false_tie_in_a_checkpoint_is_refused_on_load(tmp_path):
    model = tiny_model(seed=3, tie_word_embeddings=False)
    save_pretrained(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["tie_word_embeddings"] = "false"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="config.json.*tie_word_embeddings must be true or false"):
        load_pretrained(tmp_path)
    raw["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(ids), model(ids))


@pytest.mark.parametrize("key,value", [("hidden_size", True), ("num_hidden_layers", False),
                                       ("max_position_embeddings", None), ("max_position_embeddings", 4096.0)])
def test_integer_fields_refuse_booleans_nulls_and_floats(key, value):
    with pytest.raises(ValueError, match=f"config.{key} must be a positive integer, got {value!r}"):
        _cfg(**{key: value})


@pytest.mark.parametrize("value", [None, "1e-6", -1e-6, 0, float("nan"), float("inf")])
def test_rms_norm_eps_must_be_a_positive_number(value):
    # None used to be accepted and failed deep inside the first forward (var + None)
    with pytest.raises(ValueError, match="config.rms_norm_eps must be a finite number > 0"):
        _cfg(rms_norm_eps=value)


@pytest.mark.parametrize("value", [None, "abc", 0, -10000.0])
def test_rope_theta_must_be_a_positive_number(value):
    # None raised a TypeError naming no key; "abc" a bare float() error; 0 built a NaN rotary table
    with pytest.raises(ValueError, match=f"rope_theta must be a finite number > 0, got {value!r}"):
        _cfg(rope_theta=value)


def test_rope_theta_from_rope_parameters_and_default_rope_scaling_still_load():
    assert _cfg(rope_parameters={"rope_type": "default", "rope_theta": 5000}).rope_theta == 5000.0
    assert _cfg(rope_scaling={"type": "default"}).rope_theta == 10_000.0  # none given: transformers' default
    with pytest.raises(ValueError, match="rope_theta must be a finite number > 0, got 0"):
        _cfg(rope_parameters={"rope_type": "default", "rope_theta": 0})


def test_initializer_range_must_be_a_number():
    assert _cfg(initializer_range=0).initializer_range == 0
    with pytest.raises(ValueError, match="initializer_range must be a finite number >= 0, got None"):
        _cfg(initializer_range=None)


def test_saved_config_reads_back_equal():
    cfg = _cfg(tie_word_embeddings=True, rope_theta=10000, rms_norm_eps=1e-5)
    back = Qwen3Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    fields = [f for f in cfg.__dataclass_fields__ if f != "extra"]
    assert {f: getattr(back, f) for f in fields} == {f: getattr(cfg, f) for f in fields}


def _sample(**kw):
    base = dict(prompt_uid="p0", sample_index=2, prompt_token_ids=[1, 2], completion_token_ids=[3, 4],
                rollout_logprobs=[-0.5, -1.25], finish_reason="stop", seed=7, weight_version=3, reward=1.0,
                advantage=-0.0, loss_mask=[1, 0], turns=[Turn("policy", [3]), Turn("tool", [4], "x")])
    base.update(kw)
    return Sample(**base)


def test_sample_extra_survives_the_record_round_trip():
    s = _sample(extra={"judge": "ok", "score": 0.25})
    back = Sample.from_record(json.loads(json.dumps(s.to_record())))
    assert back.extra == {"judge": "ok", "score": 0.25}  # was {}: to_record dropped it
    assert back == s


def test_sample_without_extra_keeps_its_record_keys():
    rec = _sample().to_record()
    assert "extra" not in rec
    assert Sample.from_record(rec) == _sample()


def test_sample_from_record_owns_its_lists():
    rec = _sample().to_record()
    s = Sample.from_record(rec)
    rec["loss_mask"].append(1)  # the loss mask was the record's own list (every other list was copied)
    rec["token_ids"].append(9)
    assert s.loss_mask == [1, 0] and s.completion_token_ids == [3, 4]


def test_sample_non_finite_values_keep_their_bits_through_json():
    s = _sample(rollout_logprobs=[float("-inf"), -0.0], reward=float("inf"), advantage=-0.0)
    back = Sample.from_record(json.loads(json.dumps(s.to_record())))
    assert back == s
    assert str(back.advantage) == "-0.0" and str(back.rollout_logprobs[1]) == "-0.0"
