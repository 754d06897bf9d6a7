"""Tokenizer loaded from a model directory: ``tokenizer.json`` (the ``tokenizers`` library) plus the
``tokenizer_config.json`` that holds the special tokens and the chat template (rendered with jinja2, as
transformers does)."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from rlrepro._files import model_json


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """The chat templates' ``tojson`` filter as transformers defines it: plain :func:`json.dumps`, keys in insertion
    order, non-ASCII kept, no HTML escaping of ``<``, ``>``, ``&``, ``'`` (jinja2's own ``tojson`` sorts keys and
    escapes those, which would render a tool's schema unlike the text the model was trained on)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_template(path: Path, config: dict) -> str | None:
    """The default chat template, where transformers looks for it: ``chat_template.jinja`` (what transformers
    >= 4.50 writes), else ``tokenizer_config.json``'s ``chat_template``, a string or a list of named templates
    (``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``: the one named "default")."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{path}/tokenizer_config.json lists chat templates {sorted(map(str, named))} but none "
                             "named 'default'; name one of them 'default'")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}/tokenizer_config.json: chat_template must be a string or a list of named "
                         f"templates, got {type(template).__name__}")
    return template


def _json_object(file: Path) -> dict:
    """``file``'s JSON object ({} without the file); a damaged one is a ValueError naming it."""
    return model_json(file) if file.is_file() else {}


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}; the model directory must hold the tokenizer")
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library's error names neither the file nor the fix
            raise ValueError(f"cannot read {file} ({e}); the model directory is damaged: copy it again") from None
        self.config = _json_object(path / "tokenizer_config.json")
        self.chat_template: str | None = _chat_template(path, self.config)
        # special tokens that tokenizer_config.json lacks come from special_tokens_map.json, as in transformers
        special = {**_json_object(path / "special_tokens_map.json"),
                   **{k: v for k, v in self.config.items() if v is not None}}
        self.bos_token = self._token_str(special.get("bos_token"))
        # what a chat template sees: the special tokens the files set (no fallbacks), as transformers passes them
        self._template_tokens = {k: self._token_str(special[k]) for k in ("bos_token", "eos_token", "unk_token",
                                                                          "pad_token") if special.get(k)}
        self.eos_token = self._token_str(special.get("eos_token"))
        self.pad_token = self._token_str(special.get("pad_token")) or self.eos_token
        # the token that stands for text the vocabulary lacks (the tiny character tokenizer's "<unk>"); None for a
        # byte-level BPE (Qwen's), which covers every text
        self.unk_token = self._token_str(special.get("unk_token")) or getattr(self._tok.model, "unk_token", None)

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The model directory's Jinja chat template rendered as transformers renders it (``trim_blocks``,
        ``lstrip_blocks``, loop controls, ``raise_exception``, its ``tojson``). ``tools``: JSON schemas of the
        functions the model may call (Qwen3's template lists them, ``{{ tool | tojson }}``, in its system turn);
        passed to the template only when given. Other keyword arguments become template variables."""
        if not self.chat_template:
            raise ValueError(f"{self.path}/tokenizer_config.json has no chat_template; "
                             "set data.use_chat_template=false or add a template")
        if tools is not None:
            kwargs["tools"] = tools
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**self._template_tokens, **kwargs})


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer(path)
