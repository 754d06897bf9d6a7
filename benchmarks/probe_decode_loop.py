"""Why a decode step's attention runs slower inside the engine's loop than in back-to-back replays of one step.

`bench_engine.py --breakdown` found attention at ~2.2 ms a step in the loop against ~1.9 ms when the captured
decode graph is replayed alone on the last step's inputs. This probe replays that graph under four conditions and
reports the graph's time per replay (CUDA events) and the attention kernel's share (profiler), with the SM clock
and power that nvidia-smi reads meanwhile (read only):

  alone      20 replays back to back (what the breakdown's "graph alone" measures)
  + sampler  20 x (replay, the engine's sampler on its logits), graph time only
  sustained  300 replays back to back: the first 20 against the last 20 (clock or power settling)
  + gap      20 x (replay, 1 ms of host sleep): the device idles between replays

and between replays a fresh pinned host allocation, or an emptied device cache and a new device segment; then the
engine's own loop, with the host and device allocator counters that changed during it.

    python benchmarks/probe_decode_loop.py            # on the H200 (CUDA only); a benchmark: it asserts nothing
"""
from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import build_model, random_prompts, sampling  # noqa: E402
from rlrepro.rollout import Engine  # noqa: E402
from rlrepro.rollout.sampler import SampleRequest, sample_on_device  # noqa: E402


# nvidia-smi's clocks_throttle_reasons.active bits
THROTTLE_REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
                    0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks"}


