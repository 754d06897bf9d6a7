"""The wandb logging path (logger.wandb=true): what goes to wandb is metrics.jsonl's values at the training step,
also after a resume; wandb missing or wandb.init failing refuses the run before any work, in one line; the
summary's upload command covers every invocation of a resumed offline run. wandb is a fake module here."""
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from rlrepro.checks import ConfigError
from rlrepro.orchestration.config import LoggerConfig, RunConfig, RunSchema
from rlrepro.orchestration.runlog import RunLog
from rlrepro.orchestration.summary import run_summary

REPO = Path(__file__).resolve().parents[1]


class _Run:
    def __init__(self, calls, step=0):
        self.calls, self.step, self.dir = calls, step, None

    def log(self, payload, step=None, **kwargs):
        self.calls.append(("log", payload, step, kwargs))

    def finish(self, *a, **k):
        self.calls.append(("finish",))


def _fake_wandb(monkeypatch, calls, *, held_step=0, init_error=None):
    monkeypatch.setenv("WANDB_MODE", "offline")
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        if init_error is not None:
            raise init_error
        return _Run(calls, held_step)

    class Table:
        def __init__(self, columns):
            self.columns, self.rows = columns, []

        def add_data(self, *row):
            self.rows.append(row)

    mod.init, mod.Table = init, Table
    mod.define_metric = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "wandb", mod)


def _cfg(run_dir, resume=False, tables=0, mode="offline"):
    return RunSchema(logger=LoggerConfig(wandb=True, progress=True, num_table_samples=tables, mode=mode),
                     run=RunConfig(dir=str(run_dir), resume=resume))


def _metrics(step):
    return {"step": step, "rollout/reward_mean": 0.1 + 0.2, "train/loss": -0.0, "train/grad_norm": float("nan"),
            "train/kl": float("inf"), "train/lr": 0.0030000000000000005, "rollout/num_samples": 256,
            "repro/weights_digest": "0123456789abcdef", "perf/step_time_s": 1.25}


def _logs(calls):
    return [c for c in calls if c[0] == "log"]


def test_wandb_step_is_the_training_step(tmp_path, monkeypatch):
    """wandb's own step (the default x-axis, and what a resumed run's rows are keyed by) is the training step, not
    a per-invocation counter from 0 (old code: steps 1, 2 logged at wandb steps 0, 1; a resume started at 0 again)."""
    calls = []
    _fake_wandb(monkeypatch, calls)
    log = RunLog(_cfg(tmp_path), tmp_path)
    log.start(0)
    for step in (1, 2):
        log.log_wandb(step, _metrics(step))
    log.close()
    assert [c[2] for c in _logs(calls)] == [1, 2]
    calls.clear()
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(2)
    log.log_wandb(3, _metrics(3))
    log.close()
    assert [c[2] for c in _logs(calls)] == [3]


def test_wandb_gets_the_metrics_jsonl_values_exactly(tmp_path, monkeypatch):
    """Every non-string value of the step's metrics.jsonl line, as the same object (bit for bit; NaN and inf
    neither dropped nor a crash), nothing but those and the samples table."""
    calls = []
    _fake_wandb(monkeypatch, calls)
    log = RunLog(_cfg(tmp_path, tables=2), tmp_path)
    log.start(0)
    m = _metrics(1)
    log.log_wandb(1, m)
    log.close()
    (_, payload, step, _), = _logs(calls)
    assert step == 1
    table = payload.pop("rollout/samples")
    assert table.columns == ["step", "prompt_uid", "prompt", "completion", "reward"]
    assert payload.keys() == {k for k, v in m.items() if not isinstance(v, str)}
    for k, v in payload.items():
        assert type(v) is type(m[k]) and (v is m[k] or repr(v) == repr(m[k])), k
    assert math.isnan(payload["train/grad_norm"]) and payload["train/kl"] == math.inf
    assert math.copysign(1.0, payload["train/loss"]) == -1.0


