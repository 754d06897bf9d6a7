"""Fused q/k/v and gate/up projections (Qwen3ForCausalLM.fuse_projections): the bookkeeping on the CPU, the bits
on CUDA (where the engine turns it on)."""
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.model.checkpoint_io import load_pretrained, save_pretrained
from rlrepro.rollout import Engine, SamplingParams


def _ids(n=12, seed=0):
    return torch.randint(0, 60, (1, n), generator=torch.Generator().manual_seed(seed))


def test_fused_weights_alias_the_parameters_and_follow_updates():
    model = tiny_model(seed=0)
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    model.fuse_projections()
    after = dict(model.named_parameters())
    assert list(after) == list(params)
    assert all(after[k] is params[k] for k in params)  # same Parameter objects: optimizers keep working
    assert all(torch.equal(after[k], before[k]) for k in params)
    attn = model.model.layers[0].self_attn
    assert attn.qkv.usable() is False  # gradients enabled and the weights require grad
    with torch.no_grad():
        assert attn.qkv.usable() and model.model.layers[0].mlp.gate_up.usable()
        attn.k_proj.weight.add_(1.0)  # an in-place update reaches the fused tensor
        nq = attn.q_proj.weight.shape[0]
        assert torch.equal(attn.qkv.weight[nq:nq + attn.k_proj.weight.shape[0]], attn.k_proj.weight)


def test_fused_forward_matches_and_falls_back_when_storage_moves(tmp_path):
    ref = tiny_model(seed=0)
    model = tiny_model(seed=0).fuse_projections()
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        got = model(ids)
        # the CPU kernels need not give the same bits for a wider N; the math is the same
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.double().float()  # .to() gives every weight new storage: the fused tensors go stale, unused
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        assert not attn.qkv.usable()
        assert torch.equal(model(ids), want)  # back to one product per linear: the unfused bits
    model.fuse_projections()  # fuses again
    with torch.no_grad():
        assert attn.qkv.usable()
    save_pretrained(model, tmp_path / "m")  # views are written as tensors of their own
    loaded = load_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ref.state_dict().values()))


def test_fusing_again_with_gradients_on_keeps_the_fused_tensors():
    """A second engine on one model is built with grad mode on, where ``usable()`` is False: fusing again must not
    move the weights to new tensors, or the first engine's CUDA graphs would read freed memory."""
    model = tiny_model(seed=0).fuse_projections()
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv.weight, layer.mlp.gate_up.weight
    assert torch.is_grad_enabled() and not layer.self_attn.qkv.usable()
    model.fuse_projections()
    assert layer.self_attn.qkv.weight is qkv and layer.mlp.gate_up.weight is gate_up
    assert layer.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    Engine(model, device="cpu", fuse_projections=True, max_num_seqs=4, max_model_len=64)
    assert layer.self_attn.qkv.weight is qkv and layer.mlp.gate_up.weight is gate_up


def test_tensor_parallel_emulation_disables_the_fused_product_off_cuda():
    """On the CPU a column split is P products (their bits may differ from one wider product): no fusing."""
    model = tiny_model(seed=0).fuse_projections()
    model.set_tensor_parallel_emulation(2)
    x = torch.zeros(3, model.config.hidden_size)
    with torch.no_grad():
        assert not model.model.layers[0].self_attn.qkv.usable(x)
        assert not model.model.layers[0].mlp.gate_up.usable(x)
        assert not model.model.layers[0].self_attn.qkv.usable()  # no input: nothing to decide on
    assert model.model.layers[0].self_attn.qkv.intact()  # the layout holds: fuse_projections keeps the tensors


def test_engine_with_fused_projections_loads_weights_into_them():
    model = tiny_model(seed=0)
    engine = Engine(model, device="cpu", fuse_projections=True, max_num_seqs=4, max_model_len=64)
    attn = model.model.layers[0].self_attn
    assert attn.qkv is not None
    other = tiny_model(seed=1)
    engine.load_weights(other.named_parameters(), version=1)
    nq = attn.q_proj.weight.shape[0]
    with torch.no_grad():
        assert attn.qkv.usable()
        assert torch.equal(attn.qkv.weight[:nq], other.model.layers[0].self_attn.q_proj.weight)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert Engine(tiny_model(seed=0), device="cpu", max_num_seqs=4,
                  max_model_len=64).model.model.layers[0].self_attn.qkv is None  # CPU default: off


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_projections_are_bitwise_neutral_on_cuda():
    ref = tiny_model(seed=0, dtype=torch.bfloat16).cuda()
    fused = tiny_model(seed=0, dtype=torch.bfloat16).cuda().fuse_projections()
    for n in (1, 7, 64, 65, 300):
        ids = _ids(n, seed=n).cuda()
        with torch.no_grad():
            assert torch.equal(ref(ids), fused(ids)), n
    prompts = [_ids(5 + 3 * i, seed=i)[0].tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    a = Engine(tiny_model(seed=0, dtype=torch.bfloat16).cuda(), device="cuda", fuse_projections=False,
               max_num_seqs=8, max_model_len=128).generate(prompts, params)
    b = Engine(tiny_model(seed=0, dtype=torch.bfloat16).cuda(), device="cuda", fuse_projections=True,
               max_num_seqs=8, max_model_len=128).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_projections_under_tensor_parallel_emulation_are_bitwise_neutral_on_cuda():
    """Under emulation (``train.tp_partials`` / a TP trainer's engines) CUDA's column split is the one whole product,
    so q|k|v and gate|up stay fused: the same logits and the same engine tokens and logprobs as the unfused model
    (emulated TP 2)."""
    for tp in (2,):  # (the tiny model has 2 KV heads)
        ref = tiny_model(seed=0, dtype=torch.bfloat16).cuda().set_tensor_parallel_emulation(tp)
        fused = tiny_model(seed=0, dtype=torch.bfloat16).cuda().fuse_projections().set_tensor_parallel_emulation(tp)
        x = torch.zeros(2, fused.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert fused.model.layers[0].self_attn.qkv.usable(x) and fused.model.layers[0].mlp.gate_up.usable(x)
            for n in (1, 7, 65):
                ids = _ids(n, seed=n).cuda()
                assert torch.equal(ref(ids), fused(ids)), (tp, n)
    prompts = [_ids(5 + 3 * i, seed=i)[0].tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    outs = [Engine(tiny_model(seed=0, dtype=torch.bfloat16).cuda().set_tensor_parallel_emulation(2), device="cuda",
                   fuse_projections=fuse, max_num_seqs=8, max_model_len=128).generate(prompts, params)
            for fuse in (False, True)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.logprobs for o in outs[0]] == [o.logprobs for o in outs[1]]
