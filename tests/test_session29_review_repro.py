"""Session 29 review of rlrepro/repro and verify/resume.

* ``config_at_step``: two resumes from one checkpoint (a resume that amended an eval key, then stopped before its
  next checkpoint, resumed again with another value) leave two amendments of one key from one step; the value
  before them is the first one's ``old``. Before: the second's, so ``rlrepro verify`` re-ran the early evaluations
  with the first resume's setting and said DIVERGED (exit 1) on a run that reproduces.
* ``rlrepro verify`` writes records only: no checkpoint of the last step (``checkpoint.save_last``) and no HF export,
  which nothing reads and which for a large model fill the run's disk; the keys it sets are not in its config diff.
* a damaged ``amendments.jsonl`` is an error naming the file, the line and the fix (before: the bare JSON error,
  ``rlrepro verify: Unterminated string starting at: line 1 column 25``, or a KeyError read as a failed re-execution).
* ``rlrepro verify --from-step K`` of a resumed run: the re-execution's inputs.json starts from the run's first
  start without the run's own ``resumes``, so diff does not say the run's resumes a second time as run B's.
"""
import shutil

import pytest

from omegaconf import OmegaConf

from rlrepro.cli import compose_config
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import verify as verify_mod
from rlrepro.orchestration.resume import config_at_step
from rlrepro.repro.inputs import INPUTS_FORMAT, read_inputs, write_inputs
from test_repro_diff import make_run

AMEND_TWICE = [{"key": "eval.num_samples", "old": 2, "new": 4, "from_step": 4},
               {"key": "eval.num_samples", "old": 4, "new": 8, "from_step": 4},
               {"key": "train.steps", "old": 3, "new": 5, "from_step": 4}]


def test_two_amendments_of_one_key_from_one_step_put_back_the_first_ones_old_value():
    latest = {"eval": {"num_samples": 8, "every": 2}, "train": {"steps": 5}}
    assert config_at_step(latest, AMEND_TWICE, 2) == {"eval": {"num_samples": 2, "every": 2}, "train": {"steps": 3}}
    assert config_at_step(latest, AMEND_TWICE, 4) == latest
    # a second resume that put the recorded value back: before step 4 it is the recorded one
    back = [{"key": "eval.every", "old": 0, "new": 2, "from_step": 4},
            {"key": "eval.every", "old": 2, "new": 0, "from_step": 4}]
    assert config_at_step({"eval": {"every": 0}}, back, 3) == {"eval": {"every": 0}}
    # and amendments from several steps, two of them from one
    several = [{"key": "eval.every", "old": 0, "new": 2, "from_step": 4},
               {"key": "eval.every", "old": 2, "new": 3, "from_step": 6},
               {"key": "eval.every", "old": 3, "new": 5, "from_step": 6}]
    assert config_at_step({"eval": {"every": 5}}, several, 1) == {"eval": {"every": 0}}
    assert config_at_step({"eval": {"every": 5}}, several, 5) == {"eval": {"every": 2}}
    assert config_at_step({"eval": {"every": 5}}, several, 6) == {"eval": {"every": 5}}


def _fake_driver(monkeypatch, run, seen):
    class FakeDriver:
        def __init__(self, cfg, out):
            seen["cfg"], self.out = cfg, out

        def run(self, *, start_checkpoint=None, last_step=None):
            seen["start"] = start_checkpoint
            OmegaConf.save(self.seen_cfg(), self.out / "config.yaml")
            for name in ("fingerprints.jsonl", "metrics.jsonl"):
                shutil.copyfile(run / name, self.out / name)

        @staticmethod
        def seen_cfg():
            return seen["cfg"]

    monkeypatch.setattr(driver_mod, "GRPODriver", FakeDriver)


def _run(tmp_path):
    cfg = OmegaConf.to_container(compose_config(["recipe=grpo_tiny", "checkpoint.export_hf=true"]), resolve=True)
    return make_run(tmp_path / "run", steps=3, config=cfg)


def test_verify_writes_no_checkpoint_or_export_and_keeps_its_own_keys_out_of_the_config_diff(tmp_path, monkeypatch):
    run, seen = _run(tmp_path), {}
    _fake_driver(monkeypatch, run, seen)
    report, start = verify_mod.verify_run(run, 1, progress=False)
    cfg = seen["cfg"].checkpoint
    assert (cfg.every, cfg.save_last, cfg.export_hf) == (0, False, False)
    assert start == 0 and report.verdict == "identical" and report.steps_compared == [1, 2, 3]
    assert report.config_diffs == []


def test_verify_from_a_checkpoint_does_not_say_the_runs_resumes_as_its_own(tmp_path, monkeypatch):
    run, seen = _run(tmp_path), {}
    resume = {"from_step": 2, "differences": [{"what": "env", "key": "RLREPRO_X", "a": None, "b": "1", "bits": True,
                                               "message": "RLREPRO_X differs: unset vs '1'"}]}
    first = {"format": INPUTS_FORMAT, "data": {"files": {}, "records_digest": "r"}, "weights_digest": "w"}
    write_inputs(run, {**first, "resumes": [resume]})
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    monkeypatch.setattr(verify_mod, "_checkpoint_before", lambda root, step: (1, root / "step_000001"))
    _fake_driver(monkeypatch, run, seen)
    report, start = verify_mod.verify_run(run, 2, progress=False)
    assert start == 1 and seen["start"] == str(run / "checkpoints" / "step_000001")
    assert read_inputs(run / "verify" / "from_2") == first   # the first start's record, which the driver extends
    assert [d.message.split(":")[0] for d in report.input_diffs] == [
        "run A resumed at step 2 with other inputs than its first start (first start vs resume)"]
    assert report.verdict == "identical" and report.steps_compared == [2, 3]


def test_a_damaged_amendments_file_is_an_error_naming_the_file_line_and_fix(tmp_path):
    from rlrepro.orchestration.config import ConfigError
    from rlrepro.orchestration.resume import read_amendments

    path = tmp_path / "amendments.jsonl"
    good = '{"from_step": 4, "key": "eval.every", "new": 2, "old": 0}\n'
    path.write_text(good + "\n")
    assert read_amendments(tmp_path) == [{"from_step": 4, "key": "eval.every", "new": 2, "old": 0}]
    for bad in ('{"from_step": 4, "key": "eval.num', '{"key": "eval.every", "new": 2}', "[1, 2]"):
        path.write_text(good + bad + "\n")
        with pytest.raises(ConfigError) as e:
            read_amendments(tmp_path)
        assert str(e.value).startswith(f"{path}:2: not an amendment (")
        assert "Fix: restore amendments.jsonl" in str(e.value)


def test_verify_of_a_run_with_a_damaged_amendments_file_exits_2_naming_it(tmp_path, capsys):
    from rlrepro.orchestration.verify import main_verify

    run = _run(tmp_path)
    (run / "amendments.jsonl").write_text('{"from_step": 4, "key": "eval.num\n')
    assert main_verify([str(run)]) == 2
    assert capsys.readouterr().err.startswith(f"rlrepro verify: {run / 'amendments.jsonl'}:1: not an amendment (")
