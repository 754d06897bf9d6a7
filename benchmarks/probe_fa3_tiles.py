"""Other tiles of flashinfer's FA3 kernel: the same bits as its paged kernel, and faster where it is slow?

    python3 benchmarks/probe_fa3_tiles.py [--out FILE.md] [--variants ragged96,paged64,...] [--no-bench]

Issue #27. ``RLREPRO_ATTENTION=fa3`` (``rlrepro/kernels/fa3_attention.py``) keeps the promise with one kernel,
flashinfer's paged FA3 (128 query rows x 96 KV positions), but its paged prefill runs at 0.8x of the ragged (TMA)
kernel and its folded decode at 0.65x of rlrepro's decode kernel. ``rlrepro/kernels/fa3_variants.py`` compiles
the same sources with other tiles; a row's bits should depend only on its 96-position KV tiles and on one
consumer warpgroup's arithmetic, so:

* ``ragged96`` (the TMA kernel with 96-position KV tiles) should give the paged kernel's bits on the trainer's
  packed layout and on a whole prefill;
* ``paged64`` (64 query rows, one consumer warpgroup) and the 3-stage ``paged96s3`` / ``paged64s3`` should give
  them in the folded decode (and ``paged96s3`` in every paged call).

Bits first (``torch.equal`` against the stock paged kernel's whole prefill of the battery in
``probe_fa3_invariance.py``), then the speed (``do_bench`` medians): causal prefill 4 x 2048 and 1 x 16384, and
the folded decode of 64 requests at 2,048 and 8,192 tokens, each variant beside the stock kernels and rlrepro's
Triton kernels in the same process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import bench, emit, write  # noqa: E402
import probe_fa3_invariance as inv  # noqa: E402

H, HKV, D = inv.H, inv.HKV, inv.D
RAGGED = ("ragged96",)
PAGED = ("paged64", "paged96s3", "paged64s3")
DECODE_CASES = ((64, 2048), (64, 8192), (256, 2048))


def _variant(name: str):
    from rlrepro.kernels import fa3_variants
    t0 = time.perf_counter()
    mod = fa3_variants.module(name)
    emit(f"- `{name}` loaded in {time.perf_counter() - t0:.1f} s (its JIT compile where not prebuilt)")
    return mod


def ragged(fi, ws, c: inv.Case, mod=None):
    """The ragged (TMA) FA3 kernel on the packed sequences, causal; ``mod``: a variant's module."""
    indptr = inv.i32([sum(c.lens[:i]) for i in range(len(c.lens) + 1)], c.device)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(indptr, indptr, c.h, c.hkv, c.d, causal=True, sm_scale=c.scale, q_data_type=c.q.dtype,
           kv_data_type=c.k.dtype)
    if mod is not None:
        w._cached_module = mod
    return w


def folded(fi, ws, c: inv.Case, picks, mod=None):
    """The folded decode of ``picks`` ((sequence, position) pairs); returns (out, lse) in [R, H] order and the
    wrapper with its folded queries (for timing)."""
    q = torch.stack([c.q[c.starts[s] + t] for s, t in picks])
    g, r = c.h // c.hkv, len(picks)
    qf = q.view(r, c.hkv, g, c.d).transpose(1, 2).reshape(r * g, c.hkv, c.d)
    w = inv.plan_paged(fi, ws, [(g, t + 1, c.pages[s]) for s, t in picks], c.page, False, (c.hkv, c.hkv), c.d,
                       q.dtype, c.device, c.scale)
    if mod is not None:
        w._cached_module = mod
    out, lse = w.run(qf, (c.kc, c.vc), return_lse=True)
    return ((out.view(r, g, c.hkv, c.d).transpose(1, 2).reshape(r, c.h, c.d),
             lse.view(r, g, c.hkv).transpose(1, 2).reshape(r, c.h)), (w, qf))


def whole_with(fi, ws, c: inv.Case, mod):
    """The whole causal paged prefill with a variant's module."""
    reqs = [(n, n, c.pages[s]) for s, n in enumerate(c.lens)]
    w = inv.plan_paged(fi, ws, reqs, c.page, True, (c.h, c.hkv), c.d, c.q.dtype, c.device, c.scale)
    w._cached_module = mod
    return w.run(c.q, (c.kc, c.vc), return_lse=True)


