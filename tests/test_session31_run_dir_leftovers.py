"""Session 31, a new user's walkthrough: what a run directory is left holding, and what the commands say about one.

1. A refused start (`data.source=nope.jsonl`, exit 2) or one interrupted before step 1 left the run directory it
   had itself created, holding only `.lock`. Now a directory the start created is removed entirely (lock file
   removed while still locked, then the directory); a directory that existed keeps what it held.
2. `rlrepro verify runs/nope` said "no config.yaml; is this a run directory?" and `rlrepro eval runs/nope` "is not a
   run directory (no config.yaml)" where show/diff/export/plot say "run directory ... not found". Now both say
   "not found" for a missing path; a directory without config.yaml keeps the "no config.yaml" wording.
3. The interrupt message named the checkpoint it had just saved twice ("Saved a checkpoint of the last completed
   step 14: P. The last complete checkpoint is P; ..."). Now once.
4. A resume with a step left records a changed `logger.*` key as an amendment from that step (slow; as before: a
   resume with no step left still records it too, which existing resume tests rely on).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from _cli_run import run_cli

from rlrepro.orchestration import run_lock as run_lock_mod
from rlrepro.orchestration.run_lock import LOCK_FILE, RunDirLocked, RunLock

SMALL = ["recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_tokens=4", "logger.progress=false"]


def _cli(args: list[str], cwd: Path, faults: list[dict] | None = None, timeout: float = 300):
    return run_cli(args, cwd, faults, timeout)


# ------------------------------------------------------------------ 1. a refused or interrupted start
def test_a_refused_start_removes_the_run_directory_it_created(tmp_path):
    p = _cli(["train", *SMALL, "run.dir=runs/e1", "data.source=nope.jsonl"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert "nope.jsonl" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "runs" / "e1").exists(), os.listdir(tmp_path / "runs" / "e1")  # was: holding .lock


def test_a_refused_start_into_an_existing_directory_keeps_what_it_held(tmp_path):
    empty, used = tmp_path / "empty", tmp_path / "used"
    empty.mkdir()
    used.mkdir()
    (used / "notes.txt").write_text("mine\n", encoding="utf-8")
    for run in (empty, used):
        p = _cli(["train", *SMALL, f"run.dir={run}", "data.source=nope.jsonl"], tmp_path)
        assert p.returncode == 2, p.stderr
    assert set(os.listdir(empty)) == {LOCK_FILE} and (empty / LOCK_FILE).read_bytes() == b""
    assert set(os.listdir(used)) == {LOCK_FILE, "notes.txt"}
    assert (used / "notes.txt").read_text(encoding="utf-8") == "mine\n"
    RunLock(used).acquire().release()  # released


def test_sigterm_before_step_1_removes_the_run_directory_it_created(tmp_path):
    run = tmp_path / "runs" / "int"
    p = _cli(["train", *SMALL, f"run.dir={run}"], tmp_path, faults=[{"kind": "sigterm", "step": 0, "at": "before_ray"}])
    assert p.returncode == 130, p.stderr
    assert "interrupted before the run started; nothing was recorded" in p.stderr
    assert not run.exists(), os.listdir(run)


def test_lock_release_removes_only_a_directory_it_created_and_that_holds_nothing_else(tmp_path):
    run = tmp_path / "new"
    lock = RunLock(run).acquire()
    assert lock.created
    lock.release(remove_created=True)
    assert not run.exists()
    run.mkdir()  # existed before: stays, with its (emptied) lock file
    lock = RunLock(run).acquire()
    assert not lock.created
    lock.release(remove_created=True)
    assert set(os.listdir(run)) == {LOCK_FILE}
    other = tmp_path / "other"
    lock = RunLock(other).acquire()
    (other / "theirs.txt").write_text("x")  # something not this start's: the directory stays
    lock.release(remove_created=True)
    assert set(os.listdir(other)) == {LOCK_FILE, "theirs.txt"}
    RunLock(other).acquire().release()


def test_a_process_that_locked_a_removed_lock_file_starts_over(tmp_path, monkeypatch):
    """B opened RUN/.lock while A held it; A removes it with the directory it created; B's flock then succeeds on
    the removed file, so B must not take that for the lock of RUN: it locks a new RUN/.lock."""
    run = tmp_path / "run"
    a = RunLock(run).acquire()
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        if not calls:
            calls.append(fd)
            a.release(remove_created=True)  # between B's open and B's flock
            assert not run.exists()
        return real_flock(fd, op)

    monkeypatch.setattr(run_lock_mod.fcntl, "flock", flock)
    b = RunLock(run, say=lambda s: None).acquire()
    monkeypatch.setattr(run_lock_mod.fcntl, "flock", real_flock)
    assert calls and b.held
    assert os.path.samestat(os.fstat(b._fd), os.stat(run / LOCK_FILE))  # the lock B holds is RUN's
    with pytest.raises(RunDirLocked):
        RunLock(run).acquire()
    b.release()


# ------------------------------------------------------------------ 2. "not found", as the other commands say it
@pytest.mark.parametrize("command", ["verify", "eval"])
def test_verify_and_eval_say_not_found_for_a_missing_run_directory(tmp_path, monkeypatch, capsys, command):
    from rlrepro.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main([command, "runs/nope"]) == 2
    err = capsys.readouterr().err
    assert f"rlrepro {command}: run directory " in err and "runs/nope not found" in err, err
    assert "runs/NAME" in err and "no config.yaml" not in err
    (tmp_path / "runs" / "plain").mkdir()  # a directory that holds no run: the "no config.yaml" wording stays
    assert main([command, "runs/plain"]) == 2
    err = capsys.readouterr().err
    assert "runs/plain is not a run directory (no config.yaml)" in err and "not found" not in err, err


# ------------------------------------------------------------------ 3. the interrupt message names its checkpoint once
class _Actors:
    def save_checkpoint(self, root, step, extra, keep_last):
        path = Path(root) / f"step_{step:06d}"
        path.mkdir(parents=True)
        return str(path)


def _interrupted(tmp_path, monkeypatch, latest_of):
    import rlrepro.trainer as trainer
    from rlrepro.cli import compose_config
    from rlrepro.orchestration.driver import GRPODriver

    d = GRPODriver(compose_config([*SMALL, "train.steps=20", f"run.dir={tmp_path / 'int'}"]))
    d.actors, d._done_step, d._trainer_step, d._saving = _Actors(), 14, 14, False
    d._done_order, d._done_pending, d._in_warm_start = {"epoch": 0}, {}, False
    monkeypatch.setattr(trainer, "latest_checkpoint", latest_of)
    return d._failed(15, KeyboardInterrupt())


def test_the_interrupt_message_names_the_checkpoint_it_saved_once(tmp_path, monkeypatch):
    def latest(root):
        return Path(root) / "step_000014"

    e = _interrupted(tmp_path, monkeypatch, latest)
    ckpt = str(tmp_path / "int" / "checkpoints" / "step_000014")
    assert str(e).count(ckpt) == 1, str(e)  # was: twice
    assert str(e).startswith("interrupted during step 15. Saved a checkpoint of the last completed step 14: ")
    assert "Rerun with run.resume=true to continue from it" in str(e)
    assert e.checkpoint == ckpt


def test_the_interrupt_message_still_names_an_older_checkpoint(tmp_path, monkeypatch):
    older = tmp_path / "int" / "checkpoints" / "step_000010"

    def latest(root):  # the checkpoint just saved is not the latest complete one (not expected; said as it is)
        return older

    e = _interrupted(tmp_path, monkeypatch, latest)
    assert f"The last complete checkpoint is {older}; rerun with run.resume=true" in str(e)


@pytest.mark.slow
def test_a_resume_with_a_step_left_still_records_its_amendments(tmp_path):
    """With a step left (its checkpoint gone) the same presentation key is an amendment from that step, as the
    bit-neutral keys always were (config.yaml holds the new value: amendments.jsonl says from when)."""
    run = tmp_path / "fin"
    args = ["train", *SMALL, "checkpoint.every=1", f"run.dir={run}"]
    assert _cli(args, tmp_path).returncode == 0
    shutil.rmtree(run / "checkpoints" / "step_000002")
    p = _cli([*args, "run.resume=true", "logger.progress=true"], tmp_path)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in (run / "amendments.jsonl").read_text().splitlines()]
    assert lines == [{"from_step": 2, "key": "logger.progress", "new": True, "old": False}]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
