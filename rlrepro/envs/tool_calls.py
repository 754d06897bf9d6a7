"""Tool calls in the model's own words: parse every call out of an assistant turn, and render results as
``role: "tool"`` messages. Two formats (``env.tool_format``):

``qwen3`` (default, real models): Qwen3's chat template lists the tools (``tools=[tool.schema(), ...]`` passed to
``apply_chat_template``) and the model answers ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call; results go back as ``{"role": "tool", "content": ...}`` messages, which the template wraps in
``<tool_response>`` inside a user turn.

``compact`` (the tiny character-level model, whose vocabulary has no ``_ { } "``): ``[calc: 12*34]`` calls the
tool named by the alias (``calc`` -> ``calculator``) with its one required argument, and the result reads
``[= 408]`` (``[error: ...]`` on failure), in the model's own alphabet. A call carries one text argument, so a
tool whose required arguments are not exactly one that takes a string is refused when the environment is made
(:meth:`CompactToolFormat.check_tools`); such tools need ``qwen3``'s JSON arguments.

Parsing never raises: bad JSON, a missing name, arguments that are not an object, an unclosed or stray tag become
a :class:`MalformedCall` whose ``error`` the environment shows the model as the call's result.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from .tools import Tool, ToolResult, _types, truncate_text, truncation_note

__all__ = ["ToolCall", "MalformedCall", "ParsedCall", "ToolCallFormat", "Qwen3ToolFormat", "CompactToolFormat",
           "TOOL_FORMATS", "make_tool_format", "tool_message"]

Message = dict[str, str]
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments (a JSON object); ``text`` is the call as written."""
    name: str
    arguments: dict[str, Any]
    text: str


@dataclass(frozen=True)
class MalformedCall:
    """A call that could not be read; ``error`` says why (shown to the model)."""
    text: str
    error: str


ParsedCall = Union[ToolCall, MalformedCall]


def tool_message(content: str) -> Message:
    """A tool result as a chat message (Qwen3's template renders it as ``<tool_response>``)."""
    return {"role": "tool", "content": content}


class ToolCallFormat:
    """How calls are written and results shown. ``parse`` finds every call in order; ``result_message`` turns a
    :class:`ToolResult` into a message (``observation_message``: cut to ``env.max_observation_chars`` first, with
    the note after the result); ``observation_text`` is what a prompt without a chat template appends;
    ``tool_schemas`` is what the chat template gets as ``tools``; ``check_tools`` refuses tools the format cannot
    call."""
    name = "base"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
        raise NotImplementedError

    def check_tools(self, tools: Sequence[Tool]) -> None:
        """Raise ValueError naming a tool no call in this format could call correctly (none by default)."""

    def result_message(self, result: ToolResult) -> Message:
        return tool_message(result.text)

    def observation_message(self, result: ToolResult, max_chars: int) -> Message:
        """The message of ``result`` with its text cut to ``max_chars`` characters and the truncation note after
        it (``truncate_text``: ``"<first max_chars>\\n[truncated: N characters, the first M are shown]"``)."""
        cut = truncate_text(result.text, max_chars)
        return self.result_message(ToolResult(cut, ok=result.ok, malformed=result.malformed))

    def observation_text(self, messages: Sequence[Message]) -> str:
        raise NotImplementedError

    def tool_schemas(self, tools: Sequence[Tool]) -> list[dict[str, Any]]:
        return [t.schema() for t in tools]

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """How the model writes a call of ``name`` with ``arguments`` (what :meth:`parse` reads back), for
        demonstrations (``warm_start.target=demonstration``)."""
        raise NotImplementedError


def _json_depth_ok(text: str, limit: int) -> bool:
    """Bracket nesting outside strings is at most ``limit`` (json recurses in C; a deep body would be judged by
    the caller's stack depth)."""
    depth, in_str, escape = 0, False, False
    for ch in text:
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


class _BadJSON(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _BadJSON(f"duplicate key {k!r}")
        out[k] = v
    return out


def _constant(name: str) -> Any:
    raise _BadJSON(f"{name} is not valid JSON")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > 400:
        raise _BadJSON("an integer of more than 400 digits")
    return int(text)


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: an infinity spelled as a number, as invalid as Infinity
        raise _BadJSON(f"the number {text[:40]} is out of range (not a finite float)")
    return value


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_integer,
                      parse_float=_number)


