"""Tools an environment offers the model: :class:`Tool` (a name, a JSON-schema of its arguments, a pure
function), argument checking, and the built-in ``calculator`` and ``python`` tools.

A tool's function must be a pure function of its arguments (no clock, no network, no state between calls),
like a reward. :meth:`Tool.run` never raises for what the model sent: unknown arguments, missing or mistyped
ones, and an exception inside the tool all come back as a :class:`ToolResult` with ``ok=False`` and an
``Error: ...`` text. Results longer than the caller's limit are cut deterministically
(:func:`truncate_text`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .calculator import CalculatorLimits, calculate
from .sandbox import SandboxLimits, run_python

__all__ = ["Tool", "ToolResult", "check_arguments", "calculator_tool", "python_tool", "BUILTIN_TOOLS",
           "make_tools", "truncate_text", "truncation_note"]

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    # JSON has one number type: 2.0 is an integer (JSON Schema), and the tool gets it as int (``_as_declared``)
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the text the model reads, and whether the call itself was well formed (``malformed``:
    unknown tool or bad arguments, which per-turn penalties count) and succeeded (``ok``)."""
    text: str
    ok: bool = True
    malformed: bool = False


@dataclass(frozen=True)
class Tool:
    """A tool: ``fn(**arguments) -> str``. ``parameters`` is a JSON schema of type object (``properties``,
    ``required``); arguments are checked against it (types, required, no extra keys) before ``fn`` runs."""
    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str] = field(compare=False)

    def __post_init__(self) -> None:  # a schema no call can satisfy would make every call "malformed"
        problem = _schema_problem(self.parameters)
        if not isinstance(self.name, str) or not self.name:
            problem = f"its name must be a non-empty string, got {self.name!r}"
        elif not callable(self.fn):
            problem = f"fn must be callable, got {type(self.fn).__name__}"
        elif problem is None:
            problem = _signature_problem(self.fn, self.parameters)
        if problem is not None:
            raise ValueError(f"tool {self.name!r}: {problem}")

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (``tools=[...]``; Qwen3 renders each inside ``<tools>``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": _plain(self.parameters)}}

    def run(self, arguments: Any) -> ToolResult:
        problem = check_arguments(self.parameters, arguments)
        if problem is not None:
            return ToolResult(f"Error: bad arguments for {self.name}: {problem}", ok=False, malformed=True)
        try:
            text = self.fn(**_as_declared(self.parameters, arguments))
        except MemoryError:  # the machine's, not the model's doing: an observation would differ between runs
            raise
        except Exception as e:  # a raising tool is an observation, not a crash
            return ToolResult(_utf8(f"Error: {self.name} raised {type(e).__name__}: {e}"), ok=False)
        if not isinstance(text, str):  # the tool's bug, whatever the model sent: loud, never an observation
            if inspect.iscoroutine(text):
                text.close()
                raise TypeError(f"tool {self.name!r}: fn is async, which is not supported. Fix: make it a plain "
                                f"function returning a str (tools run on the worker's thread pool)")
            raise TypeError(f"tool {self.name!r} returned {type(text).__name__}, not a str. Fix: make its fn "
                            f"return the observation text (e.g. return str(value) or json.dumps(value))")
        return ToolResult(_utf8(text), ok=not text.startswith("Error:"))


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (``chr(0xd800)``, a JSON ``"\\ud800"``) as their escapes: the tokenizer cannot
    encode them, and the observation must not crash the run."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _schema_problem(schema: Any) -> str | None:
    """What makes ``schema`` unusable as a tool's ``parameters`` (None when it is fine)."""
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        return f'parameters must be a JSON schema of type object, got {schema!r}'
    props = schema.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
        return f'parameters["properties"] must map each argument to its schema, got {props!r}'
    for key, spec in props.items():
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if kinds is not None and (not isinstance(kinds, (list, tuple)) or not all(k in _JSON_TYPES for k in kinds)):
            return f"argument {key!r} has type {spec.get('type')!r}; JSON schema types are {sorted(_JSON_TYPES)}"
        if "enum" in spec and not isinstance(spec["enum"], (list, tuple)):
            return f"argument {key!r} has enum {spec['enum']!r}; an enum is a list of the allowed values"
    required = schema.get("required", ())
    if not isinstance(required, (list, tuple)) or any(k not in props for k in required):
        return f'parameters["required"]={required!r} must list names of parameters["properties"] ({sorted(props)})'
    return None


def _signature_problem(fn: Callable[..., Any], schema: Mapping[str, Any]) -> str | None:
    """Why ``fn(**arguments)`` fails for some call that fits ``schema`` (every argument given, or only the
    required ones): a user's bug that would otherwise reach the model as an ``Error:`` observation on every call.
    None when it fits or the signature cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    props = list(schema.get("properties", {}))
    for names in (props, list(schema.get("required", ()))):
        try:
            sig.bind(**dict.fromkeys(names))
        except TypeError as e:
            return (f"fn{sig} cannot be called with the arguments {names} of its parameters schema ({e}). Fix: give "
                    f"fn one keyword parameter per name in parameters['properties'] ({props}), with a default for "
                    f"those not in 'required', or **kwargs")
    return None


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """None when ``arguments`` fit ``schema`` (an object schema: ``properties`` with ``type``/``enum``,
    ``required``, extra keys refused), else what is wrong, for the model to read."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", ()) if k not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    extra = sorted(k for k in arguments if k not in props)
    if extra:
        return f"unknown argument {extra[0]!r} (expected {', '.join(sorted(props)) or 'none'})"
    for key, value in arguments.items():
        spec = props[key]
        kinds = _types(spec)
        if kinds and not any(_JSON_TYPES[k](value) for k in kinds if k in _JSON_TYPES):
            return f"argument {key!r} must be of type {' or '.join(kinds)}, got {type(value).__name__}"
        if "enum" in spec and not any(_same_json(value, e) for e in spec["enum"]):
            return f"argument {key!r} must be one of {list(spec['enum'])}"
    return None