def test_wandb_config_is_the_full_resolved_config(tmp_path, monkeypatch):
    from rlrepro.orchestration.driver import config_yaml

    calls = []
    _fake_wandb(monkeypatch, calls)
    cfg = _cfg(tmp_path)
    RunLog(cfg, tmp_path).close()
    (_, kwargs), = [c for c in calls if c[0] == "init"]
    assert kwargs["config"] == yaml.safe_load(config_yaml(cfg))


def test_resumed_wandb_run_does_not_log_a_held_step_twice(tmp_path, monkeypatch, capsys):
    """An online resume from a checkpoint before the last logged step re-executes steps the wandb run holds:
    they are not logged again (old code: logged a second time), one line says so."""
    calls = []
    _fake_wandb(monkeypatch, calls, held_step=3)  # the wandb run logged steps up to 2 (its step is 3 now)
    log = RunLog(_cfg(tmp_path, resume=True, mode="online"), tmp_path)
    log.start(1)
    for step in (2, 3):
        log.log_wandb(step, _metrics(step))
    log.close()
    assert [c[2] for c in _logs(calls)] == [3]
    err = capsys.readouterr().err
    assert err.count("not logged to wandb again") == 1 and "step 2" in err


def test_wandb_missing_refuses_when_the_log_is_made(tmp_path, monkeypatch):
    """The driver makes its RunLog in set-up, before Ray starts: wandb missing must refuse there (ConfigError,
    exit 2), one line naming the fix (old code: ImportError traceback after Ray and the warm start)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError) as e:
        RunLog(_cfg(tmp_path), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "wandb cannot be imported" in msg and "logger.wandb=false" in msg


def test_wandb_init_failure_refuses_when_the_log_is_made(tmp_path, monkeypatch):
    calls = []
    _fake_wandb(monkeypatch, calls, init_error=RuntimeError("api_key not configured\n(no-tty)"))
    with pytest.raises(ConfigError) as e:
        RunLog(_cfg(tmp_path, mode="online"), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "wandb.init failed" in msg and "api_key not configured (no-tty)" in msg
    assert "logger.mode=offline" in msg and "logger.wandb=false" in msg


def test_train_without_wandb_fails_before_work_in_one_line(tmp_path):
    """``rlrepro train ... logger.wandb=true`` with wandb not importable: exit 2, one line, nothing left."""
    fake = tmp_path / "fake" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named wandb (test)")\n')
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{fake.parent}{os.pathsep}{REPO}", WANDB_MODE="offline",
               HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    p = subprocess.run([sys.executable, "-m", "rlrepro.cli", "train", "recipe=grpo_tiny", "train.steps=1",
                        "logger.wandb=true", f"run.dir={run_dir}"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "wandb cannot be imported" in lines[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    # refused in set-up: nothing of the run is left (config.yaml, base_model/, data/ removed; at most the lock file)
    assert not run_dir.exists() or {q.name for q in run_dir.iterdir()} <= {".lock"}


def test_summary_upload_command_syncs_every_invocation_of_the_wandb_run(tmp_path):
    """A resumed offline run writes one wandb directory per invocation (same id): ``wandb sync`` must name all of
    them, in order (old code: only the last one, so the steps before the resume were never uploaded)."""
    w = tmp_path / "wandb"
    first, second = w / "offline-run-20260101_120000-abc123", w / "offline-run-20260101_130000-abc123"
    other = w / "offline-run-20251231_120000-zzz999"  # an earlier run started over in the directory
    for d in (first, second, other):
        d.mkdir(parents=True)
    cfg = _cfg(tmp_path)
    s = run_summary(tmp_path, cfg, wall_s=1.0, steps_this_run=1, wandb_dir=str(second))
    assert s["files"]["wandb_sync"] == f"wandb sync {first} {second}"
    assert s["files"]["wandb_run"] == str(second)
    json.dumps(s)
