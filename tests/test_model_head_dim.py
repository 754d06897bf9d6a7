"""A config.json without ``head_dim`` means transformers' Qwen3Config default, 128, not hidden_size // heads."""
from __future__ import annotations

import json

import pytest
import torch

from rlrepro.model import load_pretrained, write_tiny_checkpoint
from rlrepro.model.config import Qwen3Config

pytestmark = pytest.mark.usefixtures("one_thread")

RAW = {"model_type": "qwen3", "vocab_size": 60, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2}  # 64 // 4 = 16, so a derived head_dim would show


def test_absent_head_dim_is_transformers_default_128():
    assert Qwen3Config.from_dict(RAW).head_dim == 128


def test_explicit_and_null_head_dim_are_kept():
    assert Qwen3Config.from_dict({**RAW, "head_dim": 8}).head_dim == 8
    assert Qwen3Config.from_dict({**RAW, "head_dim": None}).head_dim == 16  # null: derived, unchanged


def test_absent_head_dim_agrees_with_transformers():
    transformers = pytest.importorskip("transformers")
    kwargs = {k: v for k, v in RAW.items() if k != "model_type"}
    assert Qwen3Config.from_dict(RAW).head_dim == transformers.Qwen3Config(**kwargs).head_dim == 128


def test_checkpoint_without_head_dim_loads_its_128_wide_heads(tmp_path):
    # A real checkpoint with 128-wide heads (hidden 64, 4 heads) whose config.json omits head_dim, as configs that
    # rely on transformers' default do: the weights' shapes say 128, and loading must read the same.
    d = write_tiny_checkpoint(tmp_path / "m", seed=0, head_dim=128)
    with_key = load_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    del config["head_dim"]
    (d / "config.json").write_text(json.dumps(config))
    model = load_pretrained(d)
    assert model.config.head_dim == 128
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(model(ids), with_key(ids))
