"""rlrepro's Triton decode in FA3's order: the bits of flashinfer's FA3 kernel, at Triton's decode speed?

    python3 benchmarks/probe_fa3_decode.py [--out FILE.md] [--no-bench]

Issue #27. ``rlrepro/kernels/triton_fa3_decode.py`` reproduces, for one query per request, the arithmetic of
flashinfer 0.5.3's sm90 FA3 kernel (96-position KV tiles from the last, per-thread row sums, ``ex2.approx.ftz``).
Bits first: every decode row of ``probe_fa3_invariance.py``'s battery (tile boundaries of 96 and 128, the last
positions) against FA3's whole paged prefill of the battery, ``torch.equal``; each of the kernel's arithmetic
switches (which FA3 step the compiler fuses) is tried, and the launch shapes (warps, stages) must all agree.
Then the speed (``do_bench`` medians): the decode at 64 x 2048, 64 x 8192 and 256 x 2048 beside FA3's folded decode
and rlrepro's own Triton decode, in the same process.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import bench, emit, write  # noqa: E402
import probe_fa3_invariance as inv  # noqa: E402

H, HKV, D = inv.H, inv.HKV, inv.D
DECODE_CASES = ((64, 2048), (64, 8192), (256, 2048))
# (sum_fma, exp_fma, lse_fma): which of FA3's steps its compiler fuses; the output's bf16 rounding hides most
# one-bit differences of the row sum, the log-sum-exp (float32) shows them
SWITCHES = ((True, True, True), (True, True, False), (False, True, True), (False, True, False), (True, False, True))
LAUNCHES = ((4, 3), (1, 2), (2, 2), (2, 3), (4, 2), (8, 3))  # (num_warps, num_stages); the first is the default


def _tables(c: inv.Case, picks):
    """seq_lens [R] and block tables [R, max] for decode rows ``picks`` ((sequence, position) pairs)."""
    width = max(len(p) for p in c.pages)
    bt = torch.zeros(len(picks), width, dtype=torch.int32)
    for r, (s, _) in enumerate(picks):
        bt[r, : len(c.pages[s])] = torch.tensor(c.pages[s], dtype=torch.int32)
    lens = torch.tensor([t + 1 for _, t in picks], dtype=torch.int32)
    return lens.to(c.device), bt.to(c.device)


def bits(fi, ws, c: inv.Case) -> dict:
    from rlrepro.kernels import triton_fa3_decode as T
    full_o, full_l = inv.whole(fi, ws, c, list(range(len(c.lens))))
    picks = inv.decode_rows(c)
    idx = torch.tensor([c.starts[s] + t for s, t in picks], device=c.device)
    want, want_l = full_o[idx], full_l[idx]
    q = torch.stack([c.q[c.starts[s] + t] for s, t in picks])
    lens, bt = _tables(c, picks)
    fold = inv.decode(fi, ws, c, picks, folded=True)
    emit(f"Sequences {c.lens}, H={c.h}, Hkv={c.hkv}, D={c.d}, pages of {c.page} shuffled; {len(picks)} decode rows "
         "against FA3's whole paged prefill (`torch.equal`):")
    emit("")
    emit("| kernel | switches (sum_fma, exp_fma, lse_fma) | launch (warps, stages) | out `==` | lse `==` | "
         "rows that differ (out, lse) | max abs diff (out, lse) |")
    emit("|---|---|---|---|---|---|---|")
    res = {}

    def row(name, sw, launch, got):
        o, ls = got
        same, same_l = torch.equal(o, want), torch.equal(ls, want_l)
        diff = int((o != want).flatten(1).any(1).sum())
        diff_l = int((ls != want_l).any(1).sum())
        worst = float((o.float() - want.float()).abs().max())
        worst_l = float((ls - want_l).abs().max())
        emit(f"| {name} | {sw} | {launch} | {same} | {same_l} | {diff}, {diff_l} of {len(picks)} | "
             f"{worst:.2e}, {worst_l:.2e} |")
        return same and same_l

    def run(sw, launch=(4, 3), rows=slice(None)):
        return T.decode(q[rows].contiguous(), (c.kc, c.vc), lens[rows].contiguous(), bt[rows].contiguous(),
                        c.scale, return_lse=True, num_warps=launch[0], num_stages=launch[1], sum_fma=sw[0],
                        exp_fma=sw[1], lse_fma=sw[2])

    res["fa3-folded"] = row("FA3 folded decode", "-", "-", fold)
    for sw in SWITCHES:
        res[sw] = row("Triton, FA3 order", sw, (4, 3), run(sw))
    best = [sw for sw in SWITCHES if res[sw]] or [SWITCHES[0]]
    for launch in LAUNCHES:
        res[("launch",) + launch] = row("Triton, FA3 order", best[0], launch, run(best[0], launch))
    # a request alone and the batch reversed: the same bits (batch invariance of the kernel itself)
    o_all = run(best[0])[0]
    rev = torch.arange(len(picks) - 1, -1, -1, device=c.device)
    o_rev = run(best[0], rows=rev)[0]
    alone = all(torch.equal(run(best[0], rows=slice(i, i + 1))[0][0], o_all[i]) for i in range(len(picks)))
    res["reversed"] = torch.equal(o_rev.flip(0), o_all)
    res["alone"] = alone
    emit("")
    emit(f"Batch reversed == batch: {res['reversed']}; each request alone == in the batch: {alone}")
    return res


def speed(fi, ws, switches) -> None:
    from rlrepro.kernels import AttentionMetadata
    from rlrepro.kernels import triton_fa3_decode as T
    from rlrepro.kernels.triton_attention import attention_fwd
    emit("")
    emit("| case | kernel | ms | TB/s of KV | / FA3 folded |")
    emit("|---|---|---:|---:|---:|")
    for r, ctx in DECODE_CASES:
        c = inv.Case([ctx] * r, (H, HKV, D), "cuda", seed=4, page=inv.PAGE)
        kv_bytes = r * ctx * HKV * D * 2 * 2
        picks = [(s, ctx - 1) for s in range(r)]
        q = torch.stack([c.q[c.starts[s] + ctx - 1] for s in range(r)])
        g = H // HKV
        qf = q.view(r, HKV, g, D).transpose(1, 2).reshape(r * g, HKV, D)
        _, _, wf = inv.paged_call(fi, ws, qf, (c.kc, c.vc), [(g, ctx, c.pages[s]) for s in range(r)], inv.PAGE,
                                  False, (HKV, HKV), c.scale)
        meta = AttentionMetadata.paged([1] * r, [ctx] * r, c.pages, inv.PAGE, device="cuda")
        kf, vf = c.kc.view(-1, HKV, D), c.vc.view(-1, HKV, D)
        lens, bt = _tables(c, picks)
        rows = [("FA3 paged folded", lambda: wf.run(qf, (c.kc, c.vc))),
                ("rlrepro decode (Triton, its own order)", lambda: attention_fwd(q, kf, vf, meta, c.scale))]
        for nw, ns in LAUNCHES:
            rows.append((f"Triton in FA3's order, {nw} warp(s), {ns} stages",
                         lambda nw=nw, ns=ns: T.decode(q, (c.kc, c.vc), lens, bt, c.scale, num_warps=nw,
                                                       num_stages=ns, sum_fma=switches[0], exp_fma=switches[1],
                                                       lse_fma=switches[2])))
        base = None
        for name, fn in rows:
            ms = bench(fn)
            base = base or ms
            emit(f"| {r} x {ctx} | {name} | {ms:.4f} | {kv_bytes / ms / 1e9:.2f} | {base / ms:.3f} |")
        del c
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    opened = inv.open_flashinfer("probe_fa3_decode.py", "Triton decode in FA3's order")
    if opened is None:
        return 1
    fi, ws = opened
    res = {}
    for seed, scale_q in ((0, 1.0), (1, 8.0)):
        c = inv.Case(inv.LENS, (H, HKV, D), "cuda", seed=seed)
        if scale_q != 1.0:  # sharper softmax: large score gaps, rescales far from 1
            c.q = (c.q.float() * scale_q).to(c.q.dtype)
        emit(f"Seed {seed}, queries x {scale_q}:")
        r = bits(fi, ws, c)
        res.update({(seed,) + (k if isinstance(k, tuple) else (k,)): v for k, v in r.items()})
        write(args.out)
    good = [sw for sw in SWITCHES if all(res.get((s,) + sw, False) for s in (0, 1))]
    emit("")
    emit(f"Switches giving FA3's bits in every check: {good}")
    write(args.out)
    if not args.no_bench:
        speed(fi, ws, good[0] if good else SWITCHES[0])
    write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
