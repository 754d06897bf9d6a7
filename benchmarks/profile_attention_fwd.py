"""One causal packed forward of each kernel under a profiler (issue #27: where the Gluon forward's consumers stall
against FlashAttention-3's), on Qwen3-8B heads (H 32 / Hkv 8 / D 128, bf16).

    python3 benchmarks/profile_attention_fwd.py --shape 4x2048 --kernels gluon,fa3 [--iters 3]

Each kernel runs ``--iters`` times after one warm-up (its compile); run it under ``ncu`` (``scripts/gpu_check.sh
profile_fwd`` does, with the sections it names) or ``nsys``. ``RLREPRO_ATTENTION_ORDER`` and the ``GLW_*``
variables choose the Gluon kernel's order and variant as everywhere."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_gluon import gluon_fwd  # noqa: E402

from rlrepro.kernels import AttentionMetadata  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4x2048", help="BATCHxLENGTH")
    ap.add_argument("--kernels", default="gluon,fa3", help="comma list of gluon, fa3, sdpa")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    batch, length = (int(x) for x in args.shape.split("x"))
    n, h, hkv, d = batch * length, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, x, d, device="cuda", dtype=torch.bfloat16, generator=gen) for x in (h, hkv, hkv))
    meta = AttentionMetadata.packed([length] * batch, device="cuda")
    scale = d ** -0.5
    runs = {}
    for name in args.kernels.split(","):
        if name == "gluon":
            runs[name] = lambda: gluon_fwd(q, k, v, meta, scale)
        elif name == "fa3":
            import flashinfer
            indptr = torch.arange(0, n + 1, length, dtype=torch.int32, device="cuda")
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
            w.plan(indptr, indptr, h, hkv, d, causal=True, sm_scale=scale, q_data_type=q.dtype)
            runs[name] = lambda w=w: w.run(q, k, v)
        elif name == "sdpa":
            import torch.nn.functional as F
            qd, kd, vd = (t.view(batch, length, -1, d).transpose(1, 2) for t in (q, k, v))
            runs[name] = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                                enable_gqa=True)
        else:
            raise SystemExit(f"--kernels: unknown kernel {name!r} (gluon, fa3, sdpa)")
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        for _ in range(args.iters):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"{name}: ran {args.iters} times", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
