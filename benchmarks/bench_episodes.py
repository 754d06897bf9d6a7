"""Multi-turn episodes against single-turn requests on one engine, in one run, as ratios (issue #24).

On one ``rlrepro.rollout.Engine`` and one model, each timed round runs the same E episodes' worth of generation
four ways, the prefix cache reset before each:

  * ``single``: ``engine.generate`` of E requests of T*G tokens each (the single-turn baseline);
  * ``single_episodes``: ``run_episodes`` with a one-turn scripted environment, T*G tokens (the runner's own cost);
  * ``multi``: ``run_episodes`` with a scripted environment of T turns of G tokens each, every observation exactly
    ``--obs-len`` tokens (fixed text, checked against the tokenizer at set-up);
  * ``python``: ``run_episodes`` with the real ``tool`` environment and the Python sandbox tool (``env.tools=
    [python]``, ``env.tool_format=qwen3``), the model's turns replaced by scripted tool calls on typical ReTool-style
    snippets (a random model cannot write calls), so each observation is the sandbox's real output.

plus ``prefill`` (the E prompts, one token each: the run's prefill rate, which prices the later turns' uncached
prompt tokens — observations, the previous turn's last token, the partial block — that single-turn requests do not
have; ``wall_over_single_beyond_prefill`` is a mode's wall time less that estimate, over single's).

Every turn generates exactly its ``max_tokens`` (``ignore_eos=True``, no stop tokens), so every mode generates the
same E*T*G tokens. Reported per mode (median over rounds): wall seconds, episodes/s, generated tokens/s, the share
of wall time spent in environment steps (thread-seconds of the episodes' environment steps, which run on
``--tool-threads`` threads beside decoding, over wall seconds) and the prefix-cache hit rate of turns >= 2, both as
cached / prompt tokens (what ``episode_metrics`` logs) and as cached / the tokens whose K/V the previous turn left
(its prompt + its generated tokens - 1: the last sampled token has no K/V yet); the new observation can never hit.
Ratios: multi / single generated tokens/s, per round and their median. Checks (exact equality): the multi-turn
results are the same in every round, and each episode's first turn equals the first G tokens (and logprob bits) of
the single-turn request with the same prompt and seed. Separately: the sandbox's cost on the same snippets
(``rlrepro.envs.run_python``: runs/s and instructions (steps)/s on one thread).

Issue goals reported against: multi-turn decode throughput within 10 % of single-turn at the same generated tokens;
a prefix-cache hit rate across turns >= 95 % of the transcript tokens (the reusable ones).

    python benchmarks/bench_episodes.py --tiny --device cpu            # seconds
    python benchmarks/bench_episodes.py --qwen3-8b-shape --device cuda  # H200: the 36-layer 8B shape, bf16
    python benchmarks/bench_episodes.py --qwen3-8b-shape --layers 4     # a quick look

Prints a table and one JSON line; writes the JSON to ``--json`` or, when ``$OUT`` is set, ``$OUT/bench_episodes.json``.
A benchmark reports, it asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rlrepro.data import PromptRecord, load_reward_fn  # noqa: E402
from rlrepro.envs import (BUILTIN_ENVS, EnvConfig, EnvReset, Environment, StepResult, episode_seed,  # noqa: E402
                          load_env, register_env, run_python)
from rlrepro.model import load_pretrained, load_tokenizer, write_tiny_checkpoint  # noqa: E402
from rlrepro.orchestration.episodes import EpisodeRequest, episode_metrics, run_episodes  # noqa: E402
from rlrepro.rollout import Engine, SamplingParams  # noqa: E402

# Typical tool-integrated-reasoning snippets (ReTool / SimpleTIR style: short programs that count, sum, sieve,
# use fractions or math), each printing a short result.
SNIPPETS = [
    "from math import comb\nprint(comb(30, 12) % 1000)",
    "s = 0\nfor n in range(1, 2001):\n    if n % 3 == 0 or n % 5 == 0:\n        s += n\nprint(s)",
    "from fractions import Fraction\nx = sum(Fraction(1, k * (k + 1)) for k in range(1, 100))\nprint(x)",
    "N = 3000\nsieve = [True] * (N + 1)\nsieve[0] = sieve[1] = False\nfor i in range(2, int(N ** 0.5) + 1):\n"
    "    if sieve[i]:\n        for j in range(i * i, N + 1, i):\n            sieve[j] = False\nprint(sum(sieve))",
    "count = 0\nfor a in range(1, 50):\n    for b in range(a, 50):\n        if (a * a + b * b) % 7 == 0:\n"
    "            count += 1\nprint(count)",
    "import math\nprint(round(math.sqrt(2) * math.pi, 10), math.gcd(462, 1071))",
]


# ------------------------------------------------------------------------------------------- environments
class FixedObsEnv(Environment):
    """``turns`` assistant turns; after each but the last, the observation ``obs`` (a fixed text); then done."""

    def __init__(self, record, seed, turns, obs):
        self.record, self.turns, self.obs, self.n = record, turns, obs, 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.n += 1
        if self.n >= self.turns:
            return StepResult(done=True, reward=0.0)
        return StepResult(messages=[{"role": "tool", "content": self.obs}])


class ScriptedPythonEnv(Environment):
    """The built-in ``tool`` environment (python sandbox, qwen3 calls) with the model's text replaced by a script:
    turns 1..T-1 call python on a snippet (chosen by seed and turn), turn T answers without a call."""

    def __init__(self, record, seed, inner, turns):
        self.inner, self.seed, self.turns, self.n = inner, seed, turns, 0

    def reset(self):
        return self.inner.reset()

    def step(self, text):
        self.n += 1
        if self.n >= self.turns:
            return self.inner.step("The answer is \\boxed{42}.")
        code = SNIPPETS[(self.seed + self.n) % len(SNIPPETS)]
        call = json.dumps({"name": "python", "arguments": {"code": code}})
        return self.inner.step(f"Let me compute it.\n<tool_call>\n{call}\n</tool_call>")


def _fixed(record, seed, *, config, reward_fn):
    return FixedObsEnv(record, seed, **config.kwargs)


def _python(record, seed, *, config, reward_fn):
    turns = config.kwargs["turns"]
    inner_cfg = dataclasses.replace(config, name="tool", kwargs={})
    return ScriptedPythonEnv(record, seed, BUILTIN_ENVS["tool"](record, seed, config=inner_cfg, reward_fn=reward_fn),
                             turns)


register_env("_bench_fixed_obs")(_fixed)
register_env("_bench_python_scripted")(_python)


# ------------------------------------------------------------------------------------------------ model
def build(args):
    """(model, tokenizer, vocab size for random prompts)."""
    device = torch.device(args.device)
    if args.tiny:
        d = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="bench_episodes_tiny_")), seed=args.seed,
                                  max_position_embeddings=4096)
        model = load_pretrained(d, device=device)
        tok = load_tokenizer(d)
        return model, tok, model.config.vocab_size
    from bench_engine import build_model  # the random Qwen3-8B-shaped model (seeded, bf16, on the device)

    ns = argparse.Namespace(model=None, tiny=False, layers=args.layers, dtype=args.dtype, device=args.device,
                            seed=args.seed)
    model = build_model(ns)
    d = Path(tempfile.mkdtemp(prefix="bench_episodes_shape_"))
    # the character tokenizer with every id of the 151,936-token vocabulary named (what the model samples decodes)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_qwen3_shape.py"), "--out", str(d), "--layers",
                    "1"], check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                       [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))))
    return model, load_tokenizer(d), model.config.vocab_size


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fixed_text(tok, n: int) -> str:
    """A text of exactly ``n`` tokens (the character tokenizer: one character a token)."""
    text = ("tool result " * (n // 12 + 1))[:n]
    got = len(tok.encode(text))
    if got != n:
        raise SystemExit(f"the observation text encodes to {got} tokens, not {n}: use a tokenizer with one token "
                         "per character (the tiny / make_qwen3_shape tokenizers)")
    return text


# --------------------------------------------------------------------------------------------- the modes
def make_requests(prompts, records, max_tokens):
    out = []
    for i, (ids, rec) in enumerate(zip(prompts, records)):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 + i, ignore_eos=True)
        out.append(EpisodeRequest((rec.uid, 0), rec, ids, params, episode_seed(0, 0, rec.uid, 0)))
    return out


def policy_tokens(result) -> int:
    return sum(len(t.token_ids) for t in result.turns if t.role == "policy")


def reusable_hits(results) -> tuple[int, int, int]:
    """(cached, prompt, reusable) tokens over the requests of turns >= 2: reusable = the previous request's prompt
    plus its generated tokens minus 1 (the K/V the engine held when the previous turn ended)."""
    cached = prompt = reusable = 0
    for r in results:
        tp, tc = r.metrics["turn_prompt_tokens"], r.metrics["turn_cached_tokens"]
        gens = [len(t.token_ids) for t in r.turns if t.role == "policy"]
        for k in range(1, len(tp)):
            cached += tc[k]
            prompt += tp[k]
            reusable += tp[k - 1] + gens[k - 1] - 1
    return cached, prompt, reusable


def timed(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def run_mode(name, engine, tok, args, prompts, records, specs, reward_fn):
    E, T, G = len(prompts), args.turns, args.gen_len
    device = engine.device
    engine.reset_prefix_cache()
    if name == "prefill":  # the prompts alone (one token each): the engine's prefill rate in this run
        params = [SamplingParams(temperature=1.0, max_tokens=1, seed=1000 + i, ignore_eos=True) for i in range(E)]
        outs, wall = timed(device, lambda: engine.generate(prompts, params))
        return dict(wall_s=wall, generated_tokens=len(outs), env_seconds=0.0,
                    prefill_tokens_per_s=sum(len(p) for p in prompts) / wall), outs
    if name == "single":
        params = [SamplingParams(temperature=1.0, max_tokens=T * G, seed=1000 + i, ignore_eos=True) for i in range(E)]
        outs, wall = timed(device, lambda: engine.generate(prompts, params))
        gen = sum(len(o.token_ids) for o in outs)
        return dict(wall_s=wall, generated_tokens=gen, env_seconds=0.0), outs
    spec = specs[name]
    per_turn = T * G if name == "single_episodes" else G
    reqs = make_requests(prompts, records, per_turn)
    results, wall = timed(device, lambda: run_episodes(engine, reqs, spec, tok, end_of_turn=None,
                                                        tool_threads=args.tool_threads))
    m = episode_metrics(results)
    cached, prompt, reusable = reusable_hits(results)
    obs = [len(t.token_ids) for r in results for t in r.turns if t.role == "tool"]
    stats = dict(wall_s=wall, generated_tokens=sum(policy_tokens(r) for r in results),
                 env_seconds=sum(r.metrics.get("tool_seconds", 0.0) for r in results),
                 turns_mean=m["episodes/turns_mean"],
                 obs_tokens_mean=statistics.fmean(obs) if obs else 0.0,
                 prefix_hit_rate_later_turns=m["perf/prefix_hit_rate_later_turns"],
                 prefix_hit_rate_of_reusable=cached / reusable if reusable else 0.0,
                 later_turn_prompt_tokens=prompt, later_turn_cached_tokens=cached, later_turn_reusable_tokens=reusable)
    return stats, results


def sandbox_costs(repeats: int) -> dict:
    rows = []
    for code in SNIPPETS:
        res = run_python(code)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_python(code)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append(dict(code=code.splitlines()[0][:40], steps=res.steps, ok=res.error is None,
                         output=res.observation()[:40], seconds=med, steps_per_s=res.steps / med))
    total_s = sum(r["seconds"] for r in rows)
    return dict(snippets=rows, runs_per_s=len(rows) / total_s,
                steps_per_s=sum(r["steps"] for r in rows) / total_s, repeats=repeats)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--tiny", action="store_true", help="the tiny random test model (CPU smoke test)")
    what.add_argument("--qwen3-8b-shape", action="store_true", help="random bf16 Qwen3-8B-shaped model (default)")
    ap.add_argument("--layers", type=int, default=None, help="8B shape: this many layers (default 36)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--fast", action="store_true", help="the engine's fast mode (stock kernels)")
    ap.add_argument("--episodes", type=int, default=None, help="episodes (= single-turn requests); 64 / tiny 4")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--gen-len", type=int, default=None, help="generated tokens a turn; 128 / tiny 8")
    ap.add_argument("--obs-len", type=int, default=None, help="observation tokens; 32 / tiny 8")
    ap.add_argument("--prompt-len", type=int, default=None, help="initial prompt tokens; 256 / tiny 16")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds after one warm-up round; 2 / tiny 1")
    ap.add_argument("--tool-threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=None, help="KV block size; 16 / tiny 4")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-python", action="store_true", help="skip the python-tool mode")
    ap.add_argument("--sandbox-repeats", type=int, default=None, help="timed runs a snippet; 20 / tiny 3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (--device cpu: default 1)")
    ap.add_argument("--json", help="write the results here (default: $OUT/bench_episodes.json when OUT is set)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    E = args.episodes or (4 if tiny else 64)
    args.gen_len = args.gen_len or (8 if tiny else 128)
    args.rounds = args.rounds or (1 if tiny else 2)
    args.block_size = args.block_size or (4 if tiny else 16)
    args.obs_len = args.obs_len or (8 if tiny else 32)
    P = args.prompt_len or (16 if tiny else 256)
    T, G = args.turns, args.gen_len
    repeats = args.sandbox_repeats or (3 if tiny else 20)

    if args.threads or torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads or 1)  # several threads on a shared machine: much slower, noisier
    t0 = time.perf_counter()
    model, tok, vocab = build(args)
    print(f"# model ready in {time.perf_counter() - t0:.0f} s: {model.config.num_hidden_layers} layers, hidden "
          f"{model.config.hidden_size}, {model.dtype}, {model.device}", flush=True)
    obs = fixed_text(tok, args.obs_len)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(P)] for _ in range(E)]
    records = [PromptRecord(uid=f"bench:{i:05d}", answer="42", prompt="solve it") for i in range(E)]
    reward_fn = load_reward_fn("exact_match")
    specs = {
        "single_episodes": load_env(EnvConfig(name="_bench_fixed_obs", max_turns=1,
                                              kwargs={"turns": 1, "obs": obs}), reward_fn),
        "multi": load_env(EnvConfig(name="_bench_fixed_obs", max_turns=T, kwargs={"turns": T, "obs": obs}), reward_fn),
        "python": load_env(EnvConfig(name="_bench_python_scripted", max_turns=T, tools=["python"],
                                     tool_format="qwen3", kwargs={"turns": T}), reward_fn),
    }
    modes = ["single", "single_episodes", "multi"] + ([] if args.no_python else ["python"])
    timed_modes = ["prefill"] + modes
    max_len = P + T * G + (T - 1) * max(args.obs_len, 512) + 16
    bs = args.block_size
    engine = Engine(model, device=str(model.device), deterministic=not args.fast, max_num_seqs=E,
                    max_num_batched_tokens=args.max_num_batched_tokens, block_size=bs,
                    num_kv_blocks=2 * E * math.ceil(max_len / bs) + E, max_model_len=max_len)

    per_round: list[dict] = []
    outputs: dict = {}
    identical = True
    for rnd in range(args.rounds + 1):  # round 0: warm-up (compilation, CUDA graphs), not reported
        order = timed_modes if rnd % 2 == 0 else list(reversed(timed_modes))
        stats = {}
        for name in order:
            s, out = run_mode(name, engine, tok, args, prompts, records, specs, reward_fn)
            stats[name] = s
            if name in ("multi", "python"):
                if name in outputs:
                    identical = identical and outputs[name] == out  # EpisodeResult.__eq__: all but metrics
                else:
                    outputs[name] = out
            if name == "single" and "single" not in outputs:
                outputs["single"] = out
        if rnd > 0:
            per_round.append(stats)
        print(f"# round {rnd}{' (warm-up)' if rnd == 0 else ''}: " + ", ".join(
            f"{n} {stats[n]['wall_s']:.2f} s" for n in modes), flush=True)

    # exact equality: an episode's first turn is the single-turn request's first G tokens (same prompt and seed)
    first_turn_equal = True
    by_uid = {rec.uid: i for i, rec in enumerate(records)}  # results come in key order, outputs in request order
    for res in outputs["multi"]:
        single = outputs["single"][by_uid[res.key[0]]]
        pol = res.turns[0].token_ids
        n = len(pol)
        lp = res.rollout_logprobs[:n]
        first_turn_equal = first_turn_equal and list(single.token_ids[:n]) == list(pol) and \
            struct.pack(f"<{n}f", *single.logprobs[:n]) == struct.pack(f"<{n}f", *lp)

    want = E * T * G
    summary = {}
    for name in modes:
        rows = [r[name] for r in per_round]
        wall = statistics.median(r["wall_s"] for r in rows)
        s = dict(rows[-1])
        s.update(wall_s=wall, wall_s_rounds=[r["wall_s"] for r in rows], episodes_per_s=E / wall,
                 generated_tokens_per_s=rows[-1]["generated_tokens"] / wall,
                 env_share_of_wall=statistics.median(r["env_seconds"] / r["wall_s"] for r in rows))
        summary[name] = s
    # the later turns' uncached prompt tokens (observations, the previous turn's last token, the partial block)
    # are prefill work single-turn requests do not have: at this run's prefill rate, the wall time they explain
    prefill_rate = statistics.median(r["prefill"]["prefill_tokens_per_s"] for r in per_round)
    for name in ("multi", "python"):
        if name in summary:
            s = summary[name]
            extra = s["later_turn_prompt_tokens"] - s["later_turn_cached_tokens"]
            s["later_turn_uncached_tokens"] = extra
            s["uncached_prefill_s_estimate"] = extra / prefill_rate
            s["wall_over_single_beyond_prefill"] = (s["wall_s"] - extra / prefill_rate) / summary["single"]["wall_s"]
    def ratio(a, b):
        return [r[a]["generated_tokens"] / r[a]["wall_s"] / (r[b]["generated_tokens"] / r[b]["wall_s"])
                for r in per_round]
    ratios = {"multi_over_single": ratio("multi", "single"),
              "single_episodes_over_single": ratio("single_episodes", "single"),
              "multi_over_single_episodes": ratio("multi", "single_episodes")}
    if "python" in modes:
        ratios["python_over_single"] = ratio("python", "single")
    ratio_median = {k: statistics.median(v) for k, v in ratios.items()}
    sandbox = sandbox_costs(repeats)
    cfg = model.config
    result = dict(
        bench="episodes", date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
        device=torch.cuda.get_device_name(0) if model.device.type == "cuda" else "cpu",
        model=dict(tiny=tiny, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                   dtype=str(model.dtype)),
        mode="fast" if args.fast else "deterministic",
        setup=dict(episodes=E, turns=T, gen_len=G, obs_len=args.obs_len, prompt_len=P, block_size=bs,
                   tool_threads=args.tool_threads, rounds=args.rounds, generated_tokens_each_mode=want),
        prefill_tokens_per_s=prefill_rate, modes=summary, ratios=ratios, ratio_median=ratio_median, sandbox=sandbox,
        checks=dict(every_mode_generated_all=all(summary[n]["generated_tokens"] == want for n in modes),
                    multi_and_python_results_identical_across_rounds=identical,
                    first_turn_equals_single_turn_prefix=first_turn_equal),
        goals=dict(multi_decode_within_10pct=ratio_median["multi_over_single"] >= 0.9,
                   prefix_hit_of_reusable_ge_95pct=summary["multi"]["prefix_hit_rate_of_reusable"] >= 0.95),
    )
    print(f"\n# {E} episodes x {T} turns x {G} tokens, {args.obs_len}-token observations, {P}-token prompts; "
          f"{result['device']}, {result['mode']}, {cfg.num_hidden_layers} layers; median of {args.rounds} rounds")
    print("| mode | wall s | episodes/s | gen tok/s | / single | env share | hit later turns | hit of reusable |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = summary["single"]["generated_tokens_per_s"]
    for name in modes:
        s = summary[name]
        hit = (f"{s['prefix_hit_rate_later_turns']:.1%} | {s['prefix_hit_rate_of_reusable']:.1%}"
               if "prefix_hit_rate_later_turns" in s and T > 1 and name != "single_episodes" else "- | -")
        print(f"| {name} | {s['wall_s']:.3f} | {s['episodes_per_s']:.2f} | {s['generated_tokens_per_s']:,.0f} | "
              f"{s['generated_tokens_per_s'] / base:.3f} | {s['env_share_of_wall']:.2%} | {hit} |")
    for name in ("multi", "python"):
        if name in summary:
            s = summary[name]
            print(f"# {name}: {s['later_turn_uncached_tokens']:,} uncached prompt tokens in turns >= 2 = "
                  f"{s['uncached_prefill_s_estimate']:.3f} s at this run's prefill rate ({prefill_rate:,.0f} tok/s); "
                  f"wall without them / single: {s['wall_over_single_beyond_prefill']:.3f}")
    print(f"# multi/single per round: {', '.join(f'{x:.3f}' for x in ratios['multi_over_single'])}; "
          f"sandbox: {sandbox['runs_per_s']:.1f} runs/s, {sandbox['steps_per_s']:,.0f} steps/s; checks: "
          f"{result['checks']}; goals: {result['goals']}")
    line = json.dumps(result)
    print(line)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_episodes.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(line + "\n")


if __name__ == "__main__":
    main()
