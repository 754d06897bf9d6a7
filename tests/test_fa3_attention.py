"""The FA3 experiment of issue #27 (``rlrepro/kernels/fa3_attention.py``, ``RLREPRO_ATTENTION=fa3``).

On the CPU: the switch's errors, and the bookkeeping (1-token pages for the packed layout, the paged plans, the
GQA fold of decode steps) against a float64 stand-in of flashinfer's paged FA3 wrapper, through the same
invariance battery the Triton kernels pass (packed == alone == reordered == paged, chunked and decoded).
On an H200 with flashinfer: that battery on FA3 itself with ``torch.equal``, engine == trainer at an 8k context,
and the Triton backward from FA3's output and log-sum-exp against float64."""
from __future__ import annotations

import pytest
import torch

from _fake_flashinfer import FakeFlashinfer
from _triton_helpers import fresh_seed, rel_err
from rlrepro.kernels import fa3_attention as F3
from rlrepro.kernels import flashinfer_attention as FI
from rlrepro.kernels import reference as ref
from rlrepro.kernels.metadata import AttentionMetadata
from test_triton_kernels import check_attention_invariance, make_paged_case


def test_the_switch_names_a_bad_value_and_leaves_cpu_tensors_alone(monkeypatch):
    monkeypatch.delenv("RLREPRO_ATTENTION", raising=False)
    assert not F3.requested()
    monkeypatch.setenv("RLREPRO_ATTENTION", "triton")
    assert not F3.requested()
    monkeypatch.setenv("RLREPRO_ATTENTION", "flash3")
    with pytest.raises(ValueError, match="'flash3'"):
        F3.requested()
    monkeypatch.setenv("RLREPRO_ATTENTION", "FA3")
    assert F3.requested()
    assert not F3.usable(torch.zeros(2, 4, 128, dtype=torch.bfloat16))  # the CPU path has its own kernels


def test_the_fold_puts_a_groups_heads_in_one_requests_rows():
    q = torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 8, 2)  # 3 requests, 8 heads, 2 KV heads: groups of 4
    f = F3._fold(q, 2)
    assert f.shape == (12, 2, 2)
    for r in range(3):
        for g in range(4):
            for j in range(2):
                assert torch.equal(f[r * 4 + g, j], q[r, j * 4 + g])
    assert torch.equal(F3._unfold(f, 8), q)


@pytest.fixture
def fake_fa3(monkeypatch):
    monkeypatch.setattr(FI, "_MODULE", [FakeFlashinfer])
    monkeypatch.setattr(FI, "_WRAPPERS", {})
    monkeypatch.setattr(FI, "WORKSPACE_BYTES", 8)
    monkeypatch.setattr(F3, "_use_variant", lambda w, *args: w)  # fa3_variants compiles flashinfer's sources


def _fa3_attention(q, k, v, meta, scale, kv_cache=None):
    """``triton_ops.attention``'s FA3 branches, called directly (on the CPU nothing selects them)."""
    if kv_cache is None:
        return F3.packed(q, k, v, meta, scale)
    flat = [c.view(-1, *c.shape[2:]) for c in kv_cache]
    flat[0][meta.slot_mapping] = k
    flat[1][meta.slot_mapping] = v
    return F3.paged(q, meta, scale, kv_cache)


def test_packed_paged_chunked_and_folded_decode_address_the_right_rows(fake_fa3):
    """With a kernel that computes each row alone, every path must give the float64 rows bit for bit: any slip
    in the page tables, the 1-token pages, the causal flags or the fold shows as a difference."""
    check_attention_invariance(_fa3_attention, [9, 1, 17, 4, 33], h=8, hkv=2, d=16, dtype=torch.float32,
                               device="cpu", block_sizes=(4, 16), tol=1e-6)


def test_the_packed_lse_is_base_2_and_the_plans_are_kept_per_forward(fake_fa3):
    fresh_seed()
    lens = [7, 1, 12]
    q, k, v = make_paged_case(lens, 4, 2, 16, torch.float32, "cpu")
    meta = AttentionMetadata.packed(lens)
    out, lse = F3.packed(q, k, v, meta, 0.25, return_lse=True)
    assert rel_err(out, ref.attention_packed(q, k, v, meta, 0.25)) < 1e-6
    want = torch.cat([torch.logsumexp((torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double().repeat_interleave(
        2, 1)) * 0.25).masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf")), -1).T
        for a, b in ((0, 7), (7, 8), (8, 20))]) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert float((lse.double() - want).abs().max()) < 1e-5
    w = FI._WRAPPERS[("cpu", None, F3._KEY, "packed")]
    planned = w.t
    F3.packed(q, k, v, meta, 0.25)  # a second layer of the same forward: the plan is reused, not redone
    assert w.t is planned
    F3.packed(q, k, v, AttentionMetadata.packed(lens), 0.25)  # another forward plans again
    assert w.t is not planned


