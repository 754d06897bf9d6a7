"""Cost of fingerprinting: weights_digest of a ~100M-parameter state dict, and fingerprint_step of a rollout batch.

    python benchmarks/bench_fingerprint.py                      # CPU, fp32
    python benchmarks/bench_fingerprint.py --device cuda --dtype bfloat16 --params 8e9 \
        --hidden 4096 --inter 12288 --vocab 151936                 # Qwen3-8B-shaped

Prints one JSON line per measurement (median of --reps runs after one warm-up). The baseline is hashlib.sha256
over the same bytes (CPU only: on a GPU it would need the whole state dict copied to the host).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch

from rlrepro.repro.fingerprint import fingerprint_step, tensor_digest, weights_digest


def make_state_dict(params: float, dtype: torch.dtype, device: str, hidden: int = 1024, vocab: int = 32000,
                    inter: int = 2816) -> dict[str, torch.Tensor]:
    """A Qwen-like layout: embedding, then layers of attention + MLP matrices and norms, until ~``params``."""
    g = torch.Generator(device=device).manual_seed(0)

    def mk(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=device).to(dtype)

    sd = {"model.embed_tokens.weight": mk(vocab, hidden)}
    total = vocab * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    i = 0
    while total + per_layer <= params:
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = mk(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = mk(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = mk(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = mk(hidden, inter)
        sd[p + "input_layernorm.weight"] = mk(hidden)
        sd[p + "post_attention_layernorm.weight"] = mk(hidden)
        total += per_layer
        i += 1
    rest = int(params) - total
    if rest > 0:
        sd["lm_head.weight"] = mk(max(1, rest // hidden), hidden)
    return sd


def timed(fn, reps: int, device: str) -> float:
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    fn()
    sync()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=512, help="rollout batch for the fingerprint_step measurement")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--cpu-group", type=int, default=None,
                    help="override blocks per pass on CPU (a tuning knob; the digest does not depend on it)")
    ap.add_argument("--skip-steps", action="store_true", help="skip the fingerprint_step measurement")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_group:
        from rlrepro.repro import fingerprint as F
        F._GROUP_CPU = args.cpu_group
    dtype = getattr(torch, args.dtype)
    sd = make_state_dict(args.params, dtype, args.device, hidden=args.hidden, vocab=args.vocab, inter=args.inter)
    n = sum(t.numel() for t in sd.values())
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    info = {"device": args.device, "dtype": args.dtype, "params": n, "bytes": nbytes, "tensors": len(sd),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.device == "cpu":
        from rlrepro.repro import fingerprint as F
        info["cpu_group"] = F._GROUP_CPU
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()

    t = timed(lambda: weights_digest(sd), args.reps, args.device)
    print(json.dumps({"what": "weights_digest", **info, "seconds": round(t, 4), "GB_per_s": round(nbytes / t / 1e9, 2)}))
    t = timed(lambda: [tensor_digest(v) for v in sd.values()], args.reps, args.device)
    print(json.dumps({"what": "tensor_digest loop", **info, "seconds": round(t, 4)}))
    if args.device == "cpu":
        def sha():
            h = hashlib.sha256()
            for v in sd.values():
                h.update(v.contiguous().view(torch.uint8).reshape(-1).numpy())
            return h.hexdigest()
        t = timed(sha, args.reps, args.device)
        print(json.dumps({"what": "hashlib.sha256 baseline", **info, "seconds": round(t, 4),
                          "GB_per_s": round(nbytes / t / 1e9, 2)}))

    if args.skip_steps:
        return
    g = torch.Generator().manual_seed(1)
    S, T = args.samples, args.tokens
    tok = torch.randint(0, 151936, (S, T), generator=g)
    lp = -torch.rand(S, T, generator=g)
    token_ids = [r.tolist() for r in tok]
    logprobs = [r.tolist() for r in lp]
    prompts = [list(range(200))] * S
    rewards = [float(i % 2) for i in range(S)]

    def fp():
        return fingerprint_step(0, prompt_ids=prompts, token_ids=token_ids, logprobs=logprobs, rewards=rewards,
                                advantages=rewards, loss=0.5, grad_norm=1.0, weights="0" * 64)
    t = timed(fp, args.reps, "cpu")
    print(json.dumps({"what": "fingerprint_step (rollout fields, python lists)", "samples": S, "tokens_per_sample": T,
                      "seconds": round(t, 4)}))


if __name__ == "__main__":
    main()
