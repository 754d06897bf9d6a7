"""rlrepro.data: data sets, prompt templates, seeded epoch order, rewards.

Plain Python on ``datasets``, NumPy and math-verify; no ray, no torch, nothing from the layers above.
See docs/DATA.md.

    records, stats = load_records("data/gsm8k.jsonl", answer_field="answer", on_bad_row="skip")
    order = EpochOrder(len(records), seed=run_seed)          # order.state_dict() goes into checkpoints
    batch = [records[i] for i in order.next_batch(64)]
    ids = [tokenize_prompt(r, tok, template="{prompt}\\nPut the final answer in \\\\boxed{{}}.") for r in batch]
    prompts, prompt_stats = build_prompts(records, tok, max_prompt_tokens=512, on_unknown_token="warn")
    rewards, num_errors = compute_rewards(load_reward_fn("math"), completions, batch, policy="raise")
"""
from .keys import EVAL_KEYS, eval_key_names, relabel_keys, relabeled_logs
from .loading import DATA_FILE_FORMATS, LoadStats, SkippedRow, load_records
from .order import EpochOrder
from .prompts import ON_UNKNOWN_TOKEN, Prompt, PromptStats, build_prompts
from .records import PromptRecord, records_digest, write_jsonl
from .rewards import (
    BUILTIN_REWARDS,
    MathReward,
    RewardError,
    RewardFn,
    compute_rewards,
    exact_match_reward,
    extract_last_boxed,
    load_reward_fn,
    math_reward,
    overlong_penalty,
    prefix_match_reward,
    reward_with_policy,
)
from .synthetic import SYNTHETIC_CHARSET, SYNTHETIC_KINDS, make_synthetic_records
from .templates import check_template, render_prompt, tokenize_prompt

__all__ = [
    "PromptRecord", "records_digest", "write_jsonl",
    "load_records", "LoadStats", "SkippedRow", "DATA_FILE_FORMATS",
    "render_prompt", "tokenize_prompt", "check_template",
    "Prompt", "PromptStats", "build_prompts", "ON_UNKNOWN_TOKEN",
    "EpochOrder",
    "EVAL_KEYS", "eval_key_names", "relabel_keys", "relabeled_logs",
    "make_synthetic_records", "SYNTHETIC_KINDS", "SYNTHETIC_CHARSET",
    "RewardFn", "RewardError", "exact_match_reward", "prefix_match_reward", "math_reward", "MathReward",
    "extract_last_boxed", "load_reward_fn", "compute_rewards", "BUILTIN_REWARDS", "overlong_penalty",
]
