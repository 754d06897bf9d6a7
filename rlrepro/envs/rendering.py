"""Turning an episode into the text the model reads, with the tokenizer's own chat template.

A multi-turn transcript must grow token by token: the next request is the previous request's tokens, the
generated tokens (as sampled, ending with the end-of-turn token), and the tokens of the observation. Re-rendering
the whole conversation is not the same text in general: Qwen3's template, for one, rewrites an assistant turn's
``<think>`` block depending on what follows it. :func:`continuation_text` gives the observation's text alone:
what the template puts between the end of an assistant turn and the start of the next assistant turn. It renders
a fixed stand-in conversation (one user turn, one assistant turn holding a sentinel) followed by the
observation messages, and cuts after the first end-of-turn marker that follows the sentinel; so it needs only the
observation, never the real earlier turns.

:func:`end_of_turn_token` finds that end-of-turn marker from the template itself (the same stand-in, and what the
template renders right after the assistant's content), so that a tokenizer whose EOS is not the template's end of
an assistant turn (Qwen3-*-Base: EOS ``<|endoftext|>``, turns closed by ``<|im_end|>``) is told apart before any
work, not at the first observation.

``apply_chat_template`` is any callable ``(messages, add_generation_prompt=..., tools=..., **kw) -> str`` (the
rlrepro Tokenizer's method, or a Hugging Face tokenizer's with ``tokenize=False``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .api import Message, check_messages

__all__ = ["render_chat", "continuation_text", "end_of_turn_token", "SENTINEL"]

SENTINEL = "RLREPRO-ASSISTANT-TURN-SENTINEL"
# the conversation an observation is rendered after: one user turn, one assistant turn holding the sentinel
_STAND_IN: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]


def render_chat(apply_chat_template: Callable[..., Any], messages: Sequence[Message], *,
                tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: bool = True,
                **template_kwargs: Any) -> str:
    """``apply_chat_template(messages, add_generation_prompt=..., tools=...)``; ``tools`` is passed only when
    non-empty (templates that do not know tools are unaffected). Must return text."""
    kwargs = dict(template_kwargs)
    if tools:
        kwargs["tools"] = tools
    text = apply_chat_template(check_messages(list(messages), "messages"), add_generation_prompt=add_generation_prompt,
                               **kwargs)
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template returned {type(text).__name__}, expected text (pass tokenize=False "
                         f"to a Hugging Face tokenizer)")
    return text


def continuation_text(apply_chat_template: Callable[..., Any], observation: Sequence[Message], *,
                      tools: Optional[list[dict[str, Any]]] = None, end_of_turn: str = "<|im_end|>",
                      **template_kwargs: Any) -> str:
    """The text to append after an assistant turn's ``end_of_turn`` token so that the transcript continues with
    ``observation`` and a new assistant turn's header (the generation prompt). For Qwen3 and one tool result::

        "\\n<|im_start|>user\\n<tool_response>\\n408\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"

    ``end_of_turn`` is the template's end of an assistant turn (Qwen's ``<|im_end|>``; :func:`end_of_turn_token`
    finds it); the caller appends it first when the generation stopped without it (cut by the length limit)."""
    obs = check_messages(list(observation), "observation")
    if not obs:
        raise ValueError("continuation_text needs at least one observation message")
    text = render_chat(apply_chat_template, _STAND_IN + obs, tools=tools, add_generation_prompt=True,
                       **template_kwargs)
    at = text.find(SENTINEL)
    if at == -1:
        raise ValueError("the chat template does not render the assistant turn's content; cannot find where an "
                         "observation starts")
    end = text.find(end_of_turn, at + len(SENTINEL))
    if end == -1:
        raise ValueError(f"the chat template does not end an assistant turn with {end_of_turn!r}; pass the "
                         f"template's end-of-turn text as end_of_turn")
    return text[end + len(end_of_turn):]


def end_of_turn_token(tokenizer: Any, **template_kwargs: Any) -> str:
    """The chat template's end-of-turn token: what closes an assistant turn, so what a generated turn stops at
    and what :func:`continuation_text` cuts after. Found from the template: the stand-in conversation of
    :func:`continuation_text` followed by a user turn ``"?"`` (an assistant turn that something follows, as in an
    episode) is rendered, and the text right after the assistant's content decides:

    1. it starts with ``tokenizer.eos_token`` (whitespace before it allowed): the EOS (what rlrepro always used,
       so the runs of tokenizers whose EOS closes a turn, Qwen3 instruct models and the tiny test model, keep
       their bits);
    2. else it starts, directly, with one special token of the tokenizer (a token that encodes to one id and that
       ``decode(..., skip_special_tokens=True)`` drops): that token (Qwen3-*-Base: EOS ``<|endoftext|>``, turns
       closed by ``<|im_end|>``);
    3. else ValueError naming the tokenizer's eos_token, the text the template renders after an assistant turn
       and the fix.

    ``tokenizer``: ``apply_chat_template`` (see the module docstring; ``template_kwargs`` go to it, e.g.
    ``tokenize=False`` for a Hugging Face tokenizer), ``eos_token``, ``encode`` and ``decode``."""
    follow: list[Message] = [{"role": "user", "content": "?"}]
    text = render_chat(tokenizer.apply_chat_template, _STAND_IN + follow, add_generation_prompt=True,
                       **template_kwargs)
    at = text.find(SENTINEL)
    if at == -1:
        raise ValueError("the chat template does not render the assistant turn's content; cannot find its "
                         "end-of-turn token. Fix: use a model whose chat template renders assistant messages, or "
                         "set data.use_chat_template=false")
    after = text[at + len(SENTINEL):]
    eos = getattr(tokenizer, "eos_token", None)
    if eos and after.lstrip().startswith(eos):
        return eos
    ids = tokenizer.encode(after) if after else []
    if ids:
        first = tokenizer.decode([ids[0]], skip_special_tokens=False)
        special = tokenizer.decode([ids[0]], skip_special_tokens=True) == ""
        if first and special and after.startswith(first) and tokenizer.encode(first) == [ids[0]]:
            return first
    raise ValueError(f"cannot tell the chat template's end-of-turn token: the tokenizer's eos_token is {eos!r}, and "
                     f"the template renders {after[:80]!r} after an assistant turn's content, which starts with "
                     "neither the eos_token nor a special token of the tokenizer (one token id). Multi-turn "
                     "episodes stop each turn at that token and continue the transcript after it. Fix: use a chat "
                     "template that closes an assistant turn with a special token (e.g. '<|im_end|>'), or set "
                     "data.use_chat_template=false")
