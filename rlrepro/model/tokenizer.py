"""Tokenizer loaded from a model directory: ``tokenizer.json`` (the ``tokenizers`` library) plus the
``tokenizer_config.json`` that holds the special tokens and the chat template (rendered with jinja2, as
transformers does)."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}; the model directory must hold the tokenizer")
        self.path = path
        self._tok = _HFTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token = self._token_str(self.config.get("eos_token"))
        self.pad_token = self._token_str(self.config.get("pad_token")) or self.eos_token
        # the token that stands for text the vocabulary lacks (the tiny character tokenizer's "<unk>"); None for a
        # byte-level BPE (Qwen's), which covers every text
        self.unk_token = self._token_str(self.config.get("unk_token")) or getattr(self._tok.model, "unk_token", None)

    @staticmethod
    def _token_str(tok) -> str | None:
        return tok.get("content") if isinstance(tok, dict) else tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_to_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self.token_to_id(self.unk_token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_offsets(self, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` with each token's (start, end) character offsets in ``text``: what the unknown token
        stood for is ``text[start:end]``."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.path}/tokenizer_config.json has no chat_template; "
                             "set data.use_chat_template=false or add a template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token, **kwargs)


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer(path)
