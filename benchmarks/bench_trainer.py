"""One GRPO train step of ``rlrepro.trainer.Trainer``: time, tokens/s, model TFLOP/s, MFU, phase split, profile.

Set up as the trainer actor sets itself up (``rlrepro.orchestration.workers.TrainerWorker``): ``enable_determinism()``
before the first CUDA op, the policy in the compute dtype (bf16 on CUDA, so the optimizer keeps float32 master
weights, Adam state and grads), ``train_step`` under ``kernels.mode(--mode)``, no reference model (kl_coef 0).

The batch is synthetic: N samples of P random prompt and O random completion tokens (fixed seed), rollout logprobs
all -1.0 (so ``train/rollout_logprob_abs_diff`` is large; the step's work does not depend on it), advantages from a
seeded normal. Model FLOPs are ``rlrepro.trainer.flops.train_flops`` (what ``perf/train_flops`` reports: forward+backward = 3
forwards, lm_head counted at completion tokens only; the on-policy check reuses the loss pass's forward) and MFU is FLOPs / (seconds * the bf16 peak of
``rlrepro.trainer.flops.PEAK_BF16_FLOPS`` for this GPU). Tokens/s counts prompt + completion tokens of all samples.

After the timed steps, one more step runs with synchronised timing wrappers monkeypatched (in this process only)
around what ``train_step`` calls: the no-grad logprob pass (``train.token_logprobs``, the KL reference's only), the loss pass's
forward (``train.logprobs_and_entropy``), ``train.policy_loss``, ``Tensor.backward``, the float32 grad accumulation
(``optimizer.accumulate_grads`` / ``grads``), grad norm + clip, and ``optimizer.step``; "rest" is the step's time
outside them, also broken down by the phase it follows. The wrappers synchronise, so the split step is a little slower than the timed ones. ``--profile``
runs one more step under ``torch.profiler`` (phases appear as ``bench.*`` ranges, without the extra syncs).

A benchmark reports, it asserts nothing.

    python benchmarks/bench_trainer.py --tiny --device cpu --num-samples 8 --prompt-len 8 --completion-len 8 \\
        --micro-batch-size 4 --steps 1                                         # CPU smoke test
    python benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --profile  # on the H200
    python benchmarks/bench_trainer.py --qwen3-8b-shape --layers 4 --num-samples 256 --json /tmp/trainer.json

The full 36-layer Qwen3-8B does not fit one H200 this way (bf16 weights + fp32 masters, grads and Adam state are
~18 bytes per parameter, ~150 GB); use ``--layers``, or shard it over GPUs with ``--tensor-parallel``:

``--tensor-parallel N`` (N > 1) runs the megatron backend's trainer (``rlrepro.trainer.megatron``) over N processes
(``torch.multiprocessing`` spawn): each initialises ``torch.distributed`` (NCCL with one GPU per rank on CUDA, gloo
on CPU; 127.0.0.1 and a free port), then ``build_megatron_trainer(model_dir, ..., tensor_parallel=N, num_gpus=G)``
(``--num-gpus G``, default N: data parallel G / N; ``--distributed-optimizer`` shards the optimizer state over it;
``--grad-sync megatron`` takes megatron-core's DistributedDataParallel and optimizer instead of rlrepro's)
(megatron-core's ``parallel_state`` when it is installed) loads its shards of a model directory. For the Qwen3-8B
shape (and ``--tiny``) that directory is written once by the parent into a temporary directory and deleted at the
end: ``scripts/make_qwen3_shape.py`` (config.json + tokenizer; ``--small-shape`` passes ``--small``), then seeded
random weights saved as safetensors (``save_pretrained``) in the compute dtype, made as ``model.init=random`` makes
them (``init_random_weights``, ~80 s for the full 8B on the CPU) or, on CUDA, by one helper process that fills them
on the GPU from a seeded CUDA generator (seconds; the same values as this benchmark's single-process CUDA weights of
the same seed and layers). ``--model DIR`` is loaded as it is. Every rank runs the same warm-up and timed steps,
with a barrier before and after each; rank 0 prints the same lines as one process, where the model FLOPs are the
whole model's and MFU = FLOPs / (seconds * N GPUs * the bf16 peak), plus the peak GPU memory of every rank. The
phase split and ``--profile`` are rank 0's only: rank 0 runs its step under the wrappers / the profiler while the
other ranks run theirs plain, so rank 0's phases include its waits for them (the TP gradient reduction is the extra
phase "grad reduce (TP/DP)"). On CPU every rank takes torch's thread count / N threads unless ``--torch-threads``.

    python benchmarks/bench_trainer.py --qwen3-8b-shape --layers 2 --small-shape --tensor-parallel 2 --device cpu \\
        --num-samples 8 --prompt-len 8 --completion-len 8 --micro-batch-size 4 --steps 1   # CPU smoke test, 2 ranks
    python benchmarks/bench_trainer.py --qwen3-8b-shape --layers 36 --tensor-parallel 2   # full Qwen3-8B, 2 H200s

Memory at TP=2 of the full model: ~4.1 B parameters per rank (8.2 B / 2; the norms are replicated) at ~18 bytes
per parameter (bf16 weights 2 + fp32 masters 4 + fp32 grads 4 + Adam moments 8) is ~74 GB per GPU, plus the
activations of a micro-batch: it fits an H200 (~141 GB).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlrepro.trainer.train as train_mod  # noqa: E402
from rlrepro import kernels  # noqa: E402
from rlrepro.trainer.flops import PEAK_BF16_FLOPS, train_flops  # noqa: E402
from rlrepro.trainer import TrainConfig, Trainer, enable_determinism  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import DTYPES, build_model, random_weights_, sync  # noqa: E402  (the same model builder and weights)

def synthetic_samples(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int,
                      completion_len_min: int | None = None) -> list[dict]:
    """``n`` samples of ``prompt_len`` prompt tokens; completions of ``completion_len`` tokens, or with
    ``completion_len_min`` of a length drawn uniformly from ``[completion_len_min, completion_len]`` (a reasoning
    batch: short and long answers mixed), the same for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = completion_len if completion_len_min is None else rng.randint(completion_len_min, completion_len)
        out.append({"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)],
                    "completion_token_ids": [rng.randrange(vocab) for _ in range(length)],
                    "rollout_logprobs": [-1.0] * length, "advantage": rng.gauss(0.0, 1.0)})
    return out