@dataclass(frozen=True)
class Qwen3ToolFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen3, Hermes style). ``arguments`` may
    also be a string holding a JSON object (as the OpenAI wire format sends it); a missing ``arguments`` is
    ``{}``. ``max_call_chars`` bounds one call's JSON, ``max_json_depth`` its nesting."""
    max_call_chars: int = 65536
    max_json_depth: int = 32
    name = "qwen3"

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i, j = text.find(_OPEN, pos), text.find(_CLOSE, pos)
            if j != -1 and (i == -1 or j < i):
                calls.append(MalformedCall(_CLOSE, f"{_CLOSE} without an opening {_OPEN}"))
                pos = j + len(_CLOSE)
                continue
            if i == -1:
                return calls
            k, nxt = text.find(_CLOSE, i + len(_OPEN)), text.find(_OPEN, i + len(_OPEN))
            if k == -1 or (nxt != -1 and nxt < k):
                end = len(text) if nxt == -1 else nxt
                calls.append(MalformedCall(text[i:end], f"{_OPEN} is not closed by {_CLOSE}"))
                pos = end
                continue
            calls.append(self._call(text[i + len(_OPEN):k], text[i:k + len(_CLOSE)]))
            pos = k + len(_CLOSE)

    def _call(self, body: str, raw: str) -> ParsedCall:
        body = body.strip()
        if len(body) > self.max_call_chars:
            return MalformedCall(raw, f"the call has {len(body)} characters, more than {self.max_call_chars}")
        if not _json_depth_ok(body, self.max_json_depth):
            return MalformedCall(raw, f"the call's JSON nests more than {self.max_json_depth} levels")
        try:
            obj = _loads(body)
        except _BadJSON as e:
            return MalformedCall(raw, f"invalid JSON in the tool call: {e}")
        except ValueError as e:  # json.JSONDecodeError
            return MalformedCall(raw, f"invalid JSON in the tool call: {e}")
        if not isinstance(obj, dict):
            return MalformedCall(raw, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
        extra = sorted(set(obj) - {"name", "arguments"})
        if extra:
            return MalformedCall(raw, f'unexpected key {extra[0]!r}: a call has "name" and "arguments"')
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return MalformedCall(raw, 'the tool call has no "name" string')
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = _loads(args) if _json_depth_ok(args, self.max_json_depth) else None
            except ValueError:
                args = None
        if not isinstance(args, dict):
            return MalformedCall(raw, f'"arguments" of {name!r} must be a JSON object')
        return ToolCall(name, args, raw)

    def observation_text(self, messages: Sequence[Message]) -> str:
        return "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in messages)


_COMPACT_OPEN = re.compile(r"\[([a-z][a-z0-9]*)(:?)")


@dataclass(frozen=True)
class CompactToolFormat(ToolCallFormat):
    """``[alias: argument]`` -> ``[= result]`` / ``[error: why]``, for small vocabularies.

    ``aliases`` maps the written name to the tool (``calc`` -> ``calculator``; a tool's own name works too);
    the argument goes to the tool's first required parameter. ``charset``: the characters results may use
    (others become ``?``, letters are lowercased, ``]`` becomes ``)``, newlines spaces), so the observation
    stays inside the tokenizer's vocabulary. A known name not followed by ``:`` (``[calc 1+2]``) and an
    unclosed call are malformed. A call carries one text argument: :meth:`check_tools` refuses a tool without
    exactly one required argument that takes a string. A result over ``max_chars`` is cut inside its brackets
    and the note follows them: ``[= 1234][truncated: 9 characters, the first 4 are shown]``."""
    aliases: Mapping[str, str] = field(default_factory=lambda: {"calc": "calculator", "py": "python"})
    charset: str | None = None
    name = "compact"

    def _tool_name(self, written: str) -> str:
        return self.aliases.get(written, written)

    def _alias(self, name: str) -> str:
        return next((a for a, tool in self.aliases.items() if tool == name), name)

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        alias = self._alias(name)
        if len(arguments) != 1:
            raise ValueError(f"env.tool_format=compact writes one argument per call ([{alias}: text]); the call of "
                             f"{name!r} has the arguments {sorted(arguments)}. Fix: env.tool_format=qwen3 (JSON "
                             f"arguments), or a tool with one required string argument")
        return f"[{alias}: {next(iter(arguments.values()))}]"

    def check_tools(self, tools: Sequence[Tool]) -> None:
        """ValueError naming the first tool that a call ``[alias: text]`` cannot call: its one text argument goes
        to the tool's one required argument, so a tool with two or more required arguments (or none), or whose
        required argument does not take a string, would answer every call with "bad arguments"."""
        for tool in tools:
            props = tool.parameters.get("properties", {})
            required = list(tool.parameters.get("required", ()))
            typed = [f"{k}: {'|'.join(_types(props[k])) or 'any'}" for k in required]
            how = (f"env.tool_format=compact passes one text argument per call ([{self._alias(tool.name)}: text] "
                   f"-> the tool's one required argument), so the model could never call it correctly")
            fix = ("Fix: env.tool_format=qwen3 (JSON arguments, any number of them), or give the tool exactly one "
                   "required argument of type string (parse the parts in its fn), the others optional")
            if len(required) != 1:
                raise ValueError(f"tool {tool.name!r} has {len(required)} required arguments {required} "
                                 f"({', '.join(typed) or 'none'}); {how}. {fix}")
            kinds = _types(props[required[0]])
            if kinds and "string" not in kinds:
                raise ValueError(f"tool {tool.name!r} has the required argument {typed[0]}, which a text argument "
                                 f"never fits; {how}. {fix}")

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            m = _COMPACT_OPEN.search(text, pos)
            if m is None:
                return calls
            name = self._tool_name(m.group(1))
            known = name in tools or m.group(1) in self.aliases
            if not m.group(2):
                if known:
                    calls.append(MalformedCall(m.group(0), f"missing ':' after [{m.group(1)}"))
                pos = m.end()
                continue
            end, nxt = self._close(text, m.end(), tools)
            if end == -1:
                stop = len(text) if nxt is None else nxt
                calls.append(MalformedCall(text[m.start():stop], f"[{m.group(1)}: is not closed"))
                pos = stop
                continue
            tool = tools.get(name)
            required = list(tool.parameters.get("required", ())) if tool is not None else []
            key = required[0] if required else "input"
            calls.append(ToolCall(name, {key: text[m.end():end].strip()}, text[m.start():end + 1]))
            pos = end + 1

    def _close(self, text: str, start: int, tools: Mapping[str, Tool]) -> tuple[int, int | None]:
        """Where the call whose argument starts at ``start`` closes: the ``]`` that balances the brackets inside
        the argument (``[py: print([1, 2])]`` passes ``[1, 2]`` whole), or -1 with where the next call opens when
        one (a known name and ``:``) comes first or nothing closes it (None: nothing opens either)."""
        depth = 0
        for i in range(start, len(text)):
            if text[i] == "[":
                m = _COMPACT_OPEN.match(text, i)
                if m is not None and m.group(2) and (self._tool_name(m.group(1)) in tools
                                                     or m.group(1) in self.aliases):
                    return -1, i
                depth += 1
            elif text[i] == "]":
                if depth == 0:
                    return i, None
                depth -= 1
        return -1, None

    def _clean(self, text: str) -> str:
        text = text.replace("\n", " ").replace("]", ")")
        if self.charset is None:
            return text
        text = text.lower()
        return "".join(ch if ch in self.charset else "?" for ch in text)

    def _shown(self, result: ToolResult) -> tuple[str, str]:
        """(the opening of the result's brackets, the text inside them)."""
        if result.ok:
            return "[= ", result.text
        return "[error: ", result.text[len("Error:"):].strip() if result.text.startswith("Error:") else result.text

    def result_message(self, result: ToolResult) -> Message:
        opening, text = self._shown(result)
        return tool_message(f"{opening}{self._clean(text)}]")

    def observation_message(self, result: ToolResult, max_chars: int) -> Message:
        """The text inside the brackets cut to ``max_chars``, the note right after the closing ``]`` (where the
        JSON format puts it: after the result, never inside an error's text), in the tool's alphabet."""
        opening, text = self._shown(result)
        if len(text) <= max_chars:
            return tool_message(f"{opening}{self._clean(text)}]")
        note = truncation_note(len(text), max_chars)
        return tool_message(f"{opening}{self._clean(text[:max_chars])}]{self._clean_note(note)}")

    def _clean_note(self, note: str) -> str:
        return note if self.charset is None else "".join(ch if ch in self.charset else "?" for ch in note.lower())

    def observation_text(self, messages: Sequence[Message]) -> str:
        return "".join(m["content"] for m in messages)

    def tool_schemas(self, tools: Sequence[Tool]) -> list[dict[str, Any]]:
        return []  # the call syntax is learned, not described by the template


TOOL_FORMATS = ("qwen3", "compact")


def make_tool_format(name: str, *, charset: str | None = None,
                     aliases: Mapping[str, str] | None = None) -> ToolCallFormat:
    """The format ``env.tool_format`` names (``qwen3`` | ``compact``)."""
    if name == "qwen3":
        return Qwen3ToolFormat()
    if name == "compact":
        return CompactToolFormat(charset=charset) if aliases is None else \
            CompactToolFormat(aliases=dict(aliases), charset=charset)
    raise ValueError(f"unknown tool format {name!r} (env.tool_format); choose one of {list(TOOL_FORMATS)}")
