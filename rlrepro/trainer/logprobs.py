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
    t = float(temperature) if temperature > 0 else 1.0
    return kernels.log_softmax(logits.float() / t)


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` over the last dim, from a (float32) log-softmax. ``0 * -inf`` counts as 0."""
    p = log_probs.exp()
    return -torch.where(p > 0, p * log_probs, torch.zeros_like(log_probs)).sum(dim=-1)


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
                   temperature: float = 1.0) -> list[torch.Tensor]:
    """Float32 logprob of every completion token under ``model`` at ``temperature``: one 1-D tensor per sample.

    ``temperature <= 0`` means 1 (greedy rollouts report the untempered distribution), as in the engine.
    """
    logits, targets, lengths = _completion_logits(model, prompt_token_ids, completion_token_ids)
    lp = kernels.token_logprob(logits, targets, temperature)
    return list(torch.split(lp, lengths))


def logprobs_and_entropy(model, prompt_token_ids: Sequence[Sequence[int]],
                         completion_token_ids: Sequence[Sequence[int]], temperature: float = 1.0,
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`token_logprobs` plus the entropy of the tempered distribution at each of those positions.

    One log-softmax serves both. The logprobs carry grad (when grad is on); the entropy is a detached metric.
    """
    logits, targets, lengths = _completion_logits(model, prompt_token_ids, completion_token_ids)
    log_probs = tempered_log_softmax(logits, temperature)
    lp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        ent = entropy(log_probs.detach())
    return list(torch.split(lp, lengths)), list(torch.split(ent, lengths))
