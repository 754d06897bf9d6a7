"""Attention at long context on one GPU: rlrepro's deterministic Triton kernels against flashinfer and torch SDPA.

    python3 benchmarks/bench_attention_long.py [--out FILE.md] [--lengths 2048,8192,16384,32768]

Qwen3-8B's head shape (H=32, Hkv=8, D=128), bf16, causal. Per case (batch x length; every sequence of the case
has that length):

* forward TFLOP/s: rlrepro packed (tensor-descriptor KV tiles, and with ``RLREPRO_ATTENTION_TMA=0``), flashinfer's
  ragged prefill with its FA3 and FA2 backends (when flashinfer imports), SDPA (flash) on the dense batch;
* backward TFLOP/s (2.5x the forward's FLOPs): rlrepro's Triton backward against SDPA's flash backward;
* bits: rlrepro with and without descriptors (``torch.equal``), a sequence alone vs in the batch (``torch.equal``).

Then flashinfer's decode (paged, 64 requests) with its default split-KV and with ``fixed_split_size``: is a
request's output the same alone as in the batch? (The evidence for whether flashinfer can be batch-invariant.)
Timings are ``triton.testing.do_bench`` medians (L2 flushed between runs), in one process, so ratios compare
variants measured together.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import bench, emit, write  # noqa: E402

from rlrepro.kernels import AttentionMetadata  # noqa: E402
from rlrepro.kernels.fast import flashinfer_module  # noqa: E402
from rlrepro.kernels.triton_attention import attention_bwd_packed_triton, attention_fwd  # noqa: E402

H, HKV, D = 32, 8, 128


def causal_flops(batch: int, length: int) -> float:
    return 4.0 * batch * H * D * length * length / 2  # QK^T and PV, half the square


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def case(batch: int, length: int, fi) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(batch * 100003 + length)
    n = batch * length
    q = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    go = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    scale = D ** -0.5
    meta = AttentionMetadata.packed([length] * batch, dev)
    flops = causal_flops(batch, length)
    row = {}
    out = attention_fwd(q, k, v, meta, scale)
    row["rlrepro"] = bench(lambda: attention_fwd(q, k, v, meta, scale))
    os.environ["RLREPRO_ATTENTION_TMA"] = "0"
    try:
        out_ptr = attention_fwd(q, k, v, meta, scale)
        row["rlrepro (pointer loads)"] = bench(lambda: attention_fwd(q, k, v, meta, scale))
    finally:
        del os.environ["RLREPRO_ATTENTION_TMA"]
    same_tma = torch.equal(out, out_ptr)
    meta1 = AttentionMetadata.packed([length], dev)
    alone = attention_fwd(q[-length:].contiguous(), k[-length:].contiguous(), v[-length:].contiguous(), meta1, scale)
    same_alone = torch.equal(alone, out[-length:])
    qd, kd, vd = (t.view(batch, length, -1, D).transpose(1, 2) for t in (q, k, v))
    row["SDPA"] = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                               enable_gqa=True))
    if fi is not None:
        indptr = torch.arange(0, n + 1, length, dtype=torch.int32, device=dev)
        for backend in ("fa3", "fa2"):
            try:
                ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
                w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(indptr, indptr, H, HKV, D, causal=True, sm_scale=scale, q_data_type=torch.bfloat16)
                w.run(q, k, v)
                row[f"flashinfer {backend}"] = bench(lambda: w.run(q, k, v))
            except Exception as e:  # noqa: BLE001 - report and go on
                emit(f"  flashinfer {backend} failed: {type(e).__name__}: {e}")
    fwd = " | ".join(f"{name} {ms:.3f} ms ({tflops(flops, ms):.0f})" for name, ms in row.items())
    base = row.get("flashinfer fa3") or row["SDPA"]
    emit(f"| {batch} x {length} | fwd | {fwd} | rlrepro / {'FA3' if 'flashinfer fa3' in row else 'SDPA'}: "
         f"{base / row['rlrepro']:.2f} | TMA == pointer: {same_tma}, alone == in batch: {same_alone} |")
    # backward
    t_r = bench(lambda: attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out))
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (qd, kd, vd))
    o_s = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
    gos = go.view(batch, length, H, D).transpose(1, 2)
    t_s = bench(lambda: torch.autograd.grad(o_s, (qg, kg, vg), gos, retain_graph=True))
    g1 = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out)
    g2 = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out)
    rep = all(torch.equal(a, b) for a, b in zip(g1, g2))
    emit(f"| {batch} x {length} | bwd | rlrepro {t_r:.3f} ms ({tflops(2.5 * flops, t_r):.0f}) | SDPA {t_s:.3f} ms "
         f"({tflops(2.5 * flops, t_s):.0f}) | rlrepro / SDPA: {t_s / t_r:.2f} | run to run equal: {rep} |")
    del q, k, v, go, out, out_ptr, qg, kg, vg, o_s
    torch.cuda.empty_cache()


def decode_invariance(fi, batch: int = 64, ctx: int = 2048, page: int = 16) -> None:
    """flashinfer's paged decode: one request alone vs the same request in a batch of ``batch``."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    pages_per = ctx // page
    kc = torch.randn(batch * pages_per, page, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(batch * pages_per, page, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    lens = [ctx - 37 * i for i in range(batch)]  # unequal lengths
    scale = D ** -0.5

    def run(rows: list[int], **plan_kw):
        pages = [list(range(r * pages_per, r * pages_per + -(-lens[r] // page))) for r in rows]
        indptr = torch.tensor([0] + [sum(len(p) for p in pages[:i + 1]) for i in range(len(rows))],
                              dtype=torch.int32, device=dev)
        indices = torch.tensor([b for p in pages for b in p], dtype=torch.int32, device=dev)
        last = torch.tensor([(lens[r] - 1) % page + 1 for r in rows], dtype=torch.int32, device=dev)
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=plan_kw.pop("tc", False))
        w.plan(indptr, indices, last, H, HKV, D, page, q_data_type=torch.bfloat16, sm_scale=scale, **plan_kw)
        return w.run(q[rows].contiguous(), (kc, vc)), w

    for name, kw in (("default (CUDA cores)", {}), ("tensor cores", {"tc": True}),
                     ("tensor cores, fixed_split_size=64 pages", {"tc": True, "fixed_split_size": 64}),
                     ("tensor cores, disable_split_kv", {"tc": True, "disable_split_kv": True})):
        try:
            full, w = run(list(range(batch)), **dict(kw))
            worst, equal = 0.0, True
            for r in (0, 1, batch // 2, batch - 1):
                alone, _ = run([r], **dict(kw))
                equal &= torch.equal(alone[0], full[r])
                worst = max(worst, float((alone[0].float() - full[r].float()).abs().max()))
            ms = bench(lambda: w.run(q, (kc, vc)))
            kv_bytes = sum(lens) * HKV * D * 2 * 2
            emit(f"| flashinfer decode, {name} | {batch} x ~{ctx} | {ms:.4f} ms, {kv_bytes / ms / 1e6:.0f} GB/s | "
                 f"alone == in batch: {equal} (max diff {worst:.2e}) |")
        except Exception as e:  # noqa: BLE001
            emit(f"| flashinfer decode, {name} | failed: {type(e).__name__}: {str(e)[:200]} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--lengths", default="2048,8192,16384,32768")
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_long.py needs a CUDA GPU")
        return 1
    fi = flashinfer_module()
    emit(f"### Attention at long context ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
         f"flashinfer {getattr(fi, '__version__', 'absent')})")
    emit("")
    emit("| case | pass | ms (TFLOP/s) per kernel | ratio | bits |")
    emit("|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        batch = 4 if length <= 8192 else max(1, 32768 // length)
        case(batch, length, fi)
    if fi is not None and not args.no_decode:
        emit("")
        emit("| flashinfer decode | shape | time, KV bandwidth | batch invariance |")
        emit("|---|---|---|---|")
        decode_invariance(fi)
    write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
