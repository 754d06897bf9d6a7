"""The public surface DESIGN.md §3 promises, pinned so that a rename breaks CI.

* Python: the names DESIGN.md imports (``rlrepro.model``, ``rlrepro.kernels``, ``rlrepro.rollout``,
  ``rlrepro.trainer``), their parameter names and defaults, and the documented snippet run on a tiny checkpoint
  (``token_logprobs`` equals the engine's logprobs bit for bit); every subpackage keeps the names it exports.
* Command line: the subcommands of ``rlrepro --help``, the flags of ``diff`` / ``verify``, and the hydra keys of
  DESIGN.md's ``rlrepro train`` line (composed, with the meaning it documents).
* Run directory: the file names the records code writes (fast), and a two-step ``grpo_tiny`` run's directory with
  the documented files and fields (slow).
"""
from __future__ import annotations

import contextlib
import gzip
import importlib
import inspect
import io
import json

import pytest
import yaml

EMPTY = inspect.Parameter.empty


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _leading(fn, n: int) -> list[tuple[str, object]]:
    return _params(fn)[:n]


# ---------------------------------------------------------------------------------------------- Python API


def test_model_load_and_save_signatures():
    from rlrepro.model import load_pretrained, save_pretrained

    assert _leading(load_pretrained, 3) == [("path", EMPTY), ("device", "cpu"), ("dtype", None)]
    assert _leading(save_pretrained, 2) == [("model", EMPTY), ("path", EMPTY)]


def test_kernels_signatures_and_modes():
    from rlrepro import kernels

    assert kernels.MODES == ("deterministic", "fast")
    assert _params(kernels.mode) == [("name", EMPTY)]
    assert _leading(kernels.linear, 2) == [("x", EMPTY), ("weight", EMPTY)]
    assert _params(kernels.rms_norm) == [("x", EMPTY), ("weight", EMPTY), ("eps", EMPTY)]
    assert _params(kernels.log_softmax) == [("x", EMPTY)]
    assert kernels.current_mode() == "deterministic"
    with kernels.mode("fast"):
        assert kernels.current_mode() == "fast"
    assert kernels.current_mode() == "deterministic"


