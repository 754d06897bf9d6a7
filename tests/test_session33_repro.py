"""Session 33: three items the previous session left.

1. `rlrepro diff`: a fingerprint field null (not recorded) in one run and a digest in the other was a divergence at
   the first step (`FIRST DIVERGENCE: step 1, field weights`, exit 1). Now it is "recorded in only one run": no bit
   difference and not equal either (the verdict says `IDENTICAL in the recorded fields; recorded in only one run, so
   not compared: weights`, exit 0 as nothing differs; `--strict` fails it), in text and `--json`
   (`fields_recorded_in_one_run`), as a field null in both runs already was.
2. A resume of a run with no step left to run recorded the `logger.*` (any bit-neutral) keys it was given as
   amendments "from step N+1" of an N-step run and rewrote config.yaml with them, though it ran no step with them.
   Now it keeps the recorded values and records nothing (one line on stderr names what was not applied), but a
   `train.steps` cut to the steps done and how the command was started (`run.resume`, ...).
3. `save_pretrained` wrote config.json (the mark of a complete model) without fsyncing the weights first, by a
   temporary file never fsynced. Now it shares `rlrepro export`'s way (`rlrepro.model.write_config_last`): every
   other file and the directory fsynced, then config.json written atomically.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlrepro.model import load_pretrained, save_pretrained, write_tiny_checkpoint
from rlrepro.repro.diff import diff_runs, main_diff

from _io_events import record_io


# ------------------------------------------------------------------ 1. diff: a field null in one run only
def _null(run: Path, field: str, steps) -> Path:
    lines = [json.loads(ln) for ln in (run / "fingerprints.jsonl").read_text().splitlines()]
    (run / "fingerprints.jsonl").write_text("".join(
        json.dumps({**r, field: None} if r["step"] in steps else r) + "\n" for r in lines))
    return run


def test_diff_a_field_null_in_one_run_is_recorded_in_one_run_not_a_divergence(tmp_path, capsys):
    from test_repro_diff import make_run

    a = _null(make_run(tmp_path / "a", steps=3), "weights", {1, 2, 3})
    b = make_run(tmp_path / "b", steps=3)
    rep = diff_runs(a, b)
    assert rep.divergence is None and rep.diverged_steps == [] and rep.verdict == "identical"  # was: step 1, weights
    assert rep.fields_recorded_in_one_run == {"weights": {"B": [1, 2, 3]}}
    assert rep.fields_not_recorded == {}
    assert rep.exit_code() == 0 and rep.exit_code(strict=True) == 1
    lines = rep.format().splitlines()
    assert "  weights: recorded in run B only (null in run A) at 3 step(s) (1-3): not compared" in lines
    assert not any(ln.startswith("FIRST DIVERGENCE") for ln in lines)
    assert lines[-1] == ("verdict: IDENTICAL in the recorded fields; recorded in only one run, so not compared: "
                         "weights")
    assert rep.strict_failures(strict=True) == [
        "--strict: fingerprint field(s) recorded in only one run: weights (run B only)"]

    assert main_diff([str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == lines[-1]
    assert main_diff([str(a), str(b), "--strict"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "--strict: fingerprint field(s) recorded in only one run: weights (run B only)" in out
    assert out[-1].endswith("weights; exit 1: --strict failed"), out[-1]
    assert main_diff([str(a), str(b), "--json", "--strict"]) == 1
    js = json.loads(capsys.readouterr().out)
    assert js["verdict"] == "identical" and js["divergence"] is None and js["diverged_steps"] == []
    assert js["fields_recorded_in_one_run"] == {"weights": {"B": [1, 2, 3]}}
    assert js["strict_failures"] == ["--strict: fingerprint field(s) recorded in only one run: weights (run B only)"]
    assert main_diff([str(a), str(b), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strict_failures"] == []


def test_diff_null_in_one_run_either_way_and_in_both_are_each_listed(tmp_path):
    from test_repro_diff import make_run

    a = _null(_null(make_run(tmp_path / "a", steps=4), "weights", {1, 2}), "grad_norm", {1, 2, 3, 4})
    b = _null(_null(make_run(tmp_path / "b", steps=4), "weights", {3}), "grad_norm", {1, 2, 3, 4})
    rep = diff_runs(a, b)
    assert rep.verdict == "identical" and rep.divergence is None
    assert rep.fields_not_recorded == {"grad_norm": [1, 2, 3, 4]}
    assert rep.fields_recorded_in_one_run == {"weights": {"A": [3], "B": [1, 2]}}
    text = rep.format(strict=True).splitlines()
    assert "  weights: recorded in run A only (null in run B) at 1 step(s) (3): not compared" in text
    assert "  weights: recorded in run B only (null in run A) at 2 step(s) (1-2): not compared" in text
    assert text[-1] == ("verdict: IDENTICAL in the recorded fields; not recorded in either run, so not compared: "
                        "grad_norm; recorded in only one run, so not compared: weights; exit 1: --strict failed")
    assert rep.strict_failures(strict=True) == [
        "--strict: fingerprint field(s) not recorded in either run: grad_norm",
        "--strict: fingerprint field(s) recorded in only one run: weights (run A and run B only)"]


def test_diff_a_real_divergence_beside_a_field_null_in_one_run_names_only_the_differing_fields(tmp_path):
    from test_repro_diff import make_run

    def loss_changed(step, samples, weights):
        if step == 2:
            samples[0]["advantage"] += 1.0

    a = _null(make_run(tmp_path / "a", steps=3), "weights", {1, 2, 3})
    b = make_run(tmp_path / "b", steps=3, mutate=loss_changed)
    rep = diff_runs(a, b)
    assert rep.verdict == "diverged" and rep.exit_code() == 1
    assert rep.divergence.step == 2 and "weights" not in rep.divergence.fields
    assert rep.divergence.fields == ["advantages", "loss"]
    assert rep.diverged_steps == [2]
    assert rep.fields_recorded_in_one_run == {"weights": {"B": [1, 2, 3]}}
    assert rep.format().splitlines()[-1] == "verdict: DIVERGED"


# ------------------------------------------------------------------ 2. a resume of a finished run records nothing
def test_reconcile_resume_of_a_finished_run_keeps_the_recorded_config(capsys):
    from test_resume_config import changed, recorded_config

    from rlrepro.orchestration.resume import reconcile_resume

    rec = recorded_config()  # train.steps=20
    req = changed(rec, logger__progress=False, logger__wandb=True, checkpoint__export_hf=True, run__resume=True)
    config, amendments = reconcile_resume(rec, copy.deepcopy(req), completed_step=20)
    assert config == changed(rec, run__resume=True)  # how it was started, nothing else
    assert amendments == [{"key": "run.resume", "old": False, "new": True, "from_step": 21}]  # the driver drops it
    err = capsys.readouterr().err
    assert err == ("rlrepro: the run has no step left to run (20 of 20 done): logger.wandb, logger.progress, "
                   "checkpoint.export_hf not applied and not recorded (a resume records only what it changes); "
                   "`rlrepro export RUN OUT` writes its last checkpoint as an HF directory\n")
    # one step left: every change is applied and recorded from that step, as before
    config, amendments = reconcile_resume(rec, copy.deepcopy(req), completed_step=19)
    assert config == req and {a["key"] for a in amendments} == {
        "logger.wandb", "logger.progress", "checkpoint.export_hf", "run.resume"}
    assert {a["from_step"] for a in amendments} == {20}
    assert capsys.readouterr().err == ""


def test_reconcile_resume_that_cuts_train_steps_to_the_steps_done_records_only_that():
    from test_resume_config import changed, recorded_config

    from rlrepro.orchestration.resume import reconcile_resume

    rec = recorded_config(min_lr_ratio=1.0)
    config, amendments = reconcile_resume(rec, changed(rec, train__steps=12, logger__progress=False),
                                          completed_step=12)
    assert config == changed(rec, train__steps=12)
    assert amendments == [{"key": "train.steps", "old": 20, "new": 12, "from_step": 13}]
    # and one that extends a finished run runs steps with every change: all recorded
    config, amendments = reconcile_resume(rec, changed(rec, train__steps=30, logger__progress=False),
                                          completed_step=20)
    assert config == changed(rec, train__steps=30, logger__progress=False)
    assert [(a["key"], a["from_step"]) for a in amendments] == [("train.steps", 21), ("logger.progress", 21)]


def test_a_driver_resume_of_a_finished_run_writes_no_amendment_and_keeps_config_values(tmp_path, monkeypatch,
                                                                                       capsys):
    from test_resume_preflight import recorded_run, small_checkpoint

    from rlrepro.cli import compose_config
    from rlrepro.orchestration import driver as driver_mod

    run, args, order = recorded_run(tmp_path, monkeypatch)  # train.steps=3, logger.progress=false
    small_checkpoint(run / "checkpoints", 3, order)  # the last step's: nothing left to run
    cfg = compose_config([*args, "run.resume=true", "logger.progress=true"])
    driver_mod.GRPODriver(cfg, override_keys=["run.resume", "logger.progress"]).run()
    assert not (run / "amendments.jsonl").exists()  # was: logger.progress False -> True from step 4
    assert "progress: false" in (run / "config.yaml").read_text()
    err = capsys.readouterr().err
    assert "resume amends" not in err
    assert "the run has no step left to run (3 of 3 done): logger.progress not applied and not recorded" in err


@pytest.mark.slow
def test_a_finished_tiny_run_resumed_with_logger_changes_records_nothing(tmp_path):
    """Through `rlrepro train` (grpo_tiny on the CPU): a 2-step run resumed with logger.progress=true leaves no
    amendments.jsonl and config.yaml as it was but run.resume (how the command was started)."""
    run = tmp_path / "fin"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0")
    args = [sys.executable, "-m", "rlrepro.cli", "train", "recipe=grpo_tiny", f"run.dir={run}", "train.steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=4", "logger.progress=false",
            "checkpoint.every=1"]

    def train(*extra):
        return subprocess.run([*args, *extra], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    assert train().returncode == 0
    before = (run / "config.yaml").read_text()
    records = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "fingerprints.jsonl")}
    p = train("run.resume=true", "logger.progress=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (run / "amendments.jsonl").exists()
    assert (run / "config.yaml").read_text() == before.replace("  resume: false\n", "  resume: true\n")
    assert {n: (run / n).read_bytes() for n in records} == records
    assert "logger.progress not applied and not recorded" in p.stderr


# ------------------------------------------------------------------ 3. save_pretrained: config.json last, fsynced
@pytest.mark.parametrize("shard", [None, 4096])
def test_save_pretrained_fsyncs_every_file_and_the_directory_before_config_json(tmp_path, monkeypatch, shard):
    model = load_pretrained(write_tiny_checkpoint(tmp_path / "base", seed=5, num_hidden_layers=1))
    out = (tmp_path / "out").resolve()
    events = record_io(monkeypatch)
    save_pretrained(model, out, max_shard_bytes=shard)
    cfg = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out / "config.json")]
    assert len(cfg) == 1, events
    before = [e[1] for e in events[:cfg[0]] if e[0] == "fsync"]
    others = sorted(str(p) for p in out.iterdir() if p.name != "config.json")
    assert (shard is None) == (str(out / "model.safetensors") in others)
    assert sorted(set(before) & set(others)) == others  # every other file on disk first (was: none of them)
    tmp = events[cfg[0]][1]
    assert before[-1] == tmp and before[-2] == str(out)  # then the directory, then config.json's own bytes
    assert events[cfg[0] + 1:] == [("fsync", str(out))]  # and the rename
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert load_pretrained(out).state_dict().keys() == model.state_dict().keys()


def test_save_pretrained_that_dies_before_the_weights_are_on_disk_leaves_no_config_json(tmp_path, monkeypatch):
    model = load_pretrained(write_tiny_checkpoint(tmp_path / "base", seed=5, num_hidden_layers=1))
    out = (tmp_path / "out").resolve()
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(5, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output error"):
        save_pretrained(model, out)
    assert not (out / "config.json").exists()  # was: written, the weights never fsynced


def test_save_pretrained_and_export_share_one_config_last_helper(tmp_path, monkeypatch):
    import rlrepro.model
    import rlrepro.model.checkpoint_io as io

    from test_session32_export_repro import _fake_run

    from rlrepro.orchestration.export import export_checkpoint

    model = load_pretrained(write_tiny_checkpoint(tmp_path / "base", seed=5, num_hidden_layers=1))
    run = _fake_run(tmp_path)
    calls: list[str] = []
    real = io.write_config_last

    def spy(path, config):
        calls.append(Path(path).name)
        return real(path, config)

    monkeypatch.setattr(io, "write_config_last", spy)
    monkeypatch.setattr(rlrepro.model, "write_config_last", spy)
    save_pretrained(model, tmp_path / "direct")
    assert calls == ["direct"]
    calls.clear()
    final = export_checkpoint(run, tmp_path / "exported")
    tmp = f"exported.tmp-{os.getpid()}"
    assert calls == [tmp, tmp]  # save_pretrained into the export's directory, then finish_export
    assert (final / "config.json").is_file() and load_pretrained(final).config.to_dict()