class PhaseTimer:
    """Wraps functions into named phases. A call made while another phase runs counts toward that one (e.g.
    ``accumulate_grads`` inside ``optimizer.step``). With ``timed``, each top-level call is synchronised and timed,
    and the time between phases ("rest") is attributed to the phase it follows; every call is also a
    ``record_function`` range ``bench.<phase>`` for the profiler."""

    def __init__(self, device: torch.device, timed: bool = True) -> None:
        self.device, self.timed = device, timed
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.gaps: dict[str, float] = defaultdict(float)
        self.depth = 0
        self.last_phase, self.last_end = "step start", 0.0

    def start(self) -> None:
        sync(self.device)
        self.last_phase, self.last_end = "step start", time.perf_counter()

    def stop(self) -> None:
        sync(self.device)
        self.gaps[self.last_phase] += time.perf_counter() - self.last_end

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            try:
                with torch.profiler.record_function(f"bench.{phase}"):
                    if not self.timed:
                        return fn(*args, **kwargs)
                    sync(self.device)
                    t0 = time.perf_counter()
                    self.gaps[self.last_phase] += t0 - self.last_end
                    out = fn(*args, **kwargs)
                    sync(self.device)
                    t1 = time.perf_counter()
                    self.seconds[phase] += t1 - t0
                    self.calls[phase] += 1
                    self.last_phase, self.last_end = phase, t1
                    return out
            finally:
                self.depth -= 1

        return inner


PHASES = ("reference logprobs (no grad)", "loss forward (logprobs + entropy)", "policy_loss", "backward",
          "grad accumulate (fp32 masters)", "grad reduce (TP/DP)", "grad norm + clip", "optimizer step")
REPO = Path(__file__).resolve().parents[1]


