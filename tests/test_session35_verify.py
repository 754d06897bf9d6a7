"""Session 35: ``rlrepro verify`` and ``rlrepro diff --bisect`` as a user proving a run reproduces.

* a rollout record changed after the run wrote it (one token of ``rollouts/step_N.jsonl.gz``) was not seen: the
  fingerprints are digests of what the run computed, so verify said IDENTICAL (exit 0). Now the rollout files of the
  re-executed steps are compared too: exit 1 naming the step, the sample, the key and the position.
* ``--from-step`` outside the recorded steps said ``step 0 is not recorded (recorded steps: 1..3)`` and ``--steps``
  past the last step ``step 6 is not recorded; the last recorded step is 3``: neither named the argument nor the fix.
* ``--json`` had no word of what verify did: ``verify`` {``from_step``, ``last_step``, ``started_from_checkpoint``,
  ``dir``, ``rollout_diffs``} is added.
* bisect without a common checkpoint did not say which run lacks one (a verify re-execution keeps none).
"""
import gzip
import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from omegaconf import OmegaConf

from rlrepro.cli import compose_config
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import verify as verify_mod
from rlrepro.orchestration.verify import main_verify
from rlrepro.repro.bisect import bisect_runs
from rlrepro.repro.records import ReproError
from test_repro_diff import make_run


def _fake_driver(monkeypatch, original):
    """A re-execution that writes the records ``original`` (an untouched copy of the run) holds."""
    class FakeDriver:
        def __init__(self, cfg, out):
            self.cfg, self.out = cfg, out

        def run(self, *, start_checkpoint=None, last_step=None):
            OmegaConf.save(self.cfg, self.out / "config.yaml")
            for name in ("fingerprints.jsonl", "metrics.jsonl"):
                shutil.copyfile(original / name, self.out / name)
            shutil.copytree(original / "rollouts", self.out / "rollouts")

    monkeypatch.setattr(driver_mod, "GRPODriver", FakeDriver)


def _tree_digest(run):
    """sha256 of every file of the run outside verify/ (and the lock file), with the listing of names."""
    out = {}
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run)
        if rel.parts[0] in ("verify", ".lock"):
            continue
        out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def _tamper_token(run, step, sample=1, pos=0):
    path = run / "rollouts" / f"step_{step:06d}.jsonl.gz"
    lines = gzip.open(path, "rt").read().splitlines()
    rec = json.loads(lines[sample])
    rec["token_ids"][pos] += 1
    lines[sample] = json.dumps(rec)
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return rec["token_ids"][pos]


@pytest.fixture
def run_and_copy(tmp_path):
    cfg = OmegaConf.to_container(compose_config(["recipe=grpo_tiny"]), resolve=True)
    run = make_run(tmp_path / "run", steps=3, config=cfg)
    original = tmp_path / "original"
    shutil.copytree(run, original)
    return run, original


