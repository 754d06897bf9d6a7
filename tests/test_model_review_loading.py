"""load_pretrained / save_pretrained / load_tokenizer on HF directories as they come from the wild: configs of
features rlrepro's Qwen3 lacks are refused by name, a config without a dtype keeps the weights' own, a save over
a sharded directory leaves no stale index, the chat template is found where transformers puts it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlrepro.model import load_pretrained, load_tokenizer, save_pretrained, write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_DROP = object()


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, "'yarn'"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"model_type": "llama"}, "'llama'"),
])
def test_unsupported_config_is_refused_naming_file_and_value(tiny_dir, tmp_path, change, words):
    d = _copy(tiny_dir, tmp_path / "m", **change)
    with pytest.raises(ValueError) as err:
        load_pretrained(d)
    assert words in str(err.value) and str(d / "config.json") in str(err.value)


def test_null_head_dim_is_derived_as_transformers_does(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m", head_dim=None)  # hidden 64 / 4 heads = 16, the tiny head_dim
    assert load_pretrained(d).config.head_dim == 16


@pytest.mark.parametrize("stored", [torch.float32, torch.float16])
def test_config_without_dtype_keeps_the_weights_dtype(tiny_dir, tmp_path, stored):
    src = _copy(tiny_dir, tmp_path / "src")
    save_pretrained(load_pretrained(src, dtype=stored), src)
    d = _copy(src, tmp_path / "m", torch_dtype=_DROP, dtype=_DROP)
    model = load_pretrained(d)
    assert model.dtype == stored and model.config.torch_dtype == str(stored).replace("torch.", "")


def test_dtype_may_be_named(tiny_dir):
    assert load_pretrained(tiny_dir, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bf16"):
        load_pretrained(tiny_dir, dtype="bf16")


def test_save_over_a_sharded_directory_leaves_no_stale_index(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", seed=0, max_shard_bytes=20000)
    assert (d / "model.safetensors.index.json").is_file()
    other = load_pretrained(write_tiny_checkpoint(tmp_path / "other", seed=1))
    save_pretrained(other, d)
    assert sorted(f.name for f in d.glob("model*")) == ["model.safetensors"]
    assert torch.equal(load_pretrained(d).model.embed_tokens.weight, other.model.embed_tokens.weight)
    save_pretrained(other, d, max_shard_bytes=40000)  # and back to shards: no single file left beside them
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(f.name for f in d.glob("model-*")) == sorted(set(index["weight_map"].values()))


def test_index_with_a_malformed_weight_map_is_a_clear_error(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", seed=0, max_shard_bytes=20000)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-00001-of-00015"]}))
    with pytest.raises(ValueError, match="weight_map"):
        load_pretrained(d)


def _move_template_to_jinja(d: Path) -> str:
    tc = json.loads((d / "tokenizer_config.json").read_text())
    template = tc.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.jinja").write_text(template)
    return template


def test_chat_template_jinja_file_is_read_and_saved_along(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    expected = load_tokenizer(d).apply_chat_template(MESSAGES)
    _move_template_to_jinja(d)  # what transformers >= 4.50 writes
    assert load_tokenizer(d).apply_chat_template(MESSAGES) == expected
    out = save_pretrained(load_pretrained(d), tmp_path / "out")
    assert load_tokenizer(out).apply_chat_template(MESSAGES) == expected


def test_chat_template_list_of_named_templates(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    expected = load_tokenizer(d).apply_chat_template(MESSAGES)
    tc["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": tc["chat_template"]}]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    assert load_tokenizer(d).apply_chat_template(MESSAGES) == expected
    tc["chat_template"] = [{"name": "tool_use", "template": "x"}]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ValueError, match="default"):
        load_tokenizer(d)


def test_tokenizer_config_is_read_as_utf8_whatever_the_locale(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = "\uff5c" + tc["chat_template"]  # DeepSeek-style full-width bar
    (d / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False), encoding="utf-8")
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    code = ("import sys; from rlrepro.model import load_tokenizer; "
            "print(ascii(load_tokenizer(sys.argv[1]).chat_template[:1]))")
    out = subprocess.run([sys.executable, "-c", code, str(d)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "'\\uff5c'"


def test_special_tokens_missing_from_tokenizer_config_come_from_special_tokens_map(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    eos, pad = tc.pop("eos_token"), tc.pop("pad_token")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": eos, "lstrip": False},
                                                          "pad_token": pad}))
    tok = load_tokenizer(d)
    assert (tok.eos_token, tok.pad_token) == (eos, pad) and tok.eos_token_id == tok.token_to_id(eos) is not None
