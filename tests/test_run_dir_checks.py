"""What a start finds in its run directory, checked before work (no Ray: the actor group is a stub).

* the synthetic data set ``RUN/data/synthetic_<task>.jsonl`` is compared with what the run's ``data.synthetic.*``
  make: a file left by a failed start with other settings is refused, not trained on;
* it is written durably (fsynced, under a temporary name ``run.overwrite`` cleans up), as ``write_jsonl`` is;
* a refused start cleans up while it still holds the run's lock, never removes ``.lock``, and never takes what
  another run wrote before it got the lock for its own;
* a malformed line in the middle of a step log is bad input: exit 2 naming ``FILE:LINE`` and the fix."""
import json
import os
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest

from _stub_actors import NoRay, Reached
from rlrepro.cli import compose_config, main
from rlrepro.data import make_synthetic_records, write_jsonl
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import preflight
from rlrepro.orchestration.config import ConfigError
from rlrepro.orchestration.run_lock import LOCK_FILE, RunDirLocked, RunLock
from rlrepro.orchestration.synthetic_file import prepare_synthetic_data, synthetic_path

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=2", "train.warmup_steps=0", "logger.progress=false", "data.max_prompt_tokens=24"]


def syn(num=8, seed=0, task="first_letter", **kwargs):
    return SimpleNamespace(task=task, num=num, seed=seed, kwargs=kwargs or {"alphabet": "abcd"})


# ------------------------------------------------------------------------------------- the synthetic data set
def test_a_synthetic_file_made_with_other_settings_is_refused_not_reused(tmp_path):
    data = synthetic_path(tmp_path, "first_letter")
    said = []
    assert prepare_synthetic_data(tmp_path, syn(num=6), say=said.append) == data  # a failed start's file
    assert len(data.read_text().splitlines()) == 6
    left = data.read_bytes()
    with pytest.raises(ConfigError) as e:
        prepare_synthetic_data(tmp_path, syn(num=8), say=said.append)
    msg = str(e.value)
    assert "num=8" in msg and str(data) in msg and "run.overwrite=true" in msg and "another run.dir" in msg
    assert data.read_bytes() == left
    # the same settings: used as it is; other kwargs or seed: refused
    assert prepare_synthetic_data(tmp_path, syn(num=6)) == data and data.read_bytes() == left
    with pytest.raises(ConfigError, match="'xyz'"):
        prepare_synthetic_data(tmp_path, syn(num=6, alphabet="xyz"))
    with pytest.raises(ConfigError, match="seed=1"):
        prepare_synthetic_data(tmp_path, syn(num=6, seed=1))
    # a fresh run's run.overwrite=true makes it again
    prepare_synthetic_data(tmp_path, syn(num=8), overwrite=True, say=said.append)
    assert data.read_bytes() == write_jsonl(make_synthetic_records("first_letter", 8, 0, alphabet="abcd"),
                                            tmp_path / "ref.jsonl").read_bytes()
    assert any("making" in s and "again" in s for s in said)


def test_an_edited_synthetic_file_is_refused_and_a_resume_reads_it_as_it_is(tmp_path):
    data = synthetic_path(tmp_path, "first_letter")
    prepare_synthetic_data(tmp_path, syn())
    edited = data.read_bytes().replace(b'"answer": "a"', b'"answer": "b"', 1)
    assert edited != data.read_bytes()
    data.write_bytes(edited)  # the same settings, the file edited
    with pytest.raises(ConfigError, match="edited since"):
        prepare_synthetic_data(tmp_path, syn())
    # a resume reads it as it is (inputs.json's sha256 of it decides whether it is the run's data)
    assert prepare_synthetic_data(tmp_path, syn(), resume=True) == data and data.read_bytes() == edited


