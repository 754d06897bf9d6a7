"""GRPO groups in the engine: P prompts, each submitted G times with G seeds in one ``generate`` call, with the
copies sharing the prompt's K/V within the step (``Scheduler.share_in_step``, the default) and without (each copy
computes the prompt, as before the thirty-fifth session). Same engine, same requests, one run: prompt tokens
computed, wall time of a prefill-only call (max_tokens=1) and of the whole call, and the outputs' sha256 (equal:
sharing changes no bit). A benchmark reports, it asserts nothing.

    python benchmarks/bench_group_prefill.py --tiny --device cpu --prompts 4 --group 8 --prompt-len 256
    python benchmarks/bench_group_prefill.py --qwen3-8b-shape --layers 4 --prompts 16 --group 8 --prompt-len 1024
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import DTYPES, build_model, outputs_digest, random_prompts, sync  # noqa: E402

from rlrepro.rollout import Engine, SamplingParams  # noqa: E402


def run(model, prompts, args, share: bool) -> dict:
    n, bs = len(prompts), args.block_size
    longest = len(prompts[0]) + args.output_len
    engine = Engine(model, device=str(model.device), max_num_seqs=n, block_size=bs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=longest,
                    num_kv_blocks=n * -(-longest // bs) + n, enable_cuda_graphs=not args.no_cuda_graphs)
    engine.scheduler.share_in_step = share

    def params(max_tokens):
        return [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 + i, ignore_eos=True)
                for i in range(n)]
    engine.generate(prompts, params(args.output_len))  # warm-up (graphs, kernels)
    out = {}
    for name, max_tokens in (("prefill", 1), ("total", args.output_len)):
        engine.reset_prefix_cache()
        steps = engine.stats["num_steps"]
        sync(model.device)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params(max_tokens))
        sync(model.device)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_steps"] = engine.stats["num_steps"] - steps
        if name == "prefill":
            out["prompt_tokens_computed"] = sum(len(p) - o.num_cached_tokens for p, o in zip(prompts, outs))
    out["outputs_sha256"] = outputs_digest(outs)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--tiny", action="store_true", help="the tiny random test model (CPU smoke test)")
    what.add_argument("--qwen3-8b-shape", action="store_true", help="random bf16 Qwen3-8B-shaped model (default)")
    what.add_argument("--model", help="an HF Qwen3 model directory instead of random weights")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    ap.add_argument("--group", type=int, default=8, help="copies of each prompt (rollout.group_size)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.qwen3_8b_shape = args.qwen3_8b_shape or not (args.tiny or args.model)
    model = build_model(args)
    distinct = random_prompts(args.prompts, args.prompt_len, model.config.vocab_size, args.seed)
    prompts = [p for p in distinct for _ in range(args.group)]  # a group's copies side by side, as the driver
    dev = torch.cuda.get_device_name(0) if model.device.type == "cuda" else platform.processor() or "cpu"
    print(f"# {time.strftime('%Y-%m-%d')} {dev}; {args.prompts} prompts x {args.group} copies, prompt "
          f"{args.prompt_len}, output {args.output_len}, block {args.block_size}, budget {args.max_num_batched_tokens}")
    print("| sharing | prompt tokens computed | prefill s | prefill steps | total s | outputs sha256 |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for share in (False, True):
        r = rows[share] = run(model, prompts, args, share)
        print(f"| {'on' if share else 'off'} | {r['prompt_tokens_computed']} | {r['prefill_s']:.3f} | "
              f"{r['prefill_steps']} | {r['total_s']:.3f} | {r['outputs_sha256'][:16]} |")
    off, on = rows[False], rows[True]
    print(f"on/off: prompt tokens {on['prompt_tokens_computed'] / off['prompt_tokens_computed']:.3f}, prefill time "
          f"{on['prefill_s'] / off['prefill_s']:.3f}, total time {on['total_s'] / off['total_s']:.3f}; outputs "
          f"{'identical' if on['outputs_sha256'] == off['outputs_sha256'] else 'DIFFER'}")


if __name__ == "__main__":
    main()
