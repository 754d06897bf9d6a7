"""Turn a record into the prompt text and token ids the engine receives.

The tokenizer is duck-typed: ``encode(text) -> list[int]`` always, and
``apply_chat_template(messages, add_generation_prompt=True) -> str`` when ``use_chat_template`` is set
(a Hugging Face tokenizer works too: ``tokenize=False`` is passed when its signature takes it), and with
``tools`` (JSON schemas of the functions a multi-turn episode may call) ``apply_chat_template(messages,
add_generation_prompt=True, tools=tools)``.
"""
from __future__ import annotations

import inspect
import numbers
import string
from collections.abc import Mapping
from typing import Any

from .records import PromptRecord

__all__ = ["render_prompt", "tokenize_prompt", "check_template"]


def check_template(template: str) -> None:
    """Raise ValueError unless ``template`` is a format string whose only field is ``{prompt}`` (at least once),
    written plain: no conversion (``{prompt!r}``) or format spec (``{prompt:>9}``)."""
    if not isinstance(template, str):
        raise ValueError(f"data.template (template) must be a string or null, got {type(template).__name__}")
    try:
        parsed = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
        fields = [name for name, _, _ in parsed]
    except ValueError as e:
        raise ValueError(f"data.template={template!r} is not a valid format string ({e}). "
                         f"Fix: write literal braces doubled in data.template, e.g. \\boxed{{{{}}}}.") from None
    others = sorted({f for f in fields if f != "prompt"})
    if others:
        raise ValueError(f"data.template={template!r} uses the fields {others}; only {{prompt}} is filled in. "
                         f"Fix: write literal braces doubled in data.template ({{{{ and }}}}), e.g. \\boxed{{{{}}}}.")
    styled = next((f"{{prompt{'!' + conv if conv else ''}{':' + spec if spec else ''}}}" for name, spec, conv in parsed
                   if name == "prompt" and (spec or conv)), None)
    if styled is not None:  # {prompt!r} inserts a repr (quotes, escapes), {prompt:>9} pads, {prompt:{prompt}} fails
        raise ValueError(f"data.template={template!r} writes {styled}; only a plain {{prompt}} is filled in, with "
                         f"the record's text as it is (no conversion or format spec). Fix: write {{prompt}} instead.")
    if "prompt" not in fields:
        raise ValueError(f"data.template={template!r} has no {{prompt}} field, so the record's text would be "
                         f"dropped. Fix: put {{prompt}} in data.template where the question goes.")


def _fill(template: str | None, text: str) -> str:
    if template is None:
        return text
    check_template(template)
    return template.format(prompt=text)


