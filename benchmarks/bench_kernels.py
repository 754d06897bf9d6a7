"""Benchmark of the deterministic (batch-invariant) Triton kernels against stock torch / cuBLAS, on one GPU.

    python benchmarks/bench_kernels.py [--out FILE] [--sweep] [--only matmul,rowwise,rowwise_bwd,attention,attention_bwd,sampler] [--quick]
                                       [--k128]

Times are medians of ``triton.testing.do_bench`` (which clears the L2 cache before every repetition), taken in
the same run for both sides, bf16 unless noted. The matmul table reports ``speed = t_cuBLAS / t_ours`` (1.0 =
as fast as cuBLAS). ``--sweep`` also times every candidate tile config per shape and checks that all of them
give bitwise the same output (the evidence behind picking tiles by M); ``--k128`` adds the experimental 128-wide K
tile configs (``triton_matmul.CONFIGS_16BIT_K128``) to it. Writes markdown to stdout and to
``--out`` (default ``$OUT/bench_kernels.md`` when ``$OUT`` is set).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from unittest import mock
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _report import emit, write  # noqa: E402

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from rlrepro.kernels import fast as _fast  # noqa: E402
from rlrepro.kernels import triton_attention as _attn  # noqa: E402
from rlrepro.kernels import triton_matmul as _mm  # noqa: E402
from rlrepro.kernels import triton_ops as T  # noqa: E402
from rlrepro.kernels.metadata import AttentionMetadata  # noqa: E402

MATMUL_SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]  # (K, N); weight [N, K]
MATMUL_MS = [1, 16, 64, 256, 1024, 4096, 8192]



def bench(fn, rep: int = 100) -> float:
    """Median milliseconds."""
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def bench_graph(calls, rep: int = 60) -> float:
    """Median milliseconds per call of ``calls`` (closures), replayed as one CUDA graph: no launch overhead.

    Give several closures over different copies of the inputs when one copy would sit in L2 between calls.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    t = float(do_bench(graph.replay, warmup=10, rep=rep, return_mode="median"))
    del graph
    return t / len(calls)


def timed(fn) -> float:
    """CUDA-graph time of one call (do_bench clears L2 before each replay); plain do_bench if capture fails."""
    try:
        return bench_graph([fn])
    except Exception:  # noqa: BLE001 - keep a number; the eager one says so in the log
        print(f"(graph capture failed for {fn}; timing eagerly)", file=sys.stderr)
        torch.cuda.synchronize()
        return bench(fn)


def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


# ------------------------------------------------------------------------------------------------ matmul
def sweep_configs(k128: bool) -> dict:
    """The configs a sweep times: the shipped candidates, and with ``--k128`` the experimental 128-wide K tiles."""
    return {**_mm.CONFIGS_16BIT, **(_mm.CONFIGS_16BIT_K128 if k128 else {})}


def sweep_candidates(m: int, k128: bool = False) -> list[str]:
    names = list(sweep_configs(k128))
    if m <= 64:
        return [n for n in names if n.startswith("64x")]
    if m <= 512:
        return [n for n in names if not n.startswith(("64x16", "64x32", "64x64"))]
    return [n for n in names if n.startswith(("128x", "64x256"))]


