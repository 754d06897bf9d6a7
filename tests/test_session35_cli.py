"""Session 35: the command line probed as a verl/slime user on a CPU laptop.

- `rlrepro generate --max-tokens N` too long for the model said "lower max_tokens ... or raise max_model_len",
  an option `generate` does not have (and the model's context cannot be raised); it now names --max-tokens and
  the value that fits, before the weights load. An over-long --prompt names the prompt; an empty one asked for a
  BOS token id.
- `rlrepro generate` on a model whose KV cache for a long --max-tokens exceeds the engine's default CPU budget
  said "raise num_kv_blocks / kv_cache_memory_bytes", options it does not have: the cache is now sized to the
  requests.
- `rlrepro export RUN OUT` with an OUT that cannot be made (under a file, on a read-only or pseudo file system)
  read and hashed the whole checkpoint, then said "[Errno 2] No such file or directory: 'OUT.tmp-PID'" (a path
  the user never gave, no fix); now OUT is checked first and named with the fix.
- A resume with no step left to run (logger.wandb=true, offline) wrote an empty wandb offline run directory and
  put it in the summary's `wandb sync` command.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlrepro.cli import main
from rlrepro.model import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
CONTEXT = ("the model's context is 1024 tokens (max_position_embeddings in its config.json)")


# ------------------------------------------------------------------------------------------ rlrepro generate

def _no_weights(monkeypatch):
    """Loading the weights fails the test: the checks must come before it."""
    from rlrepro.model import model_dirs

    def load(*a, **k):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(model_dirs.ResolvedModel, "load", load)


def test_generate_too_many_tokens_names_the_option_and_the_value_that_fits(monkeypatch, capsys):
    _no_weights(monkeypatch)
    assert main(["generate", "--max-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert err == ("rlrepro generate: --max-tokens 100000 does not fit: the longest prompt has 12 tokens and "
                   f"{CONTEXT}; use --max-tokens 1012 or less\n")


def test_generate_too_long_prompt_and_empty_prompt_are_named(monkeypatch, capsys):
    _no_weights(monkeypatch)
    assert main(["generate", "--prompt", "ab", "--prompt", "a" * 1100]) == 2
    assert capsys.readouterr().err == (
        f"rlrepro generate: prompt {'a' * 40!r}... has 1100 tokens and {CONTEXT}, which must hold the prompt plus "
        "at least one new token; give a shorter --prompt\n")
    assert main(["generate", "--prompt", ""]) == 2
    assert capsys.readouterr().err == ("rlrepro generate: --prompt '' is empty to the tokenizer (0 tokens); "
                                       "give some text\n")


def test_generate_at_the_context_limit_runs(capsys, tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf", seed=0, max_position_embeddings=64)
    argv = ["generate", "--model", str(hf), "--prompt", "12+7=", "--temperature", "0"]
    assert main([*argv, "--max-tokens", "59"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("'12+7=' -> ") and out.count("\n") == 1
    assert main([*argv, "--max-tokens", "60"]) == 2
    assert capsys.readouterr().err == (
        "rlrepro generate: --max-tokens 60 does not fit: the longest prompt has 5 tokens and the model's context "
        "is 64 tokens (max_position_embeddings in its config.json); use --max-tokens 59 or less\n")


def test_generate_kv_cache_is_sized_to_the_requests(monkeypatch, capsys, tmp_path):
    """A model whose KV cache for --max-tokens exceeds the engine's default CPU budget (a large model; here the
    budget is made small) was refused naming engine keys generate has no option for; now the same tokens come."""
    from rlrepro.rollout import engine as engine_mod

    hf = write_tiny_checkpoint(tmp_path / "hf", seed=0)
    argv = ["generate", "--model", str(hf), "--max-tokens", "40", "--seed", "3", "--temperature", "0.8"]
    assert main(argv) == 0
    want = capsys.readouterr().out
    monkeypatch.setattr(engine_mod, "CPU_DEFAULT_KV_BYTES", 1)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == want and "num_kv_blocks" not in captured.err


def test_generate_help_names_the_context_limit(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert ("new tokens per prompt, >= 1 (default 16); a prompt plus these must fit the model's context "
            "(max_position_embeddings in its config.json)") in out


# ------------------------------------------------------------------------------------------ wandb, nothing to run

def _wandb_cfg(run_dir, resume):
    from rlrepro.orchestration.config import LoggerConfig, RunConfig, RunSchema

    return RunSchema(logger=LoggerConfig(wandb=True, progress=False, num_table_samples=0, mode="offline"),
                     run=RunConfig(dir=str(run_dir), resume=resume))


def _runs(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "wandb").glob("offline-run-*"))


def test_runlog_with_no_step_left_opens_no_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from rlrepro.orchestration.runlog import RunLog

    monkeypatch.setenv("WANDB_MODE", "offline")
    log = RunLog(_wandb_cfg(tmp_path, False), tmp_path)
    log.start(0)
    log.log_wandb(1, {"step": 1, "train/loss": 0.5})
    log.close()
    first = _runs(tmp_path)
    assert len(first) == 1 and log.wandb_dir == str(tmp_path / "wandb" / first[0])
    log = RunLog(_wandb_cfg(tmp_path, True), tmp_path, steps_left=False)
    log.start(1)
    log.close()
    assert _runs(tmp_path) == first
    assert log.wandb_dir == str(tmp_path / "wandb" / first[0])  # the summary still names the run's wandb run


@pytest.mark.slow
def test_resume_with_no_step_left_writes_no_empty_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "r"
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=str(REPO))
    base = [sys.executable, "-m", "rlrepro.cli", "train", "recipe=grpo_tiny", f"run.dir={run}", "train.steps=1",
            "logger.wandb=true", "logger.progress=false"]
    subprocess.run(base, env=env, check=True, capture_output=True, cwd=tmp_path, timeout=300)
    first = _runs(run)
    assert len(first) == 1
    done = subprocess.run(base + ["run.resume=true"], env=env, capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert _runs(run) == first
    summary = json.loads((run / "summary.json").read_text())
    assert summary["files"]["wandb_sync"] == f"wandb sync {run / 'wandb' / first[0]}"


# ------------------------------------------------------------------------------------------ rlrepro export

@pytest.fixture
def fake_run(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_export import _fake_run

    return _fake_run(tmp_path, steps=(2,))


def test_export_to_an_out_under_a_file_is_refused_first_naming_out(fake_run, tmp_path, monkeypatch, capsys):
    from rlrepro.trainer import checkpoint

    monkeypatch.setattr(checkpoint, "verify_checkpoint", lambda *a, **k: pytest.fail("the checkpoint was read first"))
    out = fake_run / "config.yaml" / "hf"
    before = sorted(p.name for p in fake_run.iterdir())
    assert main(["export", str(fake_run), str(out)]) == 2
    assert capsys.readouterr().err == (f"rlrepro export: OUT {out} cannot be made: {fake_run / 'config.yaml'} is a "
                                       "file, not a folder; choose another OUT\n")
    assert sorted(p.name for p in fake_run.iterdir()) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, a file system that takes no folder")
def test_export_to_an_out_where_no_folder_can_be_made_names_out(fake_run, capsys):
    assert main(["export", str(fake_run), "/proc/rlrepro-out"]) == 2
    assert capsys.readouterr().err == ("rlrepro export: OUT /proc/rlrepro-out cannot be made: /proc takes no new "
                                       "folder (No such file or directory); choose an OUT in a folder you can write "
                                       "to\n")


def test_export_to_a_good_out_leaves_no_probe_behind(fake_run, tmp_path, capsys):
    out = tmp_path / "exports" / "hf"
    assert main(["export", str(fake_run), str(out)]) == 0
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["hf"]
    assert (out / "config.json").is_file()
