"""The layout-invariant pieces' products (``train.tp_partials``, issue #26) one by one, against what the plain step
runs, at the 8B width and the recipe's micro-batch (12,288 tokens; the LM head's 8,192 completion tokens):

    python benchmarks/bench_pieces_products.py [--pieces 8] [--sweep] [--out FILE]

For every linear of a Qwen3-8B layer and the LM head, its three products as the pieces step computes them
(``rlrepro.kernels.tp_fused``: the forward, ``grad_x`` and ``grad_w`` through ``rlrepro.kernels.triton_pieces``)
next to the plain step's (the forward through ``triton_matmul.matmul``, the backward through cuBLAS ``torch.mm``).
``--sweep`` also times every tile config of each pieces product and checks that all give bitwise the output of
the automatic one (any config is promised the same bits). Times are ``triton.testing.do_bench`` medians (L2
flushed), one process, so the ratios compare within a run. Writes markdown to stdout and ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _report  # noqa: E402
from _report import emit, write  # noqa: E402
from rlrepro.kernels import triton_matmul as mm  # noqa: E402
from rlrepro.kernels import triton_pieces as pk  # noqa: E402

# (name, kind, N_out, K_in, tokens): a layer's linears as the trainer runs them (q, k, v and gate, up one product
# each) at a 12,288-token micro-batch, the LM head at 8,192; --fused: q|k|v and gate|up as one product each
LINEARS = [("q_proj", "column", 4096, 4096, 12288), ("k_proj", "column", 1024, 4096, 12288),
           ("v_proj", "column", 1024, 4096, 12288), ("o_proj", "row", 4096, 4096, 12288),
           ("gate_proj", "column", 12288, 4096, 12288), ("up_proj", "column", 12288, 4096, 12288),
           ("down_proj", "row", 4096, 12288, 12288), ("lm_head", "column", 151936, 4096, 8192)]
LINEARS_FUSED = [("qkv_proj", "column", 6144, 4096, 12288), ("o_proj", "row", 4096, 4096, 12288),
                 ("gate_up_proj", "column", 24576, 4096, 12288), ("down_proj", "row", 4096, 12288, 12288),
                 ("lm_head", "column", 151936, 4096, 8192)]


def bench(fn) -> float:
    return _report.bench(fn, warmup=10, rep=50)


def products(kind: str, x, w, g, pieces: int):
    """``{product: (pieces step's closure, plain step's closure, the pieces product's (a, b, m, n, k, P, a_km,
    b_kn, single) for a config sweep)}``."""
    m, k = x.shape
    n = w.shape[0]
    out = {}
    if kind == "row":
        out["forward"] = (lambda: pk.matmul_k_pieces(x, w, pieces), lambda: mm.matmul(x, w),
                          (x, w, m, n, k, pieces, False, False, False))
        out["grad_x"] = (lambda: pk.linear_grad_input(g, w), lambda: torch.mm(g, w),
                         (g, w, m, k, n, 1, False, True, True))
    else:
        out["forward"] = (lambda: mm.matmul(x, w), lambda: mm.matmul(x, w), None)
        out["grad_x"] = (lambda: pk.linear_grad_input_n_pieces(g, w, pieces), lambda: torch.mm(g, w),
                         (g, w, m, k, n, pieces, False, True, False))
    out["grad_w"] = (lambda: pk.linear_grad_weight(g, x), lambda: torch.mm(g.t(), x),
                     (g, x, n, k, m, 1, True, True, True))
    return out


def sweep(spec, auto_ms: float) -> list[str]:
    a, b, m, n, k, pieces, a_km, b_kn, single = spec
    reference = pk._pieces_product(a, b, m, n, k, pieces, False, a_km, b_kn, single)
    names = list(mm.CONFIGS_16BIT) if single else \
        [*pk.PIECES_SMALL_M, *(c for c, _ in pk.PIECES_LARGE_M_CANDIDATES)]
    rows = []
    saved = os.environ.get("RLREPRO_PIECES_FLATTEN")
    for flatten in ("0",) if single else ("0", "1"):  # several pieces: also one K loop over them (same bits)
        os.environ["RLREPRO_PIECES_FLATTEN"] = flatten
        label = "" if single else f" flatten={flatten}"
        for name in names:
            cfg = mm.CONFIGS_16BIT[name]
            try:
                got = pk._pieces_product(a, b, m, n, k, pieces, False, a_km, b_kn, single, config=cfg)
                same = torch.equal(got, reference)
                t = bench(lambda: pk._pieces_product(a, b, m, n, k, pieces, False, a_km, b_kn, single, config=cfg))
                rows.append(f"{name}{label} {t:.3f} ms x{auto_ms / t:.2f} {'==' if same else 'DIFFERENT BITS'}")
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                rows.append(f"{name}{label} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    if saved is None:
        os.environ.pop("RLREPRO_PIECES_FLATTEN", None)
    else:
        os.environ["RLREPRO_PIECES_FLATTEN"] = saved
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces", type=int, default=8)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated linear names")
    ap.add_argument("--fused", action="store_true", help="q|k|v and gate|up as one product each (the engine's)")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "bench_pieces_products.md")
                    if os.environ.get("OUT") else None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    emit(f"## Pieces products, P={args.pieces} ({torch.cuda.get_device_name(0)}, "
         f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, bf16)")
    emit("")
    emit("| linear | product | M x N x K | pieces ms | TFLOP/s | plain ms | TFLOP/s | pieces / plain time |")
    emit("|---|---|---|---:|---:|---:|---:|---:|")
    totals = [0.0, 0.0]
    sweeps = []
    torch.manual_seed(0)
    for name, kind, n, k, tokens in LINEARS_FUSED if args.fused else LINEARS:
        if args.only and name not in args.only.split(","):
            continue
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        g = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
        for prod, (ours, plain, spec) in products(kind, x, w, g, args.pieces).items():
            shape = {"forward": (tokens, n, k), "grad_x": (tokens, k, n), "grad_w": (n, k, tokens)}[prod]
            flop = 2 * shape[0] * shape[1] * shape[2]
            t_ours, t_plain = bench(ours), bench(plain)
            totals[0] += t_ours
            totals[1] += t_plain
            emit(f"| {name} | {prod} | {' x '.join(map(str, shape))} | {t_ours:.3f} | {flop / t_ours / 1e9:.0f} | "
                 f"{t_plain:.3f} | {flop / t_plain / 1e9:.0f} | {t_ours / t_plain:.2f} |")
            if args.sweep and spec is not None:
                sweeps.append((f"{name} {prod}", sweep(spec, t_ours)))
        del x, w, g
        torch.cuda.empty_cache()
    emit(f"| all | | | {totals[0]:.3f} | | {totals[1]:.3f} | | {totals[0] / totals[1]:.2f} |")
    for label, rows in sweeps:
        emit("")
        emit(f"sweep {label} (time, speed vs the automatic config, bits vs the automatic config):")
        for r in rows:
            emit(f"  {r}")
    if args.out:
        write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
