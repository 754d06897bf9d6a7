"""The GRPO train step: on-policy check, micro-batched clipped-surrogate loss, clip, AdamW, LR schedule.

``Trainer.train_step(samples)`` reads like the algorithm:

1. Without grad, recompute every completion token's logprob with the current weights and report
   ``train/rollout_logprob_abs_diff = max |trainer - rollout|`` (exactly 0.0 when trainer and engine agree bit
   for bit); with a reference model, compute its logprobs for the KL term.
2. For each of ``ppo_epochs`` passes and each mini-batch (``train.mini_batch_size`` consecutive samples; null: the
   whole batch, one update per pass): for each micro-batch of it (consecutive chunks of ``micro_batch_size``
   samples, or of at most ``micro_batch_tokens`` tokens: a pure function of the batch order and lengths) compute
   the loss share (scaled by the mini-batch's token / sequence counts, so micro-batching changes nothing
   mathematically), backward, accumulate grads in float32; then (data parallel: order-fixed gradient sum) clip by
   global norm and take an AdamW step (:mod:`rlrepro.trainer.updates`).
3. Advance the LR schedule (once per train step; every update of a step uses the same rate).

A batch in which no token has loss weight (``train/num_tokens == 0``: every completion empty or masked out) takes no
update at all: no forward or backward pass and no optimizer step, so weight decay and AdamW's momentum do not move
the weights and the optimizer state (moments, its step count) stays as it was; the LR schedule still advances, as for
a step skipped under ``train.on_nonfinite=skip`` (docs/TRAINER.md, "Steps with nothing to train").

The "old" logprobs of the PPO ratio are the rollout's, as the engine reported them; with ``train.decoupled`` they
are the proximal policy's, the current weights' logprobs at the start of the step (the first update's forward, before
any update, detached: the same bits as a no-grad pass; the later mini-batches' from a no-grad pass before it), and the
rollout's (the behaviour policy's) only enter the detached behaviour weight
(:func:`~rlrepro.trainer.losses.behaviour_weights`, ``train.is_correction``). A sample's
``loss_mask`` (multi-turn episodes: 0 at tool / environment tokens) keeps its 0 tokens in the forward pass as context
and out of everything else; without one (or with all ones) the step's arithmetic is the unmasked one, bit for bit.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import (StateHolder, capture_rng_state, checkpoint_dir_name, load_checkpoint,
                         save_checkpoint, write_on_one_rank)
from .data_parallel import DataParallel
from .config import TrainConfig
from .losses import behaviour_weights
from .optim import MasterWeightAdamW, ShardedMasterWeightAdamW, WarmupCosineLR, grad_norm
from .updates import mini_batches as split_mini_batches, run_updates

__all__ = ["TrainConfig", "TrainSample", "Trainer", "micro_batches"]


@dataclass
class TrainSample:
    """What the trainer needs of a rollout sample. Any object with these attributes (or a mapping with these
    keys) is accepted by :meth:`Trainer.train_step`."""
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    # one 0/1 per completion token (1: sampled by the policy, trained on; 0: context only, e.g. a tool's output in
    # a multi-turn episode); None: every token is trained (a mask of all ones is normalised to None)
    loss_mask: list[int] | None = None

    @property
    def num_trained(self) -> int:
        """The completion tokens the loss sees (the count that ``token-mean`` divides by)."""
        return len(self.completion_token_ids) if self.loss_mask is None else sum(self.loss_mask)


def _field(sample, name: str, index: int):
    try:
        return sample[name] if isinstance(sample, Mapping) else getattr(sample, name)
    except (KeyError, AttributeError):
        raise ValueError(f"sample {index} has no {name!r}; a train sample needs prompt_token_ids, "
                         "completion_token_ids, rollout_logprobs and advantage") from None


def _as_train_sample(sample, index: int) -> TrainSample:
    s = TrainSample(prompt_token_ids=_token_ids(_field(sample, "prompt_token_ids", index), index, "prompt token"),
                    completion_token_ids=_token_ids(_field(sample, "completion_token_ids", index), index,
                                                    "completion token"),
                    rollout_logprobs=[float(x) for x in _field(sample, "rollout_logprobs", index)],
                    advantage=float(_field(sample, "advantage", index)))
    if len(s.rollout_logprobs) != len(s.completion_token_ids):
        raise ValueError(f"sample {index} has {len(s.completion_token_ids)} completion tokens but "
                         f"{len(s.rollout_logprobs)} rollout logprobs; they must be one per token")
    if not s.prompt_token_ids and s.completion_token_ids:  # the packed forward named its index in the micro-batch
        raise ValueError(f"sample {index} has an empty prompt: the first completion token has no position that "
                         "predicts it; start every prompt with at least one token (e.g. BOS)")
    if not math.isfinite(s.advantage):
        raise ValueError(f"sample {index} has advantage {s.advantage}; advantages must be finite")
    s.loss_mask = _loss_mask(sample, index, len(s.completion_token_ids))
    for j, x in enumerate(s.rollout_logprobs):  # a NaN / inf here made the loss non-finite: "lower train.lr"
        if not math.isfinite(x) and (s.loss_mask is None or s.loss_mask[j]):
            raise ValueError(f"sample {index} has rollout logprob {x} at completion token {j}, a trained token; the "
                             "rollout's logprobs must be finite there (a placeholder belongs only at a loss_mask 0 "
                             "token)")
    return s


def _check_vocab(batch: Sequence[TrainSample], vocab: int | None) -> None:
    """Refuse a token id outside ``[0, vocab)`` naming the sample (the embedding's own error named none, and on CUDA
    an out-of-range gather is a device-side assert)."""
    for i, s in enumerate(batch if isinstance(vocab, int) else ()):
        for ids in (s.prompt_token_ids, s.completion_token_ids):
            if ids and (min(ids) < 0 or max(ids) >= vocab):  # C-speed scans; the Python loop only for the message
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(f"sample {i} has token id {bad}, outside the model's vocabulary [0, {vocab})")


def _token_ids(values, index: int, what: str) -> list[int]:
    """``values`` as a list of ints; a float (e.g. read from a float column) was truncated by ``torch.tensor``."""
    ids = list(values)
    if all(type(t) is int for t in ids):
        return ids
    out = []
    for t in ids:
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"sample {index} has {what} {t!r} ({type(t).__name__}); token ids must be integers "
                             "(convert with int(...))") from None
    return out


def _loss_mask(sample, index: int, num_completion: int) -> list[int] | None:
    """The sample's ``loss_mask`` checked (one 0 or 1 per completion token) as a list of ints; None when it has
    none or when every entry is 1 (so such a sample takes exactly the unmasked path)."""
    mask = sample.get("loss_mask") if isinstance(sample, Mapping) else getattr(sample, "loss_mask", None)
    if mask is None:
        return None
    if isinstance(mask, (str, bytes)) or not hasattr(mask, "__len__"):
        raise ValueError(f"sample {index} has loss_mask of type {type(mask).__name__}; it must be a list of 0/1, "
                         "one per completion token")
    mask = list(mask)
    if len(mask) != num_completion:
        raise ValueError(f"sample {index} has {num_completion} completion tokens but a loss_mask of {len(mask)} "
                         "entries; it must be one 0/1 per completion token")
    bad = [m for m in mask if isinstance(m, str) or not (m == 0 or m == 1)]
    if bad:
        raise ValueError(f"sample {index} has loss_mask values {bad[:5]!r}; each entry must be 0 (context only) "
                         "or 1 (trained)")
    out = [int(m) for m in mask]
    return None if all(out) else out


def micro_batches(num_samples: int, micro_batch_size: int, *, lengths: Sequence[int] | None = None,
                  max_tokens: int = 0) -> list[range]:
    """The step's micro-batches, consecutive runs of the batch: a pure function of its size, order and lengths.

    ``max_tokens == 0``: chunks of ``micro_batch_size`` samples, ``[0, m), [m, 2m), ...``. Else (``train.
    micro_batch_tokens``; ``lengths[i]``: sample ``i``'s prompt + completion tokens) a micro-batch also ends before
    the sample that would take its tokens past ``max_tokens``; a sample longer than that is one of its own."""
    if max_tokens <= 0:
        return [range(a, min(a + micro_batch_size, num_samples)) for a in range(0, num_samples, micro_batch_size)]
    if lengths is None or len(lengths) != num_samples:
        raise ValueError(f"micro_batches with max_tokens={max_tokens} needs one length per sample "
                         f"({num_samples}), got {None if lengths is None else len(lengths)}")
    out, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start == micro_batch_size or tokens + n > max_tokens):
            out.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if num_samples:
        out.append(range(start, num_samples))
    return out


class Trainer:
    """Owns the policy, its optimizer and LR schedule; ``train_step`` runs one GRPO update.

    ``param_dtype``: the compute dtype of the policy (e.g. ``torch.bfloat16`` on GPU). When it differs from the
    model's dtype the model is cast to it and the optimizer keeps float32 master weights initialised from the
    model's weights *before* the cast; when the model is float32 and ``param_dtype`` is None the parameters are
    their own masters. ``ref_model``: frozen reference for the KL term (required when ``kl_coef > 0``; with
    ``kl_coef == 0`` its KL is still reported); cast in place to the policy's compute dtype when it differs.
    ``data_parallel``: see :mod:`rlrepro.trainer.data_parallel`.
    ``distributed_optimizer`` (with ``data_parallel``): shard the float32 masters and AdamW state over the ranks
    (ZeRO-1, :class:`~rlrepro.trainer.optim.ShardedMasterWeightAdamW`); the same bits as without. Then
    construction, ``train_step`` and ``save_checkpoint`` are collectives (every rank calls them); without
    ``data_parallel`` it changes nothing.

    Determinism: call :func:`enable_determinism` first; every rank/run must use the same CPU thread count.
    """

    def __init__(self, model, config: TrainConfig, ref_model=None, *, temperature: float = 1.0,
                 max_response_length: int | None = None, param_dtype: torch.dtype | None = None,
                 data_parallel: DataParallel | None = None, distributed_optimizer: bool | None = None) -> None:
        if config.kl_coef > 0 and ref_model is None:
            raise ValueError(f"train.kl_coef={config.kl_coef} needs a reference model: pass ref_model= "
                             "(a frozen copy of the initial policy) or set kl_coef=0")
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not (math.isfinite(temperature) and temperature >= 0)):  # inf passed ">= 0": logits / inf
            raise ValueError(f"Trainer temperature must be a finite number >= 0 (the rollout's, rollout.temperature; "
                             f"0: greedy, read as 1), got {temperature!r}")
        if max_response_length is not None and (isinstance(max_response_length, bool)
                                                or not isinstance(max_response_length, int)
                                                or max_response_length < 1):
            raise ValueError(f"Trainer max_response_length must be a positive int or None (the rollout's "
                             f"rollout.max_tokens), got {max_response_length!r}")
        norm_tokens = config.loss_norm_tokens
        if config.loss_agg == "seq-mean-token-sum-norm" and max_response_length is None and norm_tokens is None:
            raise ValueError("train.loss_agg=seq-mean-token-sum-norm divides by a constant: pass "
                             "max_response_length= (the rollout's rollout.max_tokens) or set train.loss_norm_tokens "
                             "(the whole response budget of a multi-turn episode)")
        self.config = config
        # the rollout's sampling temperature (<= 0 means 1, as in the engine) and its max_tokens
        self.temperature = float(temperature)
        self.max_response_length = max_response_length
        # seq-mean-token-sum-norm's constant C: train.loss_norm_tokens, else the rollout's max_tokens
        self.loss_norm_tokens = norm_tokens if norm_tokens is not None else max_response_length
        if distributed_optimizer is None:
            distributed_optimizer = config.distributed_optimizer
        self.data_parallel = data_parallel
        master_init = None
        if param_dtype is not None and param_dtype != model.dtype:
            master_init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
            model.to(param_dtype)
        self.model = model
        self.ref_model = ref_model
        # called once before the step's first optimizer update (weights still those of the step before): the
        # pipelined driver's weight snapshot waits there for its copy (rlrepro.orchestration.workers)
        self.before_update: Callable[[], None] | None = None
        if ref_model is not None:
            ref_model.requires_grad_(False)
            ref_dtype = getattr(ref_model, "dtype", None)
            if isinstance(ref_dtype, torch.dtype) and ref_dtype != getattr(model, "dtype", ref_dtype):
                # the reference computes in the policy's dtype (as the orchestration loads it), so that the KL of
                # the unchanged policy is exactly 0; cast in place, as the policy is
                ref_model.to(model.dtype)
        optim_kwargs = dict(lr=config.lr, betas=config.betas, eps=config.adam_eps, weight_decay=config.weight_decay,
                            master_init=master_init)
        self.distributed_optimizer = bool(distributed_optimizer) and data_parallel is not None
        # train.layout_invariant: micro-batch grads and float sums folded in micro-batch order whatever the number
        # of ranks (rlrepro.trainer.grad_fold), so the step's bits do not depend on it; at one rank that is the
        # plain step's accumulation itself
        self.layout_invariant = bool(config.layout_invariant)
        # layout_invariant over several DP ranks: the last PPO epoch's sharded fold on this rank ("kind":
        # "ShardedGradFold", "peak_partial_bytes": its float32 accumulator shard); None otherwise
        self.grad_fold_stats: dict | None = None
        if self.layout_invariant and config.tp_partials > 1:
            self._set_layout_partials(config.tp_partials)
        self.optimizer = self._make_optimizer(model, **optim_kwargs)
        self.scheduler = WarmupCosineLR(self.optimizer, base_lr=config.lr, warmup_steps=config.schedule_warmup_steps,
                                        total_steps=config.steps, min_lr_ratio=config.min_lr_ratio)

    @property
    def step(self) -> int:
        """Train steps completed (the LR schedule's position)."""
        return self.scheduler.last_step

    def save_checkpoint(self, ckpt_root, step: int, *, extra_state: Mapping | None = None,
                        keep_last: int | None = None, generators: Mapping | None = None):
        """:func:`~rlrepro.trainer.checkpoint.save_checkpoint` of the policy, optimizer (with master weights),
        schedule and every RNG (plus ``generators``); returns the checkpoint's path. The reference model is not
        saved: it is the frozen initial policy, rebuilt by the caller.

        With ``distributed_optimizer`` it is a collective: every rank calls it, the optimizer state is gathered
        (tensor by tensor) onto data-parallel rank 0, which writes the checkpoint (the unsharded format: it resumes
        a sharded or an unsharded trainer); every rank returns the path."""
        if not self.distributed_optimizer:
            return save_checkpoint(ckpt_root, step, model=self.model, optimizer=self.optimizer,
                                   scheduler=self.scheduler, extra_state=extra_state,
                                   rng_state=capture_rng_state(generators), keep_last=keep_last)
        dp = self.data_parallel
        optim_state = self.optimizer.gather_state_dict(dst=0)
        write_on_one_rank(dp.rank == 0, lambda: save_checkpoint(
            ckpt_root, step, model=self.model, optimizer=StateHolder(optim_state), scheduler=self.scheduler,
            extra_state=extra_state, rng_state=capture_rng_state(generators), keep_last=keep_last), dp.barrier)
        return Path(ckpt_root) / checkpoint_dir_name(step)

    def load_checkpoint(self, path, *, generators: Mapping | None = None, restore_rng: bool = True) -> dict:
        """Verify and load a checkpoint written by :meth:`save_checkpoint`, restore the RNGs, return its extra_state.
        All or nothing: a refused load (ValueError) leaves the weights, optimizer, schedule and RNGs as they were.
        With ``distributed_optimizer`` every rank reads the full optimizer state and keeps its share."""
        return load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                               restore_rng=restore_rng, generators=generators).extra_state

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's (name, detached tensor) pairs in name order, in the compute dtype: what the engine runs."""
        for name, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0]):
            yield name, p.detach()

    def _my_leaves(self, num_micro_batches: int) -> list[int]:
        """The micro-batches this rank computes: all without data parallel; else round robin (``k % world``, with
        or without ``train.layout_invariant``)."""
        dp = self.data_parallel
        if dp is None:
            return list(range(num_micro_batches))
        return dp.my_micro_batches(num_micro_batches)

    def micro_batches(self, samples: Sequence) -> list[range]:
        """The micro-batches :meth:`train_step` cuts ``samples`` into (all ranks'; :func:`micro_batches` under
        ``train.micro_batch_size`` and ``train.micro_batch_tokens``, within each mini-batch of
        ``train.mini_batch_size``), the same whatever the layout."""
        return [micro for _, micros in self.update_plan(samples) for micro in micros]

    def update_plan(self, samples: Sequence) -> list[tuple[range, list[range]]]:
        """The step's mini-batches (one optimizer update each per PPO epoch; ``train.mini_batch_size``, null: the
        whole batch), each with its micro-batches (consecutive, within it): global sample index ranges."""
        cfg = self.config
        batch = [s if isinstance(s, TrainSample) else _as_train_sample(s, i) for i, s in enumerate(samples)]
        lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in batch]
        plan = []
        for mini in split_mini_batches(len(batch), cfg.mini_batch_size):
            micros = micro_batches(len(mini), cfg.micro_batch_size, lengths=lengths[mini.start:mini.stop],
                                   max_tokens=cfg.micro_batch_tokens)
            plan.append((mini, [range(mini.start + m.start, mini.start + m.stop) for m in micros]))
        return plan

    def _snapshot(self) -> tuple[dict, dict]:
        """Exact copies of the weights and the optimizer state (to undo earlier PPO epochs of a failed step)."""
        import copy

        return ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                copy.deepcopy(self.optimizer.local_state_dict()))

    @torch.no_grad()
    def _restore(self, snapshot: tuple[dict, dict]) -> None:
        model_state, optim_state = snapshot
        self.model.load_state_dict(model_state, strict=True)
        self.optimizer.load_local_state_dict(optim_state)

    # --- hooks (a sharded trainer overrides them; rlrepro.trainer.megatron) ------------------------------------
    def _set_layout_partials(self, partials: int) -> None:
        """``train.tp_partials``: the policy (and reference) compute every row-/column-parallel product as that many
        fixed pieces, as a tensor-parallel trainer at any TP dividing it does, and the engines emulate."""
        for model in (self.model, self.ref_model):
            if model is not None:
                try:
                    model.set_tensor_parallel_emulation(partials)
                except ValueError as e:
                    raise ValueError(f"train.tp_partials={partials}: {e} (train.tp_partials must divide the model's "
                                     "heads, KV heads, intermediate size and vocabulary)") from None

    def _make_optimizer(self, model, **optim_kwargs):
        """The optimizer over ``model``'s parameters (called once, after the cast to ``param_dtype``)."""
        if self.distributed_optimizer:
            return ShardedMasterWeightAdamW(model.named_parameters(), self.data_parallel, **optim_kwargs)
        return MasterWeightAdamW(model.named_parameters(), **optim_kwargs)

    @torch.no_grad()
    def _reduce_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Turn this rank's accumulated float32 grads (name order) into the step's grads and return the tensors
        that clipping scales: with data parallel, the order-fixed sum over the replicas, in place."""
        if self.data_parallel is not None and not self.layout_invariant:  # layout_invariant: the fold did it
            self.data_parallel.sum_tensors_(grads)
        return grads

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global grad norm (float64 0-d tensor) that clipping uses and ``train/grad_norm`` reports."""
        return grad_norm(grads)

    def _behaviour_weights(self, prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                           sums: list[float]) -> torch.Tensor:
        """The micro-batch's behaviour weights (``train.is_correction``) over its trained tokens ``mask``; adds their
        metric terms to ``sums`` (w*n, max w, truncated tokens, masked tokens, kl*n, n)."""
        cfg = self.config
        low, high = cfg.mis_bounds
        bw = behaviour_weights(prox, behaviour, mask, correction=cfg.is_correction, is_cap=cfg.is_cap, mis_low=low,
                               mis_high=high)
        weight = bw.weight[mask]
        if weight.numel():  # one device->host transfer for the five terms
            w_sum, w_max, truncated, masked, kl_sum = torch.stack([
                weight.double().sum(), weight.max().double(), bw.truncated.sum().double(), bw.masked.sum().double(),
                bw.kl[mask].double().sum()]).tolist()
            sums[:] = [sums[0] + w_sum, max(sums[1], w_max), sums[2] + truncated, sums[3] + masked, sums[4] + kl_sum,
                       sums[5] + weight.numel()]
        return bw.weight

    def _off_policy_metrics(self, sums: list[float], reduced: bool = False) -> dict:
        """``train/is_*`` and ``train/behaviour_proximal_kl`` over the step's trained tokens (all ranks; ``reduced``:
        ``sums`` are already the step's, from the layout-invariant fold)."""
        dp = self.data_parallel
        w_sum, w_max, truncated, masked, kl_sum, n = sums
        if dp is not None and not reduced:
            w_sum, truncated, masked, kl_sum, n = dp.sum_floats([w_sum, truncated, masked, kl_sum, n])
            w_max = dp.max_float(w_max)
        mean = (lambda v: v / n) if n else (lambda v: 0.0)
        return {"train/is_weight_mean": mean(w_sum), "train/is_weight_max": w_max,
                "train/is_truncated_frac": mean(truncated), "train/is_masked_frac": mean(masked),
                "train/behaviour_proximal_kl": mean(kl_sum)}

    def _check_norm_tokens(self, batch: Sequence[TrainSample]) -> None:
        """``seq-mean-token-sum-norm``'s constant ``C`` must bound every sample's trained tokens (Dr. GRPO's MAX_TOKENS;
        multi-turn: every turn is trained, ``rollout.max_tokens`` is one turn's): refused before any pass."""
        c = self.loss_norm_tokens
        if self.config.loss_agg != "seq-mean-token-sum-norm" or c is None:
            return
        for i, s in enumerate(batch):
            if s.num_trained > c:
                source = "train.loss_norm_tokens" if self.config.loss_norm_tokens else "the rollout's max_tokens"
                raise ValueError(
                    f"sample {i} has {s.num_trained} trained tokens, more than the constant {c} that "
                    f"train.loss_agg=seq-mean-token-sum-norm divides by ({source}); that constant must be the most "
                    "trained tokens a sample can have (Dr. GRPO; verl's max response length): for multi-turn episodes "
                    "set train.loss_norm_tokens to the whole response budget (e.g. env.max_episode_tokens), or use "
                    "another train.loss_agg")

    def train_step(self, samples: Sequence) -> dict:
        """One GRPO update on ``samples`` (each with prompt_token_ids, completion_token_ids, rollout_logprobs,
        advantage, and optionally loss_mask: its 0 entries are context only, out of the loss, its metrics, its token
        counts and the on-policy check; docs/TRAINER.md, "Loss masks"). Returns ``train/*`` metrics (Python
        floats; ``train/num_tokens`` counts the trained tokens) and the raw ``loss`` / ``grad_norm`` floats (means
        over the optimizer updates, PPO epochs x mini-batches; per epoch, the mean of its updates, in
        ``loss_per_epoch`` / ``grad_norm_per_epoch``; per update in ``loss_per_update`` / ``grad_norm_per_update``)
        for fingerprints; with ``train.mini_batch_size`` set also ``train/optimizer_updates`` (updates applied)."""
        cfg = self.config
        batch = [_as_train_sample(s, i) for i, s in enumerate(samples)]
        if not batch:
            raise ValueError("train_step got an empty batch")
        _check_vocab(batch, getattr(getattr(self.model, "config", None), "vocab_size", None))
        self._check_norm_tokens(batch)
        num_tokens = sum(s.num_trained for s in batch)  # the loss's tokens: masked-out ones do not count
        lr = self.scheduler.get_last_lr()
        # 1-2. the reference logprobs, the on-policy check and the optimizer updates (rlrepro.trainer.updates)
        res = run_updates(self, batch, self.update_plan(batch))
        # 3. LR schedule: once per train step, whatever the number of updates (each ran at the rate `lr`)
        self.scheduler.step()
        n = res.metric_sums[4]
        mean = (lambda v: v / n) if n else (lambda v: 0.0)
        loss = sum(res.losses) / len(res.losses)  # means over the optimizer updates
        grad_norm = sum(res.norms) / len(res.norms)
        off_policy = self._off_policy_metrics(res.is_sums, reduced=res.is_reduced) if cfg.decoupled else {}
        updates = {"train/optimizer_updates": float(res.updates)} if cfg.mini_batch_size is not None else {}
        return {
            "train/loss": loss,
            "train/pg_loss": mean(res.metric_sums[0]),
            "train/grad_norm": grad_norm,
            "train/kl": mean(res.metric_sums[1]),
            "train/clip_frac": mean(res.metric_sums[2]),
            "train/entropy": mean(res.metric_sums[3]),
            "train/lr": lr,
            "train/rollout_logprob_abs_diff": res.max_diff,
            "train/num_tokens": num_tokens,
            "train/nonfinite_skipped": float(res.skipped),
            **updates,
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_per_epoch": _per_epoch(res.losses, res.epochs),
            "grad_norm_per_epoch": _per_epoch(res.norms, res.epochs),
            "loss_per_update": res.losses,
            "grad_norm_per_update": res.norms,
            **off_policy,
        }


def _per_epoch(values: list[float], epochs: list[int]) -> list[float]:
    """The mean of each PPO epoch's update values, in epoch order (one update an epoch: the value itself)."""
    out = []
    for e in sorted(set(epochs)):
        vs = [v for v, ep in zip(values, epochs) if ep == e]
        out.append(vs[0] if len(vs) == 1 else sum(vs) / len(vs))
    return out
