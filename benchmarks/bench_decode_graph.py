"""A/B of the captured decode graph in one process: variants of how the kernels are launched, replayed alternately.

End-to-end engine runs of the same code differ by several per cent from one process to the next (docs/
BENCHMARKS.md), more than the launch variants measured here change. This script builds one engine per variant
(each captures its own decode graphs), runs the same generate on each (the outputs must be equal: a variant may
change when kernels start, never a value), then replays each engine's 64-row decode graph on its last step's
inputs, the variants alternating, and reports the median replay time (CUDA events) and the ratio to the first
variant.

    python benchmarks/bench_decode_graph.py            # on the H200 (CUDA only); a benchmark: it asserts nothing

Variants: ``pdl_off`` and ``pdl_on`` (programmatic dependent launch, ``rlrepro/kernels/_pdl.py``).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import build_model, outputs_digest, random_prompts, sampling  # noqa: E402
from rlrepro.kernels import _pdl  # noqa: E402
from rlrepro.rollout import Engine  # noqa: E402

VARIANTS = {"pdl_off": False, "pdl_on": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    args.device, args.model, args.tiny, args.dtype, args.seed = "cuda", None, False, None, 0
    args.temperature, args.block_size = 1.0, 16
    model = build_model(args)
    n, p_len, o_len = args.num_requests, args.prompt_len, args.output_len
    prompts = random_prompts(n, p_len, model.config.vocab_size, 0)
    graphs, digests = {}, {}
    for name, pdl in VARIANTS.items():
        _pdl.set_enabled(pdl)
        engine = Engine(model, device="cuda", max_num_seqs=n, block_size=16, max_num_batched_tokens=8192,
                        max_model_len=p_len + o_len, num_kv_blocks=n * math.ceil((p_len + o_len) / 16) + n)
        outs = engine.generate(prompts, [sampling(args, o_len, i) for i in range(n)])
        digests[name] = outputs_digest(outs)
        b = next(g for g in sorted(engine.runner.graphs) if g >= n)
        graphs[name] = (engine, engine.runner.graphs[b][0])
        print(f"# {name}: PDL in use {_pdl.enabled()}, outputs sha256 {digests[name]}", flush=True)
    _pdl.set_enabled(None)
    same = len(set(digests.values())) == 1
    print(f"# outputs equal across variants: {same}")
    times = {name: [] for name in VARIANTS}
    for _ in range(3):  # warm-up
        for _, g in graphs.values():
            g.replay()
    for _ in range(args.rounds):
        for name, (_, g) in graphs.items():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            times[name].append((e0, e1))
    torch.cuda.synchronize()
    base = None
    print(f"| variant | graph ms (median of {args.rounds}) | min | max | speed vs {next(iter(VARIANTS))} |")
    print("|---|---:|---:|---:|---:|")
    for name, pairs in times.items():
        t = sorted(a.elapsed_time(z) for a, z in pairs)
        med = t[len(t) // 2]
        base = base or med
        print(f"| {name} | {med:.3f} | {t[0]:.3f} | {t[-1]:.3f} | {base / med:.3f}x |")


if __name__ == "__main__":
    main()