def test_the_packed_forward_at_head_size_128_runs_the_ragged_kernel_with_96_position_tiles(fake_fa3, monkeypatch):
    """At head size 128 the trainer's forward is the ragged (TMA) wrapper, planned once a forward and switched to
    the ``ragged96`` variant after every plan (flashinfer's plan puts its stock module back); the rows and the
    base-2 lse are those of the float64 stand-in, through the whole invariance battery."""
    used = []
    monkeypatch.setattr(F3, "_use_variant", lambda w, name, dtype, d: used.append((name, dtype, d)) or w)
    check_attention_invariance(_fa3_attention, [9, 1, 17, 4], h=4, hkv=2, d=128, dtype=torch.float32,
                               device="cpu", block_sizes=(4,), tol=1e-6)
    assert used and set(used) == {("ragged96", torch.float32, 128)}
    assert ("cpu", None, F3._KEY, "ragged") in FI._WRAPPERS
    assert ("cpu", None, F3._KEY, "packed") not in FI._WRAPPERS  # no 1-token pages at this head size
    used.clear()
    lens = [7, 1, 12]
    q, k, v = make_paged_case(lens, 4, 2, 128, torch.float32, "cpu")
    meta = AttentionMetadata.packed(lens)
    out, lse = F3.packed(q, k, v, meta, 0.25, return_lse=True)
    assert rel_err(out, ref.attention_packed(q, k, v, meta, 0.25)) < 1e-6
    F3.packed(q, k, v, meta, 0.25)  # a second layer of the same forward: no new plan, no new switch
    assert len(used) == 1
    want = torch.logsumexp((torch.einsum("qhd,khd->hqk", q[:7].double(), k[:7].double().repeat_interleave(2, 1))
                            * 0.25).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf")), -1).T
    assert float((lse[:7].double() - want / torch.log(torch.tensor(2.0, dtype=torch.float64))).abs().max()) < 1e-5


def test_the_graph_decode_plans_a_fixed_fold(fake_fa3):
    g = F3.GraphDecode(3, 12, 8, 2, 16, 4, torch.float32, torch.device("cpu"), 0.25)
    g.plan([5, 1, 9], [[0, 1], [2], [3, 4, 5]])
    qo, kvp, idx, last, page = g.wrapper.t
    assert qo == [0, 4, 8, 12] and kvp == [0, 2, 3, 6] and idx == [0, 1, 2, 3, 4, 5] and last == [1, 1, 1]
    assert page == 4 and not g.wrapper.causal and g.wrapper.heads == (2, 2, 16)
    assert g.wrapper.use_cuda_graph and g.wrapper.buffers["paged_kv_indices_buf"].numel() == 12


# ---------------------------------------------------------------------------------------------- GPU (H200)


def _hopper_with_flashinfer(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3 needs a Hopper GPU")
    if FI.flashinfer_module() is None:
        pytest.skip("flashinfer is not installed (pip install 'rlrepro[flashinfer]')")
    monkeypatch.setenv("RLREPRO_ATTENTION", "fa3")


@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fa3_attention_invariance(h, hkv, monkeypatch):
    """Around FA3's 96-position KV tiles (paged) and 128-row query tiles: packed (1-token pages) == alone ==
    reordered == paged whole, chunked and decoded (GQA folded), ``torch.equal``."""
    from rlrepro.kernels import triton_ops as T
    _hopper_with_flashinfer(monkeypatch)
    check_attention_invariance(T.attention, [95, 96, 97, 127, 128, 129, 1, 191, 192, 193, 300, 2], h=h, hkv=hkv,
                               d=128, dtype=torch.bfloat16, device="cuda", block_sizes=(16, 64), tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fa3_engine_equals_trainer_at_8k_context(monkeypatch):
    """The 8,200-token check of ``test_attention_gpu_long`` on FA3: chunked prefill on FA3 and decode on the CUDA
    graphs (head size 128: FA3's arithmetic in Triton, no flashinfer plan per replay) == the trainer's forward
    with autograd."""
    from test_attention_gpu_long import check_engine_equals_trainer_at_8k
    _hopper_with_flashinfer(monkeypatch)
    fresh_seed()

    def on_fa3_graphs(engine):
        assert F3.triton_decode(128, 8, 2)
        assert not engine.runner._fi_graphs  # the Triton decode needs no GraphDecode
    check_engine_equals_trainer_at_8k(on_fa3_graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fa3_engine_equals_trainer_at_head_size_64_on_fa3s_own_decode(monkeypatch):
    """At head size 64 (another FA3 tile than the Triton decode reproduces) decode steps run FA3's folded decode,
    one :class:`GraphDecode` a CUDA-graph size planned before each replay: the engine's logprobs == the trainer's
    forward with autograd, bit for bit."""
    from rlrepro import kernels
    from rlrepro.model import tiny_model
    from rlrepro.rollout import Engine, SamplingParams
    _hopper_with_flashinfer(monkeypatch)
    fresh_seed()
    model = tiny_model(seed=4, dtype=torch.bfloat16, initializer_range=0.3, head_dim=64, num_attention_heads=8,
                       num_key_value_heads=2, hidden_size=256, max_position_embeddings=2048).cuda()
    assert not F3.triton_decode(64, 8, 2)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (700, 95, 1, 300)]
    engine = Engine(model, device="cuda", max_num_batched_tokens=512, num_kv_blocks=400, max_num_seqs=4,
                    max_model_len=1024)
    graphs = engine.runner._fi_graphs
    assert graphs and all(isinstance(x, F3.GraphDecode) for x in graphs.values())
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=9, ignore_eos=True)
    outs = engine.generate(prompts, [params] * len(prompts))
    assert engine.runner.num_graph_steps > 0
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p + out.token_ids], device="cuda")
        with torch.enable_grad():
            logits = model(ids)[0, len(p) - 1:-1].detach()
        want = kernels.token_logprob(logits, torch.tensor(out.token_ids, device="cuda"), 1.0)
        assert torch.equal(torch.tensor(out.logprobs, dtype=torch.float32, device="cuda"), want)


