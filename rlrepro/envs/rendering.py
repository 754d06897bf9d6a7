"""Turning an episode into the text the model reads, with the tokenizer's own chat template.

A multi-turn transcript must grow token by token: the next request is the previous request's tokens, the
generated tokens (as sampled, ending with the end-of-turn token), and the tokens of the observation. Re-rendering
the whole conversation is not the same text in general: Qwen3's template, for one, rewrites an assistant turn's
``<think>`` block depending on what follows it. :func:`continuation_text` gives the observation's text alone:
what the template puts between the end of an assistant turn and the start of the next assistant turn. It renders
a fixed stand-in conversation (one user turn, one assistant turn holding a sentinel) followed by the
observation messages, and cuts after the first end-of-turn marker that follows the sentinel; so it needs only the
observation, never the real earlier turns.

``apply_chat_template`` is any callable ``(messages, add_generation_prompt=..., tools=..., **kw) -> str`` (the
rlrepro Tokenizer's method, or a Hugging Face tokenizer's with ``tokenize=False``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .api import Message, check_messages

__all__ = ["render_chat", "continuation_text", "SENTINEL"]

SENTINEL = "RLREPRO-ASSISTANT-TURN-SENTINEL"


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

    ``end_of_turn`` is the template's end of an assistant turn (Qwen's ``<|im_end|>``); the caller appends it
    first when the generation stopped without it (cut by the length limit)."""
    obs = check_messages(list(observation), "observation")
    if not obs:
        raise ValueError("continuation_text needs at least one observation message")
    stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]
    text = render_chat(apply_chat_template, stand_in + obs, tools=tools, add_generation_prompt=True,
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