def render_prompt(record: PromptRecord, tokenizer: Any = None, *, template: str | None = None,
                  system_prompt: str | None = None, use_chat_template: bool = False,
                  tools: list[dict] | None = None) -> str:
    """The prompt text for ``record``.

    Plain (``use_chat_template=False``): ``template.format(prompt=record.prompt)``, or the prompt itself when
    ``template`` is None. ``system_prompt`` and chat records (``record.messages``) need the chat template and
    raise here; put any fixed plain-text preamble in ``template`` instead.

    Chat (``use_chat_template=True``): messages ``[system?, user]`` (the template fills the user turn) or, for a
    chat record, its turns with the template applied to the last user turn and the system prompt put first
    (a record that has its own system turn plus a ``system_prompt`` raises); then
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.

    ``tools``: the tool schemas the chat template renders (Qwen3's, in its system turn); passed to the template
    only when non-empty, so a render without tools is the same text as before they existed. They need the chat
    template.
    """
    if not isinstance(record, PromptRecord):
        raise TypeError(f"record must be a PromptRecord, got {type(record).__name__}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"data.system_prompt={system_prompt!r} is a {type(system_prompt).__name__}, not text. "
                         f"Fix: set data.system_prompt to a string, or data.system_prompt=null.")
    tools = _check_tools(tools)
    if not use_chat_template:
        if tools:
            raise ValueError("data.use_chat_template=false, but tools need the chat template (it renders their "
                             "schemas). Fix: set data.use_chat_template=true, or pass no tools.")
        if system_prompt is not None:
            raise ValueError("data.system_prompt needs data.use_chat_template=true, and it is false. Fix: "
                             "set data.use_chat_template=true, or set data.system_prompt=null and put the text in "
                             "data.template (e.g. 'You are ...\\n{prompt}').")
        if record.messages is not None:
            raise ValueError(f"record {record.uid!r} holds chat messages, which need data.use_chat_template=true, "
                             f"and it is false. Fix: set data.use_chat_template=true, or load a text column "
                             f"with data.messages_field=null and data.prompt_field=<column>.")
        return _fill(template, record.prompt)  # type: ignore[arg-type]

    if record.messages is None:
        messages = [{"role": "user", "content": _fill(template, record.prompt)}]  # type: ignore[arg-type]
    else:
        messages = [dict(m) for m in record.messages]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if template is not None:
            if not users:
                raise ValueError(f"record {record.uid!r}: data.template fills the last user turn, but the "
                                 f"messages have none. Fix: set data.template=null, or give every chat a user turn.")
            messages[users[-1]]["content"] = _fill(template, messages[users[-1]]["content"])
        if system_prompt is not None and any(m["role"] == "system" for m in messages):
            raise ValueError(f"record {record.uid!r} already has a system turn and data.system_prompt is set. "
                             f"Fix: set data.system_prompt=null, or drop the system turns from the data set.")
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return _apply_chat_template(tokenizer, messages, tools)


def _check_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of tool schemas (dicts) or None, got {type(tools).__name__}")
    bad = [i for i, t in enumerate(tools) if not isinstance(t, Mapping)]
    if bad:
        raise ValueError(f"tools[{bad[0]}] is a {type(tools[bad[0]]).__name__}; each tool must be a JSON schema "
                         f"(a dict such as {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}})")
    return list(tools)


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict] | None = None) -> str:
    fn = getattr(tokenizer, "apply_chat_template", None)
    if fn is None:
        raise ValueError(f"data.use_chat_template=true, but the tokenizer "
                         f"({type(tokenizer).__name__}) has no apply_chat_template. Fix: set "
                         f"data.use_chat_template=false and use data.template.")
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "tokenize" in params:
        kwargs["tokenize"] = False  # Hugging Face tokenizers return token ids unless told otherwise
    if tools:  # only then: a template may test `tools is defined`, and renders without tools stay as they were
        if params and "tools" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ValueError(f"tools were given but the tokenizer's apply_chat_template ({type(tokenizer).__name__}) "
                             f"takes no tools argument. Fix: use a tokenizer whose chat template renders tools.")
        kwargs["tools"] = tools
    text = fn(messages, **kwargs)
    if not isinstance(text, str):
        raise ValueError(f"tokenizer.apply_chat_template returned {type(text).__name__}, expected str. "
                         f"Fix: set data.use_chat_template=false and use data.template, or use another tokenizer.")
    return text


def tokenize_prompt(record: PromptRecord, tokenizer: Any, *, template: str | None = None,
                    system_prompt: str | None = None, use_chat_template: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
    """``tokenizer.encode(render_prompt(...))`` as a list of Python ints (never empty)."""
    text = render_prompt(record, tokenizer, template=template, system_prompt=system_prompt,
                         use_chat_template=use_chat_template, tools=tools)
    ids = tokenizer.encode(text)
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if not ids:
        raise ValueError(f"record {record.uid!r}: the prompt encodes to no tokens (text {text[:80]!r}). "
                         f"Fix: check the row, data.template, or the tokenizer.")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0]
    if bad:
        raise ValueError(f"record {record.uid!r}: tokenizer.encode returned non-token values {bad[:5]!r}. "
                         f"Fix: use a tokenizer whose encode returns token ids.")
    return [int(t) for t in ids]
