"""The optimizer updates of a train step: ``train.ppo_epochs`` passes, each over the step's mini-batches.

:meth:`rlrepro.trainer.Trainer.train_step` checks the batch and calls :func:`run_updates`, which runs, for each PPO
epoch and each mini-batch (:func:`mini_batches`: consecutive runs of ``train.mini_batch_size`` samples in batch
order, the last one possibly smaller; null: one mini-batch, the whole batch), one optimizer update: the mini-batch's
micro-batches (cut within it by ``train.micro_batch_size`` / ``train.micro_batch_tokens``; data parallel: dealt to
the ranks round robin, ``k % world_size``, as a whole batch's are) forward and backward with the loss normalised over
the mini-batch's own token and sequence counts, the gradients accumulated in float32 (or folded, with
``train.layout_invariant`` over several ranks), summed over the ranks, clipped, and one AdamW step. Verl's
``ppo_mini_batch_size`` (there counted in prompts and multiplied by ``rollout.n``) and slime's global batch below
its rollout batch are this; ReTool takes 4 such updates a step.

Every update's "old" logprobs (the PPO ratio's anchor) are those of the policy that generated the batch: the
rollout's, or with ``train.decoupled`` the proximal policy's, the weights at the start of the step. A mini-batch
after the first is trained by weights that earlier updates of the step have moved (off policy by those updates,
which the clipped ratio bounds, as in PPO). So the on-policy check (``train/rollout_logprob_abs_diff``) and the
proximal logprobs of every mini-batch but the first need the weights from before any update: with more than one
mini-batch a no-grad pass over the later mini-batches' micro-batches runs before the first update (the first
mini-batch's forward with grad, before its update, gives its own, as for the whole batch; the same bits either
way, docs/TRAINER.md "The train step").

A step is all or nothing: a non-finite loss or gradient norm in any of its updates puts back the weights and the
optimizer state of before the first one (``train.on_nonfinite=error`` then raises, ``skip`` records the step as
skipped), as for several PPO epochs. A mini-batch without any trained token (every completion empty or masked out)
takes no update, as a whole batch without one does. The LR schedule is not touched here: ``train_step`` advances it
once per train step, after all the updates, which all run at the step's rate (verl's per-step scheduler).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlrepro.checks import ConfigError

from .grad_fold import ShardedGradFold, fold_floats
from .logprobs import logprobs_and_entropy, token_logprobs
from .losses import pad_sequences, policy_loss
from .optim import clip_grad_norm_

__all__ = ["mini_batches", "check_mini_batch_size", "run_updates", "UpdateResult"]


def mini_batches(num_samples: int, mini_batch_size: int | None) -> list[range]:
    """The step's mini-batches (one optimizer update each): ``[0, M), [M, 2M), ...`` over ``num_samples`` (the last
    may be shorter); the whole batch as one when ``mini_batch_size`` is None or not below ``num_samples``."""
    if mini_batch_size is None or mini_batch_size >= num_samples:
        return [range(0, num_samples)]
    return [range(a, min(a + mini_batch_size, num_samples)) for a in range(0, num_samples, mini_batch_size)]


def check_mini_batch_size(mini_batch_size: int | None, prompts_per_step: int, group_size: int) -> None:
    """``train.mini_batch_size`` against the step's batch (``rollout.prompts_per_step * rollout.group_size``
    samples): at most that many (ConfigError naming both and the fix)."""
    batch = prompts_per_step * group_size
    if mini_batch_size is None or mini_batch_size <= batch:
        return
    raise ConfigError(
        f"train.mini_batch_size={mini_batch_size} is larger than the step's batch of rollout.prompts_per_step x "
        f"rollout.group_size = {prompts_per_step} x {group_size} = {batch} samples; it counts samples per optimizer "
        f"update (verl's ppo_mini_batch_size x rollout.n). Fix: give at most {batch} (e.g. train.mini_batch_size="
        f"{max(1, batch // 4)} for 4 updates a step), or null for one update over the whole batch")


@dataclass
class UpdateResult:
    """What the updates of one train step report to :meth:`~rlrepro.trainer.Trainer.train_step`."""
    losses: list[float]  # one per optimizer update taken, in order (a skipped step: the failing update's)
    norms: list[float]
    epochs: list[int]  # the PPO epoch of each entry of losses / norms
    metric_sums: list[float]  # pg*n, kl*n, clip_frac*n, entropy*n, n over every update taken
    max_diff: float = 0.0  # the on-policy check: max |trainer - rollout| over the trained tokens, before any update
    skipped: bool = False
    updates: int = 0  # optimizer updates applied (0 when skipped)
    is_sums: list[float] = field(default_factory=lambda: [0.0] * 6)  # train.decoupled: w*n, max w, ...
    is_reduced: bool = False  # is_sums are the whole step's already (the layout-invariant fold)


def _trained_positions(part: Sequence, device) -> torch.Tensor | None:
    """The micro-batch's loss masks concatenated (bool, one per completion token, on ``device``), or None when no
    sample of it has one (then the step runs exactly the unmasked arithmetic)."""
    if all(s.loss_mask is None for s in part):
        return None
    flat = [bool(m) for s in part
            for m in (s.loss_mask if s.loss_mask is not None else [1] * len(s.completion_token_ids))]
    return torch.tensor(flat, dtype=torch.bool, device=device)


def _max_abs_diff(current: list[torch.Tensor], rollout: list[torch.Tensor],
                  trained: list[torch.Tensor | None]) -> float:
    """``max |trainer - rollout|`` over the trained tokens of the micro-batches (0.0 when none is trained)."""
    diff = (torch.cat(current) - torch.cat(rollout)).abs()
    if any(t is not None for t in trained):
        lengths = [r.shape[0] for r in rollout]
        keep = torch.cat([torch.ones(n, dtype=torch.bool, device=diff.device) if t is None else t
                          for n, t in zip(lengths, trained)])
        diff = diff[keep]
    return float(diff.max()) if diff.numel() else 0.0


def _rollout_flat(part: Sequence, device) -> torch.Tensor:
    """The micro-batch's rollout logprobs, concatenated (one host->device copy)."""
    return torch.tensor([x for s in part for x in s.rollout_logprobs], dtype=torch.float32, device=device)