def test_a_fresh_run_does_not_train_on_a_failed_starts_synthetic_file(tmp_path, monkeypatch):
    """The reported case: a start with data.synthetic.num=6 failed before recording a step; a fresh run with the
    recipe's num into the same run.dir was accepted and trained on the 6-row file."""
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoRay)
    run = tmp_path / "run"
    with pytest.raises(Reached):
        driver_mod.GRPODriver(compose_config([*COMMON, f"run.dir={run}", "data.synthetic.num=6"])).setup()
    data = synthetic_path(run, "first_letter")
    assert len(data.read_text().splitlines()) == 6
    with pytest.raises(ConfigError, match="num=512.*left in run.dir by an earlier start"):
        driver_mod.GRPODriver(compose_config([*COMMON, f"run.dir={run}"])).setup()
    d = driver_mod.GRPODriver(compose_config([*COMMON, f"run.dir={run}", "run.overwrite=true"]))
    with pytest.raises(Reached):
        d.setup()
    assert len(d.prompts) == 512 and len(data.read_text().splitlines()) == 512


def test_the_synthetic_file_is_fsynced_under_a_name_overwrite_cleans_up(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b)))
    patterns = preflight.RUN_DIRS["data"]
    for write in (lambda: write_jsonl(make_synthetic_records("copy", 4, 0), tmp_path / "data" / "synthetic_copy.jsonl"),
                  lambda: prepare_synthetic_data(tmp_path / "run", syn())):
        events.clear()
        write()
        renames = [e for e in events if e[0] == "replace" and Path(e[2]).name.startswith("synthetic_")]
        assert renames, events
        for _, tmp, final in renames:
            assert any(fnmatch(Path(tmp).name, p) for p in patterns), (tmp, patterns)  # run.overwrite deletes it
            assert any(e == ("fsync", tmp) for e in events[:events.index(("replace", tmp, final))]), events
    # and run.overwrite's plan lists such a left-over temporary file
    left = tmp_path / "run" / "data" / ".synthetic_first_letter.jsonl.k3j2.tmp"
    left.write_text("partial")
    assert left in preflight.overwrite_plan(tmp_path / "run")


# ------------------------------------------------------------------------------------- a refused start
def test_a_refused_start_cleans_up_under_its_lock_and_keeps_the_lock_file(tmp_path, monkeypatch):
    """Before: the lock was released first and .lock removed with the rest, so a second process could take the
    lock in between and lose it, and a third then lock a new file: two holders of one run directory."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    seen = {}
    real_acquire, real_remove = RunLock.acquire, driver_mod.GRPODriver._remove_created

    def acquire(self):  # another run writes its file just before this start gets the lock
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        return real_acquire(self)

    def remove_created(self, before):
        with pytest.raises(RunDirLocked):  # another process is refused while the start cleans up
            RunLock(run).acquire()
        seen["inode"] = (run / LOCK_FILE).stat().st_ino
        real_remove(self, before)

    monkeypatch.setattr(RunLock, "acquire", acquire)
    monkeypatch.setattr(driver_mod.GRPODriver, "_remove_created", remove_created)
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoRay)
    missing = tmp_path / "no_such.jsonl"
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        driver_mod.GRPODriver(compose_config([*COMMON, f"run.dir={run}", f"data.source={missing}",
                                              "run.resume=true"])).run()
    assert seen, "the refused start did not clean up"
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "metrics.jsonl", "notes.txt"]  # base_model etc. gone
    assert (run / LOCK_FILE).stat().st_ino == seen["inode"] and (run / LOCK_FILE).read_bytes() == b""
    monkeypatch.setattr(RunLock, "acquire", real_acquire)
    RunLock(run).acquire().release()  # released at the end


# ------------------------------------------------------------------------------------- a damaged step log
def test_a_malformed_line_in_the_middle_of_a_step_log_is_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoRay)
    run = tmp_path / "run"
    args = [*COMMON, f"run.dir={run}"]
    run.mkdir()
    (run / "config.yaml").write_text(driver_mod.config_yaml(driver_mod.to_schema(compose_config(args))))
    text = json.dumps({"step": 1}) + '\n{"step": 2, garbage\n' + json.dumps({"step": 3}) + "\n"
    (run / "metrics.jsonl").write_text(text)
    assert main(["train", *args, "run.resume=true"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'}:2: malformed line in the middle of the file" in err, err
    assert "Fix: restore metrics.jsonl from a copy" in err and "Traceback" not in err
    assert (run / "metrics.jsonl").read_text() == text
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "config.yaml", "metrics.jsonl"]
