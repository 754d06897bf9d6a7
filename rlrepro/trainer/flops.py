"""Model FLOPs of a train step (for ``perf/mfu``), and the GPUs' bf16 dense peaks."""
from __future__ import annotations

from collections.abc import Sequence

from .updates import mini_batches

__all__ = ["PEAK_BF16_FLOPS", "train_flops", "peak_flops"]

# bf16 dense tensor-core peak (FLOP/s) by GPU name, for MFU; GPUs not listed get no MFU
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak of a GPU by its name (``torch.cuda.get_device_name()``), or None when not listed."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def train_flops(config, samples: Sequence, train_config) -> float:
    """Model FLOPs of one train step on ``samples`` (all ranks together): a forward pass for the KL reference when
    kl_coef > 0, and forward + backward (3 forwards) per PPO epoch (the on-policy check reuses the first epoch's
    forward). With ``train.mini_batch_size`` every sample is still trained once per epoch (in its mini-batch's
    update), and the samples after the first mini-batch take one more forward (no grad, before the first update:
    the on-policy check and the proximal logprobs; :mod:`rlrepro.trainer.updates`). A forward costs
    2 FLOPs per matmul weight per token for the layers' linears (the embedding lookup is free), 2 per lm_head
    weight for each completion token only (the trainer computes logits where a completion token is predicted, not
    at prompt positions), plus causal attention, 2 * 2 * layers * heads * head_dim * (i + 1) for the token at
    position i."""
    h, L = config.hidden_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    per_sample = []
    for s in samples:
        c = len(s.completion_token_ids)
        n = len(s.prompt_token_ids) + c
        per_sample.append(2.0 * L * per_layer * n + 2.0 * h * config.vocab_size * c + 4.0 * L * q * n * (n + 1) / 2)
    fwd = sum(per_sample)
    passes = (1 if train_config.kl_coef > 0 else 0) + 3 * train_config.ppo_epochs
    minis = mini_batches(len(per_sample), getattr(train_config, "mini_batch_size", None))
    later = sum(per_sample[minis[0].stop:]) if len(minis) > 1 else 0.0  # the no-grad pass before the first update
    return fwd * passes + later
