"""Advantages from outcome rewards: group-relative (GRPO, Dr. GRPO, RLOO) and batch-normalised (REINFORCE++).

Rewards come as ``[num_prompts, group_size]``: row ``i`` holds the rewards of the ``group_size`` samples of
prompt ``i``; the whole tensor is the step's batch. Every sample gets one advantage (broadcast over its tokens by
the loss):

* GRPO (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome supervision): ``A = (r - mean(r)) / (std(r) + eps)``
  over the group.
* Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1): ``A = r - mean(r)``; dividing by the
  std is dropped because it weights too-easy and too-hard prompts up ("question-level difficulty bias").
* RLOO (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024, "Back to
  Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs", the RLOO estimator): the
  baseline of sample ``i`` is the mean reward of the *other* samples of its group,
  ``A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j`` (= ``G / (G - 1) * (r_i - mean(r))``); needs ``G >= 2``.
* REINFORCE++ (Hu et al. 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward
  Models", arXiv:2501.03262, "global advantage normalization"): no group baseline; the rewards are normalised
  over the whole batch, ``A = (r - mean_B(r)) / (std_B(r) + eps)``.
* REINFORCE++-baseline (the same paper's variant for groups of samples; verl's ``reinforce_plus_plus_baseline``):
  the group mean is subtracted first, then the batch normalisation, ``A' = r - mean_group(r)``,
  ``A = (A' - mean_B(A')) / (std_B(A') + eps)``.

The std (``std=``, the key ``train.advantage_std``) is the *population* std (divide by the count) by default:
it is defined for a group of one (advantage 0) and is what the GRPO formula's "std" reads as. TRL's and verl's
GRPO use the *sample* std (divide by the count - 1): ``std="sample"`` matches them. The key applies to every
estimator that divides by a std (GRPO's group std, REINFORCE++'s batch std); it is refused for those that divide
by none (Dr. GRPO, RLOO). A group whose rewards are all equal gets advantage exactly 0 under GRPO, Dr. GRPO and
RLOO (its centred rewards are set to 0: the float32 mean of rewards such as 0.1 is not exact, and ``r - mean`` of
~7e-9 over a std of ~0 + eps gave GRPO -0.0075); under REINFORCE++-baseline it gets ``-mean_B(A') / (std_B(A') +
eps)``, 0 up to the rounding of the batch mean (0 in exact arithmetic); a batch whose rewards are all equal gets
exactly 0 under REINFORCE++.

Differences from verl, whose REINFORCE++ modes whiten per *token* (``masked_whiten``: every sample weighted by its
length, the sample variance, ``rsqrt(var + 1e-8)``): here the batch statistics are over *samples* (one reward per
sample, as the paper's outcome-reward formula), with the std chosen by ``train.advantage_std`` and ``+ eps`` outside
the root as GRPO's. REINFORCE++'s per-token KL penalty in the reward is not folded in: the KL term is the loss's
(``train.kl_coef``, ``train.kl_estimator``).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["ADVANTAGE_MODES", "ADVANTAGE_STDS", "group_advantages", "compute_advantages", "register_advantage",
           "uses_std", "min_group_size", "zeroes_equal_groups"]

# The registry (as verl's register_adv_est): name -> fn(rewards [num_prompts, group_size], eps) -> advantages of
# the same shape; an estimator registered with uses_std=True also takes std= (one of ADVANTAGE_STDS).
# ``train.advantage`` accepts exactly these names, so a new estimator is one decorated function.
ADVANTAGE_MODES: dict[str, Callable[..., torch.Tensor]] = {}
ADVANTAGE_STDS = ("population", "sample")
_USES_STD: set[str] = set()
_MIN_GROUP_SIZE: dict[str, int] = {}
_NONZERO_EQUAL_GROUPS: set[str] = set()


def register_advantage(name: str, *, uses_std: bool = False, min_group: int = 1, group_baseline: bool = True):
    """Register ``fn(rewards, eps)`` (``fn(rewards, eps, std=...)`` with ``uses_std``) as ``train.advantage=name``;
    ``min_group``: the smallest ``group_size`` it is defined for; ``group_baseline`` False: a group whose rewards are
    all equal may get a nonzero advantage (so ``rollout.dynamic_sampling``, which drops such groups, is refused)."""
    def wrap(fn):
        ADVANTAGE_MODES[name] = fn
        if uses_std:
            _USES_STD.add(name)
        else:
            _USES_STD.discard(name)
        _MIN_GROUP_SIZE[name] = min_group
        if group_baseline:
            _NONZERO_EQUAL_GROUPS.discard(name)
        else:
            _NONZERO_EQUAL_GROUPS.add(name)
        return fn
    return wrap


def zeroes_equal_groups(mode: str) -> bool:
    """Whether ``train.advantage=mode`` gives a group whose rewards are all equal advantage 0 (a group baseline;
    under ``reinforce_pp_baseline`` up to the rounding of the batch mean): what ``rollout.dynamic_sampling`` needs."""
    return mode not in _NONZERO_EQUAL_GROUPS


def uses_std(mode: str) -> bool:
    """Whether ``train.advantage=mode`` divides by a std (so that ``train.advantage_std`` means something)."""
    return mode in _USES_STD


def min_group_size(mode: str, std: str = "population") -> int:
    """The smallest ``rollout.group_size`` ``mode`` is defined for (with ``std``); for a check before the run."""
    group_std = std == "sample" and mode == "grpo"  # the sample std of a group of one divides by 0
    return max(_MIN_GROUP_SIZE.get(mode, 1), 2 if group_std else 1)


def _check_rewards(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, group_size]; got shape {tuple(rewards.shape)} "
                         "(reshape with rewards.view(num_prompts, group_size))")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating tensor, got {rewards.dtype}; use rewards.float()")
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():  # one NaN / inf made its group's (REINFORCE++: the whole batch's) advantages NaN, silently
        i, j = (int(v) for v in bad[0])
        raise ValueError(f"rewards[{i}, {j}] (prompt {i}, sample {j}) is {float(rewards[i, j])}; rewards must be "
                         "finite: fix the reward function (or map such outcomes to a number, e.g. 0.0)")


def _check_eps(eps) -> None:
    """``eps`` must be a finite number >= 0: a negative one flipped the sign of every advantage of a group whose
    std is below ``|eps|``, NaN / inf made them NaN / 0, all silently."""
    try:
        ok = not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"eps={eps!r} must be a finite number >= 0 (added to the std before dividing, as verl's "
                         f"epsilon); leave the default eps={1e-6!r}, or 0 for no smoothing")


def _equal_rows(rewards: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]`` bool: the rows whose rewards are all equal."""
    return (rewards == rewards[:, :1]).all(dim=1, keepdim=True)


