"""Session 31: defects of rlrepro/orchestration and `rlrepro train`, each reproduced first.

1. SIGTERM (or Ctrl-C) while `rlrepro train` prepared its run directory or Ray started: the driver's handler was
   installed only after Ray started, so the process died (or Ray's own handler exited with code 15) leaving
   config.yaml, base_model/ and data/ behind, a directory that looked like a started run. Now SIGTERM is an
   interrupt from the start, the entries this start created are removed, exit 130.
2. A config error found once run_training had begun printed as ``rlrepro train: ConfigError: ...``; now one line
   as every other user error of the command line prints.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from _cli_run import run_cli

from rlrepro.cli import cmd_train

TRAIN = ["train"]
SMALL = ["recipe=grpo_tiny", "train.steps=1", "rollout.prompts_per_step=2", "logger.progress=false"]


def _run_cli(args: list[str], cwd: Path, faults: list[dict] | None = None, timeout: float = 180):
    return run_cli(args, cwd, faults, timeout)


def _entries(run: Path) -> set[str]:
    return set(os.listdir(run))


# ------------------------------------------------------------------ 1. SIGTERM before the run started
@pytest.mark.parametrize("at", ["before_ray", "ray_init", "after_ray"])
def test_sigterm_during_setup_leaves_no_started_run(tmp_path, at):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n", encoding="utf-8")  # the user's: not this start's to remove
    p = _run_cli(TRAIN + SMALL + [f"run.dir={run}"], tmp_path, faults=[{"kind": "sigterm", "step": 0, "at": at}])
    # was: exit -15 (killed by the default handler) or 15 (Ray's handler), config.yaml, base_model/, data/ left
    assert p.returncode == 130, p.stderr
    assert "Traceback" not in p.stderr
    assert "interrupted before the run started; nothing was recorded" in p.stderr
    assert _entries(run) == {".lock", "notes.txt"}, _entries(run)
    assert (run / "notes.txt").read_text(encoding="utf-8") == "mine\n"


def test_after_an_interrupted_start_the_same_command_runs(tmp_path):
    run = tmp_path / "run"
    p = _run_cli(TRAIN + SMALL + [f"run.dir={run}"], tmp_path,
                 faults=[{"kind": "sigterm", "step": 0, "at": "ray_init"}])
    assert p.returncode == 130, p.stderr
    assert not run.exists()  # this start created the directory: it goes, its .lock with it
    p = _run_cli(TRAIN + SMALL + [f"run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run / "checkpoints" / "step_000001").is_dir()
    # rlrepro verify re-executes from scratch here (no checkpoint before step 1): interrupted in its set-up, it says
    # so and exits 130 (not a KeyboardInterrupt traceback), and its directory holds nothing of the start
    p = _run_cli(["verify", str(run)], tmp_path, faults=[{"kind": "sigterm", "step": 0, "at": "before_ray"}])
    assert p.returncode == 130, p.stderr
    assert "Traceback" not in p.stderr and "interrupted before the run started" in p.stderr
    assert _entries(run / "verify" / "from_1") <= {".lock"}
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # the run's own records are untouched


def test_ray_init_guard_turns_rays_sigterm_exit_into_an_interrupt():
    """In-process, without Ray: ray.init replaces the SIGTERM handler and its handler calls sys.exit(15); with the
    interrupt handler in place, the guard re-raises that as KeyboardInterrupt, shuts the half-started Ray down and
    puts the interrupt handler back."""
    from rlrepro.orchestration.ray_start import _ray_init_guard, restore_sigterm, sigterm_as_interrupt

    class FakeRay:
        shut = 0

        def shutdown(self):
            self.shut += 1

    ray = FakeRay()
    previous = sigterm_as_interrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            with _ray_init_guard(ray):
                signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))  # what ray.init installs
                raise SystemExit(signal.SIGTERM)
        assert ray.shut == 1
        assert getattr(signal.getsignal(signal.SIGTERM), "rlrepro_interrupt", False)
        with _ray_init_guard(ray):  # a ray.init that returns: its handler is replaced by the interrupt again
            signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))
        assert getattr(signal.getsignal(signal.SIGTERM), "rlrepro_interrupt", False) and ray.shut == 1
    finally:
        restore_sigterm(previous)
    with pytest.raises(SystemExit):  # without the interrupt handler (a Python caller's own): Ray's behaviour stays
        with _ray_init_guard(ray):
            raise SystemExit(signal.SIGTERM)
    assert ray.shut == 2


def test_driver_run_restores_the_callers_sigterm_handler(tmp_path):
    """GRPODriver.run installs the interrupt handler first thing and puts the caller's back when it returns (here:
    a start refused in set-up, before Ray)."""
    from rlrepro.cli import compose_config
    from rlrepro.orchestration.config import ConfigError
    from rlrepro.orchestration.driver import GRPODriver

    cfg = compose_config(["recipe=grpo_tiny", f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=600",
                          "data.synthetic.num=10"])
    mine = lambda s, f: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(ConfigError):
            GRPODriver(cfg).run()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not (tmp_path / "run").exists()  # the refused start created the directory: it goes


# ------------------------------------------------------------------ 2. a config error after run_training began
def test_setup_config_error_prints_one_line_without_class_name(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLREPRO_DEBUG", raising=False)
    rc = cmd_train(["recipe=grpo_tiny", f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=600",
                    "data.synthetic.num=10"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    # was "rlrepro train: ConfigError: the data set has ..."
    assert lines[-1].startswith("rlrepro train: the data set has 10 prompts"), err
    assert "ConfigError" not in err and "Traceback" not in err


@pytest.mark.parametrize("error", [ValueError("bad value x"), FileNotFoundError(2, "No such file", "/nope"),
                                   ValueError()])
def test_other_setup_errors_print_one_clean_line(tmp_path, capsys, monkeypatch, error):
    import rlrepro.orchestration as orch

    def refuse(cfg, **kw):
        raise error

    monkeypatch.setattr(orch, "run_training", refuse)
    monkeypatch.delenv("RLREPRO_DEBUG", raising=False)
    assert cmd_train(SMALL + [f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlrepro train: ")
    assert err != "rlrepro train:" and f"{type(error).__name__}: " not in err


# ------------------------------------------------------------------ 3. review: rlrepro eval and a damaged step log
def _fake_eval(monkeypatch, step: int = 1):
    import contextlib

    import rlrepro.orchestration.evaluation as ev
    import rlrepro.repro.inputs as inputs

    def evaluate(run, step_arg, source, records, fingerprint=False, eval_keys=None):
        if records is not None:
            records.append({"key": "u:0/0", "reward": 1.0})
        return step, {"eval/reward_mean": 1.0, "repro/eval_fingerprint": "abc"}

    monkeypatch.setattr(ev, "evaluate_checkpoint", evaluate)
    monkeypatch.setattr(inputs, "in_launch_dir", lambda run: contextlib.nullcontext(run))
    return ev


def test_eval_with_a_malformed_metrics_line_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    ev = _fake_eval(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "eval/rew\n{"step": 1, "eval/reward_mean": 1.0}\n')
    out = tmp_path / "records.jsonl"
    rc = ev.main_eval([str(run), "--records", str(out)])  # was a JSONDecodeError traceback (exit 1)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "metrics.jsonl:2" in err and err.startswith("rlrepro eval: ")
    assert out.read_text().strip() == '{"key": "u:0/0", "reward": 1.0}'  # the evaluation's records are kept


def test_eval_drops_a_torn_last_metrics_line(tmp_path, monkeypatch, capsys):
    ev = _fake_eval(monkeypatch, step=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "eval/reward_mean": 0.5}\n{"step": 2, "eval/rew')
    assert ev.main_eval([str(run)]) == 0  # a crashed run's torn last line: no record of step 2, nothing compared
    assert "the run logged no eval at this step" in capsys.readouterr().out