def bits(fi, ws, c: inv.Case, mods: dict) -> dict[str, bool]:
    emit("")
    emit(f"Sequences {c.lens} ({sum(c.lens)} tokens), H={c.h}, Hkv={c.hkv}, D={c.d}, pages of {c.page}, against the "
         "stock paged kernel's whole prefill:")
    emit("")
    emit("| variant, call | out `==` | lse `==` | rows that differ | max abs diff |")
    emit("|---|---|---|---|---|")
    full = inv.whole(fi, ws, c, list(range(len(c.lens))))
    picks = inv.decode_rows(c)
    idx = torch.tensor([c.starts[s] + t for s, t in picks], device=c.device)
    res = {}
    res["stock-folded"] = inv.compare("stock paged, folded decode", folded(fi, ws, c, picks)[0], full, idx)
    for name, mod in mods.items():
        if name in RAGGED:
            w = ragged(fi, ws, c, mod)
            res[name] = inv.compare(f"`{name}`, the packed sequences (trainer, prefill)",
                                    w.run(c.q, c.k, c.v, return_lse=True), full)
        else:
            res[name + "-folded"] = inv.compare(f"`{name}`, folded decode ({len(picks)} rows)",
                                                folded(fi, ws, c, picks, mod)[0], full, idx)
            if name.startswith("paged96"):
                res[name + "-whole"] = inv.compare(f"`{name}`, whole paged prefill", whole_with(fi, ws, c, mod), full)
    return res


def speed(fi, ws, mods: dict) -> None:
    from rlrepro.kernels import AttentionMetadata
    from rlrepro.kernels.triton_attention import attention_fwd
    dev = torch.device("cuda")
    emit("")
    emit("| case | kernel | ms | rate | / stock |")
    emit("|---|---|---:|---:|---:|")
    for batch, length in inv.PREFILL_CASES:
        c = inv.Case([length] * batch, (H, HKV, D), dev, seed=length, page=inv.PAGE)
        flops = 4.0 * batch * H * D * length * length / 2
        runs = {"FA3 ragged (stock, 128-position KV tiles)": (lambda w=ragged(fi, ws, c): w.run(c.q, c.k, c.v))}
        for name in RAGGED:
            if name in mods:
                runs[f"FA3 ragged `{name}`"] = lambda w=ragged(fi, ws, c, mods[name]): w.run(c.q, c.k, c.v)
        reqs = [(length, length, c.pages[s]) for s in range(batch)]
        wp = inv.plan_paged(fi, ws, reqs, c.page, True, (H, HKV), D, c.q.dtype, dev, c.scale)
        runs["FA3 paged (stock, the promise's kernel)"] = lambda: wp.run(c.q, (c.kc, c.vc))
        meta = AttentionMetadata.packed(c.lens, dev)
        runs["rlrepro Triton"] = lambda: attention_fwd(c.q, c.k, c.v, meta, c.scale)
        base = None
        for name, fn in runs.items():
            ms = bench(fn)
            base = base or ms
            emit(f"| {batch} x {length} causal | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} TFLOP/s | "
                 f"{base / ms:.3f} |")
        del runs, c
        torch.cuda.empty_cache()
    for r, ctx in DECODE_CASES:
        c = inv.Case([ctx] * r, (H, HKV, D), dev, seed=4, page=inv.PAGE)
        kv_bytes = r * ctx * HKV * D * 2 * 2
        picks = [(s, ctx - 1) for s in range(r)]
        runs = {}
        _, (w, qf) = folded(fi, ws, c, picks)
        runs["FA3 paged folded (stock)"] = lambda w=w, qf=qf: w.run(qf, (c.kc, c.vc))
        for name in PAGED:
            if name in mods:
                _, (w, qf) = folded(fi, ws, c, picks, mods[name])
                runs[f"FA3 paged folded `{name}`"] = lambda w=w, qf=qf: w.run(qf, (c.kc, c.vc))
        q = torch.stack([c.q[c.starts[s] + ctx - 1] for s in range(r)])
        meta = AttentionMetadata.paged([1] * r, [ctx] * r, c.pages, inv.PAGE, device=dev)
        kf, vf = c.kc.view(-1, HKV, D), c.vc.view(-1, HKV, D)
        runs["rlrepro decode (Triton)"] = lambda: attention_fwd(q, kf, vf, meta, c.scale)
        base = None
        for name, fn in runs.items():
            ms = bench(fn)
            base = base or ms
            emit(f"| decode {r} x {ctx} | {name} | {ms:.4f} | {kv_bytes / ms / 1e9:.2f} TB/s | {base / ms:.3f} |")
        del runs, c
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--variants", default=",".join(RAGGED + PAGED))
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    opened = inv.open_flashinfer("probe_fa3_tiles.py", "FA3 tile variants")
    if opened is None:
        return 1
    fi, ws = opened
    t0 = time.perf_counter()
    fi.BatchPrefillWithPagedKVCacheWrapper  # noqa: B018 - the stock module compiles at its first plan, below
    mods = {}
    for name in [v for v in args.variants.split(",") if v]:
        try:
            mods[name] = _variant(name)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            emit(f"- `{name}` failed: {type(e).__name__}: {str(e)[-600:]}")
    write(args.out)
    res = bits(fi, ws, inv.Case(inv.LENS, (H, HKV, D), "cuda"), mods)
    emit("")
    emit(f"All equal: {all(res.values())} ({time.perf_counter() - t0:.0f} s so far)")
    write(args.out)
    if not args.no_bench:
        speed(fi, ws, mods)
    write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
