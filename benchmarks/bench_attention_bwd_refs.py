"""Attention backward kernels that torch has on the GPU, against rlrepro's Triton backward: speed, and whether each
gives the same bits on every rerun (issue #27's backward goal, >= 0.9x SDPA's backward, and the FA2 experiment).

    python3 benchmarks/bench_attention_bwd_refs.py [--out FILE.md] [--cases 4x2048,1x16384]

Qwen3-8B heads (H=32, Hkv=8, D=128), bf16, causal, packed sequences of equal length; the forward is rlrepro's
(Triton, its output and base-2 log-sum-exp). Rows, each timed with ``triton.testing.do_bench`` (medians, L2 flushed)
and run four times for ``torch.equal`` of the gradients:

* rlrepro's two Triton kernels (the shipped deterministic backward);
* torch's FA2 varlen backward (``aten._flash_attention_backward``, ``kernels/flash2_bwd.py``) with
  ``torch.use_deterministic_algorithms(True)`` and without;
* SDPA on the dense batch, the backend it picks (named: ``torch._fused_sdp_choice``), and each backend forced
  (flash, cuDNN, memory-efficient; K/V expanded to H heads where GQA is not served), with and without
  deterministic algorithms (an error is reported as the row: e.g. an op without a deterministic implementation).

TFLOP/s count 2.5x the forward's causal FLOPs, as FlashAttention counts a backward. Relative errors are against the
Triton backward's gradients (a wrong kernel shows; the last bits are not compared). A benchmark reports, it
asserts nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _report import bench, emit, rel, write  # noqa: E402
from bench_attention_bwd import D, H, HKV, make_case  # noqa: E402
from rlrepro.kernels import flash2_bwd as F2  # noqa: E402
from rlrepro.kernels.triton_attention import attention_bwd_packed_triton  # noqa: E402


@contextlib.contextmanager
def deterministic(on: bool):
    """``torch.use_deterministic_algorithms(on)`` inside, the previous setting after."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def row(name: str, fn, flops: float, t_ref: float | None, want) -> float | None:
    """Time ``fn`` (returns dq, dk, dv in the packed layout), rerun it three times for the bits, report."""
    try:
        g = fn()
        same = all(torch.equal(a, b) for _ in range(3) for a, b in zip(g, fn()))
        ms = bench(fn)
        ratio = f"{t_ref / ms:.2f}" if t_ref else "1"
        errs = ", ".join(f"{rel(a, b):.1e}" for a, b in zip(g, want))
        emit(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {ratio} | {same} | {errs} |")
        return ms
    except Exception as e:  # noqa: BLE001 - report and go on
        emit(f"| {name} | failed: {type(e).__name__}: {str(e)[:240]} | | | | |")
        return None


def case(batch: int, length: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev = torch.device("cuda")
    n = batch * length
    q, k, v, go, meta, scale, flops, out, lse = make_case(batch, length)  # bench_attention_bwd's seeded case
    want = attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse)
    dense = [t.view(batch, length, -1, D).transpose(1, 2) for t in (q, k, v)]
    gos = go.view(batch, length, H, D).transpose(1, 2)
    choice = torch._fused_sdp_choice(*dense, is_causal=True, scale=scale, enable_gqa=True)
    emit(f"#### {batch} x {length} (SDPA's own choice here: {SDPBackend(choice).name})")
    emit("")
    emit("| backward | ms | TFLOP/s | SDPA default / it | rerun == (3 reruns) | rel err vs Triton (dq, dk, dv) |")
    emit("|---|---:|---:|---:|---|---|")

    def sdpa(backend, expand: bool):
        kv = [t.repeat_interleave(H // HKV, dim=1) if expand else t for t in dense[1:]]
        leaves = [t.detach().requires_grad_(True) for t in (dense[0], *kv)]
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=not expand)

        def run():
            g = torch.autograd.grad(o, leaves, gos, retain_graph=True)
            gq = g[0].transpose(1, 2).reshape(n, H, D)
            gk, gv = (x.transpose(1, 2).reshape(n, -1, D) for x in g[1:])
            if expand:
                gk, gv = (x.view(n, HKV, H // HKV, D).sum(2) for x in (gk, gv))
            return gq, gk, gv
        return run

    t_ref = row("SDPA, its own choice, deterministic algorithms off", sdpa(None, False), flops, None, want)
    with deterministic(True):
        row("rlrepro Triton (two kernels, the shipped backward)",
            lambda: attention_bwd_packed_triton(q, k, v, go, meta, scale, out=out, lse=lse), flops, t_ref, want)
        row("torch FA2 varlen, deterministic (RLREPRO_ATTENTION_BWD=flash2)",
            lambda: F2.attention_bwd(q, k, v, go, meta, scale, out, lse), flops, t_ref, want)
    with deterministic(False):
        cu = meta.cu_seqlens_q.to(torch.int32)
        rng = torch.zeros(2, dtype=torch.int64, device=dev)
        row("torch FA2 varlen, atomics (deterministic algorithms off)",
            lambda: torch.ops.aten._flash_attention_backward(go, q, k, v, out, F2.fa2_lse(lse, meta, F2.lse_layout(dev)),
                                                             cu, cu, length, length, 0.0, True, rng, rng, scale=scale),
            flops, t_ref, want)
    for backend, expand in ((SDPBackend.FLASH_ATTENTION, False), (SDPBackend.CUDNN_ATTENTION, True),
                            (SDPBackend.EFFICIENT_ATTENTION, True)):
        for det in (True, False):
            label = (f"SDPA forced {backend.name}{', K/V expanded' if expand else ''}, deterministic algorithms "
                     f"{'on' if det else 'off'}")
            with deterministic(det):
                try:
                    fn = sdpa(backend, expand)
                except Exception as e:  # noqa: BLE001 - the forward refused: report it as the row
                    emit(f"| {label} | failed: {type(e).__name__}: {str(e)[:240]} | | | | |")
                    continue
                row(label, fn, flops, t_ref, want)
    emit("")
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cases", default="4x2048,1x16384")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_bwd_refs.py needs a CUDA GPU")
        return 1
    try:
        layout = F2.lse_layout(torch.device("cuda"))
    except Exception as e:  # noqa: BLE001 - the FA2 rows will fail and say why; the others still run
        layout = f"unknown ({type(e).__name__}: {str(e)[:200]})"
    emit(f"### Attention backward kernels in torch vs rlrepro ({torch.cuda.get_device_name(0)}, torch "
         f"{torch.__version__}, FA2 varlen lse layout {layout})")
    emit("")
    for c in args.cases.split(","):
        b, length = (int(x) for x in c.split("x"))
        case(b, length)
    write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
