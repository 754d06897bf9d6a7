"""The one record that travels from the engine to the trainer: :class:`Sample`.

Plain Python, no torch, nothing else of rlrepro: the driver builds a ``Sample`` from each engine
``RequestOutput`` (plus its key and the decoded text), rewards and advantages fill it in, and the trainer, the
fingerprints, the rollout writer and ``rlrepro show`` all read the same fields. Nothing between the layers is a
dict with renamed keys.

Field names follow what the trainer needs (``prompt_token_ids``, ``completion_token_ids``, ``rollout_logprobs``,
``advantage``); the rollout files keep their historical keys (``token_ids``, ``logprobs``; see
:meth:`Sample.to_record`), so older run directories still diff against new ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Sample", "Turn"]


@dataclass
class Turn:
    """One turn of a multi-turn episode: who produced ``token_ids`` (``"policy"`` is sampled and trained on,
    anything else, e.g. ``"tool"`` or ``"env"``, is context only) and its text."""
    role: str
    token_ids: list[int]
    text: Optional[str] = None


@dataclass
class Sample:
    """One completion of one prompt, keyed by ``(prompt_uid, sample_index)``.

    ``rollout_logprobs[i]`` is the engine's float32 logprob of ``completion_token_ids[i]``. ``loss_mask`` (one 0/1
    per completion token; None = every token is trained) is where a multi-turn episode marks tool or environment
    tokens that the policy did not sample; ``turns`` keeps the episode's structure. ``reward`` and ``advantage``
    are None until the driver computes them.
    """
    prompt_uid: str
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str = "length"
    seed: Optional[int] = None
    weight_version: Optional[int] = None
    prompt_text: Optional[str] = None
    completion_text: Optional[str] = None
    reward: Optional[float] = None
    advantage: Optional[float] = None
    loss_mask: Optional[list[int]] = None
    turns: Optional[list[Turn]] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        """The order every consumer sorts by (never arrival order)."""
        return (self.prompt_uid, self.sample_index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    def to_record(self) -> dict:
        """The JSON object of this sample in ``rollouts/step_NNNNNN.jsonl.gz`` (the historical key names); the
        sampling ``seed`` and the ``weight_version`` that generated it when known (files written before they were
        recorded lack them)."""
        rec = {"prompt_uid": self.prompt_uid, "sample_index": self.sample_index,
               "prompt_token_ids": list(self.prompt_token_ids), "token_ids": list(self.completion_token_ids),
               "logprobs": list(self.rollout_logprobs), "reward": self.reward, "advantage": self.advantage,
               "finish_reason": self.finish_reason}
        if self.seed is not None:
            rec["seed"] = self.seed
        if self.weight_version is not None:
            rec["weight_version"] = self.weight_version
        if self.prompt_text is not None:
            rec["prompt_text"] = self.prompt_text
        if self.completion_text is not None:
            rec["completion_text"] = self.completion_text
        if self.loss_mask is not None:
            rec["loss_mask"] = list(self.loss_mask)
        if self.turns is not None:
            rec["turns"] = [{"role": t.role, "token_ids": list(t.token_ids), "text": t.text} for t in self.turns]
        if self.extra:  # only when set, so records of samples without extras keep their bytes
            rec["extra"] = dict(self.extra)
        return rec

    @classmethod
    def from_record(cls, rec: dict) -> "Sample":
        """Inverse of :meth:`to_record` (also reads rollout files written before the text, seed and version fields
        existed: those are None). The sample holds its own lists: changing ``rec`` afterwards does not change it."""
        turns, loss_mask = rec.get("turns"), rec.get("loss_mask")
        return cls(prompt_uid=rec["prompt_uid"], sample_index=int(rec["sample_index"]),
                   prompt_token_ids=list(rec["prompt_token_ids"]), completion_token_ids=list(rec["token_ids"]),
                   rollout_logprobs=list(rec["logprobs"]), finish_reason=rec.get("finish_reason", "length"),
                   seed=rec.get("seed"), weight_version=rec.get("weight_version"),
                   prompt_text=rec.get("prompt_text"), completion_text=rec.get("completion_text"),
                   reward=rec.get("reward"), advantage=rec.get("advantage"),
                   loss_mask=None if loss_mask is None else list(loss_mask),
                   turns=None if turns is None else [Turn(t["role"], list(t["token_ids"]), t.get("text"))
                                                     for t in turns],
                   extra=dict(rec.get("extra") or {}))