def test_out_of_range_arguments_name_the_value_and_the_fix_before_any_work(run_and_copy, capsys):
    run, _ = run_and_copy
    for argv, want in ((["--from-step", "0"], "--from-step 0: step 0 is not recorded in"),
                       (["--from-step", "4"], "--from-step 4: step 4 is not recorded in"),
                       (["--from-step", "-1"], "--from-step -1: step -1 is not recorded in")):
        assert main_verify([str(run), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"rlrepro verify: {want}") and "give a recorded step, 1..3 (or leave it out: 1)" in err
    assert main_verify([str(run), "--from-step", "2", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "--steps 5: from step 2 that reaches step 6, but the last recorded step of" in err
    assert "give --steps 2 or fewer" in err
    assert not (run / "verify").exists()  # refused before any work


def test_a_changed_rollout_token_is_a_divergence_naming_step_sample_key_and_position(run_and_copy, monkeypatch,
                                                                                      capsys):
    run, original = run_and_copy
    _fake_driver(monkeypatch, original)
    report, start = verify_mod.verify_run(run, 1, progress=False)
    assert report.verdict == "identical" and report.rollout_diffs == [] and start == 0
    new = _tamper_token(run, 2, sample=1, pos=0)
    before = _tree_digest(run)
    assert main_verify([str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "diverged" and data["divergence"] is None  # the fingerprints agree
    assert data["verify"]["from_step"] == 1 and data["verify"]["last_step"] == 3
    assert data["verify"]["started_from_checkpoint"] is None and data["verify"]["dir"].endswith("from_1")
    (d,) = data["verify"]["rollout_diffs"]
    assert (d["step"], d["sample"], d["key"]) == (2, 1, "token_ids")
    assert f"token_ids[0]: recorded {new}, re-executed {new - 1}" in d["message"]
    assert _tree_digest(run) == before  # verify reads the run, writes only under verify/
    assert main_verify([str(run)]) == 1
    out = capsys.readouterr().out
    assert "note: rollouts: step 2, sample 1 (prompt_uid" in out and "the fingerprints agree at this step" in out
    assert out.rstrip().endswith("verdict: DIVERGED")


def test_a_reexecution_without_rollout_files_is_a_note_not_a_divergence(run_and_copy, monkeypatch):
    run, original = run_and_copy
    shutil.rmtree(original / "rollouts")
    (original / "rollouts").mkdir()
    _fake_driver(monkeypatch, original)
    report, _ = verify_mod.verify_run(run, 2, progress=False)
    assert report.verdict == "identical"
    assert "rollout files not compared at step(s) 2-3: the re-execution wrote none" in report.notes


def test_bisect_without_a_common_checkpoint_says_which_run_has_which(tmp_path):
    a, b = make_run(tmp_path / "a", steps=3), make_run(tmp_path / "b", steps=3)
    for s in (1, 2):
        (a / "checkpoints" / f"step_{s:06d}").mkdir(parents=True)
        (a / "checkpoints" / f"step_{s:06d}" / "manifest.json").write_text("{}")
    with pytest.raises(ReproError) as e:
        bisect_runs(a, b, step=3, config_a={}, config_b={})
    msg = str(e.value)
    assert msg.startswith("no checkpoint common to both runs before step 3 (")
    assert f"run A ({a}) has checkpoints of step(s) 1, 2; run B ({b}) has none before step 3" in msg
    assert "a rlrepro verify re-execution keeps no checkpoints" in msg


@pytest.mark.slow
def test_a_real_run_from_scratch_reproduces_but_a_changed_rollout_token_does_not(tmp_path):
    """checkpoint.every=0: verify re-executes from scratch; the re-execution's rollout files are the run's (step 1
    agrees), the changed one (step 2) is named, and the run's files are left as they were."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlrepro.cli"]
    subprocess.run([*cmd, "train", "recipe=grpo_tiny", "train.steps=2", "checkpoint.every=0",
                    "checkpoint.save_last=false", "rollout.prompts_per_step=2", "rollout.group_size=2",
                    "rollout.max_tokens=4", "logger.progress=false", f"run.dir={run}"], check=True,
                   capture_output=True)
    _tamper_token(run, 2, sample=0, pos=0)
    before = _tree_digest(run)
    p = subprocess.run([*cmd, "verify", str(run), "--json"], capture_output=True, text=True)
    assert p.returncode == 1, p.stderr[-2000:]
    data = json.loads(p.stdout)
    assert data["diverged_steps"] == [] and data["metric_diffs"] == []
    assert [(d["step"], d["sample"], d["key"]) for d in data["verify"]["rollout_diffs"]] == [(2, 0, "token_ids")]
    assert _tree_digest(run) == before


def test_a_file_where_verify_writes_is_an_argument_error_not_a_failed_re_execution(run_and_copy, capsys):
    """RUN/verify as a file: exit 2 naming it and the fix (it was a FileExistsError, exit 3 'the re-execution
    failed'), before any work; the file is left as it was."""
    run, _ = run_and_copy
    (run / "verify").write_text("mine")
    assert main_verify([str(run)]) == 2
    err = capsys.readouterr().err
    assert "verify is a file, where rlrepro verify writes its re-execution (a folder): move or remove it" in err
    assert (run / "verify").read_text() == "mine"
