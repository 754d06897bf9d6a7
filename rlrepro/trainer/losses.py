"""GRPO / PPO policy loss: clipped surrogate with clip-higher, three aggregation modes, optional KL penalty.

Pure functions over padded tensors ``[B, T]`` with a boolean ``mask`` (True at real completion tokens);
:func:`pad_sequences` turns per-sample 1-D tensors into that form. Per token ``t`` of sample ``i``::

    ratio     = exp(logp - old_logp)                                   (old_logp: the rollout's logprobs)
    pg        = max(-A_i * ratio, -A_i * clip(ratio, 1 - clip_low, 1 + clip_high))
    pg        = min(pg, -A_i * dual_clip)  where A_i < 0                 (only with dual_clip > 1)
    kl        = k1 | k2 | k3 (logp, ref_logp)                           (only with ref_logp)
    loss      = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

* Clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, written as a loss
  (negated), with GRPO's per-sample advantage broadcast over the tokens (Shao et al. 2024, "DeepSeekMath", eq. 3).
* Separate ``clip_low`` / ``clip_high`` ("clip-higher"): Yu et al. 2025, "DAPO", §3.1 and eq. 10 (they use
  0.2 / 0.28). Equal values give PPO.
* Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", §3.3
  (their ``c``, e.g. 3): for a negative advantage the surrogate is also bounded by ``-A * c``, so a token whose
  ratio has grown large under a negative advantage cannot dominate the loss (verl's ``clip_ratio_c``).
* Entropy bonus: ``entropy`` is the per-token entropy of the tempered policy distribution (it carries grad);
  ``entropy_coef > 0`` rewards it (Mnih et al. 2016, "Asynchronous Methods for Deep RL", §4; verl's
  ``entropy_coeff``).
* KL estimators of ``KL(pi || pi_ref)`` from samples of pi, with ``log_r = ref_logp - logp``: Schulman 2020,
  "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html)::

      k1 = -log_r                   unbiased, high variance, can be negative
      k2 = log_r ** 2 / 2           biased, low variance
      k3 = exp(log_r) - 1 - log_r   unbiased, low variance, >= 0 (the estimator of DeepSeekMath eq. 4)

  The penalty is added to the loss (DeepSeekMath) rather than folded into the reward (InstructGPT).

Aggregation ``agg`` over the tokens of a batch of ``S`` sequences with ``L_i`` tokens each:

* ``"token-mean"``: ``sum_{i,t} x_it / sum_i L_i`` — every token weighs the same (DAPO §3.3).
* ``"seq-mean-token-mean"``: ``(1/S) sum_i (1/L_i) sum_t x_it`` — the original GRPO objective (DeepSeekMath eq. 3).
* ``"seq-mean-token-sum-norm"``: ``(1/S) sum_i (1/C) sum_t x_it`` with the constant ``C = max_response_length``
  — Dr. GRPO (Liu et al. 2025, §3.1), which removes GRPO's response-length bias.

Gradient accumulation: pass the *whole batch's* ``num_tokens`` (token-mean) or ``num_seqs`` (seq modes) and each
micro-batch returns its share of the whole-batch loss, so the shares sum to the full-batch loss whatever the
micro-batch size (in exact arithmetic; floating-point sums in a different grouping may round differently).
Sequences with no tokens count in ``S`` and contribute 0.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["LOSS_AGG_MODES", "KL_ESTIMATORS", "LossOutput", "pad_sequences", "aggregate", "kl_penalty",
           "clipped_surrogate", "policy_loss", "register_loss_agg", "register_kl_estimator"]

# The registries: name -> implementation. ``train.loss_agg`` / ``train.kl_estimator`` accept exactly these names
# (rlrepro.trainer.TrainConfig checks against them), so a new mode is one decorated function here.
LOSS_AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def register_loss_agg(name: str):
    """Register ``fn(masked, mask, num_tokens, num_seqs, max_response_length) -> scalar`` as ``train.loss_agg=name``
    (``masked``: the per-token values with 0 at padding; ``num_tokens`` / ``num_seqs``: the counts to divide by)."""
    def wrap(fn):
        LOSS_AGG_MODES[name] = fn
        return fn
    return wrap


def register_kl_estimator(name: str):
    """Register ``fn(log_r) -> per-token KL estimate`` (``log_r = ref_logp - logp``) as ``train.kl_estimator``."""
    def wrap(fn):
        KL_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_loss_agg("token-mean")
def _token_mean_agg(masked, mask, num_tokens, num_seqs, max_response_length):
    n = int(mask.sum()) if num_tokens is None else num_tokens
    return masked.sum() / max(n, 1)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(masked, mask, num_tokens, num_seqs, max_response_length):
    s = masked.shape[0] if num_seqs is None else num_seqs
    per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(masked.dtype)
    return per_seq.sum() / max(s, 1)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(masked, mask, num_tokens, num_seqs, max_response_length):
    s = masked.shape[0] if num_seqs is None else num_seqs
    per_seq = masked.sum(dim=-1) / float(max_response_length)
    return per_seq.sum() / max(s, 1)


@register_kl_estimator("k1")
def _k1(log_r):
    return -log_r


@register_kl_estimator("k2")
def _k2(log_r):
    return 0.5 * log_r.square()


@register_kl_estimator("k3")
def _k3(log_r):
    return torch.exp(log_r) - 1.0 - log_r


def pad_sequences(seqs: Sequence[torch.Tensor], pad_value: float = 0.0, width: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D tensors into ``[B, T]`` (``T = width`` or the longest) and a bool mask of the real entries.

    One ``masked_scatter`` of the concatenated inputs (a copy: no arithmetic), so grad flows to the inputs and the
    cost does not grow with the number of rows in kernel launches.
    """
    if not seqs:
        raise ValueError("pad_sequences needs at least one sequence")
    lengths = [int(s.shape[0]) for s in seqs]
    longest = max(lengths)
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width {width} is shorter than the longest sequence ({longest})")
    first = seqs[0]
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    mask = mask.to(first.device, non_blocking=True)
    flat = torch.cat(list(seqs)) if len(seqs) > 1 else first
    return first.new_full((len(seqs), width), pad_value).masked_scatter(mask, flat), mask


