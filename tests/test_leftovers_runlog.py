"""A resumed run continues its wandb run: wandb.init gets the id recorded in RUN/wandb (resume="allow"); a fresh
run into the same directory gets a new one. wandb itself is replaced by a fake module (offline, no network)."""
import sys
import types

import pytest

from rlrepro.orchestration.config import LoggerConfig, RunConfig, RunSchema
from rlrepro.orchestration import runlog
from rlrepro.orchestration.runlog import RunLog


@pytest.fixture
def fake_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    calls = []
    mod = types.ModuleType("wandb")

    class Run:
        dir = None

        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    def init(**kwargs):
        calls.append(kwargs)
        return Run()

    mod.init = init
    mod.define_metric = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def _start(run_dir, resume: bool, done: int = 0) -> None:
    cfg = RunSchema(logger=LoggerConfig(wandb=True, progress=False), run=RunConfig(dir=str(run_dir), resume=resume))
    log = RunLog(cfg, run_dir)
    log.start(done)
    log.close()


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, fake_wandb):
    _start(tmp_path, resume=False)
    _start(tmp_path, resume=True, done=3)
    _start(tmp_path, resume=True, done=6)
    ids = [c.get("id") for c in fake_wandb]
    assert ids[0] and ids == [ids[0]] * 3
    assert all(c.get("resume") == "allow" for c in fake_wandb)
    assert (tmp_path / "wandb" / runlog.WANDB_ID_FILE).read_text().strip() == ids[0]


def test_a_fresh_run_into_the_directory_starts_a_new_wandb_run(tmp_path, fake_wandb):
    _start(tmp_path, resume=False)
    _start(tmp_path, resume=False)  # e.g. run.overwrite=true: a new run, recorded for its own resumes
    _start(tmp_path, resume=True, done=2)
    first, second, resumed = (c["id"] for c in fake_wandb)
    assert first != second and resumed == second


def test_a_run_from_before_the_id_file_resumes_the_wandb_run_it_recorded(tmp_path, fake_wandb):
    (tmp_path / "wandb" / "offline-run-20260101_120000-ab12cd34").mkdir(parents=True)
    (tmp_path / "wandb" / "latest-run").symlink_to("offline-run-20260101_120000-ab12cd34")
    _start(tmp_path, resume=True, done=4)
    assert fake_wandb[0]["id"] == "ab12cd34"
