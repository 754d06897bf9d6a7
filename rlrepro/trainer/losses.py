"""GRPO / PPO policy losses: the clipped surrogate (PPO, clip-higher, dual clip), GSPO's sequence-level ratio and
CISPO's clipped IS weight; four aggregation modes; optional KL and entropy terms.

Pure functions over padded tensors ``[B, T]`` with a boolean ``mask`` (True at real completion tokens);
:func:`pad_sequences` turns per-sample 1-D tensors into that form. Per token ``t`` of sample ``i``, with
``train.policy_loss`` choosing ``pg`` (:data:`POLICY_LOSSES`)::

    ratio     = exp(logp - old_logp)                                   (old_logp: the rollout's logprobs)
    ppo_clip: pg = max(-A_i * ratio, -A_i * clip(ratio, 1 - clip_low, 1 + clip_high))
              pg = min(pg, -A_i * dual_clip)  where A_i < 0             (only with dual_clip > 1)
    gspo:     s_i = exp((1/L_i) sum_t (logp - old_logp))                (one ratio per sequence)
              pg = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_low, 1 + clip_high))   (every token of sequence i)
    cispo:    pg = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A_i * logp      (sg: stop-gradient)
    kl        = k1 | k2 | k3 (logp, ref_logp)                           (only with ref_logp)
    loss      = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

* Clipped surrogate (``ppo_clip``, the default): Schulman et al. 2017, "Proximal Policy Optimization
  Algorithms", eq. 7, written as a loss (negated), with GRPO's per-sample advantage broadcast over the tokens
  (Shao et al. 2024, "DeepSeekMath", eq. 3).
* Separate ``clip_low`` / ``clip_high`` ("clip-higher"): Yu et al. 2025, "DAPO", §3.1 and eq. 10 (they use
  0.2 / 0.28). Equal values give PPO.
* Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", §3.3
  (their ``c``, e.g. 3): for a negative advantage the surrogate is also bounded by ``-A * c``, so a token whose
  ratio has grown large under a negative advantage cannot dominate the loss (verl's ``clip_ratio_c``).
* GSPO (``gspo``): Zheng et al. 2025, "Group Sequence Policy Optimization" (Qwen): the importance ratio is the
  sequence's, the geometric mean of its token ratios ``s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)``, and it is
  clipped per sequence; the objective is a mean over sequences, ``(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``, so it
  takes ``loss_agg=seq-mean-token-mean`` only (which gives exactly that; verl's ``gspo`` forces it too). Its clip
  ranges are far smaller than PPO's because ``s_i`` is a per-token geometric mean: the paper uses ``clip_low=3e-4,
  clip_high=4e-4``. No dual clip (not in the paper; verl's ``gspo`` has none either).
* CISPO (``cispo``): MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
  §3.1: the importance-sampling weight is clipped and detached, and multiplies ``A * logp`` (a REINFORCE term), so
  no token loses its gradient, ``d pg / d logp = -clip(ratio) * A``. The paper sets no lower bound (a large
  ``eps_low``): ``clip_low=1`` gives that here (``1 - clip_low = 0``; only with cispo). No dual clip: the weight is
  already bounded above by ``1 + clip_high``. The paper's objective is a token mean (``token-mean``); the others
  are allowed. ``pg`` is ``-w A logp``, not a ratio-sized value, so ``train/pg_loss`` reads on another scale.
* Entropy bonus: ``entropy`` is the per-token entropy of the tempered policy distribution (it carries grad);
  ``entropy_coef > 0`` rewards it (Mnih et al. 2016, "Asynchronous Methods for Deep RL", §4; verl's
  ``entropy_coeff``). KL and entropy terms combine with every ``policy_loss``.
* KL estimators of ``KL(pi || pi_ref)`` from samples of pi, with ``log_r = ref_logp - logp``: Schulman 2020,
  "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html)::

      k1 = -log_r                   unbiased, high variance, can be negative
      k2 = log_r ** 2 / 2           biased, low variance
      k3 = exp(log_r) - 1 - log_r   unbiased, low variance, >= 0 (the estimator of DeepSeekMath eq. 4)

  Their gradients through ``logp`` (the loss's), in expectation over samples of pi: k1 0 (noise only), k2 that of
  ``KL(pi || pi_ref)``, k3 that of the reverse ``KL(pi_ref || pi)`` (docs/TRAINER.md, "Loss").
  The penalty is added to the loss (DeepSeekMath) rather than folded into the reward (InstructGPT). The estimators
  are unclamped (verl clamps k3 to [-10, 10]); outside ``mask`` ``log_r`` is taken as 0, so a loss-masked token
  whose k3 would overflow cannot put a NaN into the gradient.

Clip fraction (``clip_frac``, a token mean): ``ppo_clip``, tokens where a clip bound (including the dual clip)
is strictly the active term (no gradient); ``gspo``, every token of a sequence whose clip bound is active (the
GSPO paper's "fraction of clipped tokens"); ``cispo``, tokens whose IS weight was clipped (they keep a gradient,
scaled by the clipped weight).

Aggregation ``agg`` over the tokens of a batch of ``S`` sequences with ``L_i`` tokens each:

* ``"token-mean"``: ``sum_{i,t} x_it / sum_i L_i`` — every token weighs the same (DAPO §3.3).
* ``"seq-mean-token-mean"``: ``(1/S) sum_i (1/L_i) sum_t x_it`` — the original GRPO objective (DeepSeekMath eq. 3).
* ``"seq-mean-token-sum-norm"``: ``(1/S) sum_i (1/C) sum_t x_it`` with the constant ``C = max_response_length``
  — Dr. GRPO (Liu et al. 2025, §3.1), which removes GRPO's response-length bias. ``C`` must bound every sample's
  trained tokens: the Trainer passes ``train.loss_norm_tokens`` (multi-turn: the whole response budget) or else
  the rollout's ``max_tokens``, and refuses a sample with more.
* ``"seq-mean-token-sum"``: ``(1/S) sum_i sum_t x_it`` — verl's mode of that name (a sequence's tokens summed,
  sequences averaged; ``seq-mean-token-sum-norm`` times ``C``).

Gradient accumulation: pass the *whole batch's* ``num_tokens`` (token-mean) or ``num_seqs`` (seq modes) and each
micro-batch returns its share of the whole-batch loss, so the shares sum to the full-batch loss whatever the
micro-batch size (in exact arithmetic; floating-point sums in a different grouping may round differently).
Sequences with no tokens count in ``S`` and contribute 0.

Off-policy correction (``train.decoupled``, ``train.is_correction``; :func:`behaviour_weights`). With stale rollouts
(``rollout.max_staleness > 0``) three policies meet: the behaviour policy ``mu`` that sampled the tokens (the
rollout's logprobs), the proximal policy ``pi_prox`` (the trainer's weights at the start of the train step) and the
current policy ``pi_theta``. The decoupled objective (Hilton, Cobbe & Schulman 2021, "Batch size-invariance for
policy optimization", arXiv:2110.00641, the decoupled PPO objective; AReaL's decoupled loss, Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning", arXiv:2505.24298) clips
the ratio against ``pi_prox`` and corrects for ``mu`` with a detached importance weight::

    ratio = exp(logp - prox_logp)                       (the policy loss above with old_logp = prox_logp)
    rho_t = exp(prox_logp - behaviour_logp)             (per token; 1 wherever the token is not trained)
    none: w_t = rho_t                                   (Hilton et al.: the untruncated behaviour weight)
    tis:  w_t = min(rho_t, is_cap)                      (token-level truncated IS: Ionides 2008, "Truncated
                                                         Importance Sampling"; Yao et al. 2025, "Your Efficient RL
                                                         Framework Secretly Brings You Off-Policy RL Training";
                                                         verl's rollout_is=token, threshold 2)
    mis:  rho_i = exp(sum_t log rho_t)                  (sequence i's ratio over its trained tokens)
          w_t = rho_i if low <= rho_i <= high else 0    (sequence-level masked IS: Liu, Li et al. 2025, "When
                                                         Speed Kills Stability", Seq-MIS; verl's rollout_is=sequence
                                                         with rollout_rs=sequence, low = 1/high by default)
    loss = agg(sg(w) * pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

A masked sequence keeps counting in the aggregation's denominators (``num_tokens``, ``S``) and adds 0: it is an
importance weight of 0 in the estimator over all sampled sequences (Seq-MIS's ``E_mu[1(rho <= C) rho ...]``), not
a smaller batch (verl's rejection sampling shrinks the response mask instead). The bounds are compared with
``log rho_i`` in log space, so no sequence ratio overflows. AReaL's ``behav_imp_weight_cap`` masks the *tokens*
whose weight exceeds the cap; ``tis`` truncates them instead (the weight is the cap, the token keeps its gradient).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["LOSS_AGG_MODES", "KL_ESTIMATORS", "POLICY_LOSSES", "IS_CORRECTIONS", "LossOutput", "BehaviourWeights",
           "pad_sequences", "aggregate", "kl_penalty", "clipped_surrogate", "policy_loss", "behaviour_weights",
           "register_loss_agg", "register_kl_estimator", "register_policy_loss", "policy_loss_problems"]

# The registries: name -> implementation. ``train.loss_agg`` / ``train.kl_estimator`` / ``train.policy_loss``
# accept exactly these names (rlrepro.trainer.TrainConfig checks against them), so a new mode is one decorated
# function here.
LOSS_AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
# what a policy loss refuses: name -> (why train.dual_clip > 0 is refused or None, the loss_agg modes it takes or
# None for every one, why the others are refused)
_POLICY_LOSS_RULES: dict[str, tuple[str | None, tuple[str, ...] | None, str]] = {}
# train.is_correction: the behaviour weight of the decoupled objective (module docstring, behaviour_weights)
IS_CORRECTIONS = ("none", "tis", "mis")


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


def register_policy_loss(name: str, *, dual_clip: str | None = None, loss_aggs: tuple[str, ...] | None = None,
                         loss_agg_why: str = ""):
    """Register ``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip) -> (pg [B, T], clipped
    [B, T] bool)`` as ``train.policy_loss=name``. ``dual_clip``: why the loss refuses ``dual_clip > 0`` (None: it
    applies it); ``loss_aggs``: the only aggregations it takes (None: every one), ``loss_agg_why`` saying why."""
    def wrap(fn):
        POLICY_LOSSES[name] = fn
        _POLICY_LOSS_RULES[name] = (dual_clip, loss_aggs, loss_agg_why)
        return fn
    return wrap


def policy_loss_problems(mode: str, *, loss_agg: str, dual_clip: float) -> list[tuple[str, str]]:
    """``(field, why)`` for each setting ``train.policy_loss=mode`` cannot be combined with (empty: none), e.g.
    ``("dual_clip", "is not used by ...")``; what TrainConfig and :func:`policy_loss` refuse."""
    dual_why, aggs, agg_why = _POLICY_LOSS_RULES.get(mode, (None, None, ""))
    problems = []
    if dual_clip and dual_why is not None:
        problems.append(("dual_clip", f"cannot be used with train.policy_loss={mode}: {dual_why}; set "
                                      "train.dual_clip=0"))
    if aggs is not None and loss_agg not in aggs:
        problems.append(("loss_agg", f"cannot be used with train.policy_loss={mode}: {agg_why}; set "
                                     f"train.loss_agg={aggs[0]}"))
    return problems


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


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(masked, mask, num_tokens, num_seqs, max_response_length):
    s = masked.shape[0] if num_seqs is None else num_seqs
    return masked.sum(dim=-1).sum() / max(s, 1)


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


def _finite_at_least_0(value) -> bool:
    try:
        return not isinstance(value, bool) and math.isfinite(value) and value >= 0
    except TypeError:
        return False


def _check_clip_range(clip_low, clip_high, *, low_may_be_one: bool = False, mode: str = "ppo_clip") -> None:
    """The clip range must bound the ratio to ``[1 - clip_low, 1 + clip_high]`` with ``0 <= 1 - clip_low <= 1``:
    ``clip_high < 0`` inverted the clamp (every on-policy token with A > 0 sat on a bound and got no gradient),
    ``clip_low > 1`` gave a negative lower bound, NaN / inf reached the loss; all silently (TrainConfig refuses
    them for ``train.clip_low`` / ``train.clip_high``; this is the same rule for the Python API)."""
    if not (_finite_at_least_0(clip_low) and (clip_low < 1 or (clip_low == 1 and low_may_be_one))):
        allowed = "[0, 1]" if low_may_be_one else "[0, 1)"
        why = "" if low_may_be_one or clip_low != 1 else (
            f"; 1 (no lower bound, MiniMax-M1's setting) is taken by mode='cispo' only, not {mode!r}")
        raise ValueError(f"clip_low={clip_low!r} must be a number in {allowed}: the ratio's lower clip bound is "
                         f"1 - clip_low{why} (train.clip_low; e.g. 0.2)")
    if not _finite_at_least_0(clip_high):
        raise ValueError(f"clip_high={clip_high!r} must be a finite number >= 0: the ratio's upper clip bound is "
                         "1 + clip_high (train.clip_high; e.g. 0.28, DAPO's clip-higher, or 0.2 for PPO)")


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
    _check_clip_range(clip_low, clip_high)
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    ratio = torch.exp(_bounded(logp - old_logp))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg, no_grad = torch.maximum(unclipped, clipped), clipped > unclipped
    if dual_clip:
        bound = -adv * dual_clip
        dual = (adv < 0) & (bound < pg)
        pg, no_grad = torch.where(dual, bound.expand_as(pg), pg), no_grad | dual
    return pg, no_grad


LOG_RATIO_BOUND = 20.0  # as verl: exp(88.7) overflows float32, and 0 * inf in the backward is NaN


def _bounded(log_ratio: torch.Tensor) -> torch.Tensor:
    """The log importance ratio clamped to +-``LOG_RATIO_BOUND`` before ``exp``: a token whose behaviour logprob
    lies ~89 nats below the current one would make the ratio inf and its gradient NaN even where a clip bound is
    the active term; clamped, such a token gets no gradient. Inside the bound nothing changes, not a bit."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@register_policy_loss("ppo_clip")
