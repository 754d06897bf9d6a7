"""The FA3 invariance probe's bookkeeping (benchmarks/probe_fa3_invariance.py) on the CPU, with a float64 stand-in
for flashinfer's two prefill wrappers: page tables, chunks, decode rows, the folded GQA group and the 1-token-page
layout must address the right rows, so that its one GPU call measures the kernel and not the script. The GPU run
itself is ``scripts/gpu_check.sh fa3_invariance``."""
from __future__ import annotations

import importlib.util
import math
import os

import torch

from _fake_flashinfer import FakeFlashinfer, Wrapper

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _probe():
    spec = importlib.util.spec_from_file_location("probe_fa3", os.path.join(ROOT, "benchmarks",
                                                                            "probe_fa3_invariance.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LENS = [9, 1, 4, 17, 3]
HEADS = (4, 2, 8)


def test_every_check_holds_for_a_row_by_row_kernel_and_matches_float64():
    p = _probe()
    case = p.Case(LENS, HEADS, "cpu", page=4)
    res = p.bits(FakeFlashinfer, torch.zeros(8, dtype=torch.uint8), case)
    assert set(res) == {"alone", "reversed", "chunk512", "chunk300", "decode", "folded", "pages1", "ragged"}
    assert all(res.values()), res
    out, lse = p.whole(FakeFlashinfer, None, case, list(range(len(LENS))))
    ro, rl = p.reference(case)
    assert float((out.double() - ro).abs().max()) < 2e-2
    assert float((lse.double() * math.log(2.0) - rl).abs().max()) < 1e-5
    # the small case must exercise chunks and decode rows for real: chunked at 3 and 300 tokens differ in steps
    o3, _ = p.chunked(FakeFlashinfer, None, case, 3)
    assert torch.equal(o3, out)
    assert len(p.decode_rows(case)) > len(LENS)


def test_a_kernel_whose_rows_follow_the_call_fails_the_checks(monkeypatch):
    p = _probe()
    monkeypatch.setattr(Wrapper, "drift_per_request", 0.25)
    res = p.bits(FakeFlashinfer, None, p.Case(LENS, HEADS, "cpu", page=4))
    assert not res["alone"] and not res["decode"] and not res["folded"]
    assert res["reversed"]  # the same requests in another order: the same drift, so the same rows


def test_the_timings_run_their_calls(monkeypatch):
    """The speed half at toy sizes on the CPU: every call it times is made once (the stand-in computes; rlrepro's
    kernel is the float64 reference), and no row reports a failure."""
    from rlrepro.kernels import reference as ref
    from rlrepro.kernels import triton_attention
    p = _probe()
    monkeypatch.setattr(p, "DEVICE", "cpu")
    monkeypatch.setattr(p, "H", 4)
    monkeypatch.setattr(p, "HKV", 2)
    monkeypatch.setattr(p, "D", 8)
    monkeypatch.setattr(p, "PAGE", 4)
    monkeypatch.setattr(p, "PREFILL_CASES", ((2, 9), (1, 13)))
    monkeypatch.setattr(p, "CHUNK_CASE", (3, 5, 12))
    monkeypatch.setattr(p, "DECODE_CASE", (3, 10))
    calls = []

    def once(fn):
        calls.append(fn())
        return 1.0
    monkeypatch.setattr(p, "bench", once)

    def reference_fwd(q, k, v, meta, scale, config=None, return_lse=False):  # rlrepro's rows: only called here
        return ref.attention_packed(q, k, v, meta, scale) if meta.block_table is None else q.clone()
    monkeypatch.setattr(triton_attention, "attention_fwd", reference_fwd)
    import _report  # on sys.path once the probe is loaded
    start = len(_report.LINES)
    p.speed(FakeFlashinfer, None)
    rows = _report.LINES[start:]
    assert not any("failed" in r for r in rows), rows
    assert len(calls) == 2 * 4 + 2 + 4
    one, folded, decode = calls[-4], calls[-3], calls[-2]  # the decode rows: the same rows three ways
    assert torch.equal(one, decode)
    assert torch.equal(one, folded.view(3, 2, 2, 8).transpose(1, 2).reshape(3, 4, 8))
    assert torch.equal(calls[0], calls[1]) and torch.equal(calls[0], calls[2])  # ragged == paged 4 == paged 1
    assert sum("TFLOP/s" in r for r in rows) == 8 and sum("TB/s" in r for r in rows) == 4
