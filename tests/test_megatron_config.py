"""validate_megatron_config: every bad layout fails before any work, naming the key, the value and the fix."""
import pytest

from rlrepro.model.tiny import tiny_config
from rlrepro.trainer.megatron import config as mconfig
from rlrepro.trainer.megatron import validate_megatron_config

MODEL = tiny_config(60)  # 4 heads, 2 KV heads, intermediate 128, vocab 60


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(mconfig, "megatron_core_version", lambda: "0.16.1")


def test_good_layouts_give_tp_times_dp(installed):
    layout = validate_megatron_config("megatron", 2, 4, "cuda", MODEL)
    assert (layout.tensor_parallel, layout.data_parallel, layout.world_size) == (2, 2, 4)
    assert validate_megatron_config("default", 1, 3, "cpu", MODEL).data_parallel == 3
    assert validate_megatron_config("megatron", 1, 1, "cpu", None).world_size == 1


def test_tp_larger_than_the_gpu_count_fails_with_the_reason(installed):
    with pytest.raises(ValueError, match=r"train.tensor_parallel=4 needs 4 GPUs per replica but "
                                         r"train.num_gpus=2"):
        validate_megatron_config("megatron", 4, 2, "cuda", MODEL)
    with pytest.raises(ValueError, match=r"needs 4 trainer processes"):
        validate_megatron_config("megatron", 4, 2, "cpu", MODEL)


def test_num_gpus_must_be_a_multiple_of_tp(installed):
    with pytest.raises(ValueError, match=r"train.num_gpus=3 is not a multiple of train.tensor_parallel=2.*"
                                         r"train.num_gpus=2 or 4"):
        validate_megatron_config("megatron", 2, 3, "cuda", MODEL)


@pytest.mark.parametrize("field,value", [("num_attention_heads", 6), ("num_key_value_heads", 3),
                                         ("intermediate_size", 102), ("vocab_size", 61)])
def test_model_dimensions_must_divide_by_tp(installed, field, value):
    kw = {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 64,
          field: value}
    if field == "num_key_value_heads":
        kw["num_attention_heads"] = 12  # heads stay a multiple of KV heads and of 4
    with pytest.raises(ValueError, match=rf"tensor_parallel=4 does not divide the model's {field}={value}"):
        validate_megatron_config("megatron", 4, 4, "cuda", kw)
    validate_megatron_config("megatron", 1, 4, "cuda", kw)  # TP=1 divides everything


def test_megatron_backend_needs_megatron_core(monkeypatch):
    monkeypatch.setattr(mconfig, "megatron_core_version", lambda: None)
    with pytest.raises(ValueError, match=r"needs megatron-core.*pip install 'rlrepro\[megatron\]'"):
        validate_megatron_config("megatron", 1, 1, "cuda", MODEL)
    validate_megatron_config("megatron", 1, 1, "cuda", MODEL, check_installed=False)
    validate_megatron_config("default", 1, 1, "cuda", MODEL)  # the default backend never needs it


def test_bad_values(installed):
    with pytest.raises(ValueError, match=r"train.backend='fsdp' is not one of"):
        validate_megatron_config("fsdp", 1, 1, "cuda")
    with pytest.raises(ValueError, match=r"train.tensor_parallel=2 needs train.backend=megatron"):
        validate_megatron_config("default", 2, 2, "cuda")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="train.tensor_parallel must be a positive int"):
            validate_megatron_config("megatron", bad, 2, "cuda")
    with pytest.raises(ValueError, match="train.num_gpus must be a positive int"):
        validate_megatron_config("megatron", 1, 0, "cuda")
    with pytest.raises(ValueError, match="run.device='tpu'"):
        validate_megatron_config("megatron", 1, 1, "tpu")


def test_version_probe_does_not_import_megatron():
    import sys

    before = "megatron.core" in sys.modules
    mconfig.megatron_core_version()
    assert ("megatron.core" in sys.modules) == before
