"""The experimental warp-specialised Gluon forward (Hopper; rlrepro/kernels/gluon_attention_fwd.py) against the
Triton forward: bits first, then speed. The work runs in a child process under ``--timeout`` seconds, because the
kernel hung on the H100 (its module docstring says how far the diagnosis got); a hang is reported, not waited out.

    python3 benchmarks/bench_attention_gluon.py [--out FILE.md] [--stages 2,3,4] [--bit-stages 2] [--no-bits]
                                                [--timeout 120] [--minimal-only]

First the hang reduced (``gluon_attention_fwd.probe_tma_wait``): one partition loads one tile by TMA, another waits
on its barrier and copies the tile out, with the producer as the default partition and as a worker, each in its own
child under 30 s. Then the kernel itself (unless ``--minimal-only``).

``--variants pp0ps0,pp1ps1,...`` checks the bits of
each ping-pong (``GLW_PP``) / persistent (``GLW_PERSIST``) variant in a child of its own, then times those whose bits
held, in one child.

Bits: for packed batches of ragged sequences (lengths at and around the 64-position KV tiles and the 128-row
tiles, a 1-token sequence, a long one), GQA 4 and 8 and MHA, head sizes 128 and 64, the Gluon output and float32
lse are ``torch.equal`` to the Triton kernel's under both prefill configs ("large" and "long"); a sequence alone
gives the same bits as in the batch; at each ``--bit-stages`` count (default: each ``--stages`` count), since the
ring's size decides how many Q buffers fit beside it (``nq``, with Q by TMA).

Speed (``triton.testing.do_bench`` medians, L2 flushed, one process): Qwen3-8B heads (H=32, Hkv=8, D=128, bf16),
causal, packed: 4 x 2048, 2 x 8192, 1 x 16384 and 16 x 1024; the Gluon kernel at each ``--stages``, the Triton
"long" tile, flashinfer's FA3 ragged prefill (when it imports) and SDPA's flash forward; TFLOP/s and ratios.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from _report import bench, causal_references, emit, write  # noqa: E402
from _triton_helpers import attention_data  # noqa: E402

from rlrepro.kernels import AttentionMetadata  # noqa: E402
from rlrepro.kernels import gluon_attention_fwd as G  # noqa: E402
from rlrepro.kernels import triton_attention_fwd as A  # noqa: E402

H, HKV, D = 32, 8, 128
SHAPES = ((4, 2048), (2, 8192), (1, 16384), (16, 1024))
BIT_LENS = ([300, 129, 1, 77, 2000, 64, 65, 128, 127, 33], [4096, 17, 511, 512, 513])


def gluon_fwd(q, k, v, meta, scale, return_lse=False):
    """The Gluon kernel on a packed call, as ``attention_fwd`` would schedule its 128-row tile."""
    n, h, d = q.shape
    group = h // k.shape[1]
    gq, group_p = A.tile_shape(group, G.CONSUMERS * G.ROWS)
    out = torch.empty_like(q)
    lse = torch.zeros((n, h), device=q.device, dtype=torch.float32) if return_lse else None
    cu = meta.cu_seqlens_q
    sched = A._device_schedule(cu, meta.num_seqs, n, gq)
    block_kv, fma = A.attention_order()
    G.attention_fwd_gluon(q, k, v, cu, meta.seq_lens, sched, scale, group, group_p, gq, out, lse, block_kv=block_kv,
                          fma=fma)
    return (out, lse) if return_lse else out


def rnd(*shape, gen, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale


def smoke(gen) -> None:
    """One small call of each kernel, timed with its compile, so that a hang or a slow compile shows where."""
    lens = [300, 77]
    q, k, v = rnd(sum(lens), 32, 128, gen=gen), rnd(sum(lens), 8, 128, gen=gen), rnd(sum(lens), 8, 128, gen=gen)
    meta = AttentionMetadata.packed(lens, device="cuda")
    for name, fn in (("triton", A.attention_fwd), ("gluon", gluon_fwd)):
        t0 = time.time()
        fn(q, k, v, meta, 0.09)
        torch.cuda.synchronize()
        emit(f"smoke: {name} first call (with its compile) {time.time() - t0:.1f} s")


def bits(gen) -> None:
    for lens in BIT_LENS:
        for (h, hkv, d), kind in (((32, 8, 128), "random"), ((32, 4, 128), "random"), ((16, 16, 128), "random"),
                                  ((32, 8, 64), "random"), ((32, 8, 128), "sink"), ((32, 8, 128), "rising")):
            n = sum(lens)
            q, k, v = rnd(n, h, d, gen=gen, scale=2.0), rnd(n, hkv, d, gen=gen, scale=2.0), rnd(n, hkv, d, gen=gen)
            attention_data(kind, q, k, lens)
            meta = AttentionMetadata.packed(lens, device="cuda")
            og, lg = gluon_fwd(q, k, v, meta, d ** -0.5, return_lse=True)
            for cname in ("large", "long"):
                cfg = A.ATTENTION_CONFIGS[cname]
                if cfg.rows > 128 and d > A.LONG_MAX_HEAD_DIM:
                    continue
                ot, lt = A.attention_fwd(q, k, v, meta, d ** -0.5, config=cfg, return_lse=True)
                ok = torch.equal(og, ot) and torch.equal(lg, lt)
                diff = (og.float() - ot.float()).abs().max().item()
                emit(f"| {lens[:4]}... | {h}/{hkv}/{d}{'' if kind == 'random' else ' ' + kind} | {cname} | "
                     f"{'equal' if ok else f'DIFFERS ({diff:.3g})'} |")
        # one sequence alone vs in the batch
        q, k, v = rnd(sum(lens), 32, 128, gen=gen), rnd(sum(lens), 8, 128, gen=gen), rnd(sum(lens), 8, 128, gen=gen)
        full = gluon_fwd(q, k, v, AttentionMetadata.packed(lens, device="cuda"), 0.09)
        i = 4  # the fifth sequence, alone
        sl = slice(sum(lens[:i]), sum(lens[:i + 1]))
        alone = gluon_fwd(q[sl], k[sl], v[sl], AttentionMetadata.packed([lens[i]], device="cuda"), 0.09)
        emit(f"| alone len {lens[i]} | 32/8/128 | auto | {'equal' if torch.equal(alone, full[sl]) else 'DIFFERS'} |")


def tflops(batch: int, length: int, ms: float) -> float:
    return 4.0 * batch * H * D * length * length / 2 / (ms * 1e-3) / 1e12


def set_variant(spec: str) -> str:
    """``spec`` like ``pp1ps0kv1``, ``pp1ps1q0`` or ``pp0ps0kv0m0h1t1o128f``: GLW_PP, GLW_PERSIST, GLW_KV2, GLW_QTMA,
    GLW_OSM (``m``: O stored through shared memory, 1 unless given), GLW_HALF (``h``: the last tile's lower half
    alone where its upper half is masked), GLW_TMAX (``t``: the row max as a tree), GLW_META (``e``: with Q by TMA,
    the producer hands each work's slot row to the consumers in shared memory), GLW_KVS (``s``: a stage's K and V
    buffers freed apart, K after its ``Q @ K^T``), GLW_TAB (``w``: persistent, each work's slot row from a table in one
    step), GLW_SKIP (``r``: a warp skips the accumulator's rescale where no row's max grew), GLW_HOLD (``d``: the wait
    for ``P @ V`` held below the softmax in the SASS), GLW_QK2 (``n``: two KV tiles a ring stage, their ``Q @ K^T``
    issued together; the 64-position order only) and the reduction order
    (``RLREPRO_ATTENTION_ORDER``, for the Triton reference too) for the kernels' next calls
    (``-``: leave the env; a missing ``kv`` part: 0; a missing ``q`` part: 0, Q loaded by the consumers; a missing
    ``o`` part: the default order)."""
    if spec != "-":
        m = re.fullmatch(r"pp([01])ps([01])(?:kv([01]))?(?:q([01]))?(?:m([01]))?(?:h([01]))?(?:t([01]))?(?:e([01]))?"
                         r"(?:s([01]))?(?:w([01]))?(?:r([01]))?(?:d([01]))?(?:n([01]))?(?:o(\w+))?", spec)
        if m is None:
            raise SystemExit(f"--variants: {spec!r} is not like pp0ps1kv0q1m0h1t1e1s1w1r1d1n1o128f")
        pp, ps, kv, qt, osm, half, tmax, meta, kvs, tab, skip, hold, qk2, order = m.groups()
        os.environ.update(GLW_PP=pp, GLW_PERSIST=ps, GLW_KV2=kv or "0", GLW_QTMA=qt or "0", GLW_OSM=osm or "1",
                          GLW_HALF=half or "0", GLW_TMAX=tmax or "0", GLW_META=meta or "0", GLW_KVS=kvs or "0",
                          GLW_TAB=tab or "0", GLW_SKIP=skip or "0", GLW_HOLD=hold or "0",
                          GLW_QK2=qk2 or "0",
                          RLREPRO_ATTENTION_ORDER=order or "")
    name = "pp{}ps{}kv{}".format(*(os.environ.get(f"GLW_{k}", "0") for k in ("PP", "PERSIST", "KV2")))
    name += "q" + os.environ.get("GLW_QTMA", "0")
    name += "m0" if os.environ.get("GLW_OSM", "1") == "0" else ""
    name += "".join(f"{c}1" for c, k in (("h", "GLW_HALF"), ("t", "GLW_TMAX"), ("e", "GLW_META"), ("s", "GLW_KVS"),
                                                ("w", "GLW_TAB"), ("r", "GLW_SKIP"),
                                                ("d", "GLW_HOLD"), ("n", "GLW_QK2"))
                    if os.environ.get(k, "0") == "1")
    order = os.environ.get("RLREPRO_ATTENTION_ORDER", "")
    return name + (f"o{order}" if order else "")


def summarise(rounds: list[dict[str, float]]) -> dict[str, tuple[float, float, float | None]]:
    """Each name's ``(median ms, spread, median FA3 / this)`` over ``rounds`` (dicts of name -> ms, one a round,
    every variant timed once a round, round-robin): the spread is ``(max - min) / median``, the FA3 ratio the median
    of the rounds' own ratios (so a machine that drifts within the call moves both sides of each), None without FA3."""
    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    out = {}
    for name in rounds[0]:
        ms = [r[name] for r in rounds]
        mid = median(ms)
        ratios = [r["FA3"] / r[name] for r in rounds if "FA3" in r]
        out[name] = (mid, (max(ms) - min(ms)) / mid, median(ratios) if len(ratios) == len(rounds) else None)
    return out


