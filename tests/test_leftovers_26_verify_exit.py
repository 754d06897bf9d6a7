"""``rlrepro verify``: a re-execution that fails (a step failed, or its set-up crashed) exits 3 with a message naming
the failure and where its log and records are; 1 stays "the steps ran and differ". Before: a failed step exited 1,
the code of a divergence, and any other crash of the re-execution was a traceback (exit 1 too)."""
import pytest
from omegaconf import OmegaConf

from rlrepro.cli import compose_config
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import verify as verify_mod
from rlrepro.orchestration.errors import RunFailed, RunInterrupted
from rlrepro.orchestration.verify import main_verify
from test_repro_diff import make_run


@pytest.fixture
def run(tmp_path):
    cfg = OmegaConf.to_container(compose_config(["recipe=grpo_tiny"]), resolve=True)
    return make_run(tmp_path / "run", steps=2, config=cfg)


def _driver_fails_with(monkeypatch, error, where="run"):
    def fail(*args, **kwargs):
        raise error

    if where == "init":
        monkeypatch.setattr(driver_mod.GRPODriver, "__init__", fail)
    else:
        monkeypatch.setattr(driver_mod.GRPODriver, "__init__", lambda self, cfg, out: None)
        monkeypatch.setattr(driver_mod.GRPODriver, "run", fail)


def test_a_failed_step_of_the_reexecution_exits_3_naming_it_and_its_log(run, monkeypatch, capsys):
    failure = RunFailed("step 2 failed: RuntimeError: CUDA error: an illegal memory access. The last complete "
                        "checkpoint is none.", step=2, checkpoint=None, cause=RuntimeError("x"))
    _driver_fails_with(monkeypatch, failure)
    assert main_verify([str(run), "--from-step", "1"]) == 3
    err = capsys.readouterr().err
    out = run / "verify" / "from_1"
    assert err == ("rlrepro verify: the re-execution failed, so nothing was compared (exit 3; exit 1 means the "
                   "steps ran and differ): step 2 failed: RuntimeError: CUDA error: an illegal memory access. The "
                   f"last complete checkpoint is none. Its log is the output above; its records are in {out}; the "
                   "Ray actors' logs are under /tmp/ray/session_latest/logs\n")


def test_the_summary_of_a_failed_reexecution_is_named_when_it_was_written(run, monkeypatch, capsys):
    def fail(self, **kwargs):
        (run / "verify" / "from_1" / "summary.txt").write_text("status: failed\n")
        raise RunFailed("step 1 failed: OSError: disk", step=1, checkpoint=None, cause=OSError("disk"))

    monkeypatch.setattr(driver_mod.GRPODriver, "__init__", lambda self, cfg, out: None)
    monkeypatch.setattr(driver_mod.GRPODriver, "run", fail)
    assert main_verify([str(run)]) == 3
    err = capsys.readouterr().err
    assert f"Its log is the output above; {run / 'verify' / 'from_1' / 'summary.txt'} says what it did;" in err


def test_a_crash_of_the_reexecutions_set_up_exits_3_not_a_traceback(run, monkeypatch, capsys):
    _driver_fails_with(monkeypatch, RuntimeError("the local Ray instance took the node address 10.0.0.5"), "init")
    assert main_verify([str(run)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("rlrepro verify: the re-execution failed, so nothing was compared (exit 3; exit 1 means "
                          "the steps ran and differ): RuntimeError: the local Ray instance took the node address "
                          "10.0.0.5. Its log is the output above; ")
    assert "Traceback" not in err


def test_bad_input_and_interrupts_keep_their_codes(run, monkeypatch, capsys):
    _driver_fails_with(monkeypatch, ValueError("data row 3: not JSON"))
    assert main_verify([str(run)]) == 2
    assert capsys.readouterr().err == "rlrepro verify: data row 3: not JSON\n"
    _driver_fails_with(monkeypatch, RunInterrupted("interrupted during step 1", step=1, checkpoint=None,
                                                   cause=KeyboardInterrupt()))
    assert main_verify([str(run)]) == 130


def test_steps_that_ran_keep_exit_0_and_1(run, tmp_path, monkeypatch, capsys):
    from rlrepro.repro.diff import diff_runs

    same = make_run(tmp_path / "same", steps=2, config=OmegaConf.to_container(OmegaConf.load(run / "config.yaml")))

    def other_mutate(step, samples, weights):
        samples[0]["token_ids"][0] += 1

    other = make_run(tmp_path / "other", steps=2, mutate=other_mutate,
                     config=OmegaConf.to_container(OmegaConf.load(run / "config.yaml")))
    for b, code in ((same, 0), (other, 1)):
        monkeypatch.setattr(verify_mod, "verify_run", lambda r, k, n, b=b: (diff_runs(r, b, steps=range(1, 3)), 0))
        assert main_verify([str(run)]) == code
    assert verify_mod.EXIT_REEXECUTION_FAILED == 3
