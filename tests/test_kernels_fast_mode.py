"""The fast mode's flashinfer glue on CPU (kernels/flashinfer_attention.py): the page table handed to flashinfer,
one plan per forward whatever the number of layers, the fallback when flashinfer is absent or turned off. The
kernels themselves run on the GPU (tests/test_attention_gpu_long.py)."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata
from rlrepro.kernels import flashinfer_attention as FA


@pytest.fixture
def fresh_module_cache(monkeypatch):
    monkeypatch.setattr(FA, "_MODULE", [])
    monkeypatch.setattr(FA, "_WRAPPERS", {})
    monkeypatch.setattr(FA, "_WORKSPACE", {})


def test_page_table_device_and_host_forms_agree():
    lens, bs = [1, 16, 17, 40], 16
    tables = [[7, 99, 99], [3, 99, 99], [4, 5, 99], [0, 1, 2]]
    indptr, indices, last = FA._page_table(torch.tensor(lens), torch.tensor(tables), bs)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [7, 3, 4, 5, 0, 1, 2]
    assert last.tolist() == [1, 16, 1, 8]
    assert FA.host_page_table(lens, tables, bs) == (indptr.tolist(), indices.tolist(), last.tolist())
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_absent_or_disabled_flashinfer_falls_back_and_says_so(fresh_module_cache, monkeypatch, caplog):
    monkeypatch.setenv("RLREPRO_FLASHINFER", "0")
    with caplog.at_level(logging.INFO, logger="rlrepro.kernels"):
        assert FA.flashinfer_module() is None
        assert FA.flashinfer_module() is None  # decided once
    assert not FA.serves(torch.device("cuda"), torch.bfloat16, 128)
    monkeypatch.delenv("RLREPRO_FLASHINFER")
    monkeypatch.setattr(FA, "_MODULE", [])
    monkeypatch.setattr(FA.importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError("nope")))
    with caplog.at_level(logging.INFO, logger="rlrepro.kernels"):
        assert FA.flashinfer_module() is None
    assert "flashinfer is not usable (ImportError: nope)" in caplog.text
    assert "rlrepro[flashinfer]" in caplog.text
    # fast mode on CPU is stock torch whatever flashinfer does: RMSNorm is the float32 formula
    x, w = torch.randn(5, 8), torch.randn(8)
    with kernels.mode("fast"):
        got = kernels.rms_norm(x, w, 1e-6)
    assert torch.equal(got, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))


class _Wrapper:
    def __init__(self, log, kind, *args, **kw):
        self.log, self.kind, self.kw = log, kind, kw

    def plan(self, *args, **kw):
        self.log.append(("plan", self.kind, args, kw))

    def run(self, q, *args):
        self.log.append(("run", self.kind))
        return torch.zeros_like(q)


def _fake_flashinfer(log):
    return types.SimpleNamespace(
        __version__="fake",
        BatchPrefillWithRaggedKVCacheWrapper=lambda *a, **k: _Wrapper(log, "ragged", *a, **k),
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: _Wrapper(log, "paged_prefill", *a, **k),
        BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: _Wrapper(log, "decode", *a, **k))


def test_one_plan_per_forward_for_every_path(fresh_module_cache, monkeypatch):
    log: list = []
    monkeypatch.setattr(FA, "_MODULE", [_fake_flashinfer(log)])
    monkeypatch.setattr(FA, "_prefill_backend", lambda device: "fa3")
    q, k, v = torch.randn(9, 4, 64), torch.randn(9, 2, 64), torch.randn(9, 2, 64)
    meta = AttentionMetadata.packed([4, 5])
    for _layer in range(3):
        FA.ragged_prefill(q, k, v, meta, 0.125)
    plans = [e for e in log if e[0] == "plan"]
    assert len(plans) == 1 and plans[0][1] == "ragged"
    assert plans[0][2][0].tolist() == [0, 4, 9] and plans[0][3]["causal"] is True
    assert [e for e in log if e[0] == "run"] == [("run", "ragged")] * 3
    # another forward plans the shared wrapper for its own metadata; the first forward's next call plans again
    other = AttentionMetadata.packed([9])
    FA.ragged_prefill(q, k, v, other, 0.125)
    FA.ragged_prefill(q, k, v, meta, 0.125)
    plans = [e for e in log if e[0] == "plan"]
    assert [p[2][0].tolist() for p in plans] == [[0, 4, 9], [0, 9], [0, 4, 9]]
    cache = (torch.zeros(6, 4, 2, 64), torch.zeros(6, 4, 2, 64))
    log.clear()
    dec = AttentionMetadata.paged([1, 1], [3, 6], [[0, 9], [1, 2]], 4)
    for _layer in range(2):
        FA.paged(q[:2], dec, 0.125, cache)
    pre = AttentionMetadata.paged([3, 2], [3, 6], [[0, 9], [1, 2]], 4)
    FA.paged(q[:5], pre, 0.125, cache)
    plans = [e for e in log if e[0] == "plan"]
    assert [p[1] for p in plans] == ["decode", "paged_prefill"]
    assert plans[0][2][0].tolist() == [0, 1, 3] and plans[0][2][1].tolist() == [0, 1, 2]
    assert plans[0][2][2].tolist() == [3, 2]
    assert plans[1][2][0].tolist() == [0, 3, 5]  # the queries' indptr
