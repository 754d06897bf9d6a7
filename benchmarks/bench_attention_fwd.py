"""The deterministic attention forward's variants, side by side on one GPU: speed and the bit promises of each.

    python3 benchmarks/bench_attention_fwd.py [--out FILE.md] [--variants kv64,kv128-s3,...] [--no-bits]

A variant sets the reduction order (``RLREPRO_ATTENTION_ORDER``: KV positions per online-softmax step and whether
the scale is folded into an FMA, so variants of another order differ in bits from the shipped kernel), the prefill
tile (rows, warps, pipeline stages),
whether packed KV tiles are read by TMA descriptors, and (``-nR``) a cap of R registers a thread (all speed
only). Each variant is checked for the promises on its own, and a 64-position one against the shipped kernel's
output (``torch.equal``). (The PREFETCH_QK and WIDE_QK loops were measured here and removed: docs/BENCHMARKS.md.)

* every tile config (16, 64, 128 rows and the variant's prefill tile) gives the same bits, GQA 4 and 1
  (``torch.equal``);
* packed == paged (block 16) == chunked prefill == decode, a sequence alone == in the batch, with the 128-row
  tile switched in at 64 tokens so calls mix configs (the GPU test suite's own check, imported from tests/).

Timed (``triton.testing.do_bench`` medians, L2 flushed; all variants in one process, so ratios compare): Qwen3-8B
heads (H=32, Hkv=8, D=128, bf16), causal prefill 4 x 2048 and 1 x 16384 (TFLOP/s); a 512-token chunk of 16
sequences against 2048 cached tokens (paged, block 16, the prefill tile); a mixed step of 16 x 32 new tokens on
2048 cached (the 64-row tile at 1 and 2 stages); decode 64 x 2048 context (the 16-row tile at 1 and 2 stages and
the 64-row one at 1 and 2, TB/s of KV read); and SDPA's flash forward and flashinfer's FA3 prefill (when flashinfer
imports) as references.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from _report import bench, causal_references, emit, write  # noqa: E402

from rlrepro.kernels import AttentionMetadata  # noqa: E402
from rlrepro.kernels import triton_attention_fwd as A  # noqa: E402

H, HKV, D = 32, 8, 128
# name -> (reduction order, prefill tile (rows, warps, stages), largest tile that reads packed KV by TMA descriptors).
# kv64 is the "large" config (TMA), kv64-r256w16-s3 the "long" one (pointer loads).
VARIANTS = {
    "o128f": ("128f", (128, 8, 2), 128),
    "o128f-r256w16-s2": ("128f", (256, 16, 2), 128),
    "kv64": (64, (128, 8, 2), 128),
    "kv64-r128-s3": (64, (128, 8, 3), 128),
    "kv64-r256w16-s2": (64, (256, 16, 2), 128),
    "kv64-r256w16-s3": (64, (256, 16, 3), 128),
    "kv64-r256w16-s3-tma": (64, (256, 16, 3), 256),
    "kv64-r256w16-s4": (64, (256, 16, 4), 128),
    "kv64-r256w8": (64, (256, 8, 2), 128),
    # "-n128": the 128-row tile capped at 128 registers a thread (ptxas spills what does not fit), so that two
    # programs share an SM as the 256-row tile's four warpgroups do, but without its block-wide barriers
    "kv64-n128": (64, (128, 8, 2), 128),
}
DEFAULTS = (A.DEFAULT_ORDER, A.DESC_MAX_ROWS)  # the shipped kernel's settings
COLS = ["4x2048", "1x16384", "chunk 16x512", "mixed 16x32 s1", "mixed 16x32 s2", "decode s1", "decode s2",
        "decode r64 s1", "decode r64 s2"]


def rnd(*shape, gen):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def set_variant(name: str) -> A.AttentionConfig:
    order, (rows, warps, stages), desc_rows = VARIANTS[name]
    os.environ["RLREPRO_ATTENTION_ORDER"] = "" if order == 64 else order
    A.DESC_MAX_ROWS = desc_rows
    nreg = int(name.rsplit("-n", 1)[1]) if "-n1" in name else None
    return A.AttentionConfig(rows=rows, num_warps=warps, num_stages=stages, maxnreg=nreg)


def same_as_shipped(large: A.AttentionConfig) -> str:
    """A 64-position variant's output against the shipped kernel's (``torch.equal``), Qwen3-8B heads."""
    if A.attention_order() != A.ATTENTION_ORDERS[DEFAULTS[0]]:
        return "n/a (another KV order)"
    import test_triton_kernels as TK
    lens = [300, 129, 1, 77, 2000]
    q, k, v = TK.make_paged_case(lens, H, HKV, D, torch.bfloat16, "cuda")
    meta = AttentionMetadata.packed(lens, device="cuda")
    got = A.attention_fwd(q, k, v, meta, 0.09, config=large)
    saved = A.DESC_MAX_ROWS
    A.DESC_MAX_ROWS = DEFAULTS[1]
    try:
        shipped = A.attention_fwd(q, k, v, meta, 0.09, config=A.ATTENTION_CONFIGS["large"])
    finally:
        A.DESC_MAX_ROWS = saved
    return "== shipped" if torch.equal(got, shipped) else "**differs from the shipped kernel**"


def causal_tflops(batch: int, length: int, ms: float) -> float:
    return 4.0 * batch * H * D * length * length / 2 / (ms * 1e-3) / 1e12


def timings(large: A.AttentionConfig, gen) -> dict[str, float]:
    scale = D ** -0.5
    row = {}
    for batch, length in ((4, 2048), (1, 16384)):
        n = batch * length
        q, k, v = rnd(n, H, D, gen=gen), rnd(n, HKV, D, gen=gen), rnd(n, HKV, D, gen=gen)
        meta = AttentionMetadata.packed([length] * batch, "cuda")
        row[f"{batch}x{length}"] = bench(lambda: A.attention_fwd(q, k, v, meta, scale, config=large))
    bs, ctx = 16, 2048
    cases = (("chunk 16x512", 16, 512, (large,)), ("mixed 16x32", 16, 32, (A.AttentionConfig(64, 4, 1),
                                                                           A.AttentionConfig(64, 4, 2))),
             ("decode", 64, 1, (A.AttentionConfig(16, 1, 1), A.AttentionConfig(16, 1, 2))),
             ("decode r64", 64, 1, (A.AttentionConfig(64, 4, 1), A.AttentionConfig(64, 4, 2))))
    for name, s_count, q_len, cfgs in cases:
        nblk = ctx // bs
        perm = torch.randperm(s_count * nblk).view(s_count, nblk)
        kc, vc = rnd(s_count * nblk * bs, HKV, D, gen=gen), rnd(s_count * nblk * bs, HKV, D, gen=gen)
        meta = AttentionMetadata.paged([q_len] * s_count, [ctx] * s_count, perm.tolist(), bs, device="cuda")
        q = rnd(s_count * q_len, H, D, gen=gen)
        for cfg in cfgs:
            key = name if len(cfgs) == 1 else f"{name} s{cfg.num_stages}"
            row[key] = bench(lambda: A.attention_fwd(q, kc, vc, meta, scale, config=cfg))
    return row


def references(gen, fi) -> dict[str, float]:
    row = {}
    for batch, length in ((4, 2048), (1, 16384)):
        n = batch * length
        q, k, v = rnd(n, H, D, gen=gen), rnd(n, HKV, D, gen=gen), rnd(n, HKV, D, gen=gen)
        for name, ms in causal_references(q, k, v, batch, length, D ** -0.5, fi).items():
            row[f"{name} {batch}x{length}"] = ms
    return row


def bits(large: A.AttentionConfig) -> str:
    """The promises for the current variant: configs agree; packed/paged/chunked/decode/alone agree."""
    import test_triton_kernels as TK
    from rlrepro.kernels import triton_ops as T
    lens = [300, 129, 1, 77, 200]
    for h, hkv in ((32, 8), (16, 16)):
        q, k, v = TK.make_paged_case(lens, h, hkv, 128, torch.bfloat16, "cuda")
        meta = AttentionMetadata.packed(lens, device="cuda")
        cfgs = dict(A.ATTENTION_CONFIGS, variant=large, decode1=A.AttentionConfig(16, 1, 1),
                    small1=A.AttentionConfig(64, 4, 1))
        outs = {c: A.attention_fwd(q, k, v, meta, 0.09, config=cfg) for c, cfg in cfgs.items()}
        first = next(iter(outs.values()))
        bad = [c for c, o in outs.items() if not torch.equal(o, first)]
        if bad:
            return f"configs {bad} differ (h={h}, hkv={hkv})"
    old = A.LARGE_MIN_TOKENS
    A.LARGE_MIN_TOKENS = 64
    try:
        TK.check_attention_invariance(T.attention, lens, h=32, hkv=8, d=128, dtype=torch.bfloat16, device="cuda",
                                      block_sizes=(16,), tol=2e-2)
    except AssertionError as e:
        return f"invariance: {e}"
    finally:
        A.LARGE_MIN_TOKENS = old
    return "all equal, " + same_as_shipped(large)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-bits", action="store_true")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    from rlrepro.kernels.fast import flashinfer_module
    fi = flashinfer_module()
    gen = torch.Generator(device="cuda").manual_seed(1)
    emit(f"### Attention forward variants ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
         f"{time.strftime('%Y-%m-%d')})")
    emit()
    ref = references(gen, fi)
    emit("References: " + ", ".join(
        f"{k} {ms:.3f} ms ({causal_tflops(int(k.split()[1].split('x')[0]), int(k.split('x')[1]), ms):.0f} TFLOP/s)"
        for k, ms in ref.items()))
    emit()
    emit("| variant | " + " | ".join(f"{c} ms" for c in COLS) + " | 4x2048 TFLOP/s | 16k TFLOP/s | "
         "decode r16 / r64 TB/s (best stage) | bits |")
    emit("|---|" + "---:|" * (len(COLS) + 3) + "---|")
    default = DEFAULTS
    kv_bytes = 2.0 * 64 * 2048 * HKV * D * 2
    rows = {}
    for name in names:
        large = set_variant(name)
        try:
            row = timings(large, gen)
            verdict = "not checked" if args.no_bits else bits(large)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            emit(f"| {name} | failed: {type(e).__name__}: {str(e)[:300]} |")
            continue
        finally:
            os.environ.pop("RLREPRO_ATTENTION_ORDER", None)
            A.DESC_MAX_ROWS = default[1]
        rows[name] = row
        emit(f"| {name} | " + " | ".join(f"{row[c]:.4f}" for c in COLS)
             + f" | {causal_tflops(4, 2048, row['4x2048']):.0f} | {causal_tflops(1, 16384, row['1x16384']):.0f}"
             f" | {kv_bytes / min(row['decode s1'], row['decode s2']) / 1e9:.2f} / "
             f"{kv_bytes / min(row['decode r64 s1'], row['decode r64 s2']) / 1e9:.2f} | {verdict} |")
        torch.cuda.empty_cache()
    if rows:
        first = next(iter(rows))
        emit()
        emit(f"Speed against {first} (its time / the variant's; > 1 is faster):")
        emit()
        emit("| variant | " + " | ".join(COLS) + " |")
        emit("|---|" + "---:|" * len(COLS))
        for name, row in rows.items():
            emit(f"| {name} | " + " | ".join(f"{rows[first][c] / row[c]:.3f}" for c in COLS) + " |")
    write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
