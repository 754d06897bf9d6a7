"""Group-relative advantages (GRPO and Dr. GRPO).

Rewards come as ``[num_prompts, group_size]``: row ``i`` holds the rewards of the ``group_size`` samples of
prompt ``i``. Every sample of a group gets its reward relative to the group:

* GRPO (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome supervision): ``A = (r - mean(r)) / (std(r) + eps)``.
* Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1): ``A = r - mean(r)``; dividing by the
  std is dropped because it weights too-easy and too-hard prompts up ("question-level difficulty bias").

The std is the *population* std (``unbiased=False``, divide by ``group_size``) by default: it is defined for a
group of one (advantage 0) and is what the GRPO formula's "std" reads as. TRL's and verl's GRPO use the sample
std (divide by ``group_size - 1``); pass ``unbiased=True`` to match them. A group whose rewards are all equal gets
advantage 0 either way (``0 / (0 + eps)``).
"""
from __future__ import annotations

import torch

from collections.abc import Callable

__all__ = ["ADVANTAGE_MODES", "group_advantages", "compute_advantages", "register_advantage"]

# The registry (as verl's register_adv_est): name -> fn(rewards [num_prompts, group_size], eps) -> advantages of
# the same shape. ``train.advantage`` accepts exactly these names, so a new estimator is one decorated function.
ADVANTAGE_MODES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {}


def register_advantage(name: str):
    def wrap(fn):
        ADVANTAGE_MODES[name] = fn
        return fn
    return wrap


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6,
                     unbiased: bool = False) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` per row (GRPO), or ``r - mean`` with ``normalize_std=False`` (Dr. GRPO).

    ``rewards``: ``[num_prompts, group_size]`` floating tensor. Returns the same shape and dtype.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, group_size]; got shape {tuple(rewards.shape)} "
                         "(reshape with rewards.view(num_prompts, group_size))")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating tensor, got {rewards.dtype}; use rewards.float()")
    if unbiased and rewards.shape[1] < 2:
        raise ValueError("unbiased std needs group_size >= 2; use unbiased=False or larger groups")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=unbiased) + eps)


def compute_advantages(rewards: torch.Tensor, mode: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """``mode`` ``"grpo"`` (std-normalised) or ``"dr_grpo"`` (mean-centred only); see :func:`group_advantages`."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {list(ADVANTAGE_MODES)}")
    return ADVANTAGE_MODES[mode](rewards, eps)


@register_advantage("grpo")
def _grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    return group_advantages(rewards, normalize_std=True, eps=eps)


@register_advantage("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    return group_advantages(rewards, normalize_std=False, eps=eps)
