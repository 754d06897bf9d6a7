"""Tiny random Qwen3 checkpoints with a character-level tokenizer, for tests and the CPU recipe.

The checkpoint is written through the real :func:`save_pretrained`, so everything that loads it goes through
the same code as a real Qwen3 directory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from .checkpoint_io import save_pretrained
from .config import Qwen3Config
from .qwen3 import Qwen3ForCausalLM, init_random_weights

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,:;()[]<>!#'\n")
# A ChatML template like Qwen's, without the thinking blocks.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ["<unk>"] + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def tiny_config(vocab_size: int, **overrides) -> Qwen3Config:
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=1024, tie_word_embeddings=True, torch_dtype="float32",
              bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"))
    kw.update(overrides)
    return Qwen3Config(**kw)


def write_tiny_checkpoint(path: str | Path, seed: int = 0, max_shard_bytes: int | None = None,
                          **config_overrides) -> Path:
    """Write a tiny random Qwen3 (config.json, safetensors, tokenizer.json, tokenizer_config.json) to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    config = tiny_config(tok.get_vocab_size(with_added_tokens=True), **config_overrides)
    model = Qwen3ForCausalLM(config).to(config.dtype)
    init_random_weights(model, seed)
    save_pretrained(model, path, max_shard_bytes=max_shard_bytes)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE, "model_max_length": config.max_position_embeddings,
    }, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_id}) + "\n")
    return path


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides) -> Qwen3ForCausalLM:
    """The same tiny model in memory, without touching the disk."""
    config = tiny_config(build_char_tokenizer().get_vocab_size(with_added_tokens=True), **config_overrides)
    return init_random_weights(Qwen3ForCausalLM(config).to(dtype), seed)