class Smi:
    """nvidia-smi's SM clock (MHz), power (W), memory clock and active throttle reasons, sampled every 50 ms in a
    thread while a condition runs."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.reasons = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks.mem,"
                                      "clocks_throttle_reasons.active", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=5).stdout.split(",")
                self.samples.append((float(out[0]), float(out[1]), float(out[2])))
                self.reasons |= int(out[3].strip(), 16)
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            time.sleep(0.05)

    def __enter__(self) -> "Smi":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        if not self.samples:
            return "no nvidia-smi samples"
        clocks, power, mem = zip(*self.samples)
        reasons = [name for bit, name in THROTTLE_REASONS.items() if self.reasons & bit] or ["none"]
        return (f"SM clock {min(clocks):.0f}-{max(clocks):.0f} MHz, memory clock {min(mem):.0f}-{max(mem):.0f} MHz, "
                f"power {min(power):.0f}-{max(power):.0f} W, throttle reasons seen: {', '.join(reasons)} "
                f"({len(self.samples)} samples)")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    args.device, args.model, args.tiny, args.layers, args.dtype, args.seed = "cuda", None, False, None, None, 0
    args.temperature, args.block_size = 1.0, 16
    model = build_model(args)
    n, p_len, o_len = args.num_requests, args.prompt_len, args.output_len
    prompts = random_prompts(n, p_len, model.config.vocab_size, 0)
    engine = Engine(model, device="cuda", max_num_seqs=n, block_size=16, max_num_batched_tokens=8192,
                    max_model_len=p_len + o_len, num_kv_blocks=n * math.ceil((p_len + o_len) / 16) + n)
    runner = engine.runner
    b = next(g for g in sorted(runner.graphs) if g >= n)
    graph, out = runner.graphs[b]

    def graph_ms_in_a_generate(ps, tag) -> None:
        """One generate with CUDA events around every replay of the b-row graph: the last 20 replays' median."""
        marks = []

        class Marked:
            def replay(self) -> None:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                marks.append((e0, e1))

        runner.graphs[b] = (Marked(), out)
        engine.generate(ps, [sampling(args, o_len, i) for i in range(n)])
        torch.cuda.synchronize()
        runner.graphs[b] = (graph, out)
        t = sorted(a.elapsed_time(z) for a, z in marks[-20:])
        print(f"# graph replay inside the loop, {tag}: {t[len(t) // 2]:.3f} ms (median of the last 20)")

    graph_ms_in_a_generate(prompts, "first generate")
    graph_ms_in_a_generate(random_prompts(n, p_len, model.config.vocab_size, 1), "second generate, new prompts")
    reqs = [SampleRequest(1.0, 0, 1.0, i, p_len + o_len - 1) for i in range(n)]

    def run(k: int, between=None) -> list[float]:
        pairs = []
        for _ in range(k):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            pairs.append((e0, e1))
            if between is not None:
                between()
        torch.cuda.synchronize()
        return [a.elapsed_time(z) for a, z in pairs]

    def attention_ms(k: int, between=None) -> float:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(k, between)
        return sum(e.self_device_time_total for e in prof.key_averages() if "_attn_fwd" in e.key) / k / 1e3

    conditions = [
        ("alone", 20, None),
        ("+ sampler", 20, lambda: sample_on_device(out[:n], reqs)),
        ("+ gap", 20, lambda: time.sleep(0.001)),
    ]
    def set_context(c: int) -> None:
        """Point the graph's static inputs at context ``c`` (position c - 1) in every sequence's own blocks."""
        rows = torch.arange(b, device="cuda")
        pos = torch.full((b,), c - 1, dtype=torch.int64, device="cuda")
        runner._positions[:b].copy_(pos)
        runner._seq_lens[:b].fill_(c)
        runner._slots[:b].copy_(runner._block_table[rows, (c - 1) // 16] * 16 + (c - 1) % 16)

    last_ctx = int(runner._seq_lens[0])
    print("# nvidia-smi before the probe's replays (temperature, SM clock, throttle reasons):", subprocess.run(
        ["nvidia-smi", "--query-gpu=temperature.gpu,clocks.sm,clocks_throttle_reasons.active", "--format=csv,noheader",
         "-i", "0"], capture_output=True, text=True).stdout.strip())
    for c in (last_ctx, last_ctx - 15, last_ctx - 64):
        set_context(c)
        fixed = sorted(run(20))
        print(f"# replays alone at context {c}: {fixed[10]:.3f} ms (median of 20)")
    stepped = []
    for c in range(last_ctx - 40, last_ctx + 1):
        set_context(c)
        stepped += run(1)
    print(f"# replays alone, context advanced by one before each (like the loop), {last_ctx - 40}..{last_ctx}: "
          f"{sorted(stepped)[len(stepped) // 2]:.3f} ms (median)")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for advance in (False, True):
        varied = []
        for c in range(last_ctx - 40, last_ctx + 1):
            set_context(c if advance else last_ctx)
            runner._ids[:b].copy_(torch.randint(0, model.config.vocab_size, (b,), device="cuda", generator=gen))
            varied += run(1)
        print(f"# replays alone, new random token ids before each{', context advanced' if advance else ''}: "
              f"{sorted(varied)[len(varied) // 2]:.3f} ms (median)")
    set_context(last_ctx)
    # a fresh pinned host allocation (a size not seen before, so the caching host allocator calls cudaHostAlloc)
    # between replays: does mapping new host memory slow the graph?
    sizes = iter(range(1 << 20, 1 << 30, 4096 * 7))
    kept = []
    pinned = sorted(run(20, lambda: kept.append(torch.empty(next(sizes), dtype=torch.uint8, pin_memory=True))))
    print(f"# replays alone, a new pinned host allocation between replays: {pinned[10]:.3f} ms (median of 20)")
    kept.clear()
    run(5)
    # a device allocation the caching allocator cannot serve from its cache (empty_cache, then cudaMalloc of a
    # new segment) between replays: does (un)mapping device memory slow the graph (TLB)?
    def fresh_device_segment() -> None:
        torch.cuda.empty_cache()
        kept.append(torch.empty(48 << 20, dtype=torch.uint8, device="cuda"))
        kept.pop(0) if len(kept) > 1 else None

    fresh = sorted(run(20, fresh_device_segment))
    kept.clear()
    print(f"# replays alone, empty_cache + a new 48 MiB device segment between replays: {fresh[10]:.3f} ms "
          f"(median of 20)")
    run(5)
    print(f"# probe: {n} requests, context ~{p_len + o_len}, graph batch {b}; ms per replay (median, CUDA events)")
    print("| condition | graph ms (median) | min | max | attention ms (profiled) | nvidia-smi |")
    print("|---|---:|---:|---:|---:|---|")
    for name, k, between in conditions:
        with Smi() as smi:
            times = sorted(run(k, between))
        att = attention_ms(k, between)
        print(f"| {name} | {times[len(times) // 2]:.3f} | {times[0]:.3f} | {times[-1]:.3f} | {att:.3f} | "
              f"{smi.summary()} |")
    with Smi() as smi:
        times = run(300)
    first, last = sorted(times[:20]), sorted(times[-20:])
    print(f"| sustained, replays 1-20 | {first[10]:.3f} | {first[0]:.3f} | {first[-1]:.3f} | | {smi.summary()} |")
    print(f"| sustained, replays 281-300 | {last[10]:.3f} | {last[0]:.3f} | {last[-1]:.3f} | | |")
    # the loop itself again, for the same machine and minute
    times = []
    real = runner.launch

    def timed(scheduled):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        res = real(scheduled)
        e1.record()
        full = len(scheduled) == n and all(s.num_new_tokens == 1 for s in scheduled)
        times.append((full, e0, e1))
        if full:  # what _replay_decode_graph reads, copied (the sequences' blocks are freed when they finish)
            last_full[:] = [[SimpleNamespace(start=q.start, seq=SimpleNamespace(block_table=list(q.seq.block_table)))
                             for q in scheduled]]
        return res

    last_full: list = []

    class EventGraph:
        """The captured graph with CUDA events recorded just before and after each replay."""

        def __init__(self, g) -> None:
            self.g, self.marks = g, []

        def replay(self) -> None:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            self.g.replay()
            e1.record()
            self.marks.append((e0, e1))

    wrapped = EventGraph(graph)
    runner.graphs[b] = (wrapped, out)
    runner.launch = timed
    stats0 = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    dev0 = torch.cuda.memory_stats()
    with Smi() as smi:
        engine.generate(prompts, [sampling(args, o_len, i) for i in range(n)])
        torch.cuda.synchronize()
    runner.launch = real
    runner.graphs[b] = (graph, out)
    stats1 = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    changed = {k: stats1[k] - stats0.get(k, 0) for k in stats1
               if isinstance(stats1[k], (int, float)) and stats1[k] != stats0.get(k, 0)}
    print(f"# host (pinned) allocator counters that changed during the loop's generate: {changed}")
    dev1 = torch.cuda.memory_stats()
    keys = [k for k in dev1 if k.startswith(("num_", "segment.all.", "reserved_bytes.all."))
            and isinstance(dev1[k], (int, float)) and dev1[k] != dev0.get(k, 0)]
    print("# device allocator counters that changed during the loop's generate (cudaMalloc/cudaFree show as "
          f"num_device_alloc / num_device_free / segment.*): { {k: dev1[k] - dev0.get(k, 0) for k in keys} }")
    full = [(a, z) for f, a, z in times if f]
    steps = [a.elapsed_time(z) for a, z in full]
    marks = wrapped.marks[-len(full):]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"| the engine's loop, last 20 decode steps (graph + sampler) | {med(steps[-20:]):.3f} | "
          f"{min(steps[-20:]):.3f} | {max(steps[-20:]):.3f} | | {smi.summary()} |")
    before = [a.elapsed_time(m0) for (a, _), (m0, _) in zip(full[-20:], marks[-20:])]
    inside = [m0.elapsed_time(m1) for m0, m1 in marks[-20:]]
    after = [m1.elapsed_time(z) for (_, z), (_, m1) in zip(full[-20:], marks[-20:])]
    print(f"| ... of which launch start -> replay (inputs) | {med(before):.3f} | {min(before):.3f} | "
          f"{max(before):.3f} | | |")
    print(f"| ... of which the graph replay | {med(inside):.3f} | {min(inside):.3f} | {max(inside):.3f} | | |")
    print(f"| ... of which replay end -> launch end (sampler) | {med(after):.3f} | {min(after):.3f} | "
          f"{max(after):.3f} | | |")
    # the loop's last full decode step again, outside the loop: its input staging + replay alone, then the whole
    # launch (staging, replay, sampler, the copies of the result to pinned host memory), 20 times each
    (sched,) = last_full
    runner.graphs[b] = (wrapped, out)
    from rlrepro.rollout.runner import StepOutput

    def staged_replay():
        return runner._replay_decode_graph(sched, [0] * len(sched), b, [], [])

    def as_the_loop():  # staging, replay, the sampler, the result copied to pinned host memory and awaited
        StepOutput(*sample_on_device(staged_replay(), reqs)).result()

    pending = []

    def one_ahead():  # as the engine: the previous step's result is read after this step is enqueued
        pending.append(StepOutput(*sample_on_device(staged_replay(), reqs)))
        if len(pending) > 1:
            pending.pop(0).result()

    for name, call in (("the loop's last step: staging + replay", staged_replay),
                       ("the loop's last step: staging + replay + sampler + result", as_the_loop),
                       ("the same, each result read one step later", one_ahead)):
        wrapped.marks = []
        try:
            for _ in range(20):
                call()
        except Exception as e:  # (a finished sequence's state may not launch again)
            print(f"# {name}: not run ({type(e).__name__}: {e})")
            continue
        torch.cuda.synchronize()
        inside = sorted(m0.elapsed_time(m1) for m0, m1 in wrapped.marks)
        print(f"| {name}, graph replay | {med(inside):.3f} | {inside[0]:.3f} | {inside[-1]:.3f} | | |")
    # does the physical layout of the KV blocks matter? The same step (positions) with synthetic block tables
    width = len(sched[0].seq.block_table)
    num_blocks = engine.num_kv_blocks

    def jumps(tables):  # share of logical-block steps that are not to the next physical block
        steps = [(t[j], t[j + 1]) for t in tables for j in range(len(t) - 1)]
        return sum(1 for a, z in steps if z != a + 1) / max(1, len(steps))

    perm = torch.randperm(n * width, generator=torch.Generator().manual_seed(0)).tolist()
    layouts = {
        "the loop's own tables": [q.seq.block_table for q in sched],
        "contiguous per sequence": [list(range(i * width, (i + 1) * width)) for i in range(n)],
        "interleaved (block j of sequence i at j*n + i)": [[j * n + i for j in range(width)] for i in range(n)],
        "random permutation": [perm[i * width:(i + 1) * width] for i in range(n)],
    }
    print(f"# KV layout (same step, {n} sequences x {width} blocks, {num_blocks} blocks in the pool): graph ms")
    for name, tables in layouts.items():
        fake = [SimpleNamespace(start=q.start, seq=SimpleNamespace(block_table=t)) for q, t in zip(sched, tables)]
        wrapped.marks = []
        runner.graphs[b] = (wrapped, out)
        for _ in range(20):
            runner._replay_decode_graph(fake, [0] * n, b, [], [])
        torch.cuda.synchronize()
        inside = sorted(m0.elapsed_time(m1) for m0, m1 in wrapped.marks)
        print(f"| {name} (non-adjacent steps {jumps(tables):.0%}) | {med(inside):.3f} | {inside[0]:.3f} | "
              f"{inside[-1]:.3f} | | |")
    # which staged input makes the difference: replay after set_context, after staging, and after staging then
    # set_context (positions, lengths and slots replaced, ids and block table as staged)
    def replays(prepare, count: int = 20) -> list[float]:
        wrapped.marks = []
        for _ in range(count):
            prepare()
            wrapped.replay()
        torch.cuda.synchronize()
        return sorted(m0.elapsed_time(m1) for m0, m1 in wrapped.marks)

    def stage_only():  # _replay_decode_graph's input writes without its replay
        real_graph = runner.graphs[b]
        runner.graphs[b] = (SimpleNamespace(replay=lambda: None), out)
        runner._replay_decode_graph(sched, [0] * n, b, [], [])
        runner.graphs[b] = real_graph

    ctx = max(q.start for q in sched) + 1
    for name, prepare in (("set_context(last step's length)", lambda: set_context(ctx)),
                          ("staged inputs", stage_only),
                          ("staged, then set_context", lambda: (stage_only(), set_context(ctx)))):
        t = replays(prepare)
        print(f"| {name} | {med(t):.3f} | {t[0]:.3f} | {t[-1]:.3f} | | |")
    def temperature() -> str:
        try:
            return subprocess.run(["nvidia-smi", "--query-gpu=temperature.gpu,clocks.sm,clocks_throttle_reasons.active",
                                   "--format=csv,noheader", "-i", "0"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    for pause in (0, 5, 20):  # does the slowdown outlast an idle GPU (heat, power state)?
        time.sleep(pause)
        state = temperature()
        t = replays(lambda: set_context(ctx))
        print(f"| set_context after {pause} s idle (nvidia-smi: {state}) | {med(t):.3f} | {t[0]:.3f} | "
              f"{t[-1]:.3f} | | |")
    # is it the data the attention reads? the same replays with the KV cache zeroed, then refilled with noise
    caches = [t for layer in runner.kv_caches for t in (layer if isinstance(layer, (list, tuple)) else (layer,))]
    saved = [kv.clone() for kv in caches]
    if saved:
        gen = torch.Generator(device="cuda").manual_seed(3)
        for name, fill in (("KV cache zeroed", lambda kv: kv.zero_()),
                           ("KV cache N(0, 1) noise", lambda kv: kv.copy_(torch.randn(kv.shape, generator=gen,
                                                                                    device="cuda", dtype=kv.dtype))),
                           ("KV cache as the loop left it", None)):
            for kv, old_kv in zip(caches, saved):
                fill(kv) if fill is not None else kv.copy_(old_kv)
            t = replays(lambda: set_context(ctx))
            print(f"| set_context, {name} | {med(t):.3f} | {t[0]:.3f} | {t[-1]:.3f} | | |")
        del saved
    # the slow state long enough for nvidia-smi to see it: clocks, power and throttle reasons during 150 replays
    with Smi() as smi:
        t = replays(lambda: set_context(ctx), count=150)
    print(f"| set_context, 150 replays | {med(t):.3f} | {t[0]:.3f} | {t[-1]:.3f} | | {smi.summary()} |")
    stage_only()
    print("# staged: positions", runner._positions[:b].min().item(), runner._positions[:b].max().item(),
          "seq_lens", runner._seq_lens[:b].min().item(), runner._seq_lens[:b].max().item(),
          "ids", runner._ids[:b].min().item(), runner._ids[:b].max().item(), "ctx", ctx,
          "block table", tuple(runner._block_table.shape), "max_model_len", runner.max_model_len)
    runner.graphs[b] = (graph, out)
    own = [q.seq.block_table for q in sched]
    print("# the loop's tables, first 3 sequences:", [t[:6] + ["..."] + t[-6:] for t in own[:3]])


if __name__ == "__main__":
    main()
