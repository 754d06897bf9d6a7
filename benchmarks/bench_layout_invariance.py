"""What ``train.layout_invariant`` costs: one GRPO train step with the option off and on, timed, and the ratios.

Three configurations of the same model, batch and micro-batching (``rlrepro.trainer.Trainer`` as the trainer actor
runs it: ``enable_determinism()``, the compute dtype, float32 master weights when it is not float32, no reference
model):

* ``off``: today's step (micro-batch grads accumulated in place, rank-order DP sum);
* ``on (fold)``: ``train.layout_invariant=true train.tp_partials=1``: the micro-batch gradients folded in
  micro-batch order (``rlrepro.trainer.grad_fold``): at one rank the very operations of ``off``; over N ranks each
  micro-batch's gradient exchanged by shard (``all_to_all``) and added into a float32 accumulator shard, the
  shards all-gathered at the end;
* ``on (fold + P pieces)``: ``train.tp_partials=P`` as well: every row-/column-parallel product computed as ``P``
  fixed pieces (what any TP dividing ``P`` computes), forward and backward. On CUDA in the deterministic mode the
  pieces take the fused path of ``rlrepro.kernels.tp`` (one launch per product and per gradient, see
  docs/TRAINER.md);
* ``--per-piece`` adds ``on (... per-piece)``: the same with ``RLREPRO_TP_PIECES=per-piece`` (the pieces one by one,
  the same forward bits, a cuBLAS backward per piece), to show what the fused path saves.

After one untimed step of the process, each is warmed up, then ``--steps`` steps are timed (synchronised on CUDA);
the median step time is printed with the ratio to ``off``, and the peak memory of the steps
(``torch.cuda.max_memory_allocated``, reset after the trainer is built; n/a on CPU) with its ratio. The batch is
synthetic (seeded prompts and completions, rollout logprobs -1.0, seeded advantages). A benchmark reports, it
asserts nothing.

    python benchmarks/bench_layout_invariance.py --device cpu --hidden 64 --layers 2 --steps 2      # CPU smoke test
    python benchmarks/bench_layout_invariance.py --device cuda --hidden 4096 --layers 4 --heads 32 --kv-heads 8 \\
        --head-dim 128 --intermediate 12288 --vocab 151936 --num-samples 64 --micro-batch-size 8 \\
        --tp-partials 8 --warmup 2 --steps 5 --per-piece                                    # Qwen3-8B width, an H200

Data parallel: run it under ``torchrun --nproc-per-node N``; every rank initialises ``torch.distributed`` (NCCL on
CUDA with one GPU per local rank, gloo on CPU) and the step is data parallel over the N ranks (the ``off`` sum is the
all-gather + rank-order sum, the ``on`` one the sharded fold); rank 0 prints.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlrepro import kernels  # noqa: E402
from rlrepro.model import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from rlrepro.trainer import DataParallel, TrainConfig, Trainer, enable_determinism  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--intermediate", type=int, default=None, help="default: 3 x hidden")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--tp-partials", type=int, default=2, help="P of the third configuration (must divide the "
                   "KV heads, heads, intermediate size and vocabulary)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-piece", action="store_true", help="also time the P pieces one by one "
                   "(RLREPRO_TP_PIECES=per-piece: the same forward bits; what the CUDA fused path replaces)")
    p.add_argument("--rounds", type=int, default=1, help="time the configurations in turn this many times and "
                   "print each round's ratios and their medians (step times drift by several percent between "
                   "blocks of steps)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one more step of each configuration (torch.profiler) and print its "
                        "N most expensive kernels by device time")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(args, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    head_dim = args.head_dim or args.hidden // args.heads
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or
                      3 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype)


def samples(args) -> list[dict]:
    rng = random.Random(args.seed)
    return [{"prompt_token_ids": [rng.randrange(args.vocab) for _ in range(args.prompt_len)],
             "completion_token_ids": [rng.randrange(args.vocab) for _ in range(args.completion_len)],
             "rollout_logprobs": [-1.0] * args.completion_len, "advantage": rng.gauss(0.0, 1.0)}
            for _ in range(args.num_samples)]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def time_config(args, device, dtype, data_parallel, env=None, **train) -> tuple[float, int | None, str | None]:
    """Median step seconds, the steps' peak allocated bytes (None on CPU) and the profile table (``--profile``,
    rank 0; else None) of one configuration; ``env``: environment variables set while it runs."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        _free(device)
        model = make_model(args, device, torch.float32)
        config = TrainConfig(lr=1e-6, steps=args.warmup + args.steps, micro_batch_size=args.micro_batch_size,
                             num_gpus=1 if data_parallel is None else data_parallel.world_size, **train)
        trainer = Trainer(model, config, param_dtype=dtype if dtype != torch.float32 else None,
                          data_parallel=data_parallel)
        del model
        batch = samples(args)
        times = []
        sync(device)
        if device.type == "cuda":  # the steps' peak: weights, optimizer state, activations, gradients
            torch.cuda.reset_peak_memory_stats(device)
        with kernels.mode("deterministic"):
            for i in range(args.warmup + args.steps):
                if data_parallel is not None:
                    data_parallel.barrier()
                sync(device)
                t0 = time.perf_counter()
                trainer.train_step(batch)
                sync(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        table = _profile_step(args, trainer, batch, device, data_parallel) if args.profile else None
        del trainer
        _free(device)
        return statistics.median(times), peak, table
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _profile_step(args, trainer, batch, device, data_parallel) -> str | None:
    """One more step under torch.profiler: the table of the ``args.profile`` kernels with the most device time (CPU
    time on CPU), then where the most expensive fills, copies and adds come from (Python stacks), on rank 0 (None
    elsewhere)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if data_parallel is not None:
        data_parallel.barrier()
    sync(device)
    with profile(activities=activities) as prof, kernels.mode("deterministic"), _MemoryOps() as ops:
        trainer.train_step(batch)
        sync(device)
    if data_parallel is not None and data_parallel.rank != 0:
        return None
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    lines = [prof.key_averages().table(sort_by=key, row_limit=args.profile, max_name_column_width=70),
             "fills, copies and adds by bytes written (op, dtype, shape, the innermost rlrepro frames):"]
    for (op, dtype, shape, where), (count, nbytes) in sorted(ops.seen.items(), key=lambda kv: -kv[1][1])[:15]:
        lines.append(f"  {nbytes / 2 ** 30:8.3f} GiB x{count:<5} {op:<14} {dtype:<9} {shape:<18} {where}")
    return "\n".join(lines)


class _MemoryOps:
    """A dispatch mode that counts the bytes written by fills, zeroings, copies and in-place adds, keyed by op,
    dtype, shape and the innermost rlrepro stack frames (Python frames only: autograd's own nodes show none)."""

    OPS = ("fill_", "zero_", "copy_", "add_", "zeros", "zeros_like", "clone", "contiguous", "cat", "add")

    def __enter__(self):
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        self.seen = {}
        seen = self.seen

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.__name__.split(".")[0]
                if name in _MemoryOps.OPS and isinstance(out, torch.Tensor):
                    frames = [f for f in traceback.extract_stack()[:-1] if "rlrepro" in f.filename
                              and "benchmarks" not in f.filename][-3:]
                    where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames))
                    k = (name, str(out.dtype).replace("torch.", ""), "x".join(map(str, out.shape)), where)
                    c, b = seen.get(k, (0, 0))
                    seen[k] = (c + 1, b + out.numel() * out.element_size())
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _gib(peak: int | None, base: int | None) -> str:
    if peak is None:
        return "peak memory n/a (CPU)"
    return f"peak {peak / 2 ** 30:8.2f} GiB   x{peak / base:.3f} of off"