def timings(gen, stages: list[int], fi, variants: list[str], data: tuple[str, ...] = ("random",),
            rounds: int = 1) -> list[str]:
    """The table's rows: each shape and data kind, the Triton tile, each variant at each stage count and the
    references, timed ``rounds`` times round-robin (:func:`summarise`)."""
    rows = []
    scale = D ** -0.5
    for (batch, length), kind in [(shape, kind) for shape in SHAPES for kind in data]:
        n = batch * length
        q, k, v = rnd(n, H, D, gen=gen), rnd(n, HKV, D, gen=gen), rnd(n, HKV, D, gen=gen)
        attention_data(kind, q, k, [length] * batch)
        label = f"{batch} x {length}" + ("" if kind == "random" else f" {kind}")
        meta = AttentionMetadata.packed([length] * batch, "cuda")
        # the Triton tile the order's packed calls take without Gluon ("long" in the default order, "large" in
        # 128f, whose 256 x 128 "long" tile is never picked: 0.06x FA3 on the H100); the order of the first variant
        set_variant(variants[0]) if variants else None
        tile = "large" if A.attention_order()[0] > A.BLOCK_KV else "long"
        got = []
        for _ in range(rounds):
            set_variant(variants[0]) if variants else None
            res = {}
            res[f"triton {tile}"] = bench(lambda: A.attention_fwd(q, k, v, meta, scale,
                                                                  config=A.ATTENTION_CONFIGS[tile]))
            base_stages = G.STAGES
            try:
                for spec in variants:
                    name = set_variant(spec)
                    for st in stages:
                        G.STAGES = st
                        key = f"gluon {name} s{st}"
                        while key in res:  # a variant listed again (before and after another): a row of its own
                            key += "'"
                        res[key] = bench(lambda: gluon_fwd(q, k, v, meta, scale))
            finally:
                G.STAGES = base_stages
            res.update(causal_references(q, k, v, batch, length, scale, fi))
            got.append(res)
        for name, (ms, spread, ratio) in summarise(got).items():
            rows.append(f"| {label} | {name} | {ms:.4f} | {tflops(batch, length, ms):.0f} | "
                        f"{'-' if ratio is None else f'{ratio:.3f}'} |" + (f" {spread:.1%} |" if rounds > 1 else ""))
    return rows


