"""Write a model directory with Qwen3-8B's config.json (optionally fewer layers) and the character tokenizer,
for `model.init=random` runs where no Qwen3-8B weights are at hand. The weights are then created by rlrepro
itself (seeded) and saved/loaded through the same code as a real checkpoint.

    python scripts/make_qwen3_shape.py --out /tmp/qwen3_8b_shape --layers 4
"""
import argparse
import json
from pathlib import Path

from rlrepro.model.tiny import CHAT_TEMPLATE, build_char_tokenizer

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                torch_dtype="bfloat16", model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                attention_bias=False, hidden_act="silu", use_sliding_window=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU smoke test of the same scripts)")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    # Name every other id of the 151,936-token vocabulary, so that what a random model samples decodes to distinct
    # text (the systems reward hashes the text; unnamed ids would all decode to "").
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(f"<t{i}>", normalized=False) for i in range(tok.get_vocab_size(), QWEN3_8B["vocab_size"])])
    cfg = dict(QWEN3_8B, num_hidden_layers=ns.layers, eos_token_id=tok.token_to_id("<|im_end|>"))
    if ns.small:
        # 4 KV heads: the recipe's tensor parallel size (4) must divide them (GRPO_SET=eight smoke test)
        cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    print(out)


if __name__ == "__main__":
    main()