def main(argv=None) -> None:
    args = parse_args(argv)
    enable_determinism()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data_parallel = None
    device = torch.device(args.device)
    if world > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        data_parallel = DataParallel()
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    rank0 = data_parallel is None or data_parallel.rank == 0
    micro = -(-args.num_samples // args.micro_batch_size)
    if rank0:
        print(f"device {device} x {world} rank(s), {dtype}, hidden {args.hidden}, {args.layers} layers, "
              f"{args.num_samples} samples of {args.prompt_len}+{args.completion_len} tokens, {micro} micro-batches "
              f"of {args.micro_batch_size}, median of {args.steps} steps")
    pieces = f"on (fold + {args.tp_partials} pieces)"
    configs = [("off", {}, None), ("on (fold)", dict(layout_invariant=True), None),
               (pieces, dict(layout_invariant=True, tp_partials=args.tp_partials), None)]
    if args.per_piece:
        configs.append((pieces[:-1] + ", per-piece)", dict(layout_invariant=True, tp_partials=args.tp_partials),
                        {"RLREPRO_TP_PIECES": "per-piece"}))
    if rank0 and device.type == "cuda":
        print(f"  pieces: the CUDA fused path (rlrepro.kernels.tp; RLREPRO_TP_PIECES="
              f"{os.environ.get('RLREPRO_TP_PIECES', '') or 'fused'})")
    # one untimed pass first: the process's one-time costs (allocator, kernel compilation, thread pools) would
    # otherwise land on whichever configuration runs first
    time_config(argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0, "profile": 0}), device, dtype,
                data_parallel)
    ratios: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    for round_ in range(args.rounds):
        if rank0 and args.rounds > 1:
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
        base = base_peak = None
        for label, train, env in configs:
            seconds, peak, table = time_config(args if round_ == 0 else argparse.Namespace(
                **{**vars(args), "profile": 0}), device, dtype, data_parallel, env=env, **train)
            base = base or seconds
            base_peak = base_peak or peak
            ratios[label].append(seconds / base)
            if rank0:
                print(f"  {label:<36} {seconds * 1e3:10.1f} ms/step   x{seconds / base:.3f} of off   "
                      f"{_gib(peak, base_peak)}", flush=True)
                if table:
                    print(table, flush=True)
    if rank0 and args.rounds > 1:
        print(f"median over {args.rounds} rounds of the step time / off's in the same round:")
        for label, values in ratios.items():
            print(f"  {label:<36} x{statistics.median(values):.3f}   (rounds: "
                  f"{', '.join(f'x{v:.3f}' for v in values)})", flush=True)
    if data_parallel is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
