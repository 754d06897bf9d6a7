"""One writer per run directory (issue 22, item 1): ``RUN/.lock`` is flock-ed for a run's whole life and for
``rlrepro verify``'s writes. A second run is refused before it writes anything, naming the holder (pid, host,
command, start time); a lock left by a killed process is taken over with a log line; a lock still held through a
descriptor inherited by a child of a dead holder is refused naming that child."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.run_lock import LOCK_FILE, RunDirLocked, RunLock, read_holder

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=1", "train.warmup_steps=0", "logger.progress=false", "data.max_prompt_tokens=24"]

HOLDER = textwrap.dedent("""
    import os, sys, time
    from rlrepro.orchestration.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    if sys.argv[2] == "fork":  # a child inherits the descriptor (and the lock) and outlives its parent
        if os.fork() == 0:
            print("CHILD", os.getpid(), flush=True)
            time.sleep(120)
            os._exit(0)
        time.sleep(0.5)
        os._exit(0)
    print("HELD", flush=True)
    sys.stdin.readline()
    lock.release() if sys.argv[2] == "release" else os._exit(0)
""")


def hold(run_dir: Path, mode: str = "release") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(("HELD", "CHILD")), line
    proc.first_line = line
    return proc


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_lock_is_refused_naming_the_holder_then_free_once_released(tmp_path):
    run = tmp_path / "run"
    proc = hold(run)
    try:
        with pytest.raises(RunDirLocked) as ei:
            RunLock(run).acquire()
        msg = str(ei.value)
        assert f"pid {proc.pid} on host {socket.gethostname()}" in msg
        assert "-c" in msg and "started 20" in msg and str(run / LOCK_FILE) in msg and "another run.dir" in msg
        assert ei.value.holder["pid"] == proc.pid
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    said = []
    with RunLock(run, say=said.append) as lock:
        assert lock.held and read_holder(run)["pid"] == os.getpid()
    assert said == []  # a clean release leaves no holder to take over
    assert read_holder(run) is None and (run / LOCK_FILE).exists()  # emptied, never removed


def test_two_locks_in_one_process_exclude_each_other(tmp_path):
    first = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(RunDirLocked, match=f"pid {os.getpid()} "):
            RunLock(tmp_path).acquire()
    finally:
        first.release()
    RunLock(tmp_path).acquire().release()


def test_the_lock_of_a_killed_holder_is_taken_over_with_a_log_line(tmp_path):
    proc = hold(tmp_path, mode="kill")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert read_holder(tmp_path)["pid"] == proc.pid  # the dead holder's name is still in the file
    said = []
    lock = RunLock(tmp_path, say=said.append).acquire()
    try:
        assert len(said) == 1 and "taking over" in said[0] and f"pid {proc.pid} is no longer running" in said[0]
        assert read_holder(tmp_path)["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_stale_lock_file_naming_a_dead_pid_is_not_obeyed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"format": "rlrepro-run-lock", "pid": gone.pid,
                                                  "host": socket.gethostname(), "command": "rlrepro train x",
                                                  "started": "2026-01-01T00:00:00+00:00"}))
    said = []
    with RunLock(tmp_path, say=said.append):
        pass
    assert "taking over" in said[0] and "rlrepro train x" in said[0] and "2026-01-01" in said[0]


def test_a_lock_held_through_an_inherited_descriptor_names_the_process_that_holds_it(tmp_path):
    proc = hold(tmp_path, mode="fork")
    child = int(proc.first_line.split()[1])
    try:
        proc.wait(timeout=30)  # the holder that wrote its name has ended; its forked child keeps the lock
        with pytest.raises(RunDirLocked) as ei:
            RunLock(tmp_path).acquire()
        assert f"Pid {proc.pid} is no longer running" in str(ei.value) and str(child) in str(ei.value)
    finally:
        os.kill(child, signal.SIGKILL)
    for _ in range(100):  # the child is reaped by init; then the lock is free
        try:
            RunLock(tmp_path, say=lambda s: None).acquire().release()
            break
        except RunDirLocked:
            time.sleep(0.1)
    else:
        raise AssertionError("the lock was not freed after its last holder died")


def test_a_symlinked_lock_file_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        RunLock(run).acquire()
    assert target.read_text() == "keep"


class Reached(Exception):
    pass


class StubActors:
    def __init__(self, *a, **k):
        raise Reached


@pytest.mark.parametrize("extra", [[], ["run.resume=true"], ["run.overwrite=true"]], ids=["fresh", "resume",
                                                                                          "overwrite"])
def test_a_driver_into_a_locked_directory_is_refused_before_it_writes_anything(tmp_path, monkeypatch, capsys, extra):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001.tmp-1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (run / "config.yaml").write_text("# the first run's\n")
    proc = hold(run)
    try:
        before = tree(run)
        cfg = compose_config([*COMMON, f"run.dir={run}", *extra])
        with pytest.raises(RunDirLocked, match=f"pid {proc.pid} "):
            driver_mod.GRPODriver(cfg).run()
        assert main(["train", *COMMON, f"run.dir={run}", *extra]) == 2
        err = capsys.readouterr().err
        assert f"pid {proc.pid} on host" in err and "is in use" in err
        assert tree(run) == before and (run / "checkpoints" / "step_000001.tmp-1").is_dir()
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)


def test_verify_holds_the_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    proc = hold(run)
    try:
        from rlrepro.orchestration.verify import verify_run

        with pytest.raises(RunDirLocked):
            _verify_with_a_recorded_step(run, verify_run)
        assert not (run / "verify").exists()
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)


def _verify_with_a_recorded_step(run: Path, verify_run):
    from rlrepro.repro.fingerprint import fingerprint_from_samples
    from rlrepro.repro.records import dumps_line
    from rlrepro.samples import Sample

    cfg = compose_config([*COMMON, f"run.dir={run}"])
    (run / "config.yaml").write_text(driver_mod.config_yaml(driver_mod.to_schema(cfg)))
    fp = fingerprint_from_samples(1, [Sample("u", 0, [1, 2], [3], [-0.5], reward=1.0, advantage=0.0)], loss=0.0,
                                  grad_norm=0.0, weights="00" * 32)
    (run / "fingerprints.jsonl").write_text(dumps_line(fp) + "\n")
    return verify_run(run, 1, progress=False)


@pytest.mark.slow
def test_two_rlrepro_train_processes_into_one_directory(tmp_path):
    """The attack: a second `rlrepro train` into the run.dir of one that is running (another seed). Before the lock
    both exited 0 and metrics.jsonl held every step twice; now the second exits 2 naming the first, and the first
    run's records are its own."""
    run = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0")
    args = ["train", "recipe=grpo_tiny", f"run.dir={run}", "train.steps=3", "logger.progress=false",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=4", "warm_start.steps=0"]
    first = subprocess.Popen([sys.executable, "-m", "rlrepro.cli", *args, "run.seed=1"], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            holder = read_holder(run)
            if holder or first.poll() is not None:
                break
            time.sleep(0.1)
        assert holder and holder["pid"] == first.pid, first.communicate()[1][-2000:] if first.poll() else holder
        second = subprocess.run([sys.executable, "-m", "rlrepro.cli", *args, "run.seed=2"], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert "rlrepro train" in second.stderr and "run.seed=1" in second.stderr
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert "seed: 1" in (run / "config.yaml").read_text()
    assert read_holder(run) is None
