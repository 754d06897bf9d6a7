"""Engine throughput: N concurrent requests of ~P prompt and O output tokens.

Measures, on the same random weights:
  * rlrepro's Engine in deterministic mode (batch-invariant kernels) and in fast mode (stock kernels);
  * transformers' ``generate`` on the same weights (written with save_pretrained, read with from_pretrained);
  * the decode roofline: (weight bytes + KV bytes read) per decode step over the memory bandwidth measured by a
    device-to-device copy in this run.

Output tokens/s counts every generated token over the whole ``generate`` call (prefill included); decode
tokens/s subtracts a prefill-only run (max_tokens=1) of the same requests. Every request generates exactly O
tokens (ignore_eos). A benchmark reports, it asserts nothing.

    python benchmarks/bench_engine.py --tiny --device cpu --num-requests 4 --prompt-len 32 --output-len 16
    python benchmarks/bench_engine.py --qwen3-8b-shape --device cuda --num-requests 64      # on the H200
    python benchmarks/bench_engine.py --qwen3-8b-shape --layers 4 --device cuda            # a quick look
    python benchmarks/bench_engine.py --qwen3-8b-shape --prompt-len 1024 --output-len 8192 --warmup-output-len 64 \
        --no-hf                                                                             # long outputs (1k/8k)
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlrepro.model import (Qwen3Config, Qwen3ForCausalLM, init_random_weights, load_pretrained,  # noqa: E402
                           save_pretrained, tiny_model)
from rlrepro.rollout import Engine, SamplingParams  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def qwen3_8b_config(layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                       torch_dtype="bfloat16", eos_token_id=151645)


def random_weights_(model: Qwen3ForCausalLM, seed: int) -> Qwen3ForCausalLM:
    """Seeded random weights in place: ``init_random_weights`` on the CPU; on CUDA the same distribution from a
    CUDA generator (seconds instead of ~80 s for the 8B shape; other values than the CPU's, which a speed benchmark
    does not care about: every system in one run reads these same weights)."""
    if model.device.type != "cuda":
        return init_random_weights(model, seed)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, model.config.initializer_range, generator=gen)
    return model


def build_model(args) -> Qwen3ForCausalLM:
    device = torch.device(args.device)
    if args.model:
        return load_pretrained(args.model, device=device, dtype=DTYPES[args.dtype] if args.dtype else None)
    if args.tiny:
        overrides = {"num_hidden_layers": args.layers} if args.layers else {}
        dtype = DTYPES[args.dtype or "float32"]
        return tiny_model(seed=args.seed, dtype=dtype, max_position_embeddings=4096, **overrides).to(device)
    cfg = qwen3_8b_config(args.layers or 36)
    dtype = DTYPES[args.dtype or "bfloat16"]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    t0 = time.perf_counter()
    random_weights_(model, args.seed)
    print(f"# random Qwen3-8B-shaped weights ({cfg.num_hidden_layers} layers) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    nbytes = 2**30 if device.type == "cuda" else 2**28
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    iters = 20 if device.type == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def decode_roofline(model, n: int, prompt_len: int, output_len: int, bandwidth: float) -> float:
    """Output tokens/s if each decode step only streamed the weights and the KV it reads at memory bandwidth."""
    cfg = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    total = sum(p.numel() for p in model.parameters()) * elem
    embed = model.model.embed_tokens.weight.numel() * elem
    weights = total if cfg.tie_word_embeddings else total - embed  # decode gathers n embedding rows only
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    steps = output_len - 1  # the first output token comes from the prefill
    if steps < 1:
        return float("nan")
    seconds = sum(weights + n * kv_per_token * (prompt_len + t) for t in range(1, steps + 1)) / bandwidth
    return n * steps / seconds


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def sampling(args, max_tokens: int, i: int) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=i, ignore_eos=True)


def speedups(results: list[dict]) -> list[tuple[int, float, float]]:
    """(round, decode ratio, output ratio) of the deterministic engine over transformers, within each round."""
    out = []
    for rnd in sorted({r.get("round", 0) for r in results}):
        ours = [r for r in results if r.get("round", 0) == rnd and r["mode"] == "deterministic"]
        hf = [r for r in results if r.get("round", 0) == rnd and r["system"].startswith("transformers")]
        if ours and hf:
            out.append((rnd, ours[0]["decode_tokens_per_s"] / hf[0]["decode_tokens_per_s"],
                        ours[0]["tokens_per_s"] / hf[0]["tokens_per_s"]))
    return out


def outputs_digest(outs) -> str:
    """sha256 of every request's token ids and logprob bits: two runs (or kernel variants) gave the same outputs
    exactly when their digests agree."""
    h = hashlib.sha256()
    for o in outs:
        h.update(repr(list(o.token_ids)).encode())
        h.update(struct.pack(f"<{len(o.logprobs)}f", *o.logprobs))
    return h.hexdigest()


def bench_engine(model, prompts, args, deterministic: bool) -> dict:
    device = model.device
    n, p_len, o_len = len(prompts), len(prompts[0]), args.output_len
    bs = args.block_size
    blocks = n * math.ceil((p_len + o_len) / bs) + n
    engine = Engine(model, device=str(device), deterministic=deterministic, max_num_seqs=max(n, 1),
                    max_num_batched_tokens=args.max_num_batched_tokens, block_size=bs, num_kv_blocks=blocks,
                    max_model_len=p_len + o_len, enable_cuda_graphs=not args.no_cuda_graphs)
    # a whole-size warm-up, as transformers gets (bench_transformers); --warmup-output-len shortens it (long outputs:
    # the same batch sizes and graphs, without a second full run)
    w_len = args.warmup_output_len or o_len
    engine.generate(prompts, [sampling(args, w_len, i) for i in range(n)])
    engine.reset_prefix_cache()
    sync(device)
    t0 = time.perf_counter()
    engine.generate(prompts, [sampling(args, 1, i) for i in range(n)])
    sync(device)
    prefill_s = time.perf_counter() - t0
    engine.reset_prefix_cache()  # the timed run must compute its prompts, not find them cached
    steps_before = engine.stats["num_steps"]
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [sampling(args, o_len, i) for i in range(n)])
    sync(device)
    total_s = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    stats = engine.stats
    result = dict(system="rlrepro", mode="deterministic" if deterministic else "fast", total_s=total_s,
                  prefill_s=prefill_s, output_tokens=tokens, tokens_per_s=tokens / total_s,
                  decode_tokens_per_s=n * (o_len - 1) / max(total_s - prefill_s, 1e-9),
                  steps=stats["num_steps"] - steps_before, graph_steps=stats["num_graph_steps"],
                  cuda_graphs=bool(engine.runner.graphs), outputs_sha256=outputs_digest(outs))
    del engine, outs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_engine(model, prompts, args) -> None:
    """Per-step wall times (synchronised) and the profiler's top ops for a short deterministic run."""
    device = model.device
    n, p_len = len(prompts), len(prompts[0])
    steps = args.profile
    engine = Engine(model, device=str(device), max_num_seqs=max(n, 1), block_size=args.block_size,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=p_len + steps + 1,
                    num_kv_blocks=n * math.ceil((p_len + steps + 1) / args.block_size) + n,
                    enable_cuda_graphs=not args.no_cuda_graphs)
    engine.generate(prompts[: min(n, 4)], [sampling(args, 4, i) for i in range(min(n, 4))])
    engine.reset_prefix_cache()
    launches: list[tuple[int, float]] = []  # (tokens in the step, launch time): steps overlap, so no sync here
    real = engine.runner.launch

    def timed(scheduled):
        launches.append((sum(s.num_new_tokens for s in scheduled), time.perf_counter()))
        return real(scheduled)

    engine.runner.launch = timed
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, [sampling(args, steps, i) for i in range(n)])
        sync(device)
        total = time.perf_counter() - t0
    decode = [t1 - t0 for (k, t0), (_, t1) in zip(launches, launches[1:]) if k == n]
    print(f"# profile: {len(launches)} steps in {total:.3f} s; launch to next launch over the {len(decode)} full "
          f"decode steps: mean {1e3 * sum(decode) / max(len(decode), 1):.2f} ms")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=60))
    names = ("rlrepro.schedule", "rlrepro.launch", "rlrepro.resolve", "rlrepro.sample")
    for evt in prof.key_averages():
        if evt.key in names:
            print(f"# {evt.key}: {evt.count} calls, CPU total {evt.cpu_time_total / 1e3:.1f} ms")


