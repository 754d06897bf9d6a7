"""The engine end to end with and without the 256-row attention tile ("long"), in one process, rounds alternating.

    python3 benchmarks/bench_engine_tiles.py [--layers 8] [--num-requests 32] [--prompt-len 2048] [--output-len 16]
                                             [--rounds 2] [--json FILE]

``pick_attention_config`` gives calls that average at least ``LONG_MIN_QUERIES`` queries a sequence (prefill and
chunked prefill) the 256-row tile; "off" sets the threshold out of reach, so those calls take the 128-row tile,
as before the change. Both must give the same outputs bit for bit (token ids and logprobs: the digest column), and
the prefill time shows what the tile is worth end to end. Random Qwen3-8B-shaped weights (``--layers`` of them),
``bench_engine.py``'s engine settings and timing (a warm-up, then a prefill-only run, then the timed run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import bench_engine as BE  # noqa: E402

from rlrepro.kernels import triton_attention_fwd as A  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (a CPU smoke test of the script)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.model, args.dtype, args.temperature, args.no_cuda_graphs = None, None, 1.0, False
    model = BE.build_model(args)
    prompts = BE.random_prompts(args.num_requests, args.prompt_len, model.config.vocab_size, args.seed)
    default = A.LONG_MIN_QUERIES
    print(f"# {torch.cuda.get_device_name() if model.device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{model.config.num_hidden_layers} layers, {args.num_requests} x {args.prompt_len} prompt + "
          f"{args.output_len} output tokens, token budget {args.max_num_batched_tokens}", flush=True)
    print("| round | tiles | prefill s | total s | output tok/s | outputs sha256 |")
    print("|---|---|---:|---:|---:|---|")
    results = []
    try:
        for rnd in range(args.rounds):
            for name, threshold in (("long", default), ("off (128 rows)", 1 << 62)):
                A.LONG_MIN_QUERIES = threshold
                r = BE.bench_engine(model, prompts, args, deterministic=True)
                r.update(round=rnd, tiles=name)
                results.append(r)
                print(f"| {rnd} | {name} | {r['prefill_s']:.3f} | {r['total_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                      f"{r['outputs_sha256'][:16]} |", flush=True)
    finally:
        A.LONG_MIN_QUERIES = default
    same = len({r["outputs_sha256"] for r in results}) == 1
    ratios = [a["prefill_s"] / b["prefill_s"] for a, b in zip(results[1::2], results[0::2])]
    print(f"# outputs identical across tiles and rounds: {same}; prefill time off / long per round: "
          + ", ".join(f"{x:.3f}" for x in ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=results, identical=same, prefill_ratio_off_over_long=ratios), f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