@contextmanager
def phase_wrappers(trainer: Trainer, timer: PhaseTimer, reduce_grads: bool = False):
    """Monkeypatch the train step's callees with ``timer``'s wrappers; everything is put back on exit.
    ``reduce_grads``: also time ``trainer._reduce_grads`` (the TP/DP gradient reduction; a no-op in one process)."""
    fwd_nograd, fwd, loss, bwd, acc, reduce, clip, opt = PHASES
    optimizer = trainer.optimizer
    module_patches = [(train_mod, "token_logprobs", fwd_nograd), (train_mod, "logprobs_and_entropy", fwd),
                      (train_mod, "policy_loss", loss), (train_mod, "clip_grad_norm_", clip),
                      (torch.Tensor, "backward", bwd)]
    # instance attributes shadow the class's methods; deleting them afterwards brings the methods back
    instance_patches = [(optimizer, "accumulate_grads", acc), (optimizer, "grads", acc), (optimizer, "step", opt),
                        (trainer, "_grad_norm", clip)]
    if reduce_grads:
        instance_patches.append((trainer, "_reduce_grads", reduce))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in module_patches]
    try:
        for obj, name, phase in module_patches + instance_patches:
            setattr(obj, name, timer.wrap(phase, getattr(obj, name)))
        yield timer
    finally:
        for obj, name, _ in instance_patches:
            obj.__dict__.pop(name, None)
        for obj, name, original in saved:
            setattr(obj, name, original)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the tiny test model (CPU smoke test)")
    which.add_argument("--qwen3-8b-shape", action="store_true", help="random weights of Qwen3-8B's shape (default)")
    which.add_argument("--model", help="a checkpoint directory to load instead of random weights")
    ap.add_argument("--layers", type=int, default=None, help="layers of the model (8B shape: default 36)")
    ap.add_argument("--small-shape", action="store_true",
                    help="with the 8B shape: scripts/make_qwen3_shape.py --small's tiny widths (hidden 64, 8 heads, "
                         "4 KV heads; Qwen3-8B's vocabulary), float32 by default (CPU smoke test)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="N > 1: the megatron backend's trainer over N processes (one GPU each on CUDA, NCCL; gloo "
                         "on CPU) on a model directory written once to a temp dir (module doc); MFU counts N GPUs; "
                         "the phase split and --profile are rank 0's only (the other ranks run the step plain)")
    ap.add_argument("--num-gpus", type=int, default=None, metavar="G",
                    help="ranks of the megatron backend (default: --tensor-parallel): data parallel G / N")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="with data parallel: shard the fp32 masters and AdamW state over the DP ranks (ZeRO-1)")
    ap.add_argument("--grad-sync", choices=("ordered", "megatron"), default="ordered",
                    help="megatron backend: rlrepro's order-fixed gradient sum + AdamW, or megatron-core's "
                         "DistributedDataParallel + optimizer (--distributed-optimizer: its DistributedOptimizer)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="compute dtype of the policy (default: bfloat16 for the 8B shape, float32 for --tiny and "
                         "--small-shape, the checkpoint's for --model)")
    ap.add_argument("--mode", choices=kernels.MODES, default="deterministic", help="rlrepro.kernels mode")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=0, metavar="TOKENS",
                    help="train.micro_batch_tokens: a token budget per micro-batch (0: micro_batch_size samples)")
    ap.add_argument("--completion-len-min", type=int, default=None, metavar="L",
                    help="completion lengths drawn uniformly from [L, --completion-len] (default: all equal)")
    ap.add_argument("--logits-chunk-size", type=int, default=0, metavar="ROWS",
                    help="train.logits_chunk_size: logits rows per float32 log-softmax chunk (0: unchunked)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads (the trainer actor uses 1; default: leave torch's; with "
                         "--tensor-parallel N on CPU: torch's / N per rank)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-phases", action="store_true", help="skip the phase-split step")
    ap.add_argument("--profile", action="store_true", help="profile one more step with torch.profiler")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if not args.tiny and not args.model:
        args.qwen3_8b_shape = True
    if args.small_shape and not args.qwen3_8b_shape:
        ap.error("--small-shape goes with the Qwen3-8B shape (not --tiny or --model)")
    if args.tensor_parallel < 1:
        ap.error(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.num_gpus is None:
        args.num_gpus = args.tensor_parallel
    if args.num_gpus < 1 or args.num_gpus % args.tensor_parallel:
        ap.error(f"--num-gpus {args.num_gpus} must be a positive multiple of --tensor-parallel {args.tensor_parallel}")
    if args.grad_sync == "megatron" and args.num_gpus == 1:
        ap.error("--grad-sync megatron runs the megatron backend over ranks: give --num-gpus (or --tensor-parallel)")
    if args.distributed_optimizer and args.num_gpus == args.tensor_parallel:
        ap.error("--distributed-optimizer needs data parallel: --num-gpus larger than --tensor-parallel")
    return args


def compute_dtype(args) -> torch.dtype | None:
    """The policy's dtype: --dtype, else float32 (--tiny, --small-shape), the checkpoint's (--model), bfloat16."""
    if args.dtype:
        return DTYPES[args.dtype]
    if args.model:
        return None
    return torch.float32 if args.tiny or args.small_shape else torch.bfloat16


def _random_weights(model_dir: str, device: str, dtype_name: str, seed: int) -> None:
    """Seeded random weights of ``model_dir``/config.json's shape, saved there as safetensors in ``dtype_name``:
    ``init_random_weights`` (what ``model.init=random`` runs) on the CPU; on CUDA a seeded CUDA generator fills them
    on the GPU (``bench_engine.random_weights_``: seconds instead of ~80 s for the 8B)."""
    from rlrepro.model import Qwen3Config, Qwen3ForCausalLM, save_pretrained

    config = Qwen3Config.from_file(model_dir)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device=device).to(DTYPES[dtype_name])
    random_weights_(model, seed)
    save_pretrained(model, model_dir, max_shard_bytes=5 << 30)  # the tokenizer files are there already