BACKWARD_LENS = [1500, 97, 65, 1, 300]


def backward_case():
    """bf16 q, k, v (8 heads, 2 KV heads, D 128) of ``BACKWARD_LENS`` packed, an output gradient, the scale, and
    the float64 output and gradients ``[out, dq, dk, dv]`` (on the CPU) to hold the kernels' against."""
    h, hkv, d = 8, 2, 128
    q, k, v = make_paged_case(BACKWARD_LENS, h, hkv, d, torch.bfloat16, "cuda")
    go = torch.randn_like(q)
    scale = d ** -0.5
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    o64 = ref.attention_packed(q64, k64, v64, AttentionMetadata.packed(BACKWARD_LENS), scale)
    o64.backward(go.double().cpu())
    return q, k, v, go, scale, [o64.detach(), q64.grad, k64.grad, v64.grad]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fa3_forward_with_the_triton_backward(monkeypatch):
    """Autograd through ``kernels.attention``: FA3's forward (its lse feeds the Triton backward) against float64,
    run to run equal, and a sequence's gradients alone equal to those in the batch."""
    from rlrepro import kernels
    _hopper_with_flashinfer(monkeypatch)
    seed = fresh_seed()
    lens = BACKWARD_LENS
    q, k, v, go, scale, want64 = backward_case()

    def grads(q, k, v, go, lens):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = kernels.attention(*leaves, AttentionMetadata.packed(lens, device="cuda"), scale)
        out.backward(go)
        return [out.detach()] + [t.grad for t in leaves]

    got = grads(q, k, v, go, lens)
    for name, x, want in zip(("out", "dq", "dk", "dv"), got, want64):
        assert rel_err(x, want) < 3e-2, f"{name} vs float64 (seed {seed})"
    assert all(torch.equal(a, b) for a, b in zip(got, grads(q, k, v, go, lens))), f"rerun differs (seed {seed})"
    a, b = sum(lens[:2]), sum(lens[:3])
    alone = grads(q[a:b], k[a:b], v[a:b], go[a:b], lens[2:3])
    assert all(torch.equal(x, y[a:b]) for x, y in zip(alone, got)), f"sequence alone differs (seed {seed})"
