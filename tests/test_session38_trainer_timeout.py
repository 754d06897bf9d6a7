"""``train.call_timeout_s``: how long the driver waits for one call of the trainer actors (a train step, a
checkpoint write or load, an export) before it takes the trainer as hung, stops it and ends the run naming the key
(before, a hung trainer held the run for ever: only rollout workers were timed). Checked before any work,
bit-neutral on resume; end to end (slow), a trainer hung in step 2 ends the run, no checkpoint is asked of it, and
the resume from step 1's checkpoint ends bitwise identical to a run that never hung."""
from __future__ import annotations

import copy
import json
import time

import pytest

from rlrepro.checks import ConfigError
from rlrepro.orchestration.actors import ActorGroup
from rlrepro.orchestration.errors import TrainerHung
from rlrepro.orchestration.resume import reconcile_resume
from rlrepro.trainer import TrainConfig
from test_resume_config import recorded_config


def test_default_and_bad_values():
    assert TrainConfig().call_timeout_s is None
    assert TrainConfig(call_timeout_s=3600).call_timeout_s == 3600
    for bad in (0, -5, float("nan"), float("inf"), "10m", True):
        with pytest.raises(ConfigError, match=r"train\.call_timeout_s") as err:
            TrainConfig(call_timeout_s=bad)
        assert "null (no limit) or a positive number" in str(err.value)


def test_resume_may_change_it():
    rec = recorded_config(call_timeout_s=None)
    req = copy.deepcopy(rec)
    req["train"]["call_timeout_s"] = 900.0
    config, amendments = reconcile_resume(rec, req, completed_step=3)
    assert config["train"]["call_timeout_s"] == 900.0
    assert amendments == [{"key": "train.call_timeout_s", "old": None, "new": 900.0, "from_step": 4}]


class _Ray:
    """Ray's get as far as ActorGroup.get uses it: a call answers after ``answer_s`` seconds."""

    def __init__(self, answer_s):
        self.answer_s, self.timeouts, self.killed = answer_s, [], []

    def get(self, refs, timeout=None):
        from ray.exceptions import GetTimeoutError

        self.timeouts.append(timeout)
        if timeout is not None and self.answer_s > timeout:
            raise GetTimeoutError("Get timed out: some object(s) not ready.")
        return refs

    def kill(self, actor):
        self.killed.append(actor)


def _group(timeout, answer_s):
    pytest.importorskip("ray")
    group = object.__new__(ActorGroup)  # only what get() reads
    group.call_timeout_s = TrainConfig(call_timeout_s=timeout).call_timeout_s
    group._ray, group.trainers = _Ray(answer_s), ["rank0", "rank1"]
    return group


def test_a_call_past_the_timeout_stops_the_trainer_naming_the_call_and_the_key():
    group = _group(5.0, answer_s=60.0)
    with pytest.raises(TrainerHung) as err:
        group.get(["ref"], "its train_step call")
    text = str(err.value)
    assert "has not answered its train_step call in 5 s (train.call_timeout_s)" in text
    assert "raise train.call_timeout_s" in text and "RLREPRO_STACK_DUMP_S" in text
    assert group._ray.timeouts == [5.0] and group._ray.killed == ["rank0", "rank1"]


def test_calls_within_the_timeout_or_without_one_answer():
    group = _group(5.0, answer_s=1.0)
    assert group.get(["ref"]) == ["ref"] and group._ray.killed == []
    group = _group(None, answer_s=1e9)  # null: ray.get without a timeout, as before the key
    assert group.get(["ref"]) == ["ref"] and group._ray.timeouts == [None]


def test_the_hang_trainer_fault_is_a_trainer_fault():
    from rlrepro.orchestration.fault_injection import FaultPlan

    plan = FaultPlan([{"kind": "hang_trainer", "step": 2, "seconds": 1}])
    assert plan.has_trainer_faults()
    assert plan.take("hang_trainer", 1) is None and plan.take("hang_trainer", 2)["seconds"] == 1


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_hung_trainer_ends_the_run_and_the_resume_is_bitwise_identical(tmp_path, monkeypatch, capsys):
    from rlrepro.cli import main
    from test_session35_hang import BASE, numbers, records

    base = [a for a in BASE if not a.startswith("checkpoint.every")] + ["checkpoint.every=1"]
    monkeypatch.delenv("RLREPRO_FAULTS", raising=False)
    ref = tmp_path / "ref"
    assert main(["train", *base, f"run.dir={ref}"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "hang_trainer", "step": 2, "seconds": 600}]))
    run = tmp_path / "run"
    start = time.monotonic()
    assert main(["train", *base, f"run.dir={run}", "train.call_timeout_s=40"]) != 0
    assert time.monotonic() - start < 300  # the 600 s sleep was cut short
    err = capsys.readouterr().err
    assert "step 2 failed: TrainerHung: the trainer has not answered its train_step call in 40 s" in err, err
    assert "could not be saved" not in err and "died" not in err  # no checkpoint was asked of the hung trainer
    assert [m["step"] for m in records(run, "metrics.jsonl")] == [1]
    monkeypatch.delenv("RLREPRO_FAULTS")
    assert main(["train", *base, f"run.dir={run}", "run.resume=true"]) == 0
    assert main(["diff", str(ref), str(run), "--strict"]) == 0
    assert records(run, "fingerprints.jsonl") == records(ref, "fingerprints.jsonl")
    assert [numbers(m) for m in records(run, "metrics.jsonl")] == [numbers(m) for m in records(ref, "metrics.jsonl")]