def _random_weights_process(index: int, model_dir: str, dtype_name: str, seed: int) -> None:
    _random_weights(model_dir, "cuda:0", dtype_name, seed)  # a spawned helper: the parent never touches CUDA


def write_model_dir(args, out: Path) -> str:
    """Write the model directory the ranks load (tiny or the Qwen3-8B shape, seeded random weights); returns a
    description for the log."""
    dtype = compute_dtype(args)
    dtype_name = str(dtype).replace("torch.", "")
    if args.tiny:
        from rlrepro.model import write_tiny_checkpoint

        overrides = {"num_hidden_layers": args.layers} if args.layers else {}
        write_tiny_checkpoint(out, seed=args.seed, max_position_embeddings=4096, **overrides)
        return "the tiny model"
    cmd = [sys.executable, str(REPO / "scripts" / "make_qwen3_shape.py"), "--out", str(out),
           "--layers", str(args.layers or 36)] + (["--small"] if args.small_shape else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    if torch.device(args.device).type == "cuda":
        import torch.multiprocessing as mp

        mp.start_processes(_random_weights_process, args=(str(out), dtype_name, args.seed), nprocs=1,
                           start_method="spawn")
        where = "on the GPU"
    else:
        _random_weights(str(out), "cpu", dtype_name, args.seed)
        where = "init_random_weights on the CPU"
    return (f"random Qwen3-8B-shaped{' (--small)' if args.small_shape else ''} weights ({args.layers or 36} "
            f"layers, {dtype_name}, {where})")


def benchmark(args, trainer: Trainer, device: torch.device, *, rank: int = 0, world: int = 1,
              header: str = "", extra: dict | None = None) -> dict | None:
    """Warm-up, timed steps, phase split, profile; rank 0 prints and returns the results (None on other ranks).
    With ``world`` > 1 every rank calls it together (the train step is a collective)."""
    model = trainer.model
    cfg = model.config
    train_config = trainer.config
    lead = rank == 0

    def say(*a, **kw) -> None:
        if lead:
            print(*a, **kw)

    def sync_all() -> None:
        sync(device)
        if world > 1:
            import torch.distributed as dist

            if device.type == "cuda":
                dist.barrier(device_ids=[device.index])
            else:
                dist.barrier()
            sync(device)

    def gather(value):
        if world == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * world
        dist.all_gather_object(out, value)
        return out

    samples = synthetic_samples(args.num_samples, args.prompt_len, args.completion_len, cfg.vocab_size, args.seed,
                                args.completion_len_min)
    cuts = trainer.micro_batches(samples)
    cut_tokens = [sum(len(samples[i]["prompt_token_ids"]) + len(samples[i]["completion_token_ids"]) for i in c)
                  for c in cuts]
    tokens = sum(len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) for s in samples)
    flops = train_flops(cfg, [SimpleNamespace(**s) for s in samples], train_config)
    passes = 3 * train_config.ppo_epochs
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size * sum(len(s["completion_token_ids"]) for s in samples) * passes
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None) if device.type == "cuda" else None
    rank_params = sum(p.numel() for p in model.parameters())
    if world == 1:
        n_params = rank_params
        params_text = f"{n_params:,} params"
    else:
        from rlrepro.model import Qwen3ForCausalLM

        with torch.device("meta"):
            n_params = sum(p.numel() for p in Qwen3ForCausalLM(cfg).parameters())
        per_rank = gather(rank_params)
        params_text = f"{n_params:,} params ({', '.join(f'{n:,}' for n in per_rank)} per rank)"
    say(f"# {name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {cfg.num_hidden_layers} "
        f"layers, {params_text}, {model.dtype} (fp32 masters: "
        f"{trainer.optimizer.has_master_copies}), kernels {args.mode}{header}", flush=True)
    budget = f", at most {train_config.micro_batch_tokens:,} tokens" if train_config.micro_batch_tokens else ""
    spread = f"{args.completion_len_min}..{args.completion_len}" if args.completion_len_min else args.completion_len
    say(f"# N={args.num_samples} P={args.prompt_len} O={spread} micro-batch {args.micro_batch_size}{budget} "
        f"({len(cuts)} micro-batches of {min(cut_tokens):,}..{max(cut_tokens):,} tokens), {tokens:,} tokens/step, "
        f"model FLOPs/step {flops / 1e12:.4g} T (of which lm_head: {lm_head / flops:.1%})", flush=True)
    gpus = f" * {world} GPUs" if world > 1 else ""
    peak_all = peak * world if peak else None  # MFU: FLOPs / (seconds * N GPUs * peak)

    def step() -> dict:
        with kernels.mode(args.mode):
            return trainer.train_step(samples)

    for i in range(args.warmup):
        sync_all()
        t0 = time.perf_counter()
        step()
        sync_all()
        say(f"# warm-up step {i + 1}: {time.perf_counter() - t0:.3f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    metrics: dict = {}
    for i in range(args.steps):
        sync_all()
        t0 = time.perf_counter()
        metrics = step()
        sync_all()
        times.append(time.perf_counter() - t0)
        t = times[-1]
        mfu = f", MFU {flops / t / peak_all:.1%}" if peak else ""
        say(f"step {i + 1}: {t:.3f} s, {tokens / t:,.0f} tokens/s, {flops / t / 1e12:.4g} model TFLOP/s{mfu}, "
            f"loss {metrics['loss']:.6g}, grad_norm {metrics['grad_norm']:.6g}", flush=True)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peak_mems = gather(peak_mem)
    result: dict = dict(device=name, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                        layers=cfg.num_hidden_layers, params=n_params, dtype=str(model.dtype),
                        fp32_masters=trainer.optimizer.has_master_copies, kernel_mode=args.mode,
                        num_samples=args.num_samples, prompt_len=args.prompt_len, completion_len=args.completion_len,
                        micro_batch_size=args.micro_batch_size, logits_chunk_size=args.logits_chunk_size,
                        completion_len_min=args.completion_len_min,
                        micro_batch_tokens=train_config.micro_batch_tokens, micro_batches=len(cuts),
                        micro_batch_tokens_max=max(cut_tokens), tokens_per_step=tokens, model_flops_per_step=flops,
                        lm_head_flops_share=lm_head / flops, peak_bf16_flops=peak,
                        step_seconds=times, peak_allocated_gib=peak_mem,
                        last_metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    if world > 1:
        result.update(tensor_parallel=args.tensor_parallel, num_gpus=world if device.type == "cuda" else None,
                      params_per_rank=per_rank, peak_allocated_gib=max(peak_mems) if peak_mem is not None else None,
                      peak_allocated_gib_per_rank=peak_mems, **(extra or {}))
    if times:
        mean = sum(times) / len(times)
        result.update(mean_step_s=mean, min_step_s=min(times), tokens_per_s=tokens / mean,
                      model_tflops_per_s=flops / mean / 1e12, mfu=flops / mean / peak_all if peak else None)
        mfu = f", MFU {result['mfu']:.1%}{gpus}" if peak else (", MFU n/a (no bf16 peak for this device)"
                                                                if device.type == "cuda" else "")
        if peak_mem is None:
            mem = ""
        elif world == 1:
            mem = f", peak allocated {peak_mem:.1f} GiB"
        else:
            mem = ", peak allocated " + " / ".join(f"{m:.1f}" for m in peak_mems) + " GiB (ranks 0..)"
        say(f"# mean of {len(times)}: {mean:.3f} s/step (min {min(times):.3f}), {tokens / mean:,.0f} tokens/s, "
            f"{flops / mean / 1e12:.4g} model TFLOP/s{mfu}{mem}", flush=True)

    if not args.no_phases:
        timer = PhaseTimer(device, timed=True)
        sync_all()
        if lead:  # the other ranks run the same step plain; rank 0's phases include its waits for them
            with phase_wrappers(trainer, timer, reduce_grads=world > 1):
                timer.start()
                t0 = time.perf_counter()
                step()
                timer.stop()
                total = time.perf_counter() - t0
        else:
            step()
        sync_all()
        if lead:
            rest = total - sum(timer.seconds.values())
            title = " on rank 0" if world > 1 else ""
            print(f"\n# phase split of one step{title} (synchronised wrappers): {total:.3f} s")
            print("| phase | calls | seconds | share |")
            print("|---|---:|---:|---:|")
            for phase in PHASES:
                if phase in timer.seconds:
                    s = timer.seconds[phase]
                    print(f"| {phase} | {timer.calls[phase]} | {s:.4f} | {s / total:.1%} |")
            print(f"| rest | | {rest:.4f} | {rest / total:.1%} |")
            print(f"| total | | {total:.4f} | 100.0% |")
            gaps = sorted(timer.gaps.items(), key=lambda kv: -kv[1])
            print("# rest, by the phase it follows: " + ", ".join(f"after {k}: {v:.4f} s" for k, v in gaps))
            result["phases"] = dict(total_s=total, rest_s=rest, seconds=dict(timer.seconds),
                                    calls=dict(timer.calls), rest_after=dict(timer.gaps))

    if args.profile:
        sync_all()
        if lead:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            timer = PhaseTimer(device, timed=False)  # bench.* ranges only, no extra syncs
            with phase_wrappers(trainer, timer, reduce_grads=world > 1), \
                    torch.profiler.profile(activities=activities) as prof:
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                total = time.perf_counter() - t0
        else:
            step()
        sync_all()
        if lead:
            title = " on rank 0" if world > 1 else ""
            print(f"\n# profiled step{title}: {total:.3f} s (profiler overhead included)")
            sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=60))
            result["profiled_step_s"] = total

    if lead and args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"# wrote {args.json}")
    return result if lead else None


