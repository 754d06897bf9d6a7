"""wandb logging (logger.wandb=true, WANDB_MODE=offline, real wandb where it is run end to end): a resumed offline
run that re-executes a step does not log it to the wandb run a second time; a logger.project wandb refuses is
refused before any work, naming key, value and fix."""
import json
import os
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

from rlrepro.checks import ConfigError
from rlrepro.orchestration.config import LoggerConfig, RunConfig, RunSchema
from rlrepro.orchestration.runlog import RunLog

REPO = Path(__file__).resolve().parents[1]


class _Run:
    """wandb's offline run: it cannot know what an earlier invocation logged, so its step starts at 0."""

    def __init__(self, calls, run_dir):
        self.calls, self.step = calls, 0
        (Path(run_dir) / "wandb" / "offline-run-x").mkdir(parents=True, exist_ok=True)
        self.dir = str(Path(run_dir) / "wandb" / "offline-run-x" / "files")

    def log(self, payload, step=None, **kwargs):
        self.calls.append(("log", payload, step))

    def finish(self, *a, **k):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _Run(calls, kwargs["dir"])

    mod.init, mod.Table, mod.define_metric = init, None, lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def _cfg(run_dir, resume=False, project="rlrepro"):
    return RunSchema(logger=LoggerConfig(wandb=True, progress=True, num_table_samples=0, project=project),
                     run=RunConfig(dir=str(run_dir), resume=resume))


def _logged(calls):
    return [c[2] for c in calls if c[0] == "log"]


def test_offline_resume_does_not_log_a_step_an_earlier_invocation_logged(tmp_path, fake_wandb, capsys):
    """Steps 1, 2 logged, the run resumed from the checkpoint of step 1: step 2 is re-executed, and (old code)
    logged again in the new offline directory, so that the wandb run held step 2 twice; step 3 is logged."""
    log = RunLog(_cfg(tmp_path), tmp_path)
    log.start(0)
    for step in (1, 2):
        log.log_wandb(step, {"step": step, "train/loss": 0.5})
    log.close()
    first = _logged(fake_wandb)
    fake_wandb.clear()
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(1)
    for step in (2, 3):
        log.log_wandb(step, {"step": step, "train/loss": 0.5})
    log.close()
    assert first == [1, 2]
    assert _logged(fake_wandb) == [3]
    assert "not logged to wandb again" in capsys.readouterr().err


def test_a_fresh_run_into_the_directory_logs_every_step(tmp_path, fake_wandb):
    """The record of logged steps is of one wandb id: a fresh run (a new wandb run) logs from step 1 again."""
    for resume in (False, False):
        log = RunLog(_cfg(tmp_path, resume=resume), tmp_path)
        log.start(0)
        for step in (1, 2):
            log.log_wandb(step, {"step": step})
        log.close()
    assert _logged(fake_wandb) == [1, 2, 1, 2]


@pytest.mark.parametrize("project", ["", " ", "team/rlrepro", "a:b", "x" * 129])
def test_a_bad_project_is_refused_before_wandb_init(tmp_path, fake_wandb, project):
    """Old code: "" and " " were accepted silently (an offline run of project "", uploaded to another project);
    "a/b" failed in wandb.init with a fix of logger.wandb=false only, naming neither the key nor a valid value."""
    with pytest.raises(ConfigError) as e:
        RunLog(_cfg(tmp_path, project=project), tmp_path)
    msg = str(e.value)
    assert f"logger.project={project!r}" in msg and "Fix: set logger.project" in msg and "\n" not in msg
    assert not [c for c in fake_wandb if c[0] == "init"]


def test_a_good_project_is_taken(tmp_path, fake_wandb):
    RunLog(_cfg(tmp_path, project="my-project_1.x"), tmp_path).close()
    assert [c[1]["project"] for c in fake_wandb if c[0] == "init"] == ["my-project_1.x"]


# ---------------------------------------------------------------------------------------- end to end, real wandb
def _records(path: Path):
    """The records of a ``.wandb`` file (leveldb log format: 7-byte header, 32 KiB blocks, chunked records)."""
    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and n == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


def _wandb_history(run_dir: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for f in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")):
        for data in _records(f):
            r = pb.Record()
            r.ParseFromString(data)
            if r.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def _train(run_dir, *extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0")
    p = subprocess.run([sys.executable, "-m", "rlrepro.cli", "train", "recipe=grpo_tiny", f"run.dir={run_dir}",
                        "train.steps=2", "checkpoint.every=1", "rollout.prompts_per_step=2",
                        "train.warmup_steps=0", "logger.wandb=true", "logger.progress=false", *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
def test_resumed_offline_run_holds_each_step_once_with_the_metrics_jsonl_values(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    _train(run)
    shutil.rmtree(next((run / "checkpoints").glob("*2")))  # the run resumes from step 1's checkpoint
    _train(run, "run.resume=true")
    history = _wandb_history(run)
    assert [row["_step"] for row in history] == [1, 2]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row, m in zip(history, metrics):
        want = {k: v for k, v in m.items() if not isinstance(v, str) and not k.startswith("perf/")}
        assert {k: row[k] for k in want} == want


def test_a_resume_into_another_wandb_project_is_refused():
    """The resumed leg opened the same wandb run id in the new project: two runs on wandb sync. Refused when both
    legs log to wandb; with logger.wandb=false for the leg (or the recorded run without wandb) it is an amendment."""
    from rlrepro.checks import ConfigError
    from rlrepro.orchestration.resume import reconcile_resume

    recorded = {"logger": {"wandb": True, "project": "rlrepro"}, "train": {"steps": 4}}
    requested = {"logger": {"wandb": True, "project": "other"}, "train": {"steps": 4}}
    with pytest.raises(ConfigError) as e:
        reconcile_resume(recorded, requested, completed_step=2)
    assert 'logger.project: "rlrepro" -> "other" (the run\'s wandb run lives in project "rlrepro"' in str(e.value)
    assert "keep the recorded logger.project, or set logger.wandb=false for this leg" in str(e.value)
    for rec, req in ((recorded, {"logger": {"wandb": False, "project": "other"}, "train": {"steps": 4}}),
                     ({"logger": {"wandb": False, "project": "rlrepro"}, "train": {"steps": 4}}, requested)):
        config, amendments = reconcile_resume(rec, req, completed_step=2)
        assert config["logger"]["project"] == "other"
        assert {"key": "logger.project", "old": "rlrepro", "new": "other", "from_step": 3} in amendments
