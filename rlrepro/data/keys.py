"""The config keys that data messages name, for a reader of the data that is not training.

Every message of the data layer (loading, sources, rows, templates, prompts) names training's keys:
``data.prompt_field=...``, ``data.source``, ``data.split``. Held-out evaluation (``eval.*``, ``rlrepro eval RUN
--source FILE``) reads its files through the same code, where the user sets other keys; :func:`relabel_keys`
rewrites a message (raised or logged) with a key map, once, at the caller, so that the fix text is the data layer's
and the key is the caller's. :func:`eval_key_names` is evaluation's map; :func:`relabeled_logs` applies a map to
the data layer's log records while a block runs.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from typing import Collection, Iterator, Mapping

__all__ = ["EVAL_KEYS", "EVAL_FALLBACK_KEYS", "eval_key_names", "relabel_keys", "relabeled_logs"]

# the data.* keys eval.* has a key of its own for (the others, such as data.on_bad_row, apply to eval as they are)
EVAL_KEYS = ("source", "split", "prompt_field", "answer_field", "id_field", "messages_field", "template",
             "system_prompt", "limit")
# those of them whose null eval.* value takes the data.* value (eval.source and eval.limit do not)
EVAL_FALLBACK_KEYS = ("split", "prompt_field", "answer_field", "id_field", "messages_field", "template",
                      "system_prompt")

_KEY = re.compile(r"(?<![\w.])(?P<verb>set |point )?data\.(?P<key>[a-z_]+)\b(?P<rest>=null\b|='[^']*'|=| to| at)?")
_LOGGERS = ("rlrepro.data.loading", "rlrepro.data.sources", "rlrepro.data.prompts")


def eval_key_names(option: bool = False) -> dict[str, str]:
    """Evaluation's map: ``data.<key>`` -> ``eval.<key>`` for :data:`EVAL_KEYS`; ``option``: the source came from
    ``rlrepro eval``'s ``--source`` option, which messages then name."""
    names = {key: f"eval.{key}" for key in EVAL_KEYS}
    if option:
        names["source"] = "--source"
    return names


def relabel_keys(message: str, names: Mapping[str, str], fallback: Collection[str] = EVAL_FALLBACK_KEYS) -> str:
    """``message`` with every ``data.<key>`` of ``names`` named ``names[key]``, the rest of the text as it is.

    A name that is a command-line option (``--source``) takes its value after a space (``--source FILE``, quotes
    dropped), and a fix that sets it (``set data.source to X``, ``set data.source=X``) points or passes it. A
    ``data.<key>=null`` fix of a ``fallback`` key (one whose null takes the ``data.*`` value) names both keys."""

    def sub(m: re.Match) -> str:
        key, verb, rest = m["key"], m["verb"] or "", m["rest"] or ""
        name = names.get(key)
        if name is None:
            return m[0]
        if not name.startswith("-"):
            if rest == "=null" and key in fallback:
                return f"{verb}{name}=null and data.{key}=null"
            return f"{verb}{name}{rest}"
        if rest.startswith("="):  # an option's value: --source FILE
            value = rest[1:]
            return f"{'pass ' if verb == 'set ' else verb}{name} {value[1:-1] if value.startswith(chr(39)) else value}"
        if verb == "set " and rest == " to":
            return f"point {name} at"
        return f"{verb}{name}{rest}"

    return _KEY.sub(sub, message)


class _Relabel(logging.Filter):
    def __init__(self, names: Mapping[str, str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = relabel_keys(record.getMessage(), self.names), None
        return True


@contextmanager
def relabeled_logs(names: Mapping[str, str]) -> Iterator[None]:
    """While the block runs, the data layer's log records name keys as :func:`relabel_keys` does with ``names``."""
    relabel = _Relabel(names)
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for log in loggers:
        log.addFilter(relabel)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(relabel)
