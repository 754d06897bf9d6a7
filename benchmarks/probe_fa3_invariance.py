"""Is flashinfer's FA3 forward (Hopper) batch-, chunk- and decode-invariant? The bits, then the speed (issue #27).

    python3 benchmarks/probe_fa3_invariance.py [--out FILE.md] [--no-bench]

FA3's forward walks a query row's KV tiles from the last to the first, in tiles aligned to KV position 0, with no
split of the KV in flashinfer's sm90 plan. Masked scores are a finite -5e4, and a tile wholly masked for a row
(it lies past the row's diagonal but not past its query tile's last row) is undone exactly by the next tile's
rescale (``exp2`` of about -6,000 is 0). So a row's bits should depend only on its own KV, its position and the
kernel's KV tile (``CTA_KV``: 96 for the paged kernel at D=128, 128 for the ragged one), not on the batch, the
chunking, the query count of the call or the page size (the paged FA3 path gathers K/V token by token). If that
holds, one kernel could serve the trainer's forward (the packed sequences as a cache of 1-token pages), prefill,
chunked prefill and decode with the bits the engine == trainer promise needs, at FA3's speed.

Checked here with ``torch.equal`` against one whole-sequence paged prefill of a batch of unequal sequences
(lengths around the 96- and 128-row tiles): each sequence alone; the batch reversed; chunked prefill in chunks of
512 and 300; decode rows (one query a request, causal) at tile boundaries and at the end; decode with the GQA
group's heads folded into one request's rows (non-causal, ``num_qo_heads == num_kv_heads``: each KV tile read once
per group); the packed layout as 1-token pages; and the ragged (TMA) kernel, expected to differ (another tile).
The log-sum-exp too, and everything against float64 (the lse comes in base 2).

Then the speed (``triton.testing.do_bench`` medians, one process): causal prefill 4 x 2048 and 1 x 16384 (ragged
FA3, paged FA3 at page sizes 16 and 1, rlrepro's deterministic kernel); a 512-token chunk of 16 sequences on 2,048
cached tokens; decode of 64 requests at 2,048 tokens (FA3 one query a request, FA3 with the group folded,
flashinfer's tensor-core decode without split KV, rlrepro's decode kernel).

``fi`` is the flashinfer module; ``tests/test_probe_fa3.py`` runs the bookkeeping on the CPU with a float64
stand-in of its two wrappers, so that the one GPU call this needs measures the kernel and not the script.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _report, also when loaded by a test
from _report import bench, emit, write  # noqa: E402

H, HKV, D = 32, 8, 128
DEVICE = "cuda"  # the timings' device (the CPU test of the bookkeeping sets "cpu")
PAGE = 16
LENS = [2048, 1531, 777, 3001, 64, 1, 95, 96, 97, 129, 130, 383]
PREFILL_CASES = ((4, 2048), (1, 16384))  # (sequences, length) of the causal prefill timings
CHUNK_CASE = (16, 512, 2048)  # sequences, new tokens, context
DECODE_CASE = (64, 2048)  # requests, context


class Case:
    """Packed sequences (q, k, v) and the same K/V in a paged cache of shuffled pages."""

    def __init__(self, lens: list[int], heads: tuple[int, int, int], device, seed: int = 0, page: int = PAGE):
        h, hkv, d = heads
        self.lens, self.h, self.hkv, self.d, self.page = list(lens), h, hkv, d, page
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        n = sum(lens)
        self.q, self.k, self.v = (torch.randn(n, x, d, generator=gen).to(torch.bfloat16).to(self.device)
                                  for x in (h, hkv, hkv))
        self.starts = [sum(lens[:i]) for i in range(len(lens))]
        counts = [-(-x // page) for x in lens]
        order = torch.randperm(sum(counts), generator=gen).tolist()
        self.pages, at = [], 0
        for c in counts:
            self.pages.append(order[at:at + c])
            at += c
        self.kc = torch.zeros(sum(counts), page, hkv, d, dtype=torch.bfloat16, device=self.device)
        self.vc = torch.zeros_like(self.kc)
        for s, length in enumerate(lens):
            for i, p in enumerate(self.pages[s]):
                lo, hi = self.starts[s] + i * page, self.starts[s] + min((i + 1) * page, length)
                self.kc[p, : hi - lo] = self.k[lo:hi]
                self.vc[p, : hi - lo] = self.v[lo:hi]
        self.scale = d ** -0.5

    def rows(self, s: int, lo: int, hi: int) -> slice:
        return slice(self.starts[s] + lo, self.starts[s] + hi)


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def plan_paged(fi, ws, reqs, page: int, causal: bool, heads: tuple[int, int], d: int, dtype, device, scale: float,
               w=None):
    """A paged FA3 prefill wrapper (``w``, or a new one) planned for ``reqs``: (query count, KV length, pages) per
    request."""
    qo, kv_indptr, indices, last = [0], [0], [], []
    for n_q, n_kv, pages in reqs:
        used = -(-n_kv // page)
        qo.append(qo[-1] + n_q)
        kv_indptr.append(kv_indptr[-1] + used)
        indices.extend(pages[:used])
        last.append((n_kv - 1) % page + 1)
    w = w or fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(i32(qo, device), i32(kv_indptr, device), i32(indices, device), i32(last, device), heads[0], heads[1], d,
           page, causal=causal, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
    return w


def paged_call(fi, ws, q, cache, reqs, page: int, causal: bool, heads: tuple[int, int], scale: float):
    """One paged FA3 prefill call, queries packed in ``q`` in request order. Returns (out, lse in base 2), and the
    planned wrapper (for timing)."""
    w = plan_paged(fi, ws, reqs, page, causal, heads, q.shape[-1], q.dtype, q.device, scale)
    out, lse = w.run(q, cache, return_lse=True)
    return out, lse, w


def ragged_call(fi, ws, q, k, v, lens, heads: tuple[int, int], scale: float):
    indptr = i32([sum(lens[:i]) for i in range(len(lens) + 1)], q.device)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(indptr, indptr, heads[0], heads[1], q.shape[-1], causal=True, sm_scale=scale, q_data_type=q.dtype,
           kv_data_type=k.dtype)
    out, lse = w.run(q, k, v, return_lse=True)
    return out, lse, w


def whole(fi, ws, c: Case, seqs: list[int]):
    """Whole-sequence paged prefill of ``seqs`` (in that order): (out, lse) in ``seqs`` order."""
    q = torch.cat([c.q[c.rows(s, 0, c.lens[s])] for s in seqs])
    out, lse, _ = paged_call(fi, ws, q, (c.kc, c.vc), [(c.lens[s], c.lens[s], c.pages[s]) for s in seqs], c.page,
                             True, (c.h, c.hkv), c.scale)
    return out, lse


def chunked(fi, ws, c: Case, chunk: int):
    """Every sequence prefilled chunk by chunk, the j-th chunks of all sequences in one call; packed order."""
    out = torch.empty(c.q.shape[0], c.h, c.d, dtype=c.q.dtype, device=c.device)
    lse = torch.empty(c.q.shape[0], c.h, dtype=torch.float32, device=c.device)
    step = 0
    while True:
        seqs = [s for s, n in enumerate(c.lens) if n > step * chunk]
        if not seqs:
            return out, lse
        spans = [(step * chunk, min((step + 1) * chunk, c.lens[s])) for s in seqs]
        q = torch.cat([c.q[c.rows(s, lo, hi)] for s, (lo, hi) in zip(seqs, spans)])
        o, ls, _ = paged_call(fi, ws, q, (c.kc, c.vc), [(hi - lo, hi, c.pages[s]) for s, (lo, hi) in zip(seqs, spans)],
                              c.page, True, (c.h, c.hkv), c.scale)
        at = 0
        for s, (lo, hi) in zip(seqs, spans):
            out[c.rows(s, lo, hi)], lse[c.rows(s, lo, hi)] = o[at:at + hi - lo], ls[at:at + hi - lo]
            at += hi - lo
        step += 1


def decode_rows(c: Case) -> list[tuple[int, int]]:
    """(sequence, position) pairs for decode checks: tile boundaries of 96 and 128 and the last 4 positions."""
    picks = []
    for s, n in enumerate(c.lens):
        for t in sorted({0, 95, 96, 97, 127, 128, 191, 192, n - 4, n - 3, n - 2, n - 1}):
            if 0 <= t < n:
                picks.append((s, t))
    return picks


def decode(fi, ws, c: Case, picks, folded: bool):
    """Each (sequence, position) a request of one query (``folded``: the group's heads as that request's rows,
    non-causal, one KV head per "query head"). Returns (out [R, H, D], lse [R, H])."""
    q = torch.stack([c.q[c.starts[s] + t] for s, t in picks])  # [R, H, D]
    reqs = [(1, t + 1, c.pages[s]) for s, t in picks]
    if not folded:
        out, lse, _ = paged_call(fi, ws, q, (c.kc, c.vc), reqs, c.page, True, (c.h, c.hkv), c.scale)
        return out, lse
    g, r = c.h // c.hkv, len(picks)
    qf = q.view(r, c.hkv, g, c.d).transpose(1, 2).reshape(r * g, c.hkv, c.d)
    out, lse, _ = paged_call(fi, ws, qf, (c.kc, c.vc), [(g, kv, p) for _, kv, p in reqs], c.page, False,
                             (c.hkv, c.hkv), c.scale)
    return (out.view(r, g, c.hkv, c.d).transpose(1, 2).reshape(r, c.h, c.d),
            lse.view(r, g, c.hkv).transpose(1, 2).reshape(r, c.h))


def trainer_layout(fi, ws, c: Case):
    """The packed K/V as a cache of 1-token pages (what the trainer would pass): no copy, page i = token i."""
    cache = (c.k.unsqueeze(1), c.v.unsqueeze(1))
    reqs = [(n, n, list(range(c.starts[s], c.starts[s] + n))) for s, n in enumerate(c.lens)]
    out, lse, _ = paged_call(fi, ws, c.q, cache, reqs, 1, True, (c.h, c.hkv), c.scale)
    return out, lse


def reference(c: Case):
    """float64 causal attention and natural-log lse, sequence by sequence."""
    g = c.h // c.hkv
    outs, lses = [], []
    for s, n in enumerate(c.lens):
        sl = c.rows(s, 0, n)
        q, k, v = (x[sl].double() for x in (c.q, c.k, c.v))
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        sc = torch.einsum("qhd,khd->hqk", q, k) * c.scale
        sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool, device=c.device).triu(1), float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)  # [h, n]
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(sc - lse[..., None]), v))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def compare(name: str, got, want, rows=None) -> bool:
    """``got`` (out, lse) against ``want`` (the same rows of the whole prefill): ``torch.equal`` for both."""
    (o, ls), (wo, wl) = got, want
    if rows is not None:
        wo, wl = wo[rows], wl[rows]
    same_o, same_l = torch.equal(o, wo), torch.equal(ls, wl)
    diff_rows = int((o != wo).flatten(1).any(1).sum())
    worst = float((o.float() - wo.float()).abs().max()) if o.numel() else 0.0
    emit(f"| {name} | {same_o} | {same_l} | {diff_rows} of {o.shape[0]} | {worst:.2e} |")
    return same_o and same_l


def bits(fi, ws, c: Case) -> dict[str, bool]:
    emit(f"Sequences {c.lens} ({sum(c.lens)} tokens), H={c.h}, Hkv={c.hkv}, D={c.d}, pages of {c.page} in "
         "shuffled order; each row against the whole batch's paged prefill.")
    emit("")
    emit("| against the whole paged prefill | out `==` | lse `==` | rows that differ | max abs diff |")
    emit("|---|---|---|---|---|")
    t0 = time.perf_counter()
    full = whole(fi, ws, c, list(range(len(c.lens))))
    first_s = time.perf_counter() - t0  # on a fresh machine: flashinfer's JIT compile of the paged FA3 module
    res = {}
    alone = [whole(fi, ws, c, [s]) for s in range(len(c.lens))]
    res["alone"] = compare("each sequence alone", (torch.cat([a[0] for a in alone]), torch.cat([a[1] for a in alone])),
                           full)
    rev = list(reversed(range(len(c.lens))))
    o, ls = whole(fi, ws, c, rev)
    idx = torch.cat([torch.arange(c.starts[s], c.starts[s] + c.lens[s]) for s in rev]).to(c.device)
    res["reversed"] = compare("the batch reversed", (o, ls), full, idx)
    for chunk in (512, 300):
        res[f"chunk{chunk}"] = compare(f"chunked prefill, chunks of {chunk}", chunked(fi, ws, c, chunk), full)
    picks = decode_rows(c)
    idx = torch.tensor([c.starts[s] + t for s, t in picks], device=c.device)
    res["decode"] = compare(f"decode, one query a request ({len(picks)} requests, causal)", decode(fi, ws, c, picks,
                                                                                                  False), full, idx)
    res["folded"] = compare("decode, the GQA group folded into rows (non-causal)", decode(fi, ws, c, picks, True),
                            full, idx)
    res["pages1"] = compare("the packed layout as 1-token pages (the trainer)", trainer_layout(fi, ws, c), full)
    o, ls, _ = ragged_call(fi, ws, c.q, c.k, c.v, c.lens, (c.h, c.hkv), c.scale)
    res["ragged"] = compare("ragged kernel (TMA, another KV tile: expected to differ)", (o, ls), full)
    ro, rl = reference(c)
    err_o = float((full[0].double() - ro).abs().max())
    err_l = float((full[1].double() * math.log(2.0) - rl).abs().max())
    emit("")
    emit(f"Whole paged prefill against float64: out max abs diff {err_o:.2e}, lse (base 2 x ln 2) {err_l:.2e}. "
         f"Its first call took {first_s:.1f} s (flashinfer's JIT compile included where its cache was empty).")
    return res


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _free() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def speed(fi, ws) -> None:
    emit("")
    emit("| case | kernel | ms | rate |")
    emit("|---|---|---:|---:|")
    for part in (speed_prefill, speed_chunk, speed_decode):
        try:
            part(fi, ws)
        except Exception as e:  # noqa: BLE001 - report and go on: the bits above are the main result
            emit(f"| {part.__name__} | failed: {type(e).__name__}: {str(e)[:300]} | | |")
        _free()


def speed_prefill(fi, ws) -> None:
    from rlrepro.kernels import AttentionMetadata
    from rlrepro.kernels.triton_attention import attention_fwd
    dev = torch.device(DEVICE)
    for batch, length in PREFILL_CASES:
        c = Case([length] * batch, (H, HKV, D), dev, seed=length, page=PAGE)
        flops = 4.0 * batch * H * D * length * length / 2
        runs = {}
        _, _, w = ragged_call(fi, ws, c.q, c.k, c.v, c.lens, (H, HKV), c.scale)
        runs["FA3 ragged (TMA, 128-position KV tiles)"] = lambda w=w: w.run(c.q, c.k, c.v)
        for page, cache in ((PAGE, (c.kc, c.vc)), (1, (c.k.unsqueeze(1), c.v.unsqueeze(1)))):
            pages = c.pages if page == PAGE else [list(range(c.starts[s], c.starts[s] + length)) for s in range(batch)]
            _, _, wp = paged_call(fi, ws, c.q, cache, [(length, length, pages[s]) for s in range(batch)], page, True,
                                  (H, HKV), c.scale)
            runs[f"FA3 paged, pages of {page}"] = lambda wp=wp, cache=cache: wp.run(c.q, cache)
        meta = AttentionMetadata.packed(c.lens, dev)
        runs["rlrepro deterministic (Triton)"] = lambda: attention_fwd(c.q, c.k, c.v, meta, c.scale)
        for name, fn in runs.items():
            ms = bench(fn)
            emit(f"| {batch} x {length} causal | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} TFLOP/s |")
        runs.clear()
        _free()


def speed_chunk(fi, ws) -> None:
    from rlrepro.kernels import AttentionMetadata
    from rlrepro.kernels.triton_attention import attention_fwd
    dev = torch.device(DEVICE)
    seqs, new, ctx = CHUNK_CASE
    c = Case([ctx] * seqs, (H, HKV, D), dev, seed=3, page=PAGE)
    q = torch.cat([c.q[c.rows(s, ctx - new, ctx)] for s in range(seqs)])
    _, _, wp = paged_call(fi, ws, q, (c.kc, c.vc), [(new, ctx, c.pages[s]) for s in range(seqs)], PAGE, True,
                          (H, HKV), c.scale)
    meta = AttentionMetadata.paged([new] * seqs, [ctx] * seqs, c.pages, PAGE, device=dev)
    kf, vf = c.kc.view(-1, HKV, D), c.vc.view(-1, HKV, D)
    emit(f"| chunk {seqs} x {new} on {ctx} | FA3 paged | {bench(lambda: wp.run(q, (c.kc, c.vc))):.3f} | |")
    emit(f"| chunk {seqs} x {new} on {ctx} | rlrepro | {bench(lambda: attention_fwd(q, kf, vf, meta, c.scale)):.3f} | |")


def speed_decode(fi, ws) -> None:
    from rlrepro.kernels import AttentionMetadata
    from rlrepro.kernels.triton_attention import attention_fwd
    dev = torch.device(DEVICE)
    r, ctx = DECODE_CASE
    c = Case([ctx] * r, (H, HKV, D), dev, seed=4, page=PAGE)
    kv_bytes = r * ctx * HKV * D * 2 * 2
    q = torch.stack([c.q[c.starts[s] + ctx - 1] for s in range(r)])
    g = H // HKV
    reqs = [(1, ctx, c.pages[s]) for s in range(r)]
    _, _, w1 = paged_call(fi, ws, q, (c.kc, c.vc), reqs, PAGE, True, (H, HKV), c.scale)
    qf = q.view(r, HKV, g, D).transpose(1, 2).reshape(r * g, HKV, D)
    _, _, wf = paged_call(fi, ws, qf, (c.kc, c.vc), [(g, ctx, c.pages[s]) for s in range(r)], PAGE, False,
                          (HKV, HKV), c.scale)
    wd = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    per = -(-ctx // PAGE)  # pages a request
    wd.plan(i32([s * per for s in range(r + 1)], dev), i32([p for s in range(r) for p in c.pages[s]], dev),
            i32([(ctx - 1) % PAGE + 1] * r, dev), H, HKV, D, PAGE, q_data_type=q.dtype, sm_scale=c.scale,
            disable_split_kv=True)
    meta = AttentionMetadata.paged([1] * r, [ctx] * r, c.pages, PAGE, device=dev)
    kf, vf = c.kc.view(-1, HKV, D), c.vc.view(-1, HKV, D)
    folded_reqs = [(g, ctx, c.pages[s]) for s in range(r)]
    times = []
    for _ in range(20):  # the host's share of a decode step on CUDA graphs: a plan before every replay
        t0 = time.perf_counter()
        plan_paged(fi, ws, folded_reqs, PAGE, False, (HKV, HKV), D, q.dtype, dev, c.scale, w=wf)
        _sync()
        times.append(time.perf_counter() - t0)
    emit(f"| decode {r} x {ctx} | FA3 folded decode's plan (host, before each step) | "
         f"{sorted(times)[len(times) // 2] * 1e3:.4f} | |")
    for name, fn in (("FA3 paged, one query a request", lambda: w1.run(q, (c.kc, c.vc))),
                     ("FA3 paged, group folded, non-causal", lambda: wf.run(qf, (c.kc, c.vc))),
                     ("flashinfer decode, tensor cores, no split KV", lambda: wd.run(q, (c.kc, c.vc))),
                     ("rlrepro decode (Triton)", lambda: attention_fwd(q, kf, vf, meta, c.scale))):
        ms = bench(fn)
        emit(f"| decode {r} x {ctx} | {name} | {ms:.4f} | {kv_bytes / ms / 1e9:.2f} TB/s of KV |")


def open_flashinfer(script: str, title: str):
    """(flashinfer, a 256 MiB workspace) on the GPU, the report's heading emitted; None (said why) without a GPU or
    flashinfer. The probes' common start."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU and flashinfer")
        return None
    from rlrepro.kernels.fast import flashinfer_module
    fi = flashinfer_module()
    if fi is None:
        print("flashinfer does not import: carry .fi (scripts/make_fi_kit.sh)")
        return None
    emit(f"### {title} ({torch.cuda.get_device_name(0)}, torch {torch.__version__}, flashinfer "
         f"{getattr(fi, '__version__', '?')})")
    emit("")
    return fi, torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    opened = open_flashinfer("probe_fa3_invariance.py", "FA3 invariance")
    if opened is None:
        return 1
    fi, ws = opened
    res = bits(fi, ws, Case(LENS, (H, HKV, D), "cuda"))
    emit("")
    emit("Invariant (every check but the ragged kernel's): "
         f"{all(v for k, v in res.items() if k != 'ragged')}")
    write(args.out)  # the bits, whatever the timings do
    if not args.no_bench:
        speed(fi, ws)
    write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
