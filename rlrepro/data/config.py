"""The data and reward configuration: the run schema's ``data:`` (:class:`DataConfig`, with
``data.synthetic``: :class:`SyntheticConfig`), ``reward:`` (:class:`RewardConfig`) and ``eval:`` (:class:`EvalConfig`:
the held-out data set evaluated during training, rlrepro.orchestration.evaluation) sections.

Each checks its values in ``__post_init__`` and raises :class:`rlrepro.checks.ConfigError` naming the key.
Whether the files, the fields and the reward function exist is checked when the run starts (before any work),
by the code that reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from rlrepro.checks import Checker, finite_number

from .synthetic import SYNTHETIC_KINDS

__all__ = ["DataConfig", "SyntheticConfig", "RewardConfig", "EvalConfig", "BAD_ROW_POLICIES", "UNKNOWN_TOKEN_POLICIES",
           "REWARD_ERROR_POLICIES"]

BAD_ROW_POLICIES = ("error", "skip")
UNKNOWN_TOKEN_POLICIES = ("warn", "error")
REWARD_ERROR_POLICIES = ("raise", "zero")


@dataclass
class SyntheticConfig:
    """The built-in synthetic task (used when ``data.source`` is null); rlrepro.data.synthetic."""
    SECTION: ClassVar[str] = "data.synthetic"

    task: str = "copy"
    num: int = 512
    seed: int = 0
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = Checker(self)
        c.choice("task", SYNTHETIC_KINDS)
        c.positive_int("num")
        c.int_at_least("seed", 0)
        c.require(isinstance(self.kwargs, dict), "kwargs", "must be a mapping of the task's options (e.g. "
                  "data.synthetic.kwargs.max_len=8) or {}")


@dataclass
class DataConfig:
    SECTION: ClassVar[str] = "data"

    source: Optional[str] = None  # local .jsonl/.parquet (or dir), a hub name with allow_hub, or None for synthetic
    # the data set's revision (a hub data set's git revision; recorded in inputs.json for local files too)
    revision: Optional[str] = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    split: str = "train"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    id_field: Optional[str] = None
    messages_field: Optional[str] = None
    template: Optional[str] = None
    system_prompt: Optional[str] = None
    use_chat_template: bool = True
    on_bad_row: str = "error"  # error | skip
    # prompt tokens that the tokenizer maps to its unknown token: warn (one line naming them) | error
    on_unknown_token: str = "warn"
    allow_hub: bool = False
    limit: Optional[int] = None
    shuffle: bool = True
    max_prompt_tokens: int = 512

    def __post_init__(self) -> None:
        c = Checker(self)
        c.choice("on_bad_row", BAD_ROW_POLICIES)
        c.choice("on_unknown_token", UNKNOWN_TOKEN_POLICIES)
        c.positive_int("max_prompt_tokens")
        c.positive_int("limit", optional=True)
        c.boolean("use_chat_template", "allow_hub", "shuffle")
        _names(c, "split", "prompt_field", "answer_field")
        _names(c, "id_field", "messages_field", optional=True)


@dataclass
class RewardConfig:
    SECTION: ClassVar[str] = "reward"

    fn: str = "exact_match"  # exact_match | prefix_match | math | package.module:function
    on_error: str = "raise"  # raise | zero
    # DAPO's soft overlong punishment (rlrepro.data.overlong_penalty): the last overlong_buffer tokens before
    # rollout.max_tokens cost up to overlong_penalty_factor of reward, linearly; 0 = off
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        c = Checker(self)
        c.choice("on_error", REWARD_ERROR_POLICIES)
        c.int_at_least("overlong_buffer", 0)
        c.non_negative("overlong_penalty_factor")


@dataclass
class EvalConfig:
    """``eval:``: a held-out local file, scored during training (rlrepro.orchestration.evaluation) and after it
    (``rlrepro eval RUN``). The field and template keys left null take the ``data.*`` value of the same name; the
    same loaders, templates, reward function (``reward.fn``, no overlong shaping) and chat template as data."""
    SECTION: ClassVar[str] = "eval"

    source: Optional[str] = None  # a local .jsonl/.parquet file or directory (never the hub)
    every: int = 0  # 0 = off; else after every N-th step and after the last one (train.steps)
    num_samples: int = 4  # k: sampled completions per prompt (eval/avg@k, eval/pass@k)
    temperature: Optional[float] = None  # null: rollout.temperature; 0 = greedy
    max_tokens: Optional[int] = None  # null: rollout.max_tokens
    limit: Optional[int] = None  # the first N rows of the file
    greedy: bool = True  # one extra greedy (temperature 0) completion per prompt: eval/greedy_acc
    pass_threshold: float = 1.0  # a completion passes (pass@k, greedy_acc) when its reward >= this
    split: Optional[str] = None
    prompt_field: Optional[str] = None
    answer_field: Optional[str] = None
    id_field: Optional[str] = None
    messages_field: Optional[str] = None
    template: Optional[str] = None
    system_prompt: Optional[str] = None

    def __post_init__(self) -> None:
        c = Checker(self)
        c.int_at_least("every", 0)
        c.positive_int("num_samples")
        c.positive_int("max_tokens", "limit", optional=True)
        c.boolean("greedy")
        c.require(self.temperature is None or (isinstance(self.temperature, (int, float))
                                               and not isinstance(self.temperature, bool) and self.temperature >= 0),
                  "temperature", "must be >= 0 (0 = greedy) or null (rollout.temperature)")
        # NaN, > 1 or <= 0 would make pass@k and greedy_acc a constant (nothing or everything passes), silently
        c.require(finite_number(self.pass_threshold) and 0 < self.pass_threshold <= 1, "pass_threshold",
                  "must be a number in (0, 1] (rewards are in [0, 1]; 1.0 = only a full score passes)")
        _names(c, "split", "prompt_field", "answer_field", "id_field", "messages_field", optional=True)


def _names(c: Checker, *keys: str, optional: bool = False) -> None:
    """Split and column names: non-empty strings (or null where ``optional``)."""
    for key in keys:
        value = getattr(c.obj, key)
        c.require((optional and value is None) or (isinstance(value, str) and bool(value)), key,
                  "must be a non-empty string" + (" or null" if optional else "")
                  + (f" (a name that looks like a number is quoted: {c.key(key)}='{value}')"
                     if isinstance(value, (int, float)) and not isinstance(value, bool) else ""))