def test_engine_and_sampling_params_signatures():
    from rlrepro.rollout import Engine, RequestOutput, SamplingParams

    assert _leading(Engine, 8) == [
        ("model_or_path", EMPTY), ("device", "cpu"), ("dtype", None), ("deterministic", True), ("seed", 0),
        ("max_num_seqs", 256), ("max_num_batched_tokens", 8192), ("enable_prefix_cache", True)]
    assert _leading(Engine.generate, 2) == [("prompt_token_ids", EMPTY), ("sampling_params", None)]
    assert _leading(SamplingParams, 6) == [
        ("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("max_tokens", 128), ("seed", None),
        ("stop_token_ids", ())]
    fields = set(inspect.signature(RequestOutput).parameters)
    assert {"token_ids", "logprobs", "finish_reason"} <= fields


def test_token_logprobs_signature():
    from rlrepro.trainer import token_logprobs

    assert _leading(token_logprobs, 4) == [("model", EMPTY), ("prompt_token_ids", EMPTY),
                                           ("completion_token_ids", EMPTY), ("temperature", 1.0)]


def test_design_snippet_runs_and_trainer_equals_engine_bitwise(tmp_path):
    import torch

    from rlrepro import kernels
    from rlrepro.model import load_pretrained, save_pretrained, write_tiny_checkpoint
    from rlrepro.rollout import Engine, SamplingParams
    from rlrepro.trainer import token_logprobs

    path = write_tiny_checkpoint(tmp_path / "m", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    model = load_pretrained(path, device="cpu", dtype=None)
    assert next(model.parameters()).dtype == torch.float32          # dtype None: the checkpoint's own
    assert next(load_pretrained(path, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16
    out_dir = tmp_path / "saved"
    save_pretrained(model, out_dir)
    reloaded = load_pretrained(out_dir)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    logits = model(ids)
    assert tuple(logits.shape) == (2, 4, model.config.vocab_size)
    assert torch.equal(reloaded(ids), logits)

    x = torch.randn(3, 8)
    assert tuple(kernels.linear(x, torch.randn(5, 8)).shape) == (3, 5)
    assert kernels.rms_norm(x, torch.ones(8), 1e-6).shape == x.shape
    assert kernels.log_softmax(x.bfloat16()).dtype == torch.float32

    engine = Engine(model, device="cpu", dtype=None, deterministic=True, seed=0, max_num_seqs=256,
                    max_num_batched_tokens=8192, enable_prefix_cache=True)
    assert engine.model is model                                     # a model object is used as is
    prompts = [[1, 2, 3], [4, 5]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, seed=0,
                                                   stop_token_ids=()))
    per_prompt = engine.generate(prompts, [SamplingParams(max_tokens=6, seed=0), SamplingParams(max_tokens=6, seed=0)])
    assert [o.token_ids for o in per_prompt] == [o.token_ids for o in outs]
    for o in outs:
        assert isinstance(o.logprobs, list) and len(o.logprobs) == len(o.token_ids) == 6
        assert all(type(v) is float for v in o.logprobs)
        assert o.finish_reason == "length"
    lps = token_logprobs(model, prompts, [o.token_ids for o in outs], temperature=1.0)
    assert isinstance(lps, list) and all(t.dim() == 1 for t in lps)
    assert [t.tolist() for t in lps] == [o.logprobs for o in outs]   # bit for bit


# The names each subpackage exports today: renaming or dropping one breaks this test (adding one does not).
PINNED_EXPORTS = {
    "rlrepro.data": (
        'BUILTIN_REWARDS', 'DATA_FILE_FORMATS', 'EVAL_KEYS', 'EpochOrder', 'LoadStats', 'MathReward',
        'ON_UNKNOWN_TOKEN', 'Prompt', 'PromptRecord', 'PromptStats', 'RewardError', 'RewardFn', 'SYNTHETIC_CHARSET',
        'SYNTHETIC_KINDS', 'SkippedRow', 'build_prompts', 'check_template', 'compute_rewards', 'eval_key_names',
        'exact_match_reward', 'extract_last_boxed', 'load_records', 'load_reward_fn', 'make_synthetic_records',
        'math_reward', 'overlong_penalty', 'prefix_match_reward', 'records_digest', 'relabel_keys', 'relabeled_logs',
        'render_prompt', 'tokenize_prompt', 'write_jsonl'
    ),
    "rlrepro.envs": (
        'BUILTIN_ENVS', 'BUILTIN_TOOLS', 'CalculatorError', 'CalculatorLimits', 'CompactToolFormat', 'EnvConfig',
        'EnvError', 'EnvFactory', 'EnvReset', 'EnvSpec', 'Environment', 'Episode', 'FINISH_REASONS', 'FORBIDDEN_NAMES',
        'MALFORMED_POLICIES', 'MalformedCall', 'Message', 'Outcome', 'ParsedCall', 'Qwen3ToolFormat', 'SandboxLimits',
        'SandboxResult', 'SingleTurnEnv', 'StepResult', 'TOOL_FORMATS', 'Tool', 'ToolCall', 'ToolCallFormat', 'ToolEnv',
        'ToolResult', 'calculate', 'calculator_tool', 'check_arguments', 'check_messages', 'continuation_text',
        'end_of_turn_token', 'episode_seed', 'evaluate', 'execute_calls', 'format_number', 'load_env',
        'load_env_factory', 'make_calculator_records', 'make_calculator_task_env', 'make_tool_format', 'make_tools',
        'python_tool', 'register_env', 'render_chat', 'replay', 'run_episode', 'run_python', 'tool_message',
        'transcript_digest'
    ),
    "rlrepro.kernels": (
        'AttentionMetadata', 'MODES', 'add_rms_norm', 'apply_rope', 'attention', 'current_mode', 'embedding', 'linear',
        'log_softmax', 'mode', 'qk_norm_rope_attention', 'rms_norm', 'scale_logits', 'scaled_token_logprob',
        'silu_and_mul', 'token_logprob'
    ),
    "rlrepro.model": (
        'BaseModelError', 'ModelDirError', 'Qwen3Config', 'Qwen3ForCausalLM', 'ResolvedModel', 'Tokenizer',
        'init_random_weights', 'load_pretrained', 'load_resolved', 'load_tokenizer', 'prepare_base_model',
        'resolve_model_dir', 'save_pretrained', 'tiny_model', 'verify_base_model', 'write_config_last',
        'write_tiny_checkpoint'
    ),
    "rlrepro.orchestration": (
        'ConfigError', 'GRPODriver', 'RunSchema', 'run_training', 'to_schema', 'validate'
    ),
    "rlrepro.repro": (
        'DiffReport', 'FIELDS', 'FingerprintWriter', 'JsonlStepWriter', 'MetricsWriter', 'ReproError', 'RolloutWriter',
        'StepFingerprint', 'build_figures', 'diff_runs', 'digest_values', 'fingerprint_from_samples',
        'fingerprint_step', 'log_comparison_to_wandb', 'main_diff', 'main_plot', 'optimizer_state_digest', 'plot_runs',
        'read_fingerprints', 'read_metrics', 'read_rollout_samples', 'read_rollouts', 'read_step_records',
        'rollout_steps', 'rollouts_path', 'step_dirname', 'tensor_digest', 'tensor_digests', 'weights_digest'
    ),
    "rlrepro.rollout": (
        'Engine', 'EngineConfig', 'RequestOutput', 'SamplingConfig', 'SamplingParams', 'derive_seed', 'eval_seed',
        'request_seed'
    ),
    "rlrepro.trainer": (
        'ADVANTAGE_MODES', 'BehaviourWeights', 'DataParallel', 'IS_CORRECTIONS', 'KL_ESTIMATORS', 'LOSS_AGG_MODES',
        'LoadedCheckpoint', 'LossOutput', 'MasterWeightAdamW', 'POLICY_LOSSES', 'TrainConfig', 'TrainSample', 'Trainer',
        'WarmupCosineLR', 'aggregate', 'assign_micro_batches', 'behaviour_weights', 'capture_rng_state',
        'clip_grad_norm_', 'compute_advantages', 'enable_determinism', 'entropy', 'export_hf', 'group_advantages',
        'kl_penalty', 'latest_checkpoint', 'list_checkpoints', 'load_checkpoint', 'logprobs_and_entropy', 'lr_at',
        'micro_batches', 'pad_sequences', 'policy_loss', 'restore_rng_state', 'save_checkpoint', 'token_logprobs',
        'verify_checkpoint'
    ),
}


@pytest.mark.parametrize("package", sorted(PINNED_EXPORTS))
def test_subpackage_keeps_its_exported_names(package):
    mod = importlib.import_module(package)
    exported = set(mod.__all__)
    assert sorted(set(PINNED_EXPORTS[package]) - exported) == []
    assert len(mod.__all__) == len(exported)                         # no name listed twice
    unresolved = [name for name in sorted(exported) if not hasattr(mod, name)]
    assert unresolved == []


def test_repro_exports_documented_in_run_directory_md():
    # docs/RUN_DIRECTORY.md names these beside read_rollouts / plot_runs, which rlrepro.repro exports
    from rlrepro import repro
    from rlrepro.repro import plot, records

    assert repro.read_rollout_samples is records.read_rollout_samples
    assert repro.rollout_steps is records.rollout_steps
    assert repro.build_figures is plot.build_figures


def test_repro_lazy_exports_do_not_import_torch_for_the_records():
    import subprocess
    import sys

    code = ("import sys; from rlrepro.repro import read_rollout_samples, rollout_steps, read_rollouts, diff_runs; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------------- command line

COMMANDS = ("train", "diff", "verify", "show", "plot", "generate", "export", "eval", "recipes")


def _help(args: list[str]) -> str:
    from rlrepro import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = cli.main(args)
        except SystemExit as e:                                       # argparse's --help
            rc = e.code
    assert rc == 0, args
    return buf.getvalue()


def test_cli_subcommands():
    lines = _help(["--help"]).splitlines()
    listed = tuple(line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   "))
    assert listed == COMMANDS


@pytest.mark.parametrize("cmd, flags", [
    ("diff", ("--json", "--strict", "--strict-inputs", "--no-detail", "--bisect")),
    ("verify", ("--from-step K", "--steps N", "--json")),
    ("train", ("--cfg",)),
])
def test_cli_documented_flags(cmd, flags):
    text = _help([cmd, "--help"])
    assert [f for f in flags if f not in text] == []


DESIGN_TRAIN_LINE = ["recipe=grpo_tiny", "run.dir=runs/a", "run.seed=1", "train.steps=20", "rollout.num_workers=2",
                     "rollout.max_num_seqs=64", "rollout.max_num_batched_tokens=2048", "rollout.prefix_cache=true",
                     "checkpoint.every=5", "run.resume=false", "logger.wandb=true"]


def test_design_train_line_composes_with_the_documented_meaning():
    from rlrepro.cli import compose_config
    from rlrepro.orchestration.config import to_schema

    schema = to_schema(compose_config(DESIGN_TRAIN_LINE))
    got = (schema.recipe, schema.run.dir, schema.run.seed, schema.train.steps, schema.rollout.num_workers,
           schema.rollout.max_num_seqs, schema.rollout.max_num_batched_tokens, schema.rollout.prefix_cache,
           schema.checkpoint.every, schema.run.resume, schema.logger.wandb)
    assert got == ("grpo_tiny", "runs/a", 1, 20, 2, 64, 2048, True, 5, False, True)
    kwargs = schema.rollout.engine.engine_kwargs()                    # what Engine.from_config passes the Engine
    documented = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_cache")   # the Engine's own names
    assert tuple(kwargs[k] for k in documented) == (64, 2048, True)
    engine_params = set(inspect.signature(importlib.import_module("rlrepro.rollout").Engine).parameters)
    assert [k for k in documented if k not in engine_params] == []


def test_train_cfg_prints_the_documented_keys():
    cfg = yaml.safe_load(_help(["train", "recipe=grpo_tiny", "--cfg"]))
    keys = ("run.dir", "run.seed", "run.resume", "train.steps", "rollout.num_workers", "rollout.max_num_seqs",
            "rollout.max_num_batched_tokens", "rollout.prefix_cache", "checkpoint.every", "logger.wandb")
    missing = []
    for key in keys:
        section, name = key.split(".")
        if name not in (cfg.get(section) or {}):
            missing.append(key)
    assert missing == []
    assert cfg["recipe"] == "grpo_tiny"


# ---------------------------------------------------------------------------------------------- run directory

METRIC_KEYS = ("step", "rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm",
               "train/kl", "train/entropy", "train/rollout_logprob_abs_diff", "perf/step_time_s")
FINGERPRINT_FIELDS = ("rollout_token_ids", "rollout_logprobs", "rewards", "advantages", "loss", "grad_norm",
                      "weights")


def test_run_directory_file_names(tmp_path):
    from rlrepro.repro import FIELDS, FingerprintWriter, MetricsWriter, rollouts_path, step_dirname
    from rlrepro.repro import records
    from rlrepro.trainer import checkpoint

    assert (records.CONFIG_FILE, records.METRICS_FILE, records.FINGERPRINTS_FILE) == (
        "config.yaml", "metrics.jsonl", "fingerprints.jsonl")
    assert MetricsWriter(tmp_path).path == tmp_path / "metrics.jsonl"
    assert FingerprintWriter(tmp_path).path == tmp_path / "fingerprints.jsonl"
    assert step_dirname(7) == "step_000007"
    assert rollouts_path(tmp_path, 7) == tmp_path / "rollouts" / "step_000007.jsonl.gz"
    assert checkpoint.checkpoint_dir_name(7) == "step_000007"
    assert checkpoint.MANIFEST == "manifest.json"
    assert [f for f in FINGERPRINT_FIELDS if f not in FIELDS] == []


@pytest.mark.slow
def test_two_step_run_writes_the_documented_run_directory(tmp_path):
    from _cli_run import run_cli

    from rlrepro.trainer import verify_checkpoint

    run = tmp_path / "run"
    proc = run_cli(["train", "recipe=grpo_tiny", "train.steps=2", "train.warmup_steps=1", f"run.dir={run}"],
                   cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "fingerprints.jsonl", "inputs.json", "summary.json", "summary.txt",
                 "rollouts/step_000001.jsonl.gz", "rollouts/step_000002.jsonl.gz",
                 "checkpoints/step_000002/manifest.json"):
        assert (run / name).is_file(), name
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["run"]["dir"], config["train"]["steps"]) == (str(run), 2)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [[k for k in METRIC_KEYS if k not in m] for m in metrics] == [[], []]
    prints = [json.loads(line) for line in (run / "fingerprints.jsonl").read_text().splitlines()]
    assert [p["step"] for p in prints] == [1, 2]
    for p in prints:
        assert p["format"] == "rlrepro.fingerprint.v1"
        digests = [p[f] for f in FINGERPRINT_FIELDS]
        assert all(isinstance(d, str) and len(d) == 64 and set(d) <= set("0123456789abcdef") for d in digests)
    with gzip.open(run / "rollouts" / "step_000001.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    assert [k for k in ("prompt_uid", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "reward",
                        "advantage") if k not in first] == []
    manifest = verify_checkpoint(run / "checkpoints" / "step_000002")  # every file's sha256 as recorded
    assert manifest["files"] and all(len(e["sha256"]) == 64 for e in manifest["files"].values())