def _ppo_clip(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip):
    """PPO's clipped surrogate with clip-higher and dual clip: :func:`clipped_surrogate`."""
    return clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high, dual_clip)


def _per_sequence(advantages: torch.Tensor, mode: str) -> torch.Tensor:
    if advantages.dim() != 1:
        raise ValueError(f"policy_loss {mode!r} needs one advantage per sequence ([B]), got shape "
                         f"{tuple(advantages.shape)}")
    return advantages


@register_policy_loss(
    "gspo", dual_clip="GSPO (Zheng et al. 2025) clips the sequence ratio and has no dual clip",
    loss_aggs=("seq-mean-token-mean",),
    loss_agg_why="GSPO's objective is a mean over sequences of one sequence-level term each (Zheng et al. 2025), "
                 "which only seq-mean-token-mean gives")
def _gspo(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip):
    """GSPO: ``s_i = exp(mean_t(logp - old_logp))``, ``pg_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low,
    1 + clip_high))`` on every token of sequence ``i``; ``clipped`` marks every token of a clipped sequence."""
    adv = _per_sequence(advantages, "gspo")
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    s = torch.exp(_bounded(log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(logp.dtype)))
    unclipped = -adv * s
    clipped = -adv * torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    pg, no_grad = torch.maximum(unclipped, clipped), clipped > unclipped
    return pg.unsqueeze(-1).expand_as(logp), no_grad.unsqueeze(-1).expand_as(mask)


