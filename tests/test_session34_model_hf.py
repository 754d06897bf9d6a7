"""Session 34: a user's own Hugging Face Qwen3 checkpoint (made by transformers) through rlrepro's public loading
and export API: sharded == single file bit for bit, dtypes, tied heads, logits against transformers, export
reloaded by transformers; and config fields / tensors rlrepro cannot honour refused with a clear error."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlrepro.model import checkpoint_io, load_pretrained, save_pretrained
from rlrepro.model.checkpoint_io import check_pretrained

transformers = pytest.importorskip("transformers")

VOCAB = 96
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _hf_model(tie=False, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=tie,
                                   max_position_embeddings=256, **kw)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()


def _save(hf, path, shard=None):
    hf.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def _edit_tensors(path, fn, file="model.safetensors"):
    tensors = load_file(path / file)
    fn(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def _refused(path, match):
    """Both the header-only check (what a run does before it starts) and the load refuse ``path``."""
    with pytest.raises(ValueError, match=match):
        check_pretrained(path)
    with pytest.raises(ValueError, match=match):
        load_pretrained(path)


# ---- what already works (kept as regression tests) ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tie", [False, True])
def test_sharded_and_single_file_loads_are_bitwise_equal_to_the_hf_weights(tmp_path, dtype, tie):
    hf = _hf_model(tie=tie, dtype=dtype)
    single = load_pretrained(_save(hf, tmp_path / "single"))
    sharded_dir = _save(hf, tmp_path / "sharded", shard="20KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_pretrained(sharded_dir)
    assert single.dtype == sharded.dtype == dtype
    assert (single.lm_head is None) == (sharded.lm_head is None) == tie
    a, b, ref = single.state_dict(), sharded.state_dict(), hf.state_dict()
    assert sorted(a) == sorted(b) and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(a[name], ref[name]), name


@pytest.mark.parametrize("tie", [False, True])
def test_logits_close_to_transformers(tmp_path, tie):
    hf = _hf_model(tie=tie, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    model = load_pretrained(_save(hf, tmp_path))
    assert model.config.rope_theta == 50000.0
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(ids, use_cache=False).logits, model(ids)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tie", [False, True])
def test_export_reloads_in_transformers_with_the_same_tensors_and_logits(tmp_path, dtype, tie):
    hf = _hf_model(tie=tie, dtype=dtype, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    model = load_pretrained(_save(hf, tmp_path / "src"))
    save_pretrained(model, tmp_path / "out")
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == dtype and back.config.tie_word_embeddings == tie
    mine, theirs = model.state_dict(), back.state_dict()
    for name, t in mine.items():
        assert torch.equal(theirs[name], t), name
    # against the source directory as transformers loads it (hf.to(dtype) above also cast its RoPE buffer)
    src = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "src")
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids, use_cache=False).logits, src(ids, use_cache=False).logits)


def test_config_dtype_wins_over_the_stored_one_and_a_missing_dtype_takes_the_stored_one(tmp_path):
    d = _save(_hf_model(dtype=torch.float32), tmp_path / "a")
    _edit_config(d, dtype="bfloat16")
    assert load_pretrained(d).dtype == torch.bfloat16  # as transformers' dtype="auto"
    d = _save(_hf_model(dtype=torch.float16), tmp_path / "b")
    raw = json.loads((d / "config.json").read_text())
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    (d / "config.json").write_text(json.dumps(raw))
    assert load_pretrained(d).dtype == torch.float16


# ---- defects found in session 34 ----

def test_rope_scaling_beside_default_rope_parameters_is_refused(tmp_path):
    # transformers 5 writes rope_parameters; a user adding rope_scaling (as Qwen3's model card says for YaRN) got
    # default RoPE from rlrepro while transformers ran YaRN (rope_scaling wins there)
    d = _save(_hf_model(), tmp_path)
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    _refused(d, "rope type 'yarn' is not supported.*remove rope_scaling")


def test_conflicting_rope_theta_keys_are_refused(tmp_path):
    # top-level rope_theta was taken; transformers 5 takes rope_parameters' (silently different logits)
    d = _save(_hf_model(), tmp_path)
    _edit_config(d, rope_theta=5000.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    _refused(d, r"rope_theta=5000.0.*rope_parameters.rope_theta=1000000.0.*keep one")
    _edit_config(d, rope_theta=1e6)  # agreeing copies are fine
    assert load_pretrained(d).config.rope_theta == 1e6


def test_partial_rotary_factor_is_refused(tmp_path):
    d = _save(_hf_model(), tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    _refused(d, "partial_rotary_factor=0.5 is not supported")


def test_sliding_attention_layer_types_are_refused(tmp_path):
    d = _save(_hf_model(), tmp_path)
    assert json.loads((d / "config.json").read_text())["layer_types"] == ["full_attention"] * 2
    _edit_config(d, layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    _refused(d, r"layer_types.*'sliding_attention'.*layers \[1\].*full_attention")


def test_quantization_config_is_refused(tmp_path):
    d = _save(_hf_model(), tmp_path)
    _edit_config(d, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    _refused(d, "quantization_config.*'fp8'.*not supported.*unquantized")


@pytest.mark.parametrize("arch", [["Qwen3ForSequenceClassification"], ["Qwen3Model"], "Qwen3ForCausalLM"])
def test_an_architecture_other_than_qwen3_for_causal_lm_is_refused(tmp_path, arch):
    d = _save(_hf_model(), tmp_path)
    _edit_config(d, architectures=arch)
    _refused(d, "architectures.*Qwen3ForCausalLM")


@pytest.mark.parametrize("stored", [torch.int8, torch.float8_e4m3fn, torch.bool])
def test_non_float_or_fp8_stored_tensors_are_refused(tmp_path, stored):
    # they were cast to the compute dtype silently (a quantized checkpoint's int8 codes became weights)
    d = _save(_hf_model(), tmp_path)
    _edit_tensors(d, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(stored)))
    _refused(d, r"'model.norm.weight'.*stored as (I8|F8_E4M3|BOOL).*F32, F16 or BF16")


def test_tied_config_with_a_different_stored_lm_head_is_refused(tmp_path):
    # transformers 5 loads the stored lm_head (untied); rlrepro skipped it and used embed_tokens: other logits
    d = _save(_hf_model(tie=True), tmp_path)
    _edit_tensors(d, lambda t: t.__setitem__("lm_head.weight", torch.randn(VOCAB, 64)))
    with pytest.raises(ValueError, match="tie_word_embeddings=true.*lm_head.weight.*differs.*tie_word_embeddings"):
        load_pretrained(d)
    # an lm_head.weight equal to the embedding (older saves store both) still loads, tied
    _edit_tensors(d, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert load_pretrained(d).lm_head is None


def test_single_file_beside_an_index_is_refused(tmp_path):
    # rlrepro read the index's shards, transformers reads model.safetensors: two different models
    d = _save(_hf_model(), tmp_path, shard="20KB")
    other = _hf_model(seed=5).state_dict()
    save_file({k: v.contiguous() for k, v in other.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    _refused(d, "both model.safetensors and model.safetensors.index.json.*delete")


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    d = _save(_hf_model(), tmp_path, shard="20KB")
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    home = weight_map["model.embed_tokens.weight"]
    other = sorted(set(weight_map.values()) - {home})[0]
    _edit_tensors(d, lambda t: t.__setitem__("model.embed_tokens.weight", torch.zeros(VOCAB, 64)), file=other)
    _refused(d, "'model.embed_tokens.weight' is stored in both")


def test_untied_checkpoint_without_lm_head_names_the_tie_fix(tmp_path):
    d = _save(_hf_model(), tmp_path)
    _edit_tensors(d, lambda t: t.pop("lm_head.weight"))
    _refused(d, r"lacks tensors \['lm_head.weight'\].*tie_word_embeddings")


@pytest.mark.parametrize("bad", ["shape", "extra", "missing"])
def test_tensor_problems_fail_before_any_tensor_is_read(tmp_path, monkeypatch, bad):
    d = _save(_hf_model(), tmp_path, shard="20KB")
    last = sorted(d.glob("model-*.safetensors"))[-1]
    name = sorted(load_file(last))[0]
    if bad == "shape":
        _edit_tensors(d, lambda t: t.__setitem__(name, torch.zeros(3, 3)), file=last.name)
        match = rf"'{name}' has shape \(3, 3\), config.json implies .*do not belong together"
    elif bad == "extra":
        _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)),
                      file=last.name)
        match = "'model.layers.0.self_attn.q_proj.bias', which a Qwen3ForCausalLM does not have.*Qwen3"
    else:
        _edit_tensors(d, lambda t: t.pop(name), file=last.name)
        match = rf"lacks tensors \['{name}'\]"
    reads = []
    real = checkpoint_io.safe_open

    class Counting:
        def __init__(self, *a, **k):
            self.h = real(*a, **k)

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def get_tensor(self, n):
            reads.append(n)
            return self.h.get_tensor(n)

        def __getattr__(self, attr):
            return getattr(self.h, attr)

    monkeypatch.setattr(checkpoint_io, "safe_open", Counting)
    with pytest.raises(ValueError, match=match):
        load_pretrained(d)
    assert reads == []


def test_a_config_without_any_rope_base_runs_transformers_default(tmp_path):
    """config.json with no rope_theta anywhere (no rope_parameters, no rope_scaling): transformers runs 10,000;
    rlrepro ran 1,000,000 (logits 0.12 apart, no error). Now the same base, and logits close to transformers'."""
    hf = _hf_model()
    path = _save(hf, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        raw.pop(key, None)
    (path / "config.json").write_text(json.dumps(raw))
    ref_model = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    model = load_pretrained(path)
    assert model.config.rope_theta == 10_000.0
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = ref_model(ids, use_cache=False).logits, model(ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
