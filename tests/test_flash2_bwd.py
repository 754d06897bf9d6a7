"""The FA2-backward experiment of issue #27 (``rlrepro/kernels/flash2_bwd.py``, ``RLREPRO_ATTENTION_BWD=flash2``).

On the CPU: the switch, the refusal without deterministic algorithms, and the log-sum-exp conversion in both
layouts torch's FA2 versions use. On an H200: the gradients through autograd against float64, the same bits on
every rerun, against the Triton backward, and after FA3's forward (``RLREPRO_ATTENTION=fa3``) as well."""
from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import fresh_seed, rel_err
from rlrepro.kernels import flash2_bwd as F2
from rlrepro.kernels import triton_ops as T
from rlrepro.kernels.metadata import AttentionMetadata


def test_the_switch(monkeypatch):
    q = torch.zeros(3, 4, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("RLREPRO_ATTENTION_BWD", "flash2")
    assert T._attention_bwd_impl(q) == "torch"  # CPU tensors: FA2 is CUDA's
    assert not F2.supported(q)
    # on CUDA a call FA2 cannot serve is an error naming the dtype, not a silent fallback (fa3's rule)
    from types import SimpleNamespace
    fp32 = SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=(3, 4, 128))
    with pytest.raises(RuntimeError, match="does not serve torch.float32 with head size 128"):
        T._attention_bwd_impl(fp32)
    assert T._attention_bwd_impl(SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(3, 4, 128))) == "flash2"
    monkeypatch.setenv("RLREPRO_ATTENTION_BWD", "flash3")
    with pytest.raises(ValueError, match="'flash2', not 'flash3'"):
        T._attention_bwd_impl(q)


def test_it_refuses_to_run_without_deterministic_algorithms(monkeypatch):
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
        F2.attention_bwd(*([None] * 5), 1.0, None, None)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: True)
    with pytest.raises(RuntimeError, match="warn_only"):
        F2.attention_bwd(*([None] * 5), 1.0, None, None)


@pytest.mark.parametrize("layout", ["hn", "bhs"])
def test_the_log_sum_exp_in_fa2s_convention(layout):
    lens = [3, 1, 5]
    meta = AttentionMetadata.packed(lens)
    lse2 = torch.randn(9, 2)
    got = F2.fa2_lse(lse2, meta, layout)
    cu = [0, 3, 4, 9]
    for s, n in enumerate(lens):
        for t in range(n):
            want = lse2[cu[s] + t] * math.log(2.0)
            have = got[:, cu[s] + t] if layout == "hn" else got[s, :, t]
            assert torch.equal(have, want)
    assert got.shape == ((2, 9) if layout == "hn" else (3, 2, 5))


# ---------------------------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("forward", ["triton", "fa3"])
def test_gpu_flash2_backward(forward, monkeypatch):
    from rlrepro import kernels
    from rlrepro.kernels import flashinfer_attention as FI
    if forward == "fa3":
        if torch.cuda.get_device_capability()[0] != 9 or FI.flashinfer_module() is None:
            pytest.skip("FA3 needs a Hopper GPU and flashinfer")
        monkeypatch.setenv("RLREPRO_ATTENTION", "fa3")
    from test_fa3_attention import BACKWARD_LENS, backward_case
    seed = fresh_seed()
    q, k, v, go, scale, want64 = backward_case()
    meta = AttentionMetadata.packed(BACKWARD_LENS, device="cuda")

    def grads(impl):
        monkeypatch.setenv("RLREPRO_ATTENTION_BWD", impl)
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        kernels.attention(*leaves, meta, scale).backward(go)
        return [t.grad for t in leaves]

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = grads("flash2")
        again = [grads("flash2") for _ in range(3)]
        triton = grads("triton")
    finally:
        torch.use_deterministic_algorithms(was)
    assert F2.lse_layout(q.device) in ("hn", "bhs")
    assert all(torch.equal(a, b) for r in again for a, b in zip(got, r)), f"rerun differs (seed {seed})"
    for name, x, want, tri in zip(("dq", "dk", "dv"), got, want64[1:], triton):
        assert rel_err(x, want) < 3e-2, f"{name} vs float64 (seed {seed})"
        assert rel_err(x, tri) < 3e-2, f"{name} vs the Triton backward (seed {seed})"