def bench_matmul(ms, shapes, sweep: bool, k128: bool = False) -> None:
    emit("### Matmul: deterministic Triton vs cuBLAS (`torch.mm`), bf16, weight [N, K]")
    emit()
    emit("Both sides timed as CUDA-graph replays over rotating weight copies (>= 256 MB, so L2 holds none); "
         "`ours eager` is one plain launch timed by `do_bench` (includes Python/launch overhead when the kernel "
         "is shorter than it).")
    emit()
    emit("| K x N | M | cuBLAS ms | ours ms | speed vs cuBLAS | time ratio | ours TFLOP/s | ours GB/s | config "
         "| ours eager ms |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    sweep_rows = []
    for k, n in shapes:
        copies = max(1, min(8, -(-(256 << 20) // (n * k * 2))))
        ws = [rnd(n, k, scale=0.02) for _ in range(copies)]
        for m in ms:
            x = rnd(m, k)
            cfg = _mm.pick_config(m, n, k, torch.bfloat16, _mm.num_sms(torch.cuda.current_device()))
            t_cub = bench_graph([lambda w=w: torch.mm(x, w.t()) for w in ws])
            t_ours = bench_graph([lambda w=w: _mm.matmul(x, w) for w in ws])
            t_eager = bench(lambda: _mm.matmul(x, ws[0]))
            flops = 2.0 * m * n * k
            nbytes = 2.0 * (n * k + m * k + m * n)
            speed = t_cub / t_ours
            summary.append((m, speed))
            emit(f"| {k}x{n} | {m} | {t_cub:.4f} | {t_ours:.4f} | {speed:.2f} | {t_ours / t_cub:.2f} | "
                 f"{flops / t_ours / 1e9:.0f} | {nbytes / t_ours / 1e6:.0f} | {cfg.name} | {t_eager:.4f} |")
            if sweep:
                auto = _mm.matmul(x, ws[0])
                row = {"shape": f"{k}x{n}", "m": m, "cublas": t_cub}
                for name in sweep_candidates(m, k128):
                    c = sweep_configs(k128)[name]
                    try:
                        same = torch.equal(_mm.matmul(x, ws[0], config=c), auto)
                        t = bench_graph([lambda w=w: _mm.matmul(x, w, config=c) for w in ws], rep=30)
                        row[name] = (t, same)
                    except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
                        row[name] = (float("nan"), repr(e)[:60])
                sweep_rows.append(row)
        torch.cuda.empty_cache()
    emit()
    for lo, hi, label in ((1, 64, "M <= 64"), (256, 256, "M = 256"), (1024, 1 << 30, "M >= 1024")):
        sel = [s for m, s in summary if lo <= m <= hi]
        if sel:
            emit(f"- {label}: speed vs cuBLAS min {min(sel):.2f}, median {sorted(sel)[len(sel) // 2]:.2f}, "
                 f"max {max(sel):.2f} (time ratio max {1 / min(sel):.2f})")
    emit()
    if sweep:
        names = list(sweep_configs(k128))
        emit("### Matmul config sweep: speed vs cuBLAS per config, CUDA-graph timed "
             "(`*` = output differs from the auto config)")
        emit()
        emit("| K x N | M | " + " | ".join(names) + " |")
        emit("|---|---|" + "---|" * len(names))
        mismatches = 0
        for row in sweep_rows:
            cells = []
            for name in names:
                if name not in row:
                    cells.append("")
                    continue
                t, same = row[name]
                if same is not True:
                    mismatches += 1
                cells.append(f"{row['cublas'] / t:.2f}" + ("" if same is True else f"*{'' if same is False else same}"))
            emit(f"| {row['shape']} | {row['m']} | " + " | ".join(cells) + " |")
        emit()
        emit(f"- configs giving different bits from the auto config: {mismatches}")
        emit()


# ------------------------------------------------------------------------------------------------ row-wise
def bench_rowwise(quick: bool) -> None:
    emit("### RMSNorm and log-softmax: deterministic Triton vs torch")
    emit()
    emit("CUDA-graph replays of one call, L2 cleared before each (no launch overhead on either side).")
    emit()
    emit("| op | shape | dtype | torch ms | ours ms | speed vs torch | ours GB/s |")
    emit("|---|---|---|---|---|---|---|")
    for m in ((1, 64, 4096) if quick else (1, 64, 4096, 16384)):
        x = rnd(m, 4096)
        w = rnd(4096, scale=1.0)
        t_torch = timed(lambda: _fast.rms_norm(x, w, 1e-6))
        t_ours = timed(lambda: T.rms_norm(x, w, 1e-6))
        nbytes = 2 * 2 * m * 4096
        emit(f"| rms_norm (torch composite) | {m}x4096 | bf16 | {t_torch:.4f} | {t_ours:.4f} | "
             f"{t_torch / t_ours:.2f} | {nbytes / t_ours / 1e6:.0f} |")
        if hasattr(F, "rms_norm"):
            t_f = timed(lambda: F.rms_norm(x, (4096,), w, 1e-6))
            emit(f"| rms_norm (F.rms_norm) | {m}x4096 | bf16 | {t_f:.4f} | {t_ours:.4f} | {t_f / t_ours:.2f} | "
                 f"{nbytes / t_ours / 1e6:.0f} |")
    for dtype in (torch.float32, torch.bfloat16):
        for m in ((64, 4096) if not quick else (4096,)):
            x = rnd(m, 151936, dtype=dtype, scale=4.0)
            t_torch = timed(lambda: torch.log_softmax(x.float(), dim=-1))
            t_ours = timed(lambda: T.log_softmax(x))
            nbytes = m * 151936 * (2 * x.element_size() + 4)
            emit(f"| log_softmax | {m}x151936 | {str(dtype).split('.')[-1]} | {t_torch:.4f} | {t_ours:.4f} | "
                 f"{t_torch / t_ours:.2f} | {nbytes / t_ours / 1e6:.0f} |")
    emit()


# ------------------------------------------------------------------------------------------------ attention
def bench_attention() -> None:
    emit("### Attention: deterministic Triton vs torch SDPA (H=32, Hkv=8, D=128, bf16)")
    emit()
    emit("Ours per tile config (`small` = 64 rows, 4 warps; `large*` = 128 rows, 8 warps); `auto` = the default "
         "choice. Timed as CUDA-graph replays of one call (median, L2 cleared before each).")
    emit()
    names = list(_attn.ATTENTION_CONFIGS)
    emit("| case | SDPA ms | auto ms | speed vs SDPA | " + " | ".join(f"{n} ms" for n in names)
         + " | auto TFLOP/s or GB/s |")
    emit("|---|---|---|---|" + "---|" * len(names) + "---|")
    h, hkv, d = 32, 8, 128
    scale = d ** -0.5
    # prefill: 4 sequences x 2048 tokens, packed
    s_count, length = 4, 2048
    n = s_count * length
    q, k, v = rnd(n, h, d), rnd(n, hkv, d), rnd(n, hkv, d)
    meta = AttentionMetadata.packed([length] * s_count, device="cuda")
    q4 = q.view(s_count, length, h, d).transpose(1, 2).contiguous()
    k4 = k.view(s_count, length, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1).contiguous()
    v4 = v.view(s_count, length, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, dim=1).contiguous()
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale))
    t_auto = timed(lambda: _attn.attention_fwd(q, k, v, meta, scale))
    per_cfg = [timed(lambda c=c: _attn.attention_fwd(q, k, v, meta, scale, config=c))
               for c in _attn.ATTENTION_CONFIGS.values()]
    flops = 4.0 * s_count * length * length * d * h / 2  # causal: half of QK^T and PV
    emit(f"| prefill 4 x 2048, packed (SDPA: dense causal, KV heads expanded) | {t_sdpa:.4f} | {t_auto:.4f} | "
         f"{t_sdpa / t_auto:.2f} | " + " | ".join(f"{t:.4f}" for t in per_cfg)
         + f" | {flops / t_auto / 1e9:.0f} TFLOP/s |")
    # decode: 64 sequences x 2048 context against the paged cache
    for block_size in (16, 256):
        s_count, ctx = 64, 2048
        nblk = ctx // block_size
        perm = torch.randperm(s_count * nblk).view(s_count, nblk)
        k_cache = rnd(s_count * nblk, block_size, hkv, d)
        v_cache = rnd(s_count * nblk, block_size, hkv, d)
        meta = AttentionMetadata.paged([1] * s_count, [ctx] * s_count, perm.tolist(), block_size, device="cuda")
        q, k, v = rnd(s_count, h, d), rnd(s_count, hkv, d), rnd(s_count, hkv, d)
        t_auto = timed(lambda: T.attention(q, k, v, meta, scale, kv_cache=(k_cache, v_cache)))
        kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        per_cfg = [timed(lambda c=c: _attn.attention_fwd(q, kf, vf, meta, scale, config=c))
                   for c in _attn.ATTENTION_CONFIGS.values()]
        kd = k_cache[perm.cuda()].flatten(1, 2).transpose(1, 2).repeat_interleave(h // hkv, dim=1).contiguous()
        vd = v_cache[perm.cuda()].flatten(1, 2).transpose(1, 2).repeat_interleave(h // hkv, dim=1).contiguous()
        qd = q.unsqueeze(2)  # [S, H, 1, D]
        t_sdpa = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
        kv_bytes = 2.0 * s_count * ctx * hkv * d * 2
        emit(f"| decode 64 x 2048 ctx, paged block {block_size}, incl. cache write (SDPA: dense gathered KV, "
             f"heads expanded) | {t_sdpa:.4f} | {t_auto:.4f} | {t_sdpa / t_auto:.2f} | "
             + " | ".join(f"{t:.4f}" for t in per_cfg) + f" | {kv_bytes / t_auto / 1e6:.0f} GB/s KV |")
        torch.cuda.empty_cache()
    emit()


def bench_attention_bwd() -> None:
    emit("### Attention backward: Triton (training default on CUDA) vs the float32 torch path (H=32, Hkv=8, D=128, "
         "bf16)")
    emit()
    emit("32 packed sequences of mixed lengths; `attention_bwd_packed_triton` (timed as a CUDA-graph replay) vs "
         "`attention_bwd_packed` (`RLREPRO_ATTENTION_BWD=torch`: a Python loop over sequences, host-synchronising, "
         "so timed eagerly); median ms, L2 cleared before each.")
    emit()
    h, hkv, d = 32, 8, 128
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(64, 2400, (32,), generator=gen)]
    n = sum(lens)
    q, k, v, g = rnd(n, h, d), rnd(n, hkv, d), rnd(n, hkv, d), rnd(n, h, d)
    meta = AttentionMetadata.packed(lens, device="cuda")
    out = _attn.attention_fwd(q, k, v, meta, scale)
    t_triton = timed(lambda: _attn.attention_bwd_packed_triton(q, k, v, g, meta, scale, out=out))
    torch.cuda.synchronize()
    t_torch = bench(lambda: _attn.attention_bwd_packed(q, k, v, g, meta, scale), rep=20)
    flops = 2.5 * 4.0 * sum(x * x for x in lens) * d * h / 2  # causal; backward ~2.5x the forward's FLOPs
    emit("| case | torch path ms | Triton ms | speedup | Triton TFLOP/s (2.5x forward) |")
    emit("|---|---|---|---|---|")
    emit(f"| {len(lens)} sequences, {n:,} tokens | {t_torch:.3f} | {t_triton:.3f} | {t_torch / t_triton:.1f}x | "
         f"{flops / t_triton / 1e9:.0f} |")
    emit()


def bench_rowwise_bwd() -> None:
    emit("### RMSNorm / SwiGLU / rotary backward: Triton (training default) vs the float32 torch compositions (bf16)")
    emit()
    emit("One `torch.autograd.grad` through the op at Qwen3-8B sizes of a 3072-token micro-batch, under "
         "`RLREPRO_ROWWISE_BWD=triton` and `=torch`; median ms (do_bench, eager: both sides pay the same autograd "
         "overhead).")
    emit()
    emit("| op | x shape | torch ms | Triton ms | speedup |")
    emit("|---|---|---|---|---|")
    eps = 1e-6
    cases = [("rms_norm", (3072, 4096)), ("rms_norm", (3072, 32, 128)), ("silu_and_mul", (3072, 2 * 12288)),
             ("apply_rope", (3072, 32, 128))]
    for name, shape in cases:
        x = rnd(*shape, scale=2.0).requires_grad_(True)
        if name == "rms_norm":
            w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16).requires_grad_(True)
            out, wrt = T.rms_norm(x, w, eps), [x, w]
        elif name == "silu_and_mul":
            out, wrt = T.silu_and_mul(x), [x]
        else:
            cos, sin = torch.randn(shape[0], shape[2] // 2, device="cuda"), torch.randn(shape[0], shape[2] // 2,
                                                                                        device="cuda")
            out, wrt = T.apply_rope(x, cos, sin), [x]
        g = rnd(*out.shape)
        times = {}
        before = os.environ.get("RLREPRO_ROWWISE_BWD")
        try:
            for impl in ("torch", "triton"):
                os.environ["RLREPRO_ROWWISE_BWD"] = impl
                times[impl] = bench(lambda: torch.autograd.grad(out, wrt, g, retain_graph=True), rep=50)
        finally:
            if before is None:
                os.environ.pop("RLREPRO_ROWWISE_BWD", None)
            else:
                os.environ["RLREPRO_ROWWISE_BWD"] = before
        emit(f"| {name} | {' x '.join(map(str, shape))} | {times['torch']:.3f} | {times['triton']:.3f} | "
             f"{times['torch'] / times['triton']:.1f}x |")
    emit()


def bench_sampler() -> None:
    from rlrepro.rollout.sampler_triton import default_splits, gumbel_argmax
    emit("### Sampler: the fused Gumbel argmax, one range a row, ranges, and chunks skipped")
    emit()
    emit("scaled logits [rows, 151936]; CUDA-graph replays of one call (median, L2 cleared before each); every "
         "variant's tokens are checked equal to the unpruned default's. `random`: N(0, 3^2) float32; `bf16`: the "
         "same in bfloat16 (widened in the kernel); `peaked`: N(0, 2^2) with 20 tokens at +15 (an LM-like head). "
         "`evaluated`: the share of 2048-wide chunks whose exact noise was computed (pruned, one pass, default "
         "ranges); `two passes`: each range's chunk bounds first, then only the chunks within reach of its best.")
    emit()
    emit("| rows | logits | 1 range ms | default ranges | unpruned ms | pruned 2048 ms | pruned 1024 ms | "
         "pruned 512 ms | pruned, half the ranges ms | pruned, twice ms | two passes 2048 ms | two passes 1024 ms | "
         "evaluated | unpruned / pruned 2048 | unpruned / best |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    v = 151936
    for rows in (64, 256):
        g = torch.Generator(device="cuda").manual_seed(rows)
        base = torch.randn(rows, v, device="cuda", generator=g) * 3
        peaked = base * (2 / 3)
        peaked[:, torch.randint(0, v, (20,), device="cuda", generator=g)] = 15.0
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
        pos = torch.full((rows,), 700, device="cuda", dtype=torch.int64)
        k = default_splits(rows, v, base.device)
        for name, x in (("random", base), ("bf16", base.to(torch.bfloat16)), ("peaked", peaked)):
            want = gumbel_argmax(x, seeds, pos, prune=False)
            _, evaluated = gumbel_argmax(x, seeds, pos, return_evaluated=True)
            variants = {"one": dict(splits=1, prune=False), "unpruned": dict(prune=False),
                        "p2048": dict(), "p1024": dict(block=1024), "p512": dict(block=512),
                        "half": dict(splits=max(1, k // 2)), "twice": dict(splits=2 * k),
                        "two2048": dict(passes=2), "two1024": dict(passes=2, block=1024)}
            same = all(torch.equal(gumbel_argmax(x, seeds, pos, **kw), want) for kw in variants.values())
            t = {n: timed(lambda kw=kw: gumbel_argmax(x, seeds, pos, **kw)) for n, kw in variants.items()}
            share = evaluated.sum().item() / (rows * triton.cdiv(v, 2048))
            emit(f"| {rows} | {name}{'' if same else ' **tokens differ**'} | {t['one']:.4f} | {k} | "
                 f"{t['unpruned']:.4f} | {t['p2048']:.4f} | {t['p1024']:.4f} | {t['p512']:.4f} | {t['half']:.4f} | "
                 f"{t['twice']:.4f} | {t['two2048']:.4f} | {t['two1024']:.4f} | {share:.1%} | "
                 f"{t['unpruned'] / t['p2048']:.2f}x | {t['unpruned'] / min(t.values()):.2f}x |")
    emit()
    bench_sample_lean(v)
    bench_top_p(v)


def bench_sample_lean(v: int) -> None:
    """The whole ``sample_on_device`` at t = 1 without filters on bfloat16 logits: as before 2026-12-08
    (``RLREPRO_SAMPLER_LEAN=0``: float32 copy, every chunk's noise, the written log-softmax) against now."""
    from rlrepro.rollout.sampler import SampleRequest, sample_on_device
    emit("### Sampler: the whole sample step, before and after (t = 1, no filter, bfloat16 logits)")
    emit()
    emit("`do_bench` medians of eager `sample_on_device` calls (launches included, as in the engine, where they "
         "overlap the previous step); tokens and logprobs checked `torch.equal` between the two.")
    emit()
    emit("| rows | before ms (`RLREPRO_SAMPLER_LEAN=0`) | now ms | before / now | equal |")
    emit("|---|---|---|---|---|")
    for rows in (64, 256):
        x = (torch.randn(rows, v, device="cuda") * 3).to(torch.bfloat16)
        reqs = [SampleRequest(1.0, -1, 1.0, seed=r, position=700 + r) for r in range(rows)]
        out, t = {}, {}
        for lean in ("0", "1"):
            with mock.patch.dict(os.environ, {"RLREPRO_SAMPLER_LEAN": lean}):
                out[lean] = sample_on_device(x, reqs)
                t[lean] = do_bench(lambda: sample_on_device(x, reqs), warmup=10, rep=100, return_mode="median")
        same = all(torch.equal(a, b) for a, b in zip(out["0"], out["1"]))
        emit(f"| {rows} | {t['0']:.4f} | {t['1']:.4f} | {t['0'] / t['1']:.2f}x | {same} |")
    emit()


def bench_top_p(v: int) -> None:
    """Top-k / top-p masks: one row at a time (the engine before the sixth session) vs all rows in one sort."""
    from rlrepro.rollout.sampler import SampleRequest, _filtered, keep_mask, sample_on_device
    emit("### Sampler: top-k / top-p masks, row by row vs batched")
    emit()
    emit(f"float32 scaled logits [rows, {v}]; eager calls timed by `do_bench` (median) (launches included: "
         "the sampler runs outside the decode graph). `row by row` = one `keep_mask` per row, as the engine did "
         "before; `batched` = `keep_masks` on all rows; `sample` = the whole `sample_on_device` (filters, fused "
         "Gumbel argmax, logprob). The masked logits are checked equal.")
    emit()
    emit("| rows | top_k | top_p | row by row ms | batched ms | speedup | sample ms (filtered) | sample ms (no filter) |")
    emit("|---|---|---|---|---|---|---|---|")
    for rows, top_k, top_p in ((64, -1, 0.9), (64, 50, 0.95), (256, -1, 0.9)):
        x = torch.randn(rows, v, device="cuda") * 3
        reqs = [SampleRequest(1.0, top_k, top_p, seed=r, position=700) for r in range(rows)]
        plain = [SampleRequest(1.0, -1, 1.0, seed=r, position=700) for r in range(rows)]

        def row_by_row():
            out = x.clone()
            for i in range(rows):
                out[i].masked_fill_(~keep_mask(x[i], top_k, top_p), float("-inf"))
            return out

        same = torch.equal(row_by_row(), _filtered(x, reqs))
        t_row = do_bench(row_by_row, warmup=5, rep=50, return_mode="median")
        t_batch = do_bench(lambda: _filtered(x, reqs), warmup=5, rep=50, return_mode="median")
        t_sample = do_bench(lambda: sample_on_device(x, reqs), warmup=5, rep=50, return_mode="median")
        t_plain = do_bench(lambda: sample_on_device(x, plain), warmup=5, rep=50, return_mode="median")
        emit(f"| {rows}{'' if same else ' **masks differ**'} | {top_k} | {top_p} | {t_row:.3f} | {t_batch:.3f} | "
             f"{t_row / t_batch:.1f}x | {t_sample:.3f} | {t_plain:.3f} |")
    emit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time every candidate matmul config too")
    ap.add_argument("--k128", action="store_true",
                    help="the sweep also times the experimental 128-wide K tile configs (bits against the auto config)")
    ap.add_argument("--only", default="matmul,rowwise,rowwise_bwd,attention,attention_bwd,sampler")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--ms", default=None, help="the matmul's M values, comma-separated (default: all, or --quick's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    emit(f"## Kernel benchmark — {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
         f"triton {triton.__version__}; {datetime.date.today().isoformat()}")
    emit()
    emit(f"Command: `python {' '.join(sys.argv)}`")
    emit()
    failed = []
    only = set(args.only.split(","))
    ms = ([int(m) for m in args.ms.split(",")] if args.ms else MATMUL_MS if not args.quick else [1, 64, 1024, 4096])
    sections = [("matmul", lambda: bench_matmul(ms, MATMUL_SHAPES, args.sweep, args.k128)),
                ("rowwise", lambda: bench_rowwise(args.quick)), ("rowwise_bwd", bench_rowwise_bwd),
                ("attention", bench_attention), ("attention_bwd", bench_attention_bwd),
                ("sampler", bench_sampler)]
    for name, fn in sections:
        if name not in only:
            continue
        try:
            fn()
        except Exception:  # keep the other sections' numbers
            failed.append(name)
            emit(f"**{name} failed:**\n```\n{traceback.format_exc()}```")
        torch.cuda.empty_cache()
    out = args.out or (os.path.join(os.environ["OUT"], "bench_kernels.md") if os.environ.get("OUT") else None)
    if out:
        write(out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
