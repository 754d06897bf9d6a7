"""``rlrepro diff --bisect``: find the first layer and op whose activations differ at the first divergent step.

Both runs' policies are restored from their newest common checkpoint before the divergent step (or from their
starting weights when the divergence is at step 1). If the weights already differ, the first differing tensor
is the answer. Otherwise the first divergent sample's tokens (from run A's rollout file) are replayed through
both policies, each in its own run's kernel mode and tensor-parallel reduction order (``trainer.backend=megatron``
runs replay with ``set_tensor_parallel_emulation(trainer.tensor_parallel)``, as their engines sampled; their
``checkpoint.format=dist`` checkpoints are read into full tensors), with a forward hook on every module; the first
module in execution order whose output differs is reported. Identical activations mean the forward pass is not the
cause (look at sampling or scheduling settings, which the config diff lists).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .records import CHECKPOINTS_DIR, ReproError, read_rollouts, step_dirname


@dataclass
class BisectResult:
    step: int
    replayed_from: str  # "checkpoint step N" or "starting weights"
    kind: str  # "weights" | "activation" | "none" | "inputs"
    where: str | None = None  # tensor or module name
    op: str | None = None  # module class (Linear, RMSNorm, Qwen3Attention, ...)
    max_abs_diff: float | None = None
    note: str | None = None

    def format(self) -> str:
        head = f"bisect at step {self.step} (replayed from {self.replayed_from}): "
        if self.kind == "weights":
            return head + f"weights already differ; first tensor {self.where} (max |diff| {self.max_abs_diff:.3e})"
        if self.kind == "activation":
            return head + (f"first differing activation: {self.where} ({self.op}), max |diff| "
                           f"{self.max_abs_diff:.3e}")
        if self.kind == "inputs":
            return head + f"the sample's inputs differ: {self.note}"
        return head + f"forward passes are identical; {self.note}"

    def to_dict(self) -> dict:
        return asdict(self)


def _policy_dir(run: Path, cfg: dict) -> Path:
    if (run / "base_model" / "config.json").is_file():
        return run / "base_model"
    path = (cfg or {}).get("model", {}).get("path")
    if not path:
        raise ReproError(f"{run}: cannot find the starting weights (no base_model/ and no model.path)")
    return Path(path)


def _load_policy(run: Path, cfg: dict, ckpt_step: int):
    import torch
    from safetensors.torch import load_file

    from rlrepro.model import load_pretrained

    model = load_pretrained(_policy_dir(run, cfg), device="cpu", dtype=torch.float32)
    if ckpt_step > 0:
        ckpt_dir = run / CHECKPOINTS_DIR / step_dirname(ckpt_step)
        if (ckpt_dir / "model.safetensors").is_file():
            state = load_file(str(ckpt_dir / "model.safetensors"))
        else:  # checkpoint.format=dist (megatron backend): every rank's shards, read into full tensors
            from rlrepro.trainer.megatron.dist_checkpoint import read_dist_model_state

            state = read_dist_model_state(ckpt_dir)
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    # a run whose trainer was tensor parallel sampled with the engine emulating its reduction order: replay it so
    return model.set_tensor_parallel_emulation(_tensor_parallel(cfg)).eval()


def _tensor_parallel(cfg: dict) -> int:
    # train.backend / train.tensor_parallel; runs from before the move have them under trainer.*
    for section in ("train", "trainer"):
        keys = (cfg or {}).get(section) or {}
        if isinstance(keys, dict) and keys.get("layout_invariant"):  # the engines emulated train.tp_partials pieces
            return int(keys.get("tp_partials") or 1)
        if isinstance(keys, dict) and "backend" in keys:
            return int(keys.get("tensor_parallel") or 1) if keys.get("backend") == "megatron" else 1
    return 1


def _kernel_mode(cfg: dict) -> str:
    return "deterministic" if (cfg.get("run") or {}).get("deterministic", True) else "fast"


def _ckpt_steps(run: Path) -> set[int]:
    root = run / CHECKPOINTS_DIR
    if not root.is_dir():
        return set()
    out = set()
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit() and (p / "manifest.json").is_file():
            out.add(int(p.name[5:]))
    return out


def _trace(model, tokens: list[int], mode: str) -> list[tuple[str, str, Any]]:
    import torch

    from rlrepro import kernels

    records: list[tuple[str, str, Any]] = []
    hooks = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod, args, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                records.append((name, type(mod).__name__, t.detach().clone()))
        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad(), kernels.mode(mode):
            logits = model(torch.tensor([tokens]))
        records.append(("logits", "lm_head", logits))
    finally:
        for h in hooks:
            h.remove()
    return records


def bisect_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, step: int, sample_index: int | None = None,
                config_a: dict | None = None, config_b: dict | None = None) -> BisectResult:
    """Replay the first divergent ``step`` of two runs (its first differing sample ``sample_index``, as
    ``diff_runs`` named them) and name the first differing tensor or op. ``config_a`` / ``config_b``: the runs'
    resolved configs (``diff.load_config``). The caller runs the diff: this module imports nothing of it, so
    ``diff`` -> ``bisect`` is one-way."""
    import torch

    a, b = Path(run_a), Path(run_b)
    cfg_a, cfg_b = config_a or {}, config_b or {}
    common = sorted(s for s in _ckpt_steps(a) & _ckpt_steps(b) if s < step)
    if common:
        start = common[-1]
    elif step == 1:
        start = 0
    else:
        raise ReproError(f"no checkpoint common to both runs before step {step}; rerun them with "
                         f"checkpoint.every=1 (or every that lands before the divergence) to bisect")
    origin = f"checkpoint step {start}" if start else "starting weights"
    model_a, model_b = _load_policy(a, cfg_a, start), _load_policy(b, cfg_b, start)
    state_b = dict(model_b.named_parameters())
    for name, p in sorted(model_a.named_parameters()):
        if not torch.equal(p, state_b[name]):
            return BisectResult(step, origin, "weights", name, "parameter",
                                float((p - state_b[name]).abs().max()))
    samples = read_rollouts(a, step)
    if not samples:
        raise ReproError(f"{a}: no rollouts for step {step}; bisect needs run.save_rollouts=true")
    samples_b = read_rollouts(b, step) or []
    i = sample_index or 0
    sample = samples[min(i, len(samples) - 1)]
    if samples_b and i < len(samples_b) and samples_b[i]["prompt_token_ids"] != sample["prompt_token_ids"]:
        return BisectResult(step, origin, "inputs", note=f"sample {i} has different prompts (data order or "
                            "templates differ: see the config diff)")
    tokens = list(sample["prompt_token_ids"]) + list(sample["token_ids"])
    trace_a, trace_b = _trace(model_a, tokens, _kernel_mode(cfg_a)), _trace(model_b, tokens, _kernel_mode(cfg_b))
    for (name, op, ta), (_, _, tb) in zip(trace_a, trace_b):
        if not torch.equal(ta, tb):
            return BisectResult(step, origin, "activation", name, op, float((ta.float() - tb.float()).abs().max()))
    return BisectResult(step, origin, "none", note="the divergence comes from sampling or scheduling; "
                        "compare the differing config keys")
