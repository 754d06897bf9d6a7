"""Token logprobs of completions under the policy: the trainer's half of "train logprob == rollout logprob".

Samples (prompt + completion) are packed back to back into one flat batch described by
:meth:`AttentionMetadata.packed`, run through ``model.forward_tokens`` once, and the LM head is applied only at
the positions that predict a completion token (position ``len(prompt) - 1 + j`` predicts completion token
``j``). Logprobs come from :func:`rlrepro.kernels.token_logprob`, the one definition the engine uses too.

Because every kernel is batch-invariant (a row's bits do not depend on the other rows of the call), a sample's
logprobs are bitwise independent of which other samples share the pack, of its place in the pack and of the
micro-batching — and equal to a plain ``model(torch.tensor([prompt + completion]))``. Works with and without
grad: under ``torch.no_grad()`` it is the on-policy check, with grad it is the loss's forward.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata

__all__ = ["token_logprobs", "logprobs_and_entropy", "entropy", "tempered_log_softmax"]


def tempered_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits.float() / t)`` in float32 with ``t = temperature if temperature > 0 else 1``.

    The same expression as inside :func:`rlrepro.kernels.token_logprob`; gathering the token column from it gives
    the same bits (``tests/test_trainer_logprobs.py`` checks this).
    """
    return kernels.log_softmax(kernels.scale_logits(logits, temperature))


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` over the last dim, from a (float32) log-softmax. ``0 * -inf`` counts as 0, in
    the value and in the gradient (the log is zeroed where ``p == 0`` before the product, so no ``0 * inf``). The
    zero is a scalar: no ``[tokens, vocab]`` float32 tensor of zeros is written and read (the same values)."""
    p = log_probs.exp()
    return -(p * torch.where(p > 0, log_probs, 0.0)).sum(dim=-1)


def _check(prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]]) -> None:
    if len(prompt_token_ids) != len(completion_token_ids):
        raise ValueError(f"got {len(prompt_token_ids)} prompts but {len(completion_token_ids)} completions; "
                         "pass one completion per prompt (repeat a prompt for each of its samples)")
    for i, (p, c) in enumerate(zip(prompt_token_ids, completion_token_ids)):
        if len(p) < 1 and len(c) > 0:
            raise ValueError(f"sample {i} has an empty prompt: the first completion token has no position that "
                             "predicts it; start every prompt with at least one token (e.g. BOS)")


def _completion_logits(model, prompt_token_ids, completion_token_ids) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Logits [M, vocab] at the M positions that predict completion tokens, their token ids [M], and per-sample
    completion lengths. Samples with an empty completion are left out of the pack."""
    _check(prompt_token_ids, completion_token_ids)
    device = model.device
    lengths = [len(c) for c in completion_token_ids]
    flat: list[int] = []
    seq_lens: list[int] = []
    predict_rows: list[int] = []
    targets: list[int] = []
    for p, c in zip(prompt_token_ids, completion_token_ids):
        if not c:
            continue
        start = len(flat)
        flat.extend(p)
        flat.extend(c)
        seq_lens.append(len(p) + len(c))
        predict_rows.extend(range(start + len(p) - 1, start + len(p) - 1 + len(c)))
        targets.extend(c)
    if not seq_lens:
        return (torch.empty(0, model.config.vocab_size, device=device), torch.empty(0, dtype=torch.long, device=device),
                lengths)
    meta = AttentionMetadata.packed(seq_lens, device=device)
    hidden = model.forward_tokens(torch.tensor(flat, dtype=torch.long, device=device), meta)
    rows = torch.tensor(predict_rows, dtype=torch.long, device=device)
    logits = model.compute_logits(hidden.index_select(0, rows))
    return logits, torch.tensor(targets, dtype=torch.long, device=device), lengths


def token_logprobs(model, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]],
                   temperature: float = 1.0, chunk_rows: int = 0) -> list[torch.Tensor]:
    """Float32 logprob of every completion token under ``model`` at ``temperature``: one 1-D tensor per sample.

    ``temperature <= 0`` means 1 (greedy rollouts report the untempered distribution), as in the engine.
    ``chunk_rows > 0``: the float32 log-softmax over at most that many rows at a time (the same bits, less memory);
    without a gradient only (a loss uses :func:`logprobs_and_entropy`). On CUDA the fused passes of
    :func:`logprobs_and_entropy` serve (:func:`fused_path`; the same bits, chunked or not, with or without grad).
    """
    logits, targets, lengths = _completion_logits(model, prompt_token_ids, completion_token_ids)
    if fused_path(logits, False):  # the same bits (the reference model's logprobs, the warm start)
        lp, _ = _FusedTokenLogprob.apply(logits, targets, float(temperature), int(chunk_rows))
        return list(torch.split(lp, lengths))
    if chunk_rows and chunk_rows < logits.shape[0]:
        if torch.is_grad_enabled() and logits.requires_grad:
            raise ValueError("token_logprobs(chunk_rows=...) has no backward; use logprobs_and_entropy(chunk_rows=...)"
                             " for a loss, or call it under torch.no_grad()")
        lp = torch.cat([kernels.token_logprob(logits[r0:r0 + chunk_rows], targets[r0:r0 + chunk_rows], temperature)
                        for r0 in range(0, logits.shape[0], chunk_rows)])
    else:
        lp = kernels.token_logprob(logits, targets, temperature)
    return list(torch.split(lp, lengths))


def logprobs_and_entropy(model, prompt_token_ids: Sequence[Sequence[int]],
                         completion_token_ids: Sequence[Sequence[int]], temperature: float = 1.0,
                         chunk_rows: int = 0, entropy_grad: bool = False,
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`token_logprobs` plus the entropy of the tempered distribution at each of those positions.

    One log-softmax serves both. The logprobs carry grad (when grad is on); the entropy is a detached metric unless
    ``entropy_grad`` (an entropy bonus in the loss).

    ``chunk_rows > 0``: the float32 log-softmax runs over at most that many logits rows at a time, in the forward
    and again in the backward (:class:`_ChunkedTokenLogprob`), so the ``[tokens, vocab]`` float32 tensors exist one
    chunk at a time; only the logits (model dtype) and their gradient are whole. The same ops on the same rows, so
    the logprobs and the gradient are bit for bit those of ``chunk_rows=0`` (``tests/test_trainer_logprobs.py`` on
    CPU, ``tests/test_trainer_gpu.py`` on CUDA: the log-softmax is batch-invariant and its backward's row sum adds
    one nonzero). The entropy is a float sum over each row whose order torch's CUDA reduction picks by the number
    of rows: it may differ in the last bits between chunk sizes on CUDA (as it does between micro-batch sizes), and
    so may the gradient when the entropy is in the loss (``entropy_grad``). The LM head's GEMMs are not chunked.
    Measured: docs/BENCHMARKS.md ("one train step").

    On CUDA without ``entropy_grad`` (:func:`fused_path`) the logprob, the entropy and the
    logprob's gradient come from fused Triton passes (:mod:`rlrepro.kernels.triton_logprob`) instead of the torch
    ops: the same logprob and gradient bits (GPU test), no ``[tokens, vocab]`` float32 tensor but one chunk's
    ``logits.float()``, and an entropy summed in one fixed order per row (independent of the other rows and of
    ``chunk_rows``; its last bits differ from the torch ops'). ``RLREPRO_FUSED_LOGPROB=0`` keeps the torch ops.
    """
    logits, targets, lengths = _completion_logits(model, prompt_token_ids, completion_token_ids)
    if fused_path(logits, entropy_grad):
        lp, ent = _FusedTokenLogprob.apply(logits, targets, float(temperature), int(chunk_rows))
        return list(torch.split(lp, lengths)), list(torch.split(ent, lengths))
    if chunk_rows and chunk_rows < logits.shape[0]:
        lp, ent = _ChunkedTokenLogprob.apply(logits, targets, float(temperature), int(chunk_rows), bool(entropy_grad))
        return list(torch.split(lp, lengths)), list(torch.split(ent, lengths))
    lp, log_probs = _token_logprob_rows(logits, targets, temperature)
    if entropy_grad:
        ent = entropy(log_probs)
    else:
        with torch.no_grad():
            ent = entropy(log_probs.detach())
    return list(torch.split(lp, lengths)), list(torch.split(ent, lengths))


def _token_logprob_rows(logits: torch.Tensor, targets: torch.Tensor,
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs of some logits rows and their log-softmax (both with the autograd graph when grad is on):
    the one sequence of ops behind both the unchunked and the chunked path."""
    log_probs = tempered_log_softmax(logits, temperature)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), log_probs


class _ChunkedTokenLogprob(torch.autograd.Function):
    """Token logprobs and entropies of ``logits`` [M, V], ``chunk`` rows at a time. The backward recomputes each
    chunk's log-softmax (and entropy) under autograd and takes its gradient: the unchunked path's ops on the same
    rows. The entropy is differentiable only with ``entropy_grad``."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, entropy_grad):
        m = logits.shape[0]
        lp = torch.empty(m, dtype=torch.float32, device=logits.device)
        ent = torch.empty(m, dtype=torch.float32, device=logits.device)
        for r0 in range(0, m, chunk):
            part_lp, log_probs = _token_logprob_rows(logits[r0:r0 + chunk], targets[r0:r0 + chunk], temperature)
            lp[r0:r0 + chunk] = part_lp
            ent[r0:r0 + chunk] = entropy(log_probs)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, targets = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_ent = None
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits)
        chunk = ctx.chunk
        for r0 in range(0, logits.shape[0], chunk):
            with torch.enable_grad():
                rows = logits[r0:r0 + chunk].detach().requires_grad_(True)
                part_lp, log_probs = _token_logprob_rows(rows, targets[r0:r0 + chunk], ctx.temperature)
                outputs, grads = [], []
                if grad_lp is not None:
                    outputs.append(part_lp)
                    grads.append(grad_lp[r0:r0 + chunk])
                if grad_ent is not None:
                    outputs.append(entropy(log_probs))
                    grads.append(grad_ent[r0:r0 + chunk])
                (grad[r0:r0 + chunk],) = torch.autograd.grad(outputs, rows, grads)
        return grad, None, None, None, None


def fused_path(logits: torch.Tensor, entropy_grad: bool) -> bool:
    """Whether :func:`logprobs_and_entropy` takes the fused Triton passes: CUDA logits [rows, vocab], no entropy
    gradient, and ``RLREPRO_FUSED_LOGPROB`` not ``0``. In both kernel modes: a fused loss is what a fast training
    stack runs too (verl's fused kernels), so the fast mode keeps it and deterministic-vs-fast compares the rest."""
    return (logits.is_cuda and logits.dim() == 2 and logits.shape[0] > 0 and not entropy_grad
            and os.environ.get("RLREPRO_FUSED_LOGPROB", "1") != "0")


class _FusedTokenLogprob(torch.autograd.Function):
    """Token logprobs and (non-differentiable) entropies of ``logits`` [M, V] through
    :mod:`rlrepro.kernels.triton_logprob`: the forward scales ``chunk`` rows at a time (all when 0) with
    ``kernels.scale_logits`` and keeps each row's log-sum-exp; the backward writes the logits' gradient in one
    pass. The bits of :func:`_token_logprob_rows` and its autograd backward (GPU test)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk):
        from rlrepro.kernels import triton_logprob
        m = logits.shape[0]
        step = chunk if 0 < chunk < m else m
        # a target outside [0, vocab) matches no column: its logprob stays NaN (never stale memory)
        lp = torch.full((m,), float("nan"), dtype=torch.float32, device=logits.device)
        ent, lse = (torch.empty(m, dtype=torch.float32, device=logits.device) for _ in range(2))
        for r0 in range(0, m, step):
            r1 = r0 + step
            triton_logprob.token_logprob_entropy(kernels.scale_logits(logits[r0:r1], temperature),
                                                 targets[r0:r1], lp[r0:r1], ent[r0:r1], lse[r0:r1])
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        from rlrepro.kernels import triton_logprob
        if grad_lp is None:
            return None, None, None, None
        logits, targets, lse = ctx.saved_tensors
        return triton_logprob.token_logprob_grad(logits, targets, lse, grad_lp, ctx.temperature), None, None, None