def decode_breakdown(model, prompts, args) -> None:
    """Where a steady-state decode step's time goes: whole step, launch(), graph replay, sampler, kernels.

    Runs a deterministic generate of O tokens with each launch() timed (no sync: steps overlap), then replays the decode graph
    on the last step's inputs (context ~P+O) timed with CUDA events, times the sampler alone on the same logits,
    and profiles the graph's kernels over a few replays (per-step milliseconds per kernel)."""
    device = model.device
    if device.type != "cuda":
        raise SystemExit("--breakdown needs CUDA (decode graphs)")
    n, p_len, o_len = len(prompts), len(prompts[0]), args.output_len
    bs = args.block_size
    engine = Engine(model, device=str(device), max_num_seqs=max(n, 1), block_size=bs,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=p_len + o_len,
                    num_kv_blocks=n * math.ceil((p_len + o_len) / bs) + n, enable_cuda_graphs=True)
    engine.generate(prompts[: min(n, 4)], [sampling(args, 4, i) for i in range(min(n, 4))])
    engine.reset_prefix_cache()
    runner = engine.runner
    launches: list[tuple[bool, float, float]] = []  # (full decode step?, launch start, launch end)
    # CUDA events at each launch's start and end, as the device reaches them: a step's device time, and the
    # device's idle time between one step's last kernel and the next step's first
    events: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []
    real = runner.launch

    def timed(scheduled):
        full = len(scheduled) == n and all(s.num_new_tokens == 1 for s in scheduled)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        out = real(scheduled)
        e1.record()
        launches.append((full, t0, time.perf_counter()))
        events.append((full, e0, e1))
        return out

    runner.launch = timed
    engine.generate(prompts, [sampling(args, o_len, i) for i in range(n)])
    sync(device)
    # the same generate again, its device ops profiled over PROFILED full decode steps near the end (context
    # ~P+O-15): the whole step as the loop runs it, graph and sampler (kept out of the timed run above)
    profiled = 10
    engine.reset_prefix_cache()
    def stepped(scheduled):
        out = real(scheduled)
        step_prof.step()
        return out

    first = max(len(launches) - profiled - 5, 1)
    step_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                       schedule=torch.profiler.schedule(wait=first, warmup=1, active=profiled,
                                                                        repeat=1))
    runner.launch = stepped
    with step_prof:
        engine.generate(prompts, [sampling(args, o_len, i) for i in range(n)])
        sync(device)
    runner.launch = real
    # wall time of a decode step in the overlapped loop: from its launch to the next one
    execs = [b[1] - a[1] for a, b in zip(launches, launches[1:]) if a[0] and b[0]]
    host = [t1 - t0 for full, t0, t1 in launches if full]
    steps = len(execs)
    dev_ms = [e0.elapsed_time(e1) for full, e0, e1 in events if full]
    idle_ms = [a[2].elapsed_time(b[1]) for a, b in zip(events, events[1:]) if a[0] and b[0]]
    b = next(g for g in sorted(runner.graphs) if g >= n)
    graph, out = runner.graphs[b]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    sync(device)
    graph_ms = start.elapsed_time(end) / 20
    logits = out[:n].clone()
    from rlrepro.rollout.sampler import SampleRequest, sample
    reqs = [SampleRequest(args.temperature, 0, 1.0, i, p_len + o_len - 1) for i in range(n)]
    for _ in range(3):
        sample(logits, reqs)
    sync(device)
    t1 = time.perf_counter()
    for _ in range(20):
        sample(logits, reqs)
    sample_ms = (time.perf_counter() - t1) / 20 * 1e3
    print(f"# decode breakdown, {n} requests, P={p_len} O={o_len}, graph batch {b}:")
    print(f"#   decode step, launch to next launch (the engine overlaps host and device), mean of {steps} steps: "
          f"{1e3 * sum(execs) / max(steps, 1):.2f} ms (first {1e3 * execs[0]:.2f}, last {1e3 * execs[-1]:.2f})")
    print(f"#   device time per decode step (launch's first to last enqueued op; events): "
          f"{sum(dev_ms) / max(len(dev_ms), 1):.2f} ms (last {dev_ms[-1] if dev_ms else 0:.2f}); device idle "
          f"between steps: {sum(idle_ms) / max(len(idle_ms), 1):.3f} ms (max {max(idle_ms, default=0):.3f})")
    print(f"#   host time inside launch() per decode step (inputs, graph replay call, sampler launches): "
          f"{1e3 * sum(host) / max(len(host), 1):.2f} ms")
    print(f"#   graph replay alone at the last step's context (~{p_len + o_len}): {graph_ms:.2f} ms")
    print(f"#   sample() alone (host + GPU, synchronised by its .tolist()): {sample_ms:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        sync(device)
    rows = sorted(((e.key, e.self_device_time_total / 10 / 1e3, e.count // 10) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"#   kernels in one graph replay (profiled, {total:.2f} ms in all):")
    print("| kernel | ms per step | share | launches per step |")
    print("|---|---:|---:|---:|")
    for name, ms, count in rows[: args.profile_rows]:
        print(f"| {name[:70]} | {ms:.3f} | {ms / total:.1%} | {count} |")
    # the loop's own steps: every kernel and copy on the device per step, and what is not in the graph
    graph_ms = {name: ms for name, ms, _ in rows}
    loop_events = [e for e in step_prof.key_averages() if e.self_device_time_total > 0]
    n_steps = next((e.count for e in loop_events if "_schedule_kernel" in e.key), 0)  # one per decode step
    if not n_steps:
        print("#   the loop's profiled steps: no decode step found")
        return
    loop = sorted(((e.key, e.self_device_time_total / n_steps / 1e3, e.count / n_steps) for e in loop_events),
                  key=lambda r: -r[1])
    loop_total = sum(r[1] for r in loop)
    print(f"#   a second identical generate, {n_steps} of its decode steps near the end profiled (context "
          f"~{p_len + o_len - 15}): device busy {loop_total:.2f} ms per step in all kernels and copies (graph alone "
          f"{total:.2f} ms)")
    print("| op in the loop's step | ms per step | graph alone ms | difference | calls per step |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, count in loop[: args.profile_rows]:
        g = graph_ms.get(name, 0.0)
        print(f"| {name[:70]} | {ms:.3f} | {g:.3f} | {ms - g:+.3f} | {count:g} |")


_HF_MODELS: dict[int, object] = {}  # id(model) -> the transformers copy, loaded once for all --repeat rounds


def bench_transformers(model, prompts, args) -> dict:
    import transformers

    device = model.device
    if id(model) not in _HF_MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, tmp)
            major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
            dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
            _HF_MODELS[id(model)] = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, **{dtype_kw: model.dtype}).to(device).eval()
    hf = _HF_MODELS[id(model)]
    n, o_len = len(prompts), args.output_len
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=args.temperature > 0, pad_token_id=0,
                  eos_token_id=None, top_k=None, top_p=None)
    if args.temperature > 0:
        kwargs["temperature"] = args.temperature
    with torch.inference_mode():
        if not getattr(hf, "_rlrepro_warm", False):
            # a whole-size warm-up: transformers' first full-size generate in a process runs ~2x slower than the
            # next (H200, 2026-12-01: 752 then 1,608 and 1,671 decode tok/s at 64 requests), and a short one did
            # not warm it; the timed run below is the steady state
            hf.generate(ids, max_new_tokens=o_len, min_new_tokens=o_len, **kwargs)
            sync(device)
            hf._rlrepro_warm = True
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        sync(device)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=o_len, min_new_tokens=o_len, **kwargs)
        sync(device)
        total_s = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * n
    del hf, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(system=f"transformers {transformers.__version__}", mode="generate", total_s=total_s,
                prefill_s=prefill_s, output_tokens=tokens, tokens_per_s=tokens / total_s,
                decode_tokens_per_s=n * (o_len - 1) / max(total_s - prefill_s, 1e-9))


def _sync_fi_plans() -> None:
    """Make flashinfer's decode-graph plans wait for the device's queue, as its pageable copies did before
    ``GraphDecode.plan`` staged them asynchronously (benchmark comparison only)."""
    from rlrepro.kernels import flashinfer_attention as fia
    plan = fia.GraphDecode.plan

    def synced(self, seq_lens, block_tables):
        torch.cuda.current_stream().synchronize()
        return plan(self, seq_lens, block_tables)
    fia.GraphDecode.plan = synced


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--tiny", action="store_true", help="the tiny random test model (CPU smoke test)")
    what.add_argument("--qwen3-8b-shape", action="store_true", help="random bf16 Qwen3-8B-shaped model (default)")
    what.add_argument("--model", help="an HF Qwen3 model directory instead of random weights")
    ap.add_argument("--layers", type=int, default=None, help="shorten the model to this many layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--warmup-output-len", type=int, default=0,
                    help="output tokens of the engine's warm-up run (default: --output-len)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--modes", default="deterministic,fast", help="comma-separated engine modes to run")
    ap.add_argument("--sampler-ab", action="store_true",
                    help="run each mode with RLREPRO_SAMPLER_LEAN=0 (the sampler before 2026-12-08) and 1 (now), "
                         "in ABBA order over the --repeat rounds; the outputs' digests must agree")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the modes and transformers this many times in turn (rounds), for the spread and the "
                         "median of the per-round speedups")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="profile a deterministic run of STEPS output tokens instead of benchmarking")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--tp-emulation", default="1",
                    help="comma-separated train.tp_partials values P to run the engine modes at: the model computes "
                         "every row-/column-parallel product as P fixed pieces, as the engines of a "
                         "train.layout_invariant run do (1: the plain model); e.g. 1,8 for the pieces' cost")
    ap.add_argument("--breakdown", action="store_true",
                    help="time a steady-state decode step's parts (CUDA): launch to launch, graph replay, "
                         "sampler, kernels")
    ap.add_argument("--fi-plan-sync", action="store_true",
                    help="the fast mode's decode plan waits for the stream first (as before it staged its copies "
                         "asynchronously): the comparison of the two")
    args = ap.parse_args(argv)
    if not args.tiny and not args.model:
        args.qwen3_8b_shape = True
    if args.fi_plan_sync:
        _sync_fi_plans()

    model = build_model(args)
    device = model.device
    prompts = random_prompts(args.num_requests, args.prompt_len, model.config.vocab_size, args.seed)
    bandwidth = measure_bandwidth(device)
    roofline = decode_roofline(model, args.num_requests, args.prompt_len, args.output_len, bandwidth)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {model.config.num_hidden_layers} layers, {model.dtype}, "
          f"N={args.num_requests} P={args.prompt_len} O={args.output_len} T={args.temperature}", flush=True)
    print(f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s; decode roofline {roofline:,.0f} tokens/s", flush=True)

    if args.profile:
        profile_engine(model, prompts, args)
        return
    if args.breakdown:
        decode_breakdown(model, prompts, args)
        return
    results = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("deterministic", "fast"):
            raise SystemExit(f"--modes: unknown mode {mode!r}; use deterministic and/or fast")
    pieces = [int(x) for x in args.tp_emulation.split(",") if x.strip()]
    leans = ["0", "1"] if args.sampler_ab else [None]
    for rnd in range(args.repeat):
        for p in pieces:
            model.set_tensor_parallel_emulation(p)
            for mode in modes:
                for lean in leans[::-1] if rnd % 2 else leans:  # ABBA over the rounds
                    with mock.patch.dict(os.environ, {} if lean is None else {"RLREPRO_SAMPLER_LEAN": lean}):
                        res = bench_engine(model, prompts, args, deterministic=mode == "deterministic")
                    label = res["mode"] if lean is None else f"{res['mode']}, RLREPRO_SAMPLER_LEAN={lean}"
                    results.append(dict(res, mode=label, round=rnd, tp_emulation=p))
                    print(json.dumps(results[-1]), flush=True)
        model.set_tensor_parallel_emulation(1)
        if not args.no_hf:
            try:
                results.append(dict(bench_transformers(model, prompts, args), round=rnd))
                print(json.dumps(results[-1]), flush=True)
            except ImportError as e:
                print(f"# transformers unavailable: {e}")

    print()
    print("| system | mode | TP pieces | output tok/s | decode tok/s | decode / roofline | prefill s | total s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['system']} | {r['mode']} | {r.get('tp_emulation', 1)} | {r['tokens_per_s']:,.0f} | "
              f"{r['decode_tokens_per_s']:,.0f} | {r['decode_tokens_per_s'] / roofline:.1%} | {r['prefill_s']:.2f} | "
              f"{r['total_s']:.2f} |")
    print(f"| roofline | weights + KV at {bandwidth / 1e12:.2f} TB/s | | | {roofline:,.0f} | 100% | | |")
    if args.sampler_ab:
        digests = {r["outputs_sha256"] for r in results if r["system"] == "rlrepro"}
        print(f"\noutputs' sha256 of the {len(results)} engine runs: "
              f"{'all equal, ' if len(digests) == 1 else '**DIFFER**: '}{', '.join(d[:12] for d in sorted(digests))}")
    base = {(r["round"], r["mode"]): r for r in results if r["system"] == "rlrepro" and r.get("tp_emulation") == 1}
    piece_rows = [r for r in results if r["system"] == "rlrepro" and r.get("tp_emulation", 1) > 1
                  and (r["round"], r["mode"]) in base]
    if piece_rows:  # the pieces' cost: each P against P=1 in the same round and mode
        print()
        print("| round | mode | TP pieces | decode tok/s / P=1 | prefill s / P=1 |")
        print("|---:|---|---:|---:|---:|")
        for r in piece_rows:
            b = base[(r["round"], r["mode"])]
            print(f"| {r['round']} | {r['mode']} | {r['tp_emulation']} | "
                  f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.3f} | "
                  f"{r['prefill_s'] / max(b['prefill_s'], 1e-9):.3f} |")
    ratios = speedups(results)
    if ratios:
        print()
        print("| round | deterministic / transformers, decode tok/s | output tok/s |")
        print("|---:|---:|---:|")
        for rnd, dec, outp in ratios:
            print(f"| {rnd} | {dec:.2f}x | {outp:.2f}x |")
        if len(ratios) > 1:
            print(f"| median of {len(ratios)} | {statistics.median(r[1] for r in ratios):.2f}x | "
                  f"{statistics.median(r[2] for r in ratios):.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=name, torch=torch.__version__, layers=model.config.num_hidden_layers, dtype=str(model.dtype),
            num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len,
            temperature=args.temperature, bandwidth_bytes_per_s=bandwidth, roofline_tokens_per_s=roofline,
            results=results), indent=2) + "\n")


if __name__ == "__main__":
    main()
