"""Tokenizer loaded from a model directory: ``tokenizer.json`` (the ``tokenizers`` library) plus the
``tokenizer_config.json`` that holds the special tokens, and the chat templates (``chat_template.jinja``,
``additional_chat_templates/*.jinja``, else ``tokenizer_config.json``'s; rendered with jinja2, as transformers
does)."""
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


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the default template, as transformers >= 4.43 saves it
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # NAME.jinja: the template named NAME ("tool_use", ...)


def _chat_templates(path: Path, config: dict) -> dict[str, str]:
    """The model's chat templates by name, where transformers looks for them: the files first,
    ``chat_template.jinja`` (named "default") and ``additional_chat_templates/NAME.jinja`` (named NAME); when any
    is there, ``tokenizer_config.json``'s ``chat_template`` is not read (transformers' precedence). Else that key:
    a string (the "default") or a list of named templates (``[{"name": "default", "template": ...}, {"name":
    "tool_use", ...}]``). {} when the model has none. Templates but none named "default" is a ValueError (the
    default renders every prompt without tools; transformers refuses to render one without it too)."""
    templates = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            if file.is_file():
                templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        where, fix = path / CHAT_TEMPLATE_DIR, f"add the default one as {path / CHAT_TEMPLATE_FILE}"
    else:
        where, fix = path / "tokenizer_config.json", "name one of them 'default'"
        template = config.get("chat_template")
        if isinstance(template, list):
            templates = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            templates = {k: v for k, v in templates.items() if isinstance(k, str) and isinstance(v, str)}
        elif isinstance(template, str):
            templates = {"default": template}
        elif template is not None:
            raise ValueError(f"{where}: chat_template must be a string or a list of named templates, got "
                             f"{type(template).__name__}")
    if templates and "default" not in templates:
        raise ValueError(f"{where} holds chat templates {sorted(templates)} but none named 'default'; {fix}")
    return templates


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
        # every named template (transformers' ``tokenizer.chat_template`` dict); the default one
        self.chat_templates: dict[str, str] = _chat_templates(path, self.config)
        self.chat_template: str | None = self.chat_templates.get("default")
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
        passed to the template only when given, and then, as in transformers, the template named "tool_use" renders
        when the model has one (``additional_chat_templates/tool_use.jinja``, or so named in
        ``tokenizer_config.json``), else the default. Other keyword arguments become template variables."""
        template = self.chat_template
        if tools is not None:
            kwargs["tools"] = tools
            template = self.chat_templates.get("tool_use", template)
        if not template:
            raise ValueError(f"{self.path} has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template in "
                             "tokenizer_config.json); set data.use_chat_template=false or add a template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**self._template_tokens, **kwargs})


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer(path)
