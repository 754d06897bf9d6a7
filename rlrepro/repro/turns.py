"""Multi-turn samples in the records: the turn structure that fingerprints hash, and the words ``rlrepro diff``
uses for a difference inside an episode (which turn, whose token).

A multi-turn episode is one sample whose ``turns`` (rollout file: ``[{"role", "token_ids", "text"}]``; in memory
:class:`~rlrepro.samples.Turn` objects) concatenated are its completion, and whose ``loss_mask`` is 1 on the tokens
the policy sampled. ``role == "policy"`` marks a sampled turn; any other role (``"tool"``, ``"env"``) is context
from the environment. No torch: ``rlrepro diff`` imports this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["TurnPosition", "turn_spans", "locate_turn", "turn_position", "where_text", "kind_text",
           "num_turns_text", "structure_text", "record_value"]

POLICY = "policy"


@dataclass
class TurnPosition:
    """Where a completion position lies in a multi-turn episode: turn ``index`` (0-based; printed 1-based, as
    ``rlrepro show`` numbers turns) of ``num_turns``, its ``role`` and the ``position`` within the turn."""
    index: int
    role: str
    position: int
    num_turns: int


def _turn_parts(t: Any) -> tuple[str, Any]:
    if isinstance(t, Mapping):
        return t["role"], t["token_ids"]
    return t.role, t.token_ids


def turn_spans(turns: Iterable[Any]) -> list[list[Any]]:
    """The structure of a multi-turn sample: ``[role, start, end]`` per turn, the turn's half-open span of
    completion token positions (the turns' tokens concatenated are the completion). ``turns``: ``Turn`` objects
    or the rollout file's ``{"role", "token_ids", ...}`` dicts. This is what the ``turns`` fingerprint hashes."""
    out, start = [], 0
    for t in turns:
        role, ids = _turn_parts(t)
        end = start + len(ids)
        out.append([role, start, end])
        start = end
    return out


def locate_turn(turns: Iterable[Any] | None, position: int) -> tuple[int, str, int] | None:
    """``(turn index, role, position within the turn)`` of completion position ``position``; None without
    turns or past their end."""
    if turns is None:
        return None
    for k, (role, start, end) in enumerate(turn_spans(turns)):
        if start <= position < end:
            return k, role, position - start
    return None


def record_value(record: Mapping[str, Any], key: str) -> Any:
    """A rollout record's value of ``key``; for ``"turns"`` their structure (:func:`turn_spans`), as
    fingerprinted (the turns' text is not)."""
    if key == "turns":
        return None if record.get("turns") is None else turn_spans(record["turns"])
    return record.get(key)


def turn_position(record: Mapping[str, Any], position: int) -> TurnPosition | None:
    """:func:`locate_turn` of a rollout record, as a :class:`TurnPosition`."""
    where = locate_turn(record.get("turns"), position)
    return None if where is None else TurnPosition(*where, num_turns=len(record["turns"]))


def _turn_text(p: TurnPosition | None) -> str:
    if p is None:
        return "no turn"
    return f"turn {p.index + 1} of {p.num_turns}, {p.role}, position {p.position} in the turn"


def where_text(a: TurnPosition | None, b: TurnPosition | None) -> str:
    """``' (turn 2 of 3, tool, position 4 in the turn)'``, or both runs' when they differ; ``''`` when neither
    sample has turns (single-turn messages stay as they were)."""
    if a is None and b is None:
        return ""
    if a == b:
        return f" ({_turn_text(a)})"
    return f" (A: {_turn_text(a)}; B: {_turn_text(b)})"


def kind_text(what: str, a: TurnPosition | None, b: TurnPosition | None) -> str | None:
    """Whose token differs: sampled by the policy, or context from the environment (then, every token before it
    being the same, the environment answered the same transcript differently). None for single-turn samples."""
    if what not in ("token_ids", "logprobs", "loss_mask") or (a is None and b is None):
        return None
    roles = [None if p is None else p.role for p in (a, b)]
    if roles == [POLICY, POLICY]:
        return {"token_ids": "a policy token (sampled): the policy sampled a different token",
                "logprobs": "a policy token (sampled): the same token with a different sampling logprob",
                "loss_mask": "a policy token (sampled)"}[what]
    if None not in roles and POLICY not in roles:
        role = roles[0] if roles[0] == roles[1] else f"{roles[0]} / {roles[1]}"
        if what == "token_ids":
            return (f"an observation token ({role}, not sampled by the policy): every token before it is the same, "
                    "so the environment answered the same transcript differently: an ENVIRONMENT difference")
        return f"an observation token ({role}, not sampled by the policy)"
    return (f"a {roles[0] or 'missing'} token in A, a {roles[1] or 'missing'} token in B: the turns end at "
            "different tokens (one run's turn ended where the other's went on)")


def num_turns_text(a: int | None, b: int | None) -> str:
    if a == b:
        return f"{a} turns"
    return f"A {'no' if a is None else a} turns, B {'no' if b is None else b} turns"


def _mask_text(n: int | None) -> str:
    return "no loss mask" if n is None else f"a loss mask of {n} tokens"


def _span_text(span: list[Any] | None) -> str:
    if span is None:
        return "no such turn"
    role, start, end = span
    return f"{role}, completion tokens {start}-{end - 1}" if end > start else f"{role}, empty (at {start})"


def structure_text(what: str, position: int | None, a: Any, b: Any, where: str) -> str:
    """The diff line of a loss-mask (``what="loss_mask"``: the bits at ``position``, or, with ``position`` None,
    the lengths of the masks, None where a run has none) or turn-structure difference (``what="turns"``: the
    :func:`turn_spans` entries of turn ``position``)."""
    if what == "loss_mask" and position is None:
        return f"loss mask: A={_mask_text(a)} B={_mask_text(b)}"
    if what == "loss_mask":
        return (f"first differing loss-mask bit at position {position}{where}: A={a} B={b} "
                "(1 = sampled by the policy and trained on)")
    return (f"first differing turn: turn {position + 1}: A={_span_text(a)} B={_span_text(b)} "
            "(the same tokens, split into turns differently)")