@register_policy_loss(
    "cispo", dual_clip="CISPO's IS weight (MiniMax-M1 §3.1) is already bounded above by 1 + clip_high, and its "
                       "loss -w A logp is no ratio-sized surrogate for a dual clip to bound")
def _cispo(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip):
    """CISPO: ``pg = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp``; ``clipped`` marks the tokens whose
    weight was clipped (``ratio`` outside the bounds); they keep their gradient."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    ratio = torch.exp(_bounded(logp - old_logp)).detach()
    low, high = 1.0 - clip_low, 1.0 + clip_high
    weight = torch.clamp(ratio, low, high)
    return -weight * adv * logp, (ratio < low) | (ratio > high)


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
                num_seqs: int | None = None, dual_clip: float = 0.0, entropy_coef: float = 0.0,
                mode: str = "ppo_clip", is_weight: torch.Tensor | None = None) -> LossOutput:
    """``agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)`` over padded ``[B, T]`` tensors, ``pg`` the
    per-token loss of ``mode`` (one of :data:`POLICY_LOSSES`); see the module docstring for the formulas.

    ``ref_logp`` is needed when ``kl_coef != 0``; given with ``kl_coef == 0`` the KL is still reported.
    ``entropy`` (``[B, T]``, optional) is reported, and with ``entropy_coef != 0`` (which needs it, with grad) it
    enters the loss. ``num_tokens`` / ``num_seqs``: whole-batch counts for micro-batch shares (see
    :func:`aggregate`). ``is_weight`` (``[B, T]``, the decoupled objective's behaviour weight,
    :attr:`BehaviourWeights.weight`; pass the proximal logprobs as ``old_logp``) multiplies ``pg``, detached, before
    the aggregation; None (the default) leaves ``pg`` untouched (not even a multiplication by 1).
    """
    _check_mode(loss_agg, max_response_length)
    if mode not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {mode!r}; choose one of {list(POLICY_LOSSES)}")
    _check_clip_range(clip_low, clip_high, low_may_be_one=mode == "cispo", mode=mode)
    for name, value in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
        if not _finite_at_least_0(value):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 (train.{name}; 0 = off)")
    problems = policy_loss_problems(mode, loss_agg=loss_agg, dual_clip=dual_clip)
    if problems:
        name, why = problems[0]
        raise ValueError(f"{name}={dual_clip if name == 'dual_clip' else repr(loss_agg)} {why}")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the reference policy's logprobs); "
                         "pass ref_logp or set kl_coef=0")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy (per-token entropies with grad); "
                         "pass entropy or set entropy_coef=0")
    agg = dict(loss_agg=loss_agg, max_response_length=max_response_length, num_tokens=num_tokens, num_seqs=num_seqs)
    pg, clipped = POLICY_LOSSES[mode](logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                      dual_clip=dual_clip)
    if is_weight is not None:
        pg = pg * is_weight.detach()
    loss = aggregate(pg, mask, **agg)
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * aggregate(entropy, mask, **agg)
    n = int(mask.sum())
    kl_value = 0.0
    if ref_logp is not None:
        # outside the mask (padding, loss-masked tokens) the log ratio is 0: there k3's exp(ref - logp) could
        # overflow, and the masked-out inf would still give a NaN gradient (0 * inf); trained tokens keep their bits
        kl = kl_penalty(logp, torch.where(mask, ref_logp, logp.detach()), kl_estimator)
        if kl_coef != 0.0:
            loss = loss + kl_coef * aggregate(kl, mask, **agg)
        kl_value = _token_mean(kl, mask, n)
    return LossOutput(
        loss=loss, pg_loss=_token_mean(pg, mask, n), kl=kl_value, clip_frac=_token_mean(clipped, mask, n),
        entropy=0.0 if entropy is None else _token_mean(entropy, mask, n), num_tokens=n)


@dataclass
class BehaviourWeights:
    """The behaviour weight of the decoupled objective and what it did, all ``[B, T]`` and detached.

    ``weight``: ``w`` of the module docstring (exactly 1.0 outside ``mask``); ``truncated``: trained tokens whose
    ``rho_t`` exceeded ``is_cap`` (``tis``); ``masked``: trained tokens of a masked sequence (``mis``); ``kl``: the
    k3 estimate of ``KL(mu || pi_prox)`` per token, ``rho_t - 1 - log rho_t`` (Schulman 2020; verl's rollout
    correction reports it too), 0 outside ``mask``.
    """
    weight: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor
    kl: torch.Tensor


@torch.no_grad()
def behaviour_weights(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, *,
                      correction: str = "none", is_cap: float = 2.0, mis_low: float = 0.5,
                      mis_high: float = 2.0) -> BehaviourWeights:
    """The detached weight ``w`` that corrects the proximal policy's loss for samples of the behaviour policy.

    ``proximal_logp`` / ``behaviour_logp``: ``[B, T]`` (the trainer's logprobs before the step's first update, the
    rollout's); ``mask``: the trained tokens. ``correction`` is one of :data:`IS_CORRECTIONS` (module docstring:
    ``none`` ``rho_t``, ``tis`` ``min(rho_t, is_cap)``, ``mis`` the sequence ratio, 0 for a sequence outside
    ``[mis_low, mis_high]``). Outside ``mask`` the log ratio is taken as 0, so padding, masked-out tokens and their
    placeholders give ``w = 1`` exactly and reach no bit. When proximal and behaviour logprobs are equal at every
    trained token (a synchronous run), every ``w`` is exactly 1.0 (``exp(0)``; ``exp`` of a sum of zeros).
    """
    if correction not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {correction!r}; choose one of {list(IS_CORRECTIONS)}")
    raw_log_rho = torch.where(mask, proximal_logp - behaviour_logp, torch.zeros_like(proximal_logp))
    log_rho = _bounded(raw_log_rho)  # a token's weight: exp of at most +-LOG_RATIO_BOUND
    rho = torch.exp(log_rho)
    none = torch.zeros_like(mask)
    truncated, masked = none, none
    if correction == "none":
        weight = rho
    elif correction == "tis":
        if not (_finite_at_least_0(is_cap) and is_cap > 0):  # a cap of -1 weighed every token -1: the loss negated
            raise ValueError(f"is_cap={is_cap!r} must be a finite number > 0 (train.is_cap, the largest token weight "
                             "is_correction='tis' keeps; verl uses 2)")
        # exactly the cap where truncated; outside mask rho is exactly 1 and stays so (a cap < 1 made it the cap)
        weight = torch.where(mask, torch.clamp(rho, max=is_cap), rho)
        truncated = mask & (rho > is_cap)
    else:
        if not 0 <= mis_low < 1 < mis_high:
            raise ValueError(f"mis bounds must satisfy 0 <= low < 1 < high, got low={mis_low}, high={mis_high}")
        # log rho_i over the trained tokens of each sequence, from the unbounded token terms (verl sums the raw
        # log ratios too): clamping each token first would change the sum (+25 and -25 nats are not +20 and -20)
        # and so which sequence is kept; the sum is only compared in log space and exponentiated where kept
        # (<= log high), so it needs no bound
        log_seq = raw_log_rho.sum(dim=-1, keepdim=True)
        low = math.log(mis_low) if mis_low > 0 else -math.inf
        keep = (log_seq >= low) & (log_seq <= math.log(mis_high))
        seq_weight = torch.where(keep, torch.exp(torch.where(keep, log_seq, torch.zeros_like(log_seq))),
                                 torch.zeros_like(log_seq))
        weight = torch.where(mask, seq_weight.expand_as(rho), torch.ones_like(rho))
        masked = mask & ~keep.expand_as(mask)
    kl = torch.where(mask, rho - 1.0 - log_rho, torch.zeros_like(rho))
    return BehaviourWeights(weight=weight, truncated=truncated, masked=masked, kl=kl)