def _rank_main(rank: int, args, model_dir: str, port: int, extra: dict) -> None:
    """One rank of the megatron backend (a spawned process; TP and DP groups): process group, trainer,
    the benchmark."""
    import datetime

    import torch.distributed as dist

    from rlrepro.trainer.megatron import build_megatron_trainer, destroy_parallel, megatron_core_version

    world, tp = args.num_gpus, args.tensor_parallel
    cuda = torch.device(args.device).type == "cuda"
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    enable_determinism()  # before the first CUDA op
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the trainer actor runs NCCL
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=900))
    trainer = None
    try:
        use_megatron = megatron_core_version() is not None
        train_config = TrainConfig(lr=1e-6, kl_coef=0.0, micro_batch_size=args.micro_batch_size,
                               logits_chunk_size=args.logits_chunk_size, micro_batch_tokens=args.micro_batch_tokens)
        t0 = time.perf_counter()
        trainer = build_megatron_trainer(model_dir, train_config, tensor_parallel=tp, num_gpus=world,
                                         device="cuda" if cuda else "cpu", dtype=compute_dtype(args),
                                         use_megatron_parallel_state=use_megatron,
                                         distributed_optimizer=args.distributed_optimizer,
                                         grad_sync=args.grad_sync)
        device = trainer.model.device
        load_s = time.perf_counter() - t0
        if rank == 0:
            print(f"# rank trainers built (megatron backend, TP={tp}, DP={world // tp}"
                  f"{', ZeRO-1' if args.distributed_optimizer else ''}, grad sync {args.grad_sync}, parallel_state: "
                  f"{'megatron-core ' + megatron_core_version() if use_megatron else 'torch.distributed groups'}) "
                  f"in {load_s:.1f} s", flush=True)
        extra = dict(extra, parallel_state="megatron-core" if use_megatron else "torch", build_trainer_s=load_s)
        extra.update(data_parallel=world // tp, distributed_optimizer=args.distributed_optimizer,
                     grad_sync=args.grad_sync)
        benchmark(args, trainer, device, rank=rank, world=world,
                  header=f", tensor parallel {tp} x data parallel {world // tp}"
                         f"{' (ZeRO-1)' if args.distributed_optimizer else ''}, grad sync {args.grad_sync} "
                         f"({'NCCL' if cuda else 'gloo'})",
                  extra=extra)
    finally:
        if trainer is not None:
            destroy_parallel(trainer.groups)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args) -> None:
    import torch.multiprocessing as mp

    n = args.num_gpus
    cuda = torch.device(args.device).type == "cuda"
    if cuda and torch.cuda.device_count() < n:
        raise SystemExit(f"{n} ranks need {n} GPUs (one per rank); {torch.cuda.device_count()} visible")
    if not cuda and not args.torch_threads:
        args.torch_threads = max(1, torch.get_num_threads() // n)  # the ranks share the cores
    tmp = None
    extra: dict = {}
    try:
        if args.model:
            model_dir = args.model
        else:
            tmp = tempfile.mkdtemp(prefix="bench_trainer_tp_")
            t0 = time.perf_counter()
            what = write_model_dir(args, Path(tmp))
            extra["write_model_dir_s"] = time.perf_counter() - t0
            print(f"# {what} written to {tmp} in {extra['write_model_dir_s']:.0f} s", flush=True)
            model_dir = tmp
        mp.start_processes(_rank_main, args=(args, model_dir, _free_port(), extra), nprocs=n, start_method="spawn")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.num_gpus > 1:
        return run_ranks(args)
    tmp = None
    if args.small_shape:  # one process on the --small shape: write the directory as for TP, then load it
        tmp = tempfile.mkdtemp(prefix="bench_trainer_")
        print(f"# {write_model_dir(args, Path(tmp))} written to {tmp}", flush=True)
        args.model, args.dtype = tmp, str(compute_dtype(args)).replace("torch.", "")
    try:
        run_single(args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_single(args) -> None:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    enable_determinism()  # before the first CUDA op, as TrainerWorker does
    model = build_model(args)
    # param_dtype = the model's dtype: no cast; a bf16 policy still gets float32 masters in MasterWeightAdamW
    train_config = TrainConfig(lr=1e-6, kl_coef=0.0, micro_batch_size=args.micro_batch_size,
                               logits_chunk_size=args.logits_chunk_size, micro_batch_tokens=args.micro_batch_tokens)
    trainer = Trainer(model, train_config, param_dtype=model.dtype)
    benchmark(args, trainer, model.device)


if __name__ == "__main__":
    main()
