"""The deterministic attention backward's tile configs on one GPU, against SDPA's flash backward.

    python3 benchmarks/bench_attention_bwd.py [--out FILE.md] [--cases 4x2048,1x16384] [--no-sweep]
                                              [--kv-parts "64,32,8,3;64,64,8,2"]

Qwen3-8B's head shape (H=32, Hkv=8, D=128), bf16, causal, packed sequences of equal length. For each candidate
``AttentionBwdConfig`` (the dQ part and the dK/dV part vary separately; the other part keeps the default):

* the dQ kernel alone (``dq_only=True``) and both kernels, ``triton.testing.do_bench`` medians (L2 flushed);
* TFLOP/s counted as FlashAttention counts a backward (2.5x the forward's causal FLOPs) for the whole backward;
  the dK/dV kernel's time is the whole minus the dQ kernel's;
* bits: two calls equal (``torch.equal``), tensor-descriptor loads equal pointer loads (``RLREPRO_ATTENTION_TMA=0``),
  a sequence alone equal to the same sequence in the batch, the gradients equal the first row's (the default's),
  and the relative error against SDPA's gradients (float32 math would differ in the last bits; this only catches a
  wrong kernel).

``--kv-parts`` runs the default and the named dK/dV parts only; ``--no-sweep`` the default only. (The one-kernel
backward that ``--fused`` measured is in the history: commit 54d07f2, docs/BENCHMARKS.md.)

Also the forward's output with and without the log-sum-exp written (``torch.equal``: the trainer's forward writes
it, the engine's does not). A benchmark reports, it asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _report import bench, emit, rel, write  # noqa: E402
from rlrepro.kernels import AttentionMetadata  # noqa: E402
from rlrepro.kernels.triton_attention import (attention_bwd_packed_triton, attention_fwd,  # noqa: E402
                                              pick_attention_bwd_config)

H, HKV, D = 32, 8, 128
DQ_PARTS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2),
            (128, 32, 4, 3)]
KV_PARTS = [(64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3),
            (128, 64, 8, 3)]


def make_case(batch: int, length: int):
    """Seeded bf16 q, k, v and an output gradient for ``batch`` packed sequences of ``length``, their metadata,
    scale and backward FLOPs (2.5x the forward's causal count), and the Triton forward's output and lse."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + length)
    n = batch * length
    q, go = (torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    scale = D ** -0.5
    meta = AttentionMetadata.packed([length] * batch, dev)
    flops = 2.5 * 4.0 * batch * H * D * length * length / 2
    out, lse = attention_fwd(q, k, v, meta, scale, return_lse=True)
    return q, k, v, go, meta, scale, flops, out, lse


def case(batch: int, length: int, sweep: bool = True, kv_parts=None) -> None:
    dev = torch.device("cuda")
    n = batch * length
    q, k, v, go, meta, scale, flops, out, lse = make_case(batch, length)
    same_fwd = torch.equal(out, attention_fwd(q, k, v, meta, scale))
    qd, kd, vd = (t.detach().view(batch, length, -1, D).transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    o_s = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
    gos = go.view(batch, length, H, D).transpose(1, 2)
    ref = [t.transpose(1, 2).reshape(n, -1, D) for t in torch.autograd.grad(o_s, (qd, kd, vd), gos, retain_graph=True)]
    t_sdpa = bench(lambda: torch.autograd.grad(o_s, (qd, kd, vd), gos, retain_graph=True))
    emit(f"#### {batch} x {length}: SDPA flash backward {t_sdpa:.3f} ms ({flops / t_sdpa / 1e9:.0f} TFLOP/s); "
         f"forward with lse == without: {same_fwd}")
    emit("")
    emit("| config (dq_rows,dq_kv,w,s / kv_block,kv_rows,w,s) | dQ ms | dK/dV ms | total ms | TFLOP/s | vs SDPA | "
         "rerun == | TMA == ptr | alone == batch | == first row | rel err vs SDPA (dq, dk, dv) |")
    emit("|---|---:|---:|---:|---:|---:|---|---|---|---|---|")
    base = pick_attention_bwd_config(D, 2)
    cfgs = [replace(base, dq_rows=a, dq_kv=b, dq_warps=c, dq_stages=d) for a, b, c, d in DQ_PARTS]
    cfgs += [replace(base, kv_block=a, kv_rows=b, kv_warps=c, kv_stages=d) for a, b, c, d in KV_PARTS[1:]]
    if not sweep:
        cfgs = [base]
    if kv_parts:  # --kv-parts: the default, then the dK/dV parts named (the dQ part kept)
        cfgs = [base] + [replace(base, kv_block=a, kv_rows=b, kv_warps=c, kv_stages=d) for a, b, c, d in kv_parts]
    g_first = None
    for cfg in cfgs:
        try:
            g1 = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse, config=cfg)
            g_first = g1 if g_first is None else g_first
            same_first = all(torch.equal(a, b) for a, b in zip(g1, g_first))
            g2 = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse, config=cfg)
            os.environ["RLREPRO_ATTENTION_TMA"] = "0"
            try:
                g3 = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse, config=cfg)
            finally:
                del os.environ["RLREPRO_ATTENTION_TMA"]
            sl = slice(n - length, n)
            m1 = AttentionMetadata.packed([length], dev)
            alone = attention_bwd_packed_triton(q[sl].contiguous(), k[sl].contiguous(), v[sl].contiguous(),
                                                go[sl].contiguous(), m1, scale, out=out[sl].contiguous(),
                                                lse=lse[sl].contiguous(), config=cfg)
            t_dq = bench(lambda: attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse, config=cfg,
                                                             dq_only=True))
            t_all = bench(lambda: attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse, config=cfg))
            rerun = all(torch.equal(a, b) for a, b in zip(g1, g2))
            tma = all(torch.equal(a, b) for a, b in zip(g1, g3))
            al = all(torch.equal(a, b[sl]) for a, b in zip(alone, g1))
            errs = ", ".join(f"{rel(a, b):.1e}" for a, b in zip(g1, ref))
            name = (f"{cfg.dq_rows},{cfg.dq_kv},{cfg.dq_warps},{cfg.dq_stages} / "
                    f"{cfg.kv_block},{cfg.kv_rows},{cfg.kv_warps},{cfg.kv_stages}")
            emit(f"| {name} | {t_dq:.3f} | {t_all - t_dq:.3f} | {t_all:.3f} | {flops / t_all / 1e9:.0f} | "
                 f"{t_sdpa / t_all:.2f} | {rerun} | {tma} | {al} | {same_first} | {errs} |")
        except Exception as e:  # noqa: BLE001 - report and go on
            emit(f"| {cfg} | failed: {type(e).__name__}: {str(e)[:300]} |")
    emit("")
    del q, k, v, go, out, lse, qd, kd, vd, o_s, ref
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cases", default="4x2048,1x16384")
    ap.add_argument("--no-sweep", action="store_true", help="the two-kernel backward's default config only")
    ap.add_argument("--kv-parts", help="the default and these dK/dV parts only: 'kv_block,kv_rows,warps,stages;...'")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_bwd.py needs a CUDA GPU")
        return 1
    emit(f"### Attention backward tile configs ({torch.cuda.get_device_name(0)}, torch {torch.__version__})")
    emit("")
    for c in args.cases.split(","):
        b, L = (int(x) for x in c.split("x"))
        kv = [tuple(int(x) for x in p.split(",")) for p in args.kv_parts.split(";")] if args.kv_parts else None
        case(b, L, sweep=not args.no_sweep, kv_parts=kv)
    write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
