"""Qwen3 on rlrepro kernels: parity with transformers, checkpoint round trips, full-sequence == cached decode."""
import json
import random

import pytest
import torch

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata
from rlrepro.model import (Qwen3Config, Qwen3ForCausalLM, init_random_weights, load_pretrained, load_tokenizer,
                           save_pretrained, tiny_model, write_tiny_checkpoint)

transformers = pytest.importorskip("transformers")


def _hf_logits(path, ids):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tmp_path, tie):
    path = write_tiny_checkpoint(tmp_path / "m", seed=3, tie_word_embeddings=tie, num_hidden_layers=3)
    model = load_pretrained(path)
    ids = [[random.randrange(60) for _ in range(37)] for _ in range(2)]
    with torch.no_grad():
        ours = model(torch.tensor(ids))
    ref = _hf_logits(path, ids)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_transformers_checkpoint_loads_and_roundtrips(tmp_path):
    """HF writes, we read; we write (sharded), HF reads: the same weights bit for bit both ways."""
    cfg = transformers.Qwen3Config(vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).float()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    hf_state = hf.state_dict()
    for name, p in ours.state_dict().items():
        assert torch.equal(p, hf_state[name]), name
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=20_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "ours").glob("model-*.safetensors"))) > 1
    back = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "ours"))
    for name, p in back.state_dict().items():
        assert torch.equal(p, hf_state[name]), name
    again = load_pretrained(tmp_path / "ours")
    for name, p in again.state_dict().items():
        assert torch.equal(p, hf_state[name]), name


def test_dtype_override_and_default(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", seed=0)
    assert load_pretrained(path).dtype == torch.float32
    assert load_pretrained(path, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_rows_of_a_batch_are_independent():
    model = tiny_model(seed=1)
    rng = random.Random()
    base = [rng.randrange(60) for _ in range(29)]
    with torch.no_grad():
        alone = model(torch.tensor([base]))[0]
        for b in (2, 3, 7):
            batch = [[rng.randrange(60) for _ in range(29)] for _ in range(b)]
            pos = rng.randrange(b)
            batch[pos] = base
            assert torch.equal(model(torch.tensor(batch))[pos], alone)


def test_full_sequence_equals_chunked_cached_decode():
    """The trainer's path (one packed forward) and the engine's (prefill chunks + decode on a paged cache)."""
    model = tiny_model(seed=2)
    cfg = model.config
    rng = random.Random()
    tokens = [rng.randrange(cfg.vocab_size) for _ in range(45)]
    with torch.no_grad():
        full = model.compute_logits(model.forward_tokens(torch.tensor(tokens), AttentionMetadata.packed([45])))
        bs, nb = 8, 16
        caches = [(torch.zeros(nb, bs, cfg.num_key_value_heads, cfg.head_dim),
                   torch.zeros(nb, bs, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
        blocks = rng.sample(range(nb), 6)
        done, rows = 0, []
        for chunk in [11, 7, 1, 1, 13, 1, 1, 10]:
            meta = AttentionMetadata.paged([chunk], [done + chunk], [blocks], bs)
            hidden = model.forward_tokens(torch.tensor(tokens[done:done + chunk]), meta, caches)
            rows.append(model.compute_logits(hidden))
            done += chunk
    assert done == 45
    assert torch.equal(torch.cat(rows), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_path_equals_the_training_path(dtype):
    """Without autograd, forward_tokens folds each residual add into the norm after it (Qwen3DecoderLayer.
    forward_pending + kernels.add_rms_norm); with autograd it runs the plain adds and norms. Same bits."""
    model = tiny_model(seed=5, dtype=dtype)
    ids = torch.randint(0, 60, (37,))
    meta = AttentionMetadata.packed([20, 17])
    with torch.no_grad():
        fused = model.forward_tokens(ids, meta)
    with torch.enable_grad():
        plain = model.forward_tokens(ids, meta)
    assert plain.requires_grad and not fused.requires_grad
    assert torch.equal(fused, plain.detach())


def test_fast_mode_close_to_deterministic():
    model = tiny_model(seed=4)
    ids = torch.randint(0, 60, (3, 20))
    with torch.no_grad():
        det = model(ids)
        with kernels.mode("fast"):
            fast = model(ids)
    torch.testing.assert_close(fast, det, rtol=1e-4, atol=1e-4)


def test_init_random_weights_is_seeded_and_dtype_independent():
    a = tiny_model(seed=7)
    b = tiny_model(seed=7)
    c = tiny_model(seed=8)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    bf = init_random_weights(Qwen3ForCausalLM(a.config).to(torch.bfloat16), 7)
    for pa, pb in zip(a.parameters(), bf.parameters()):
        assert torch.equal(pa.to(torch.bfloat16), pb)


def test_tokenizer_and_chat_template(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    tok = load_tokenizer(path)
    ids = tok.encode("12+7=")
    assert tok.decode(ids) == "12+7=" and len(ids) == 5
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "1+1="}])
    assert text == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert hf_tok.encode("ab c") == tok.encode("ab c")


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_pretrained(tmp_path / "nope")
    path = write_tiny_checkpoint(tmp_path / "m", max_shard_bytes=30_000)
    shards = sorted(path.glob("model-*.safetensors"))
    shards[0].write_bytes(shards[0].read_bytes()[:100])
    with pytest.raises(ValueError, match=shards[0].name):
        load_pretrained(path)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_pretrained(path)
    bad = write_tiny_checkpoint(tmp_path / "b")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type"):
        load_pretrained(bad)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=3, num_key_value_heads=2, head_dim=4)


def test_out_of_vocab_ids_rejected():
    model = tiny_model(seed=0)
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(torch.tensor([[1, 2, 999]]))
