"""The data and reward configuration: the run schema's ``data:`` (:class:`DataConfig`, with
``data.synthetic``: :class:`SyntheticConfig`) and ``reward:`` (:class:`RewardConfig`) sections.

Each checks its values in ``__post_init__`` and raises :class:`rlrepro.checks.ConfigError` naming the key.
Whether the files, the fields and the reward function exist is checked when the run starts (before any work),
by the code that reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from rlrepro.checks import Checker

from .synthetic import SYNTHETIC_KINDS

__all__ = ["DataConfig", "SyntheticConfig", "RewardConfig", "BAD_ROW_POLICIES", "UNKNOWN_TOKEN_POLICIES",
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
        c.integer("seed")


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