def _check_mode(loss_agg: str, max_response_length: int | None) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; choose one of {list(LOSS_AGG_MODES)}")
    if loss_agg == "seq-mean-token-sum-norm" and (max_response_length is None or max_response_length < 1):
        raise ValueError("loss_agg 'seq-mean-token-sum-norm' divides by a constant: set max_response_length to the "
                         f"rollout's max_tokens (a positive int); got {max_response_length!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token-mean", *,
              max_response_length: int | None = None, num_tokens: int | None = None,
              num_seqs: int | None = None) -> torch.Tensor:
    """Reduce per-token ``values [B, T]`` over the real tokens (``mask``) to a scalar; see the module docstring.

    ``num_tokens`` / ``num_seqs`` default to this batch's own counts; pass the whole batch's counts when this is a
    micro-batch of it.
    """
    _check_mode(loss_agg, max_response_length)
    masked = torch.where(mask, values, torch.zeros_like(values))
    return LOSS_AGG_MODES[loss_agg](masked, mask, num_tokens, num_seqs, max_response_length)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)``, ``k1``, ``k2`` or ``k3`` (Schulman 2020); see the module doc."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {list(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](ref_logp - logp)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2,
                      clip_high: float = 0.2, dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` and where the clipped term won;
    with ``dual_clip = c > 1``, tokens with ``A < 0`` are also bounded by ``-A c`` (the module docstring).

    ``advantages``: per sample ``[B]`` (broadcast over tokens) or per token ``[B, T]``.
    Returns ``(pg [B, T], clipped [B, T] bool)``; ``clipped`` is True where a clip bound is strictly the active
    term, i.e. where the token gets no gradient.
    """
    if dual_clip and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be 0 (off) or > 1 (the bound -A * dual_clip for A < 0), got {dual_clip}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg, no_grad = torch.maximum(unclipped, clipped), clipped > unclipped
    if dual_clip:
        bound = -adv * dual_clip
        dual = (adv < 0) & (bound < pg)
        pg, no_grad = torch.where(dual, bound.expand_as(pg), pg), no_grad | dual
    return pg, no_grad


@dataclass
class LossOutput:
    """``loss`` carries grad; the rest are detached float metrics, token means over this call's tokens."""
    loss: torch.Tensor
    pg_loss: float
    kl: float
    clip_frac: float
    entropy: float
    num_tokens: int


def _token_mean(x: torch.Tensor, mask: torch.Tensor, n: int) -> float:
    if n == 0:
        return 0.0
    return float(torch.where(mask, x.detach().float(), 0.0).sum() / n)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, loss_agg: str = "token-mean",
                max_response_length: int | None = None, kl_coef: float = 0.0, ref_logp: torch.Tensor | None = None,
                kl_estimator: str = "k3", entropy: torch.Tensor | None = None, num_tokens: int | None = None,
                num_seqs: int | None = None, dual_clip: float = 0.0, entropy_coef: float = 0.0) -> LossOutput:
    """``agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)`` over padded ``[B, T]`` tensors; see the module
    docstring for the formulas.

    ``ref_logp`` is needed when ``kl_coef != 0``; given with ``kl_coef == 0`` the KL is still reported.
    ``entropy`` (``[B, T]``, optional) is reported, and with ``entropy_coef != 0`` (which needs it, with grad) it
    enters the loss. ``num_tokens`` / ``num_seqs``: whole-batch counts for micro-batch shares (see
    :func:`aggregate`).
    """
    _check_mode(loss_agg, max_response_length)
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the reference policy's logprobs); "
                         "pass ref_logp or set kl_coef=0")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy (per-token entropies with grad); "
                         "pass entropy or set entropy_coef=0")
    agg = dict(loss_agg=loss_agg, max_response_length=max_response_length, num_tokens=num_tokens, num_seqs=num_seqs)
    pg, clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high, dual_clip)
    loss = aggregate(pg, mask, **agg)
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * aggregate(entropy, mask, **agg)
    n = int(mask.sum())
    kl_value = 0.0
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        if kl_coef != 0.0:
            loss = loss + kl_coef * aggregate(kl, mask, **agg)
        kl_value = _token_mean(kl, mask, n)
    return LossOutput(
        loss=loss, pg_loss=_token_mean(pg, mask, n), kl=kl_value, clip_frac=_token_mean(clipped, mask, n),
        entropy=0.0 if entropy is None else _token_mean(entropy, mask, n), num_tokens=n)
