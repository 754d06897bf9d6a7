"""``rlrepro diff --bisect``: find the first layer and op whose activations differ at the first divergent step.

First what the records already say: when the runs' ``inputs.json`` differ in something that can change bits
(the same comparison ``rlrepro diff`` prints), that is the answer and nothing is replayed; rlrepro's own source (the
code digest, ``rlrepro_code``) stops it too, unless ``allow_code_change`` (``rlrepro diff --bisect
--allow-code-change``) sets it aside: then the replay runs and its result carries the difference as a warning
(``code_change``): the replay uses this machine's rlrepro, which need not be either run's. A run that ran where
bisect cannot replay it (``run.device`` other than the CPU: bisect replays on this machine's CPU, whose kernels give
other bits than a GPU's) is refused, with no conclusion drawn. Then both runs' policies are restored from their
newest common checkpoint before the divergent step (or from their starting weights when the divergence is at step
1), each in its run's dtype (``model.dtype``). Models whose parameter names, shapes or dtypes differ are reported
as such. If the weights already differ, the first differing tensor is the answer. Otherwise the first divergent
sample's tokens (from run A's rollout file) are replayed through both policies, each in its own run's kernel mode
and tensor-parallel reduction order (``trainer.backend=megatron`` runs replay with
``set_tensor_parallel_emulation(trainer.tensor_parallel)``, as their engines sampled; their ``checkpoint.format=dist``
checkpoints are read into full tensors), with a forward hook on every module; the first module in execution order
whose output differs (bit for bit) is reported, outputs paired by module name (a module that ran in one run only
is named as such, never compared with another module's output). Identical activations mean the forward pass is not
the cause; the diverging field says where to look: sampling or scheduling for the rollout's tokens and logprobs,
the reward or advantage computation for those, the environment for loss masks and turns, and the trainer side
(backward/optimizer) for the loss, gradient norm, weights and the train step's metrics.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from .inputs import CODE_KEY
from .records import CHECKPOINTS_DIR, ReproError, read_rollouts, step_dirname

#: fingerprint fields the trainer produces after the rollout (a metric key ``train/*`` counts too)
TRAINER_FIELDS = ("loss", "grad_norm", "weights", "optimizer_state")
_CONCLUSIONS = {
    None: "the divergence comes from sampling or scheduling; compare the differing config keys",
    "rollout_token_ids": "the divergence comes from sampling or scheduling; compare the differing config keys",
    "rollout_logprobs": "the divergence comes from sampling or scheduling; compare the differing config keys",
    "prompt_ids": "the prompts differ: data order, templates or the data set (see the config diff)",
    "loss_masks": "the episodes' structure differs: the environment (env.*) or its tools, not the forward pass",
    "turns": "the episodes' structure differs: the environment (env.*) or its tools, not the forward pass",
    "rewards": "the rewards differ: the reward function (reward.*) or the answers it checks, not the forward pass",
    "advantages": "the advantages differ: their computation from the rewards (train.advantage*), not the forward "
                  "pass",
}
_TRAINER = ("trainer side: the policy is identical and its forward pass agrees on the replayed sample, so the "
            "loss, the backward or the optimizer differ, or the forward on another sample or micro-batch layout (see "
            "the train.* keys in the config diff)")


def conclusion(field: str | None) -> str:
    """What identical weights and activations leave as the cause of a divergence in ``field`` (a fingerprint
    field, or a metrics.jsonl key where the metrics diverge first)."""
    if field in TRAINER_FIELDS or (field or "").startswith("train/"):
        return _TRAINER
    if field in _CONCLUSIONS:
        return _CONCLUSIONS[field]
    return (f"metric {field} differs while the step's fingerprinted records agree: how it is computed from them, or "
            "an input that is not fingerprinted (see the config diff)")


@dataclass
class BisectResult:
    step: int
    replayed_from: str  # "checkpoint step N", "starting weights" or "not replayed"
    kind: str  # "weights" | "activation" | "none" | "inputs" | "recorded_inputs" | "model"
    where: str | None = None  # tensor or module name
    op: str | None = None  # module class (Linear, RMSNorm, Qwen3Attention, ...)
    max_abs_diff: float | None = None
    note: str | None = None
    field: str | None = None  # the diverging field (fingerprint field or metric key) bisect was given
    # rlrepro's code differs between the runs (inputs.json rlrepro_code; the sentences): it stopped the bisect
    # ("recorded_inputs"), or the replay ran anyway (allow_code_change) and this is its warning
    code_change: str | None = None

    def format(self) -> str:
        if self.kind == "recorded_inputs":
            out = (f"bisect at step {self.step}: not replayed: inputs that can change bits differ ({self.note}); "
                   "they explain a divergence before any replay could")
            if self.code_change is not None and self.note == self.code_change:
                out += f"; to replay anyway, rerun with --allow-code-change ({_CODE_CAVEAT})"
            elif self.code_change is not None:
                out += ("; --allow-code-change would set aside rlrepro's code only: the other inputs still explain "
                        "the divergence")
            return out
        text = self._format_replayed()
        if self.code_change is not None:
            text = code_change_warning(self.code_change) + "\n" + text
        return text

    def _format_replayed(self) -> str:
        head = f"bisect at step {self.step} (replayed from {self.replayed_from}): "
        if self.kind == "model":
            return head + f"the two models differ in structure: {self.note} (see the model.* keys in the config diff)"
        if self.kind == "weights":
            return head + f"weights already differ; first tensor {self.where} (max |diff| {self.max_abs_diff:.3e})"
        if self.kind == "activation":
            return head + (f"first differing activation: {self.where} ({self.op}), max |diff| "
                           f"{self.max_abs_diff:.3e}" + (f"; {self.note}" if self.note else ""))
        if self.kind == "inputs":
            return head + f"the sample's inputs differ: {self.note}"
        return head + f"forward passes are identical; {self.note}"

    def to_dict(self) -> dict:
        return asdict(self)


_CODE_CAVEAT = ("the replay runs this machine's rlrepro code, which need not be either run's, so a divergence the "
                "code change caused may not show in it")


def code_change_warning(code_change: str) -> str:
    """The line said whenever a bisect replays runs whose rlrepro code differs (``allow_code_change``)."""
    return (f"WARNING: bisect: rlrepro's code differs between the runs ({code_change}); replayed anyway "
            f"(--allow-code-change): {_CODE_CAVEAT}")


def _policy_dir(run: Path, cfg: dict) -> Path:
    if (run / "base_model" / "config.json").is_file():
        return run / "base_model"
    path = (cfg or {}).get("model", {}).get("path")
    if not path:
        raise ReproError(f"{run}: cannot find the starting weights (no base_model/ and no model.path)")
    return Path(path)


_DTYPES = {None: None, "float32": "float32", "bfloat16": "bfloat16"}


def _replay_setting(label: str, run: Path, cfg: dict) -> str | None:
    """The dtype name the run computed in (None: its checkpoint's own); ReproError when bisect cannot replay the run
    here (another device, an unknown dtype): a CPU replay of a GPU run would compare other bits than the run's."""
    device = str(((cfg or {}).get("run") or {}).get("device") or "cpu")
    if device != "cpu":
        raise ReproError(f"run {label} ({run}) ran on {device}; bisect replays on this machine's CPU, whose kernels "
                         "give other bits than the run's device, so it cannot name the op that diverged (no "
                         "conclusion drawn)")
    dtype = ((cfg or {}).get("model") or {}).get("dtype")
    if dtype not in _DTYPES:
        raise ReproError(f"run {label} ({run}) computed in model.dtype={dtype!r}, which bisect cannot replay "
                         f"(it replays {', '.join(str(d) for d in _DTYPES if d)} or the checkpoint's own dtype)")
    return dtype


def _load_policy(run: Path, cfg: dict, ckpt_step: int, dtype: str | None = "float32"):
    import torch
    from safetensors.torch import load_file

    from rlrepro.model import load_pretrained

    model = load_pretrained(_policy_dir(run, cfg), device="cpu", dtype=None if dtype is None else getattr(torch, dtype))
    if ckpt_step > 0:
        ckpt_dir = run / CHECKPOINTS_DIR / step_dirname(ckpt_step)
        if (ckpt_dir / "model.safetensors").is_file():
            state = load_file(str(ckpt_dir / "model.safetensors"))
        else:  # checkpoint.format=dist (megatron backend): every rank's shards, read into full tensors
            from rlrepro.trainer.megatron.dist_checkpoint import read_dist_model_state

            state = read_dist_model_state(ckpt_dir)
        params = dict(model.state_dict())
        model.load_state_dict({k: v.to(params[k].dtype) if k in params else v for k, v in state.items()},
                              strict=False)
    # a run whose trainer was tensor parallel sampled with the engine emulating its reduction order: replay it so
    return model.set_tensor_parallel_emulation(_tensor_parallel(cfg)).eval()


def _same_bits(x, y) -> bool:
    """Bit-for-bit equality (NaN == NaN, 0.0 != -0.0), dtype and shape included: the engine's own test."""
    from rlrepro.rollout.engine import same_bits

    return same_bits(x, y)


def _structure_difference(params_a: dict, params_b: dict) -> tuple[str, str] | None:
    """(first tensor, sentence) where the two models' parameter names, shapes or dtypes differ; None if they agree."""
    only_a, only_b = sorted(set(params_a) - set(params_b)), sorted(set(params_b) - set(params_a))
    if only_a or only_b:
        parts = [f"only in {r}: {len(x)} ({', '.join(x[:3])}{', ...' if len(x) > 3 else ''})"
                 for r, x in (("A", only_a), ("B", only_b)) if x]
        return (only_a or only_b)[0], "parameter names differ: " + "; ".join(parts)
    for name in sorted(params_a):
        a, b = params_a[name], params_b[name]
        if tuple(a.shape) != tuple(b.shape):
            return name, f"{name} has shape {list(a.shape)} in A, {list(b.shape)} in B"
        if a.dtype != b.dtype:
            return name, f"{name} is {a.dtype} in A, {b.dtype} in B"
    return None


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


def _checkpoints_before(run: Path, label: str, step: int) -> str:
    """``run A (PATH) has checkpoints of steps 1, 2`` (those before ``step``), or ``... has none before step N``."""
    steps = sorted(s for s in _ckpt_steps(run) if s < step)
    shown = ", ".join(map(str, steps[-5:]))
    return (f"run {label} ({run}) has checkpoints of step(s) {'..., ' if len(steps) > 5 else ''}{shown}" if steps
            else f"run {label} ({run}) has none before step {step}")


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


def _keyed(trace: Sequence[tuple[str, str, Any]]) -> list[tuple[tuple[str, int], str, Any]]:
    """Each output keyed by (module name, how many times that module ran before): a module called more than once
    in a forward pass (a shared one) is paired call by call."""
    seen: dict[str, int] = {}
    out = []
    for name, op, t in trace:
        out.append(((name, seen.get(name, 0)), op, t))
        seen[name] = seen.get(name, 0) + 1
    return out


def _label(key: tuple[str, int]) -> str:
    return key[0] if key[1] == 0 else f"{key[0]} (call {key[1] + 1})"


def first_activation_difference(trace_a: Sequence[tuple[str, str, Any]], trace_b: Sequence[tuple[str, str, Any]]
                                ) -> tuple[tuple[str, str, float] | None, list[str], list[str]]:
    """The two runs' module outputs (``_trace``: ``(module name, module class, tensor)`` in execution order) paired
    by module name, never by position, so a module one run has and the other lacks cannot shift the pairs and
    misname the first difference. Returns ((name, op, max |diff|) of the first output, in run A's execution order,
    whose bits differ, or None), and the names of the outputs of run A only and of run B only."""
    keyed_a, keyed_b = _keyed(trace_a), _keyed(trace_b)
    by_key_b = {key: (op, t) for key, op, t in keyed_b}
    keys_a = {key for key, _, _ in keyed_a}
    only_a = [_label(key) for key, _, _ in keyed_a if key not in by_key_b]
    only_b = [_label(key) for key, _, _ in keyed_b if key not in keys_a]
    for key, op, ta in keyed_a:
        if key not in by_key_b:
            continue
        op_b, tb = by_key_b[key]
        if not _same_bits(ta, tb):
            diff = (float((ta.float() - tb.float()).abs().max()) if tuple(ta.shape) == tuple(tb.shape)
                    else float("nan"))  # shapes differ: no elementwise difference to give
            return (_label(key), op if op == op_b else f"{op} in A, {op_b} in B", diff), only_a, only_b
    return None, only_a, only_b


def _unpaired_note(only_a: Sequence[str], only_b: Sequence[str]) -> str | None:
    """The sentence naming the module outputs of one run only (not compared), or None."""
    if not only_a and not only_b:
        return None
    parts = [f"{r}: {', '.join(x[:5])}{', ...' if len(x) > 5 else ''}" for r, x in (("A", only_a), ("B", only_b))
             if x]
    return "modules that ran in one run only (not compared): " + "; ".join(parts)


def bisect_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, step: int, sample_index: int | None = None,
                config_a: dict | None = None, config_b: dict | None = None, field: str | None = None,
                input_diffs: Sequence[str] = (), inputs_not_compared: Sequence[str] = (),
                code_diffs: Sequence[str] = (), allow_code_change: bool = False) -> BisectResult:
    """Replay the first divergent ``step`` of two runs (its first differing sample ``sample_index``, as
    ``diff_runs`` named them) and name the first differing tensor or op. ``config_a`` / ``config_b``: the runs'
    resolved configs (``diff.load_config``); ``field``: the diverging fingerprint field (or metrics key), which
    decides the conclusion when the forward passes agree; ``input_diffs``: the bit-relevant differences of the runs'
    inputs.json (sentences), which are the answer when there are any (nothing is replayed); ``inputs_not_compared``:
    what of the inputs could not be compared (said with a conclusion drawn); ``code_diffs``: the differences of
    rlrepro's own code (``rlrepro_code``, sentences), which stop the bisect as ``input_diffs`` do unless
    ``allow_code_change`` (the result's ``code_change`` says them either way). ReproError when the runs
    cannot be replayed here. The caller runs the diff: this module imports nothing of it, so ``diff`` -> ``bisect``
    is one-way (:func:`bisect_report` takes its report)."""
    code_change = "; ".join(code_diffs) or None
    stop = [*input_diffs, *([] if allow_code_change else code_diffs)]
    if stop:
        return BisectResult(step, "not replayed", "recorded_inputs", note="; ".join(stop), field=field,
                            code_change=code_change)
    result = _replay(run_a, run_b, step, sample_index, config_a, config_b, field, inputs_not_compared)
    result.code_change = code_change
    return result