def _zero_equal_groups(centered: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``centered`` with the rows whose rewards are all equal set to exactly 0: in float32 the mean of rewards
    such as 0.1 is not exactly 0.1, and ``r - mean`` (~7e-9), divided by a std of ~0 + eps, gave a whole group of
    equal rewards an advantage of about -0.0075 (GRPO). Other rows keep their bits."""
    return torch.where(_equal_rows(rewards), torch.zeros((), dtype=centered.dtype, device=centered.device),
                       centered)


def _divide(centered: torch.Tensor, std: torch.Tensor, eps: float, equal: torch.Tensor) -> torch.Tensor:
    """``centered / (std + eps)``, where the rows ``equal`` (centred to exactly 0) divide by 1: with ``eps=0``
    their ``0 / 0`` was NaN. The same bits as ``centered / (std + eps)`` wherever that was defined."""
    return centered / torch.where(equal, torch.ones((), dtype=std.dtype, device=std.device), std + eps)


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6,
                     unbiased: bool = False) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` per row (GRPO), or ``r - mean`` with ``normalize_std=False`` (Dr. GRPO).

    ``rewards``: ``[num_prompts, group_size]`` floating tensor. Returns the same shape and dtype.
    """
    _check_rewards(rewards)
    _check_eps(eps)
    if unbiased and rewards.shape[1] < 2:
        raise ValueError("unbiased std needs group_size >= 2; use unbiased=False or larger groups")
    centered = _zero_equal_groups(rewards - rewards.mean(dim=1, keepdim=True), rewards)
    if not normalize_std:
        return centered
    return _divide(centered, rewards.std(dim=1, keepdim=True, unbiased=unbiased), eps, _equal_rows(rewards))


def compute_advantages(rewards: torch.Tensor, mode: str = "grpo", eps: float = 1e-6,
                       std: str = "population") -> torch.Tensor:
    """The advantages of ``rewards [num_prompts, group_size]`` under ``mode`` (one of :data:`ADVANTAGE_MODES`);
    ``std``: ``"population"`` or ``"sample"`` for the estimators that divide by a std (the module docstring)."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {list(ADVANTAGE_MODES)}")
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"unknown advantage std {std!r}; choose one of {list(ADVANTAGE_STDS)}")
    _check_eps(eps)
    if uses_std(mode):
        return ADVANTAGE_MODES[mode](rewards, eps, std=std)
    if std != "population":
        raise ValueError(f"advantage mode {mode!r} divides by no std, so std={std!r} would change nothing; "
                         "leave std='population'")
    return ADVANTAGE_MODES[mode](rewards, eps)


def _batch_normalize(x: torch.Tensor, eps: float, std: str) -> torch.Tensor:
    """``(x - mean(x)) / (std(x) + eps)`` over every element of ``x`` (the whole batch)."""
    if std == "sample" and x.numel() < 2:
        raise ValueError("the sample std of the batch needs at least 2 samples; use std='population'")
    flat = x.reshape(1, -1)
    centered = _zero_equal_groups(flat - x.mean(), flat)
    return _divide(centered, x.std(unbiased=std == "sample"), eps, _equal_rows(flat)).reshape(x.shape)


@register_advantage("grpo", uses_std=True)
def _grpo(rewards: torch.Tensor, eps: float, std: str = "population") -> torch.Tensor:
    """GRPO (DeepSeekMath §4.1.2): ``(r - mean_group) / (std_group + eps)``."""
    if std == "sample" and rewards.dim() == 2 and rewards.shape[1] < 2:
        raise ValueError(f"advantage 'grpo' with std='sample' (train.advantage_std=sample) needs group_size >= 2, "
                         f"got group_size {rewards.shape[1]}: the sample std of one reward divides by 0; use "
                         "std='population' (a group of one then gets advantage 0) or larger groups")
    return group_advantages(rewards, normalize_std=True, eps=eps, unbiased=std == "sample")


@register_advantage("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025 §3.1): ``r - mean_group``."""
    return group_advantages(rewards, normalize_std=False, eps=eps)


@register_advantage("rloo", min_group=2)
def _rloo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``r_i - (sum_j r_j - r_i) / (G - 1)``."""
    _check_rewards(rewards)
    g = rewards.shape[1]
    if g < 2:
        raise ValueError("advantage 'rloo' needs group_size >= 2: a sample's baseline is the mean reward of the "
                         "other samples of its group")
    return _zero_equal_groups(rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1), rewards)


@register_advantage("reinforce_pp", uses_std=True, group_baseline=False)
def _reinforce_pp(rewards: torch.Tensor, eps: float, std: str = "population") -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025): ``(r - mean_batch) / (std_batch + eps)``, no group baseline."""
    _check_rewards(rewards)
    return _batch_normalize(rewards, eps, std)


@register_advantage("reinforce_pp_baseline", uses_std=True)
def _reinforce_pp_baseline(rewards: torch.Tensor, eps: float, std: str = "population") -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025; verl's reinforce_plus_plus_baseline): ``A' = r - mean_group``, then
    ``(A' - mean_batch(A')) / (std_batch(A') + eps)``."""
    _check_rewards(rewards)
    return _batch_normalize(_zero_equal_groups(rewards - rewards.mean(dim=1, keepdim=True), rewards), eps, std)
