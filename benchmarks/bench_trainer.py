"""One GRPO train step of ``rlrepro.trainer.Trainer``: time, tokens/s, model TFLOP/s, MFU, phase split, profile.

Set up as the trainer actor sets itself up (``rlrepro.orchestration.workers.TrainerWorker``): ``enable_determinism()``
before the first CUDA op, the policy in the compute dtype (bf16 on CUDA, so the optimizer keeps float32 master
weights, Adam state and grads), ``train_step`` under ``kernels.mode(--mode)``, no reference model (kl_coef 0).

The batch is synthetic: N samples of P random prompt and O random completion tokens (fixed seed), rollout logprobs
all -1.0 (so ``train/rollout_logprob_abs_diff`` is large; the step's work does not depend on it), advantages from a
seeded normal. Model FLOPs are ``workers.train_flops`` (what ``perf/train_flops`` reports: forward+backward = 3
forwards, lm_head counted at completion tokens only; the on-policy check reuses the loss pass's forward) and MFU is FLOPs / (seconds * the bf16 peak of
``workers.PEAK_BF16_FLOPS`` for this GPU). Tokens/s counts prompt + completion tokens of all samples.

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
~18 bytes per parameter, ~150 GB); use ``--layers``.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlrepro.trainer.train as train_mod  # noqa: E402
from rlrepro import kernels  # noqa: E402
from rlrepro.orchestration.workers import PEAK_BF16_FLOPS, train_flops  # noqa: E402
from rlrepro.trainer import TrainConfig, Trainer, enable_determinism  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import DTYPES, build_model, sync  # noqa: E402  (the same model builder and weights)

def synthetic_samples(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)],
             "completion_token_ids": [rng.randrange(vocab) for _ in range(completion_len)],
             "rollout_logprobs": [-1.0] * completion_len,
             "advantage": rng.gauss(0.0, 1.0)} for _ in range(n)]


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
          "grad accumulate (fp32 masters)", "grad norm + clip", "optimizer step")


@contextmanager
def phase_wrappers(trainer: Trainer, timer: PhaseTimer):
    """Monkeypatch the train step's callees with ``timer``'s wrappers; everything is put back on exit."""
    fwd_nograd, fwd, loss, bwd, acc, clip, opt = PHASES
    optimizer = trainer.optimizer
    module_patches = [(train_mod, "token_logprobs", fwd_nograd), (train_mod, "logprobs_and_entropy", fwd),
                      (train_mod, "policy_loss", loss), (train_mod, "clip_grad_norm_", clip),
                      (torch.Tensor, "backward", bwd)]
    # instance attributes shadow the class's methods; deleting them afterwards brings the methods back
    instance_patches = [(optimizer, "accumulate_grads", acc), (optimizer, "grads", acc), (optimizer, "step", opt),
                        (trainer, "_grad_norm", clip)]
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the tiny test model (CPU smoke test)")
    which.add_argument("--qwen3-8b-shape", action="store_true", help="random weights of Qwen3-8B's shape (default)")
    which.add_argument("--model", help="a checkpoint directory to load instead of random weights")
    ap.add_argument("--layers", type=int, default=None, help="layers of the model (8B shape: default 2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="compute dtype of the policy (default: bfloat16 for the 8B shape, float32 for --tiny)")
    ap.add_argument("--mode", choices=kernels.MODES, default="deterministic", help="rlrepro.kernels mode")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads (the trainer actor uses 1; default: leave torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-phases", action="store_true", help="skip the phase-split step")
    ap.add_argument("--profile", action="store_true", help="profile one more step with torch.profiler")
    ap.add_argument("--profile-rows", type=int, default=30)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if not args.tiny and not args.model:
        args.qwen3_8b_shape = True

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    enable_determinism()  # before the first CUDA op, as TrainerWorker does
    model = build_model(args)
    device = model.device
    cfg = model.config
    # param_dtype = the model's dtype: no cast; a bf16 policy still gets float32 masters in MasterWeightAdamW
    train_config = TrainConfig(lr=1e-6, kl_coef=0.0, micro_batch_size=args.micro_batch_size)
    trainer = Trainer(model, train_config, param_dtype=model.dtype)
    samples = synthetic_samples(args.num_samples, args.prompt_len, args.completion_len, cfg.vocab_size, args.seed)
    tokens = sum(len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) for s in samples)
    flops = train_flops(cfg, samples, train_config)
    passes = 3 * train_config.ppo_epochs
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size * sum(len(s["completion_token_ids"]) for s in samples) * passes
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None) if device.type == "cuda" else None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"# {name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {cfg.num_hidden_layers} "
          f"layers, {n_params:,} params, {model.dtype} (fp32 masters: "
          f"{trainer.optimizer.has_master_copies}), kernels {args.mode}", flush=True)
    print(f"# N={args.num_samples} P={args.prompt_len} O={args.completion_len} micro-batch {args.micro_batch_size} "
          f"({-(-args.num_samples // args.micro_batch_size)} micro-batches), {tokens:,} tokens/step, "
          f"model FLOPs/step {flops / 1e12:.4g} T (of which lm_head: {lm_head / flops:.1%})", flush=True)

    def step() -> dict:
        with kernels.mode(args.mode):
            return trainer.train_step(samples)

    for i in range(args.warmup):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        print(f"# warm-up step {i + 1}: {time.perf_counter() - t0:.3f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    metrics: dict = {}
    for i in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        metrics = step()
        sync(device)
        times.append(time.perf_counter() - t0)
        t = times[-1]
        mfu = f", MFU {flops / t / peak:.1%}" if peak else ""
        print(f"step {i + 1}: {t:.3f} s, {tokens / t:,.0f} tokens/s, {flops / t / 1e12:.4g} model TFLOP/s{mfu}, "
              f"loss {metrics['loss']:.6g}, grad_norm {metrics['grad_norm']:.6g}", flush=True)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    result: dict = dict(device=name, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                        layers=cfg.num_hidden_layers, params=n_params, dtype=str(model.dtype),
                        fp32_masters=trainer.optimizer.has_master_copies, kernel_mode=args.mode,
                        num_samples=args.num_samples, prompt_len=args.prompt_len, completion_len=args.completion_len,
                        micro_batch_size=args.micro_batch_size, tokens_per_step=tokens, model_flops_per_step=flops,
                        lm_head_flops_share=lm_head / flops, peak_bf16_flops=peak,
                        step_seconds=times, peak_allocated_gib=peak_mem,
                        last_metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    if times:
        mean = sum(times) / len(times)
        result.update(mean_step_s=mean, min_step_s=min(times), tokens_per_s=tokens / mean,
                      model_tflops_per_s=flops / mean / 1e12, mfu=flops / mean / peak if peak else None)
        mfu = f", MFU {result['mfu']:.1%}" if peak else (", MFU n/a (no bf16 peak for this device)"
                                                         if device.type == "cuda" else "")
        mem = f", peak allocated {peak_mem:.1f} GiB" if peak_mem is not None else ""
        print(f"# mean of {len(times)}: {mean:.3f} s/step (min {min(times):.3f}), {tokens / mean:,.0f} tokens/s, "
              f"{flops / mean / 1e12:.4g} model TFLOP/s{mfu}{mem}", flush=True)

    if not args.no_phases:
        timer = PhaseTimer(device, timed=True)
        with phase_wrappers(trainer, timer):
            timer.start()
            t0 = time.perf_counter()
            step()
            timer.stop()
            total = time.perf_counter() - t0
        rest = total - sum(timer.seconds.values())
        print(f"\n# phase split of one step (synchronised wrappers): {total:.3f} s")
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
        result["phases"] = dict(total_s=total, rest_s=rest, seconds=dict(timer.seconds), calls=dict(timer.calls),
                                rest_after=dict(timer.gaps))

    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        timer = PhaseTimer(device, timed=False)  # bench.* ranges only, no extra syncs
        with phase_wrappers(trainer, timer), torch.profiler.profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            total = time.perf_counter() - t0
        print(f"\n# profiled step: {total:.3f} s (profiler overhead included)")
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=60))
        result["profiled_step_s"] = total

    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