def child(args) -> int:
    try:
        import flashinfer as fi
    except Exception:  # noqa: BLE001
        fi = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    emit(f"### Gluon forward vs Triton ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
         f"flashinfer {'absent' if fi is None else fi.__version__}"
         ")")
    variants = [v for v in args.variants.split(",") if v]
    for spec in variants:
        emit(f"#### variant {set_variant(spec)}")
        smoke(gen)
        if not args.no_bits:  # at each --bit-stages count: it sets how many Q buffers fit beside the ring
            base_stages = G.STAGES
            try:
                for st in [int(s) for s in (args.bit_stages or args.stages).split(",") if s]:
                    G.STAGES = st
                    emit(f"stages {st}:")
                    emit("| lens | H/Hkv/D | config | gluon vs triton (out and lse) |")
                    emit("|---|---|---|---|")
                    bits(gen)
            finally:
                G.STAGES = base_stages
    if args.no_timing:
        return 0
    if args.rounds > 1:  # medians of the rounds, the FA3 ratio of each round, and the spread of the times
        emit(f"{args.rounds} rounds, round-robin: medians")
        emit("| shape | kernel | ms | TFLOP/s | FA3 / this | spread |")
        emit("|---|---|---:|---:|---:|---:|")
    else:
        emit("| shape | kernel | ms | TFLOP/s | FA3 / this |")
        emit("|---|---|---:|---:|---:|")
    for line in timings(gen, [int(s) for s in args.stages.split(",") if s], fi, variants,
                        tuple(d for d in args.data.split(",") if d), args.rounds):
        emit(line)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--no-bits", action="store_true")
    ap.add_argument("--bit-stages", default="", help="the stage counts the bits battery runs at (default: --stages)")
    ap.add_argument("--no-timing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default="-", help="comma list of ping-pong/persistent variants to check and time, "
                    "e.g. pp0ps0,pp1ps1kv1 (GLW_PP, GLW_PERSIST, GLW_KV2; '-': as the environment says)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole child run")
    ap.add_argument("--rounds", type=int, default=1, help="time every kernel this many times, round-robin, and print "
                    "the medians, the median of the rounds' FA3 ratios and the spread (a machine that drifts within "
                    "a call moves every kernel of a round alike)")
    ap.add_argument("--data", default="random", help="comma list of the timed inputs: random, sink (every query's "
                    "largest score on its sequence's first key), rising (scores grow with the key's position)")
    ap.add_argument("--minimal-only", action="store_true", help="run only the reduced TMA-wait probe")
    ap.add_argument("--cases", default="", help="packed lengths to run one call each, e.g. '64;128;300,77' "
                    "(GLW_HKV: KV heads, 8)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probes", action="store_true", help="run gluon_hang_probes.CASES first")
    ap.add_argument("--child-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-minimal", choices=["default", "worker"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [d for d in args.data.split(",") if d not in ("random", "sink", "rising")]
    if bad:
        raise SystemExit(f"--data: {bad} not among random, sink, rising")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: {args.rounds} is not a positive count (1: each kernel timed once)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not G.HAVE_GLUON:
        print("bench_attention_gluon: needs a Hopper GPU and Triton with Gluon")
        return 1
    if args.child_probe:
        import gluon_hang_probes as P

        ok, err = P.probe(264, **P.CASES[args.child_probe])
        print(f"probe {args.child_probe!r}: finished, {'equal' if ok else 'DIFFERS'} (max error {err:.3g})",
              flush=True)
        return 0
    if args.child_case:
        lens = [int(x) for x in args.child_case.split(",")]
        hkv = int(os.environ.get("GLW_HKV", "8"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = rnd(sum(lens), 4 * hkv, 128, gen=gen), rnd(sum(lens), hkv, 128, gen=gen), rnd(sum(lens), hkv, 128,
                                                                                                 gen=gen)
        meta = AttentionMetadata.packed(lens, device="cuda")
        og, lg = gluon_fwd(q, k, v, meta, 0.09, return_lse=True)
        torch.cuda.synchronize()
        ot, lt = A.attention_fwd(q, k, v, meta, 0.09, config=A.ATTENTION_CONFIGS["large"], return_lse=True)
        same = torch.equal(og, ot) and torch.equal(lg, lt)
        print(f"case {lens} (Hkv {hkv}): finished, {'equal' if same else 'DIFFERS'} to the Triton kernel", flush=True)
        return 0
    if args.child_minimal:
        import gluon_hang_probes as P
        x = torch.randn(64 * 264, 128, device="cuda", dtype=torch.bfloat16)
        got = P.probe_tma_wait(x, args.child_minimal == "default")
        torch.cuda.synchronize()
        print(f"minimal TMA wait, producer as the {args.child_minimal} partition: "
              f"{'copy equal' if torch.equal(got, x) else 'COPY DIFFERS'}", flush=True)
        return 0
    if args.child:
        return child(args)
    for where in ("default", "worker") if args.minimal_only or args.probes else ():
        rc, out = _run([sys.executable, os.path.abspath(__file__), "--child-minimal", where], 30.0)
        for line in out.splitlines()[-3:]:
            emit(line)
        if rc is None:
            emit(f"minimal TMA wait, producer as the {where} partition: **HANG** (killed after 30 s)")
    if args.probes:  # gluon_hang_probes: the forward's pieces added one at a time, each in a child under 20 s
        import gluon_hang_probes as P

        for name in P.CASES:
            rc, out = _run([sys.executable, os.path.abspath(__file__), "--child-probe", name], 20.0)
            for line in out.splitlines()[-2:]:
                emit(line)
            if rc is None:
                emit(f"probe {name!r}: **HANG** (killed after 20 s)")
    for case in [c for c in args.cases.split(";") if c]:  # one packed call each, in its own child under 20 s
        rc, out = _run([sys.executable, os.path.abspath(__file__), "--child-case", case], 20.0)
        for line in out.splitlines()[-2:]:
            emit(line)
        if rc is None:
            emit(f"case [{case}]: **HANG** (killed after 20 s)")
    if args.minimal_only:
        write(args.out)
        return 0
    base = [sys.executable, os.path.abspath(__file__), "--child", "--stages", args.stages, "--bit-stages",
            args.bit_stages or args.stages, "--data", args.data, "--rounds", str(args.rounds)]
    runs = []  # each variant's bits in a child of its own (a hang costs that variant), then the timings together
    good = []
    if not args.no_bits:
        for spec in [v for v in args.variants.split(",") if v]:
            runs.append((f"bits of {spec}", base + ["--variants", spec, "--no-timing"]))
    runs.append(("timings", base + ["--no-bits", "--variants", args.variants]))
    rc = 0
    for what, cmd in runs:
        if what == "timings" and not args.no_bits:
            if not good:
                break
            cmd = base + ["--no-bits", "--variants", ",".join(good)]
        t0 = time.time()
        rc, out = _run(cmd, args.timeout)
        for line in out.splitlines():
            emit(line)
        if rc is None:
            emit(f"**TIMEOUT** ({what}): the child ran past {args.timeout:.0f} s and was killed (the kernel hung?)")
        elif rc:
            emit(f"**FAILED** ({what}): the child exited {rc} after {time.time() - t0:.0f} s")
        elif what.startswith("bits of ") and "DIFFERS" not in out:
            good.append(what[len("bits of "):])
    write(args.out)
    return 0 if rc == 0 else 1


def _run(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``cmd``; (its exit code, or None when killed at ``timeout`` seconds; its output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, proc.communicate()[0]


if __name__ == "__main__":
    raise SystemExit(main())