def _replay(run_a, run_b, step: int, sample_index: int | None, config_a: dict | None, config_b: dict | None,
            field: str | None, inputs_not_compared: Sequence[str]) -> BisectResult:
    """bisect_runs past the recorded inputs: restore both policies, compare them, replay the sample."""
    a, b = Path(run_a), Path(run_b)
    cfg_a, cfg_b = config_a or {}, config_b or {}
    dtype_a, dtype_b = _replay_setting("A", a, cfg_a), _replay_setting("B", b, cfg_b)
    common = sorted(s for s in _ckpt_steps(a) & _ckpt_steps(b) if s < step)
    if common:
        start = common[-1]
    elif step == 1:
        start = 0
    else:
        raise ReproError(f"no checkpoint common to both runs before step {step} ("
                         f"{_checkpoints_before(a, 'A', step)}; {_checkpoints_before(b, 'B', step)}): bisect "
                         "restores both policies from one step; rerun them with checkpoint.every=1 (or an every "
                         "that lands before the divergence); a rlrepro verify re-execution keeps no checkpoints, so "
                         "bisect the run against another run instead")
    origin = f"checkpoint step {start}" if start else "starting weights"
    model_a, model_b = _load_policy(a, cfg_a, start, dtype_a), _load_policy(b, cfg_b, start, dtype_b)
    params_a, params_b = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    structure = _structure_difference(params_a, params_b)
    if structure is not None:
        return BisectResult(step, origin, "model", structure[0], "parameter", note=structure[1], field=field)
    for name, p in sorted(params_a.items()):
        if not _same_bits(p, params_b[name]):
            return BisectResult(step, origin, "weights", name, "parameter",
                                float((p.float() - params_b[name].float()).abs().max()), field=field)
    samples = read_rollouts(a, step)
    if not samples:
        raise ReproError(f"{a}: no rollouts for step {step}; bisect needs run.save_rollouts=true")
    samples_b = read_rollouts(b, step) or []
    i = sample_index or 0
    if i >= len(samples) or (samples_b and i >= len(samples_b)):  # never replay another sample in its place
        return BisectResult(step, origin, "inputs", note=f"sample {i} is in run {'B' if i >= len(samples) else 'A'} "
                            f"only (A has {len(samples)} sample(s) at step {step}, B {len(samples_b)}): the runs "
                            "drew or kept different numbers of samples (data, dynamic sampling or rollout.* keys: "
                            "see the config diff)", field=field)
    sample = samples[i]
    if samples_b and i < len(samples_b) and samples_b[i]["prompt_token_ids"] != sample["prompt_token_ids"]:
        return BisectResult(step, origin, "inputs", note=f"sample {i} has different prompts (data order or "
                            "templates differ: see the config diff)", field=field)
    tokens = list(sample["prompt_token_ids"]) + list(sample["token_ids"])
    trace_a, trace_b = _trace(model_a, tokens, _kernel_mode(cfg_a)), _trace(model_b, tokens, _kernel_mode(cfg_b))
    first, only_a, only_b = first_activation_difference(trace_a, trace_b)
    unpaired = _unpaired_note(only_a, only_b)
    if first is not None:
        name, op, diff = first
        return BisectResult(step, origin, "activation", name, op, diff, note=unpaired, field=field)
    if unpaired is not None:
        return BisectResult(step, origin, "model", (only_a or only_b)[0], "module",
                            note="the module outputs that both runs have agree, but " + unpaired, field=field)
    note = conclusion(field)
    if inputs_not_compared:
        note += "; but inputs not compared: " + "; ".join(inputs_not_compared)
    return BisectResult(step, origin, "none", note=note, field=field)


def bisect_report(report: Any, config_a: dict | None, config_b: dict | None, *,
                  allow_code_change: bool = False) -> BisectResult:
    """:func:`bisect_runs` at ``report``'s first divergent step (a ``diff.DiffReport``): the fingerprint field and
    sample when the fingerprints diverge first, else the first differing metrics key; and its bit-relevant input
    differences (rlrepro's code apart: ``code_diffs``, set aside by ``allow_code_change``)."""
    step = report.first_divergent_step
    dv = report.divergence
    if dv is not None and dv.step == step:
        field, sample_index = dv.field, dv.sample_index
    else:
        field, sample_index = report.metric_diffs[0].key, None
    return bisect_runs(report.run_a, report.run_b, step=step, sample_index=sample_index, config_a=config_a,
                       config_b=config_b, field=field, inputs_not_compared=report.inputs_not_compared,
                       input_diffs=[d.message for d in report.input_diffs if d.bits and d.what != CODE_KEY],
                       code_diffs=[d.message for d in report.input_diffs if d.bits and d.what == CODE_KEY],
                       allow_code_change=allow_code_change)
