"""``rlrepro generate``: a generation smoke run of a model, a run or a checkpoint (a tiny random Qwen3 by default).

Every option is checked before any model work (a bad value names the option as typed, exit 2), and so is the
length of each request against the model's context (``max_position_embeddings`` in its config.json), which this
command cannot stretch: the message names the ``--max-tokens`` that fits. The KV cache is sized to the requests.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["main_generate"]


def _device_problem(device: str) -> str | None:
    """Why ``--device`` cannot be used here (an unknown name, CUDA on a machine without it), or None."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device; use cpu, cuda or cuda:N"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device!r} but this machine has no visible CUDA device; use --device cpu"
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
    if dev.type not in ("cpu", "cuda"):
        return f"--device {device!r}: rlrepro runs on cpu or cuda"
    return None


def _generate_args_problem(ns) -> str | None:
    """Why ``rlrepro generate``'s options cannot be used (named as typed), checked before any model work."""
    import math

    if ns.max_tokens < 1:
        return f"--max-tokens must be an integer >= 1, got {ns.max_tokens}"
    if not (math.isfinite(ns.temperature) and ns.temperature >= 0):
        return f"--temperature must be a finite number >= 0, got {ns.temperature}; use 0 for greedy decoding"
    if not 0 <= ns.seed < 2 ** 63:
        return f"--seed must be an integer in [0, 2**63), got {ns.seed}"
    if ns.base is not None and ns.model is None:
        return (f"--base {ns.base} applies only with --model naming a run or a checkpoint (it gives the checkpoint's "
                "config.json and tokenizer); without --model the tiny random model runs. Drop --base, or add --model")
    return None


_BLOCK = 16  # the engine's default KV block size


def _context_length(config_dir) -> int | None:
    """``max_position_embeddings`` of ``config_dir/config.json`` (the engine's context), None when unreadable (the
    model load then says why)."""
    try:
        value = json.loads((Path(config_dir) / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _length_problem(prompts: list[str], ids: list[list[int]], max_tokens: int, context: int | None) -> str | None:
    """Why a prompt plus ``--max-tokens`` does not fit the model's context (which ``rlrepro generate`` cannot
    raise: it is the model's ``max_position_embeddings``), naming the ``--max-tokens`` that fits; or None."""
    for text, p_ids in zip(prompts, ids):
        if not p_ids:  # the engine would ask for a BOS token id, which this command cannot take
            return f"--prompt {text!r} is empty to the tokenizer (0 tokens); give some text"
    if context is None or not ids:
        return None
    where = f"the model's context is {context} tokens (max_position_embeddings in its config.json)"
    for text, p_ids in zip(prompts, ids):
        if len(p_ids) >= context:
            return (f"prompt {text[:40]!r}{'...' * (len(text) > 40)} has {len(p_ids)} tokens and {where}, "
                    "which must hold the prompt plus at least one new token; give a shorter --prompt")
    longest = max(len(i) for i in ids)
    if longest + max_tokens > context:
        return (f"--max-tokens {max_tokens} does not fit: the longest prompt has {longest} tokens and {where}; "
                f"use --max-tokens {context - longest} or less")
    return None


def main_generate(args: list[str]) -> int:
    """Sample completions from a model: an HF directory, a run directory (its newest checkpoint) or a checkpoint
    (``rlrepro.model.resolve_model_dir``), or by default a tiny random Qwen3. Completions go to stdout, one line a
    prompt; what was loaded goes to stderr. Exit 2 on a bad model path or argument."""
    import argparse
    import tempfile

    from rlrepro.model import load_tokenizer, resolve_model_dir, write_tiny_checkpoint
    from rlrepro.rollout import Engine, SamplingParams

    ap = argparse.ArgumentParser(prog="rlrepro generate", description="generation smoke run (tiny model by default)")
    ap.add_argument("--model", help="an HF model dir, a run dir (its newest checkpoint) or a checkpoint dir "
                                    "(RUN/checkpoints/step_NNNNNN); default: a tiny random Qwen3 in a temp dir")
    ap.add_argument("--base", help="HF dir whose config.json and tokenizer a checkpoint uses (default: the run's)")
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable); default: the tiny tasks' formats")
    ap.add_argument("--temperature", type=float, default=1.0, help="a finite number >= 0 (default 1.0); 0 = greedy")
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="new tokens per prompt, >= 1 (default 16); a prompt plus these must fit the model's context "
                         "(max_position_embeddings in its config.json)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**63) (default 0)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ns = ap.parse_args(args)
    problem = _generate_args_problem(ns) or _device_problem(ns.device)
    if problem:
        print(f"rlrepro generate: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rlrepro-tiny-") as tmp:
        try:
            if ns.model is None:
                resolved = resolve_model_dir(write_tiny_checkpoint(Path(tmp), seed=0))
                about = "a tiny Qwen3 with random, untrained weights (seed 0): its completions are noise"
            else:
                resolved = resolve_model_dir(ns.model, base=ns.base)
                about = resolved.describe()
                if ns.base is not None and resolved.kind == "hf":  # it has its own config.json and tokenizer
                    raise ValueError(f"--base {ns.base} applies to a checkpoint, but --model {ns.model} is an HF "
                                     "model directory with its own config.json and tokenizer; drop --base")
            tok = load_tokenizer(resolved.tokenizer_dir)
            # The synthetic tasks the tiny recipes train on (grpo_tiny: first_letter, "first: cabd=" -> "c").
            prompts = ns.prompt or ["first: cabd=", "copy: abc=", "12+7="]
            ids = [tok.encode(p) for p in prompts]
            problem = _length_problem(prompts, ids, ns.max_tokens, _context_length(resolved.config_dir))
            if problem:  # before the weights load: the message names what this command can change
                raise ValueError(problem)
            model = resolved.load(device=ns.device)
            # a KV cache of what these requests need (the engine's default on CPU is up to 512 MiB, and for a large
            # model less than a long --max-tokens needs): the same tokens whatever its size
            blocks = sum(-(-(len(i) + ns.max_tokens - 1) // _BLOCK) for i in ids)
            engine = Engine(model, device=ns.device, seed=ns.seed, block_size=_BLOCK, num_kv_blocks=max(blocks, 1))
            outs = engine.generate(ids, SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens,
                                                       seed=ns.seed))
        except (ValueError, FileNotFoundError) as e:
            if os.environ.get("RLREPRO_DEBUG"):
                raise
            print(f"rlrepro generate: {e}", file=sys.stderr)
            return 2
    print(f"rlrepro generate: {about}; temperature {ns.temperature}, seed {ns.seed}", file=sys.stderr)
    unk = tok.token_to_id(tok.config.get("unk_token") or "<unk>")
    eos_ids = set(engine.eos_token_ids)
    for p, p_ids, o in zip(prompts, ids, outs):
        if unk is not None and unk in p_ids:
            print(f"rlrepro generate: note: prompt {p!r} has characters the tokenizer does not know "
                  f"(each became {tok.decode([unk], skip_special_tokens=False)!r})", file=sys.stderr)
        n = len(o.token_ids)
        if o.finish_reason == "stop" and o.token_ids and o.token_ids[-1] in eos_ids:
            end = f"stopped at {tok.decode(o.token_ids[-1:], skip_special_tokens=False)!r}"
        elif o.finish_reason == "length":
            end = f"cut at --max-tokens {ns.max_tokens}"
        else:
            end = o.finish_reason
        print(f"{p!r} -> {tok.decode(o.token_ids)!r} ({n} token{'s' * (n != 1)}, {end}, "
              f"sum logprob {sum(o.logprobs):.4f})")
    return 0


