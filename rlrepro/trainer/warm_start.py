"""A deterministic supervised warm-start: a few steps of next-token cross-entropy on (prompt, answer) pairs.

GRPO needs some reward signal inside a group; a random tiny model almost never produces an answer, so the CPU
recipe first teaches it the answer format on examples drawn with their own seed. Batches are a pure function
of the seed, the loss is computed with the same batch-invariant kernels, and AdamW runs without foreach/fused
paths, so the warm-started weights are identical run to run.
"""
from __future__ import annotations

import random

import torch

from .logprobs import token_logprobs


def supervised_warm_start(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], *, steps: int,
                          lr: float, batch_size: int, seed: int) -> list[float]:
    if steps <= 0:
        return []
    if not examples:
        raise ValueError("warm_start.steps > 0 needs examples; the data produced none")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False, fused=False)
    losses = []
    model.train()
    for _ in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        lps = token_logprobs(model, [p for p, _ in batch], [c for _, c in batch], temperature=1.0)
        loss = -torch.cat(lps).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