def run_updates(trainer, batch: Sequence, plan: Sequence[tuple[range, list[range]]]) -> UpdateResult:
    """Every optimizer update of one train step on ``batch`` (checked :class:`~rlrepro.trainer.train.TrainSample`
    s): ``plan`` is the step's mini-batches, each with its micro-batches (all ranks', global sample ranges), from
    :meth:`~rlrepro.trainer.Trainer.update_plan`. Module docstring for what runs; the LR schedule is the caller's."""
    cfg = trainer.config
    dp = trainer.data_parallel
    device = trainer.model.device
    optimizer = trainer.optimizer
    # layout_invariant over several ranks: the micro-batch fold, sharded; at one rank the plain accumulation is it
    sharded = trainer.layout_invariant and dp is not None and dp.world_size > 1
    # per mini-batch: its trained tokens and samples (the loss's normalisers), this rank's micro-batches (leaf index
    # within the mini-batch, sample range) and the global index of its first micro-batch (the off-policy fold's)
    tokens = [sum(batch[i].num_trained for i in mini) for mini, _ in plan]
    seqs = [len(mini) for mini, _ in plan]
    mine = [[(leaf, micro[leaf]) for leaf in trainer._my_leaves(len(micro))] for _, micro in plan]
    offsets = [sum(len(micro) for _, micro in plan[:j]) for j in range(len(plan))]
    if not any(tokens):
        # no token has loss weight: no pass and no optimizer update (AdamW's weight decay and momentum would move
        # the weights with zero gradients); the same decision on every rank (the counts are the whole batch's)
        return UpdateResult(losses=[0.0], norms=[0.0], epochs=[0], metric_sums=[0.0] * 5)
    # a mini-batch without a trained token takes no update (on every rank alike)
    updates = [(epoch, j) for epoch in range(cfg.ppo_epochs) for j in range(len(plan)) if tokens[j]]
    first = updates[0][1]  # the first mini-batch updated: its forward (with grad) comes before any update

    # 1. reference logprobs (no grad). The on-policy check needs no pass of its own for the first mini-batch: its
    # loss forward (before any update) computes the current policy's logprobs with the same kernels and the same
    # expression as kernels.token_logprob, hence the same bits (tests/test_trainer_logprobs.py)
    def parts(j: int):
        for leaf, chunk in mine[j]:
            yield leaf, [batch[i] for i in chunk]

    ref_lps: dict[tuple[int, int], list[torch.Tensor]] = {}
    if trainer.ref_model is not None:
        with torch.no_grad():
            for j in (j for j in range(len(plan)) if tokens[j]):
                for leaf, part in parts(j):
                    ref_lps[j, leaf] = token_logprobs(trainer.ref_model, [s.prompt_token_ids for s in part],
                                                      [s.completion_token_ids for s in part], trainer.temperature,
                                                      chunk_rows=cfg.logits_chunk_size)
    # the on-policy check's inputs (per micro-batch: the policy's logprobs, the rollout's, the trained positions)
    current_all: list[torch.Tensor] = []
    rollout_all: list[torch.Tensor] = []
    trained_all: list[torch.Tensor | None] = []
    # train.decoupled: per (mini-batch, micro-batch), the proximal logprobs and the behaviour weights (first visit,
    # kept for the later epochs) and their metric sums: w*n, max w, truncated, masked, kl*n, n
    proximal: dict[tuple[int, int], torch.Tensor] = {}
    is_weights: dict[tuple[int, int], torch.Tensor] = {}
    is_sums = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    is_leaves: dict[int, list[float]] = {}  # sharded: each micro-batch's is_sums, folded in micro-batch order

    # the later mini-batches' logprobs under the weights before any update (no grad): the on-policy check and, with
    # train.decoupled, their proximal logprobs
    with torch.no_grad():
        for j in (j for j in range(len(plan)) if tokens[j] and j != first):
            for leaf, part in parts(j):
                if not any(s.num_trained for s in part):
                    continue
                lps = token_logprobs(trainer.model, [s.prompt_token_ids for s in part],
                                     [s.completion_token_ids for s in part], trainer.temperature,
                                     chunk_rows=cfg.logits_chunk_size)
                current_all.extend(lps)
                rollout_all.append(_rollout_flat(part, device))
                trained_all.append(_trained_positions(part, device))
                if cfg.decoupled:
                    proximal[j, leaf] = pad_sequences(lps)[0]

    # 2. the updates. A non-finite loss or gradient norm stops the step before the optimizer moves (with several
    # updates, the state from before the first one is put back)
    snapshot = trainer._snapshot() if len(updates) > 1 else None
    losses, norms, epochs = [], [], []
    metric_sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # pg*n, kl*n, clip_frac*n, entropy*n, n
    max_diff, skipped = 0.0, False
    for done, (epoch, j) in enumerate(updates):
        optimizer.zero_grad()
        loss_sum = 0.0
        sums = [0.0] * 5
        num_leaves = len(plan[j][1])
        # the mini-batch's micro-batch fold, its accumulator sharded over the DP ranks (ZeRO-2 style)
        fold = ShardedGradFold(num_leaves, dp, optimizer.params) if sharded else None
        leaf_floats: dict[int, list[float]] = {}  # sharded: loss, pg*n, kl*n, clip_frac*n, entropy*n, n
        for leaf, part in parts(j):
            if not any(s.num_trained for s in part):
                continue  # nothing to learn from (no completion tokens, or all masked out); contributes 0
            lps, ents = logprobs_and_entropy(trainer.model, [s.prompt_token_ids for s in part],
                                             [s.completion_token_ids for s in part], trainer.temperature,
                                             chunk_rows=cfg.logits_chunk_size, entropy_grad=cfg.entropy_coef != 0)
            logp, mask = pad_sequences(lps)
            flat_old = _rollout_flat(part, device)
            trained = _trained_positions(part, device)  # None: every token of the micro-batch is trained
            if done == 0:
                current_all.extend(lp.detach() for lp in lps)
                rollout_all.append(flat_old)
                trained_all.append(trained)
            old, _ = pad_sequences(list(torch.split(flat_old, [len(s.rollout_logprobs) for s in part])))
            behaviour = old
            key = (j, leaf)
            if cfg.decoupled:  # the ratio's anchor is the proximal policy: the weights before any update
                if key not in proximal:  # the first mini-batch's: this forward's, before its update
                    proximal[key] = logp.detach()
                old = proximal[key]
            if trained is not None:
                # masked-out tokens stay in the forward pass as context and leave the loss, its metrics and its
                # counts: out of `mask`; their old logprob (the rollout's placeholder) is replaced by the current
                # one so their ratio is 1, as at padding, and no value there can reach a gradient
                trained, _ = pad_sequences(list(torch.split(trained, [len(s.rollout_logprobs) for s in part])),
                                           width=mask.shape[1])
                mask = mask & trained
                old = torch.where(trained, old, logp.detach())
            entropy, _ = pad_sequences(ents)
            ref = pad_sequences(ref_lps[key])[0] if trainer.ref_model is not None else None
            is_weight = None
            if cfg.decoupled:
                if key not in is_weights:
                    leaf_is = is_leaves.setdefault(offsets[j] + leaf, [0.0] * 6) if sharded else is_sums
                    is_weights[key] = trainer._behaviour_weights(proximal[key], behaviour, mask, leaf_is)
                is_weight = is_weights[key]
            adv = torch.tensor([s.advantage for s in part], dtype=torch.float32, device=device)
            if cfg.advantage_clip:
                adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip)
            out = policy_loss(logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                              loss_agg=cfg.loss_agg, max_response_length=trainer.loss_norm_tokens,
                              kl_coef=cfg.kl_coef, ref_logp=ref, kl_estimator=cfg.kl_estimator,
                              entropy=entropy, num_tokens=tokens[j], num_seqs=seqs[j],
                              dual_clip=cfg.dual_clip, entropy_coef=cfg.entropy_coef, mode=cfg.policy_loss,
                              is_weight=is_weight)
            out.loss.backward()
            n = out.num_tokens
            terms = (out.pg_loss * n, out.kl * n, out.clip_frac * n, out.entropy * n, n)
            if sharded:  # this micro-batch's gradient and floats are a leaf of the mini-batch's fold
                fold.push(leaf, optimizer.take_grads())
                leaf_floats[leaf] = [float(out.loss.detach()), *terms]
                continue
            optimizer.accumulate_grads()
            loss_sum += float(out.loss.detach())
            for i, v in enumerate(terms):
                sums[i] += v
        # sharded: the fold's remaining micro-steps first (it exchanges during the pushes, so no other collective of
        # the group may come between them)
        fold_grads = fold.finish(optimizer.params) if sharded else None
        if done == 0:  # the on-policy check over the trained tokens (one device->host transfer for the batch)
            if rollout_all:
                max_diff = _max_abs_diff(current_all, rollout_all, trained_all)
            if dp is not None:
                max_diff = dp.max_float(max_diff)
            current_all.clear()
            rollout_all.clear()
            trained_all.clear()
        if sharded:
            grads = fold_grads
            trainer.grad_fold_stats = {"kind": type(fold).__name__, "peak_partial_bytes": fold.peak_partial_bytes,
                                       "exchange_peak_bytes": fold.exchange_peak_bytes}
            optimizer.set_grads(grads)
            grads = trainer._reduce_grads(grads)
            loss_sum, *sums = fold_floats(leaf_floats, num_leaves, dp, width=6)
        else:
            grads = trainer._reduce_grads(optimizer.grads())
            if dp is not None:
                loss_sum, *sums = dp.sum_floats([loss_sum, *sums])
        norm = clip_grad_norm_(grads, cfg.max_grad_norm, norm=trainer._grad_norm(grads))
        if not (math.isfinite(norm) and math.isfinite(loss_sum)):
            optimizer.zero_grad()
            if snapshot is not None and done > 0:
                trainer._restore(snapshot)
            where = []
            if cfg.ppo_epochs > 1:
                where.append(f"PPO epoch {epoch + 1}")
            if len(plan) > 1:
                where.append(f"mini-batch {j + 1} of {len(plan)}")
            what = f"loss {loss_sum}, gradient norm {norm}" + (f" ({', '.join(where)})" if where else "")
            if cfg.on_nonfinite == "error":
                raise FloatingPointError(
                    f"non-finite {what} at train step {trainer.step + 1}; the update was not applied (weights and "
                    "optimizer state are those of the step before). Fix: lower train.lr or train.max_grad_norm, "
                    "check rewards/advantages, or set train.on_nonfinite=skip to skip such steps")
            losses, norms, epochs, skipped = [loss_sum], [norm], [epoch], True
            metric_sums = [0.0] * 5
            break
        if trainer.before_update is not None and done == 0:
            trainer.before_update()
        optimizer.step()
        losses.append(loss_sum)
        norms.append(norm)
        epochs.append(epoch)
        metric_sums = [a + b for a, b in zip(metric_sums, sums)]

    if cfg.decoupled and sharded:
        is_sums = fold_floats(is_leaves, sum(len(micro) for _, micro in plan), dp, width=6, max_indices=(1,))
    return UpdateResult(losses=losses, norms=norms, epochs=epochs, metric_sums=metric_sums, max_diff=max_diff,
                        skipped=skipped, updates=0 if skipped else len(losses), is_sums=is_sums,
                        is_reduced=sharded)
