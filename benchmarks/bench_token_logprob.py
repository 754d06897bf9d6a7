"""The trainer's token logprob + entropy + logprob gradient: the torch ops against the fused Triton passes.

    python3 benchmarks/bench_token_logprob.py [--out FILE.md] [--rows 4096] [--vocab 151936]

One chunk of the LM head's output as the trainer's loss sees it (bf16 logits ``[rows, vocab]``, Qwen3's vocab),
at T = 1 and T = 0.7:

* ``torch``: ``rlrepro.trainer.logprobs._token_logprob_rows`` + ``entropy`` forward, then autograd's backward of
  ``sum(w * logprob)`` into the logits (what the trainer ran before the fused path, and what
  ``RLREPRO_FUSED_LOGPROB=0`` runs);
* ``fused``: ``_FusedTokenLogprob`` (``rlrepro.kernels.triton_logprob``), forward and backward;

``triton.testing.do_bench`` medians of forward and of forward + backward, the ratio, and the bits: the logprobs
and the gradient ``torch.equal`` to the torch path's; where a gradient differs, how many elements and whether every
such element is one where ``exp(log p)`` is subnormal in float32 (``log p < -87.3``); the entropy's largest
difference. A benchmark reports, it asserts nothing (the GPU tests in ``tests/test_token_logprob_fused.py`` do).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _report  # noqa: E402
from _report import emit, write  # noqa: E402

from rlrepro.trainer.logprobs import _FusedTokenLogprob, _token_logprob_rows, entropy  # noqa: E402



def bench(fn) -> float:
    return _report.bench(fn, warmup=5, rep=40)


def torch_path(logits, targets, t, weight, backward: bool):
    x = logits.detach().requires_grad_(backward)
    lp, lsm = _token_logprob_rows(x, targets, t)
    ent = entropy(lsm.detach())
    if backward:
        (lp * weight).sum().backward()
    return lp.detach(), ent, x.grad


def fused_path(logits, targets, t, weight, backward: bool):
    x = logits.detach().requires_grad_(backward)
    lp, ent = _FusedTokenLogprob.apply(x, targets, float(t), 0)
    if backward:
        (lp * weight).sum().backward()
    return lp.detach(), ent, x.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    m, v = args.rows, args.vocab
    logits = (torch.randn(m, v, device=dev, generator=gen) * 4).to(torch.bfloat16)
    logits[:8] -= 90.0  # rows whose other logprobs reach the float32 subnormal range of exp (-87.3 and below)
    logits[:8, 0] = 0.0
    targets = torch.randint(0, v, (m,), device=dev, generator=gen)
    weight = torch.randn(m, device=dev, generator=gen)
    gib = m * v * 4 / 2**30
    emit(f"## Token logprob, entropy and gradient: torch ops vs fused — {torch.cuda.get_device_name()}, "
         f"torch {torch.__version__}")
    emit()
    emit(f"bf16 logits [{m}, {v}] (one float32 copy: {gib:.2f} GiB); `do_bench` medians, ms")
    emit()
    emit("| T | torch fwd | fused fwd | x | torch fwd+bwd | fused fwd+bwd | x | logprobs == | grad == | "
         "grad elements differing (all subnormal-band) | entropy max abs diff |")
    emit("|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|")
    for t in (1.0, 0.7):
        tf = bench(lambda: torch_path(logits, targets, t, weight, False))
        ff = bench(lambda: fused_path(logits, targets, t, weight, False))
        tb = bench(lambda: torch_path(logits, targets, t, weight, True))
        fb = bench(lambda: fused_path(logits, targets, t, weight, True))
        lp0, ent0, g0 = torch_path(logits, targets, t, weight, True)
        lp1, ent1, g1 = fused_path(logits, targets, t, weight, True)
        diff = g0 != g1
        n = int(diff.sum())
        if n:
            with torch.no_grad():
                lsm = _token_logprob_rows(logits, targets, t)[1]
                band = bool((lsm[diff] < -87.3).all())
                del lsm
        else:
            band = True
        emit(f"| {t} | {tf:.3f} | {ff:.3f} | {tf / ff:.2f} | {tb:.3f} | {fb:.3f} | {tb / fb:.2f} | "
             f"{torch.equal(lp0, lp1)} | {torch.equal(g0, g1)} | {n} ({band}) | "
             f"{(ent0 - ent1).abs().max().item():.2e} |")
        del g0, g1, diff
        torch.cuda.empty_cache()
    write(args.out)


if __name__ == "__main__":
    main()
