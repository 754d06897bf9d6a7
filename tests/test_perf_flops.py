"""perf/train_flops: the model-FLOPs count behind perf/mfu."""
from types import SimpleNamespace

from rlrepro.samples import Sample
from rlrepro.trainer.flops import train_flops


def test_train_flops_counts_layers_at_every_token_and_the_lm_head_at_completion_tokens():
    cfg = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=4, intermediate_size=16, vocab_size=100)
    samples = [Sample("p", 0, prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], rollout_logprobs=[0.0, 0.0])]
    # per layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16 each = 64 + 64 + 64 + 384 = 576 weights
    layers = 2 * 2 * 576 * 5  # 2 FLOPs per weight per token, 5 tokens, 2 layers
    head = 2 * 8 * 100 * 2  # 2 completion tokens
    attn = 4 * 2 * 8 * (1 + 2 + 3 + 4 + 5)  # 4 * layers * q_width * (i + 1) summed
    fwd = layers + head + attn
    one_epoch = SimpleNamespace(kl_coef=0.0, ppo_epochs=1)
    assert train_flops(cfg, samples, one_epoch) == 3 * fwd  # forward/backward (the on-policy check reuses it)
    with_kl = SimpleNamespace(kl_coef=0.1, ppo_epochs=2)
    assert train_flops(cfg, samples, with_kl) == (1 + 6) * fwd  # the reference forward + 2 epochs