def _types(spec: Mapping[str, Any]) -> list[str]:
    """A parameter's declared JSON types (``"type": "integer"`` or ``["integer", "null"]``) as a list."""
    kinds = spec.get("type")
    return [kinds] if isinstance(kinds, str) else list(kinds or ())


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: ``true`` is not ``1`` (Python's ``True == 1``), ``1.0`` is ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def _as_declared(schema: Mapping[str, Any], arguments: dict) -> dict:
    """``arguments`` (already checked) with each integral float of a parameter typed ``integer`` and not ``number``
    as an int: the model wrote ``2.0``, the tool's ``range(n)`` gets ``2``."""
    out = dict(arguments)
    for key, value in arguments.items():
        kinds = _types(schema.get("properties", {})[key])
        if isinstance(value, float) and "integer" in kinds and "number" not in kinds:
            out[key] = int(value)
    return out


def truncation_note(length: int, max_chars: int) -> str:
    """The note after a result of ``length`` characters cut to ``max_chars``: every tool format shows the same words
    right after the result it cut (never inside it, nor inside an error's text)."""
    return f"[truncated: {length} characters, the first {max_chars} are shown]"


def truncate_text(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters with a note saying how long it was (the same cut every run)."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + "\n" + truncation_note(len(text), max_chars)


def calculator_tool(limits: CalculatorLimits | None = None) -> Tool:
    """``calculator(expression)``: exact arithmetic (:mod:`rlrepro.envs.calculator`)."""
    limits = limits if limits is not None else CalculatorLimits()
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
        parameters={"type": "object", "properties": {"expression": {
            "type": "string", "description": "the expression, e.g. 123*456"}}, "required": ["expression"]},
        fn=lambda expression: calculate(expression, limits))


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """``python(code)``: the deterministic sandbox (:mod:`rlrepro.envs.sandbox`); the result is what the program
    printed (and the value of a last bare expression), then ``Error: ...`` if it failed."""
    limits = limits if limits is not None else SandboxLimits()
    return Tool(
        name="python",
        description="Run a Python program (math and fractions available, no files or network) and return what "
                    "it prints. State does not persist between calls.",
        parameters={"type": "object", "properties": {"code": {
            "type": "string", "description": "the program"}}, "required": ["code"]},
        fn=lambda code: run_python(code, limits).observation())


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"calculator": calculator_tool, "python": python_tool}


def make_tools(names: list[str] | tuple[str, ...], *, calculator: CalculatorLimits | None = None,
               python: SandboxLimits | None = None) -> list[Tool]:
    """The built-in tools by name, in the order given (``env.tools``)."""
    tools = []
    for name in names:
        if name == "calculator":
            tools.append(calculator_tool(calculator))
        elif name == "python":
            tools.append(python_tool(python))
        else:
            raise ValueError(f"unknown tool {name!r} (env.tools); built-in tools: {sorted(BUILTIN_TOOLS)}. Fix: "
                             f"set env.tools to a list of those, or write an env.fn factory with your own Tool")
    if len({t.name for t in tools}) != len(tools):
        raise ValueError(f"env.tools={list(names)} names a tool twice")
    return tools
