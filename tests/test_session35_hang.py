"""rollout.hang_timeout_s: a rollout worker whose generation call does not answer in time is taken as hung, killed
and replaced as a dead one is (rollout.max_restarts), and its call re-run from its keys; a timeout only ever
restarts, it never decides a number.

- the key's checks (0 = off; > 0, finite; refused otherwise), its place among the bit-neutral resume keys, and
  that the engine never gets it;
- ``ActorGroup._gather``'s timeout with a fake Ray: a hung call is replaced and resubmitted, a slow one that
  answers in time is not, a run without the key is never timed, and hangs beyond
  rollout.max_restarts stop the step with RolloutWorkerLost naming the key;
- end to end (slow): grpo_tiny with a ``hang_worker`` fault and a small timeout ends bitwise identical to the run
  without either (``rlrepro diff --strict``, and every record compared exactly).
"""
import copy
import dataclasses
import json
import math
import time

import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config, main
from rlrepro.orchestration.actors import ActorGroup, WorkerHung
from rlrepro.orchestration.errors import RolloutWorkerLost
from rlrepro.orchestration.resume import reconcile_resume
from rlrepro.orchestration.config import RolloutConfig
from rlrepro.rollout import EngineConfig


# ------------------------------------------------------------------------------------------------ the key

@pytest.mark.parametrize("value", [-1, -0.5, "nan", "inf", "-inf"])
def test_bad_hang_timeouts_are_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"rollout\.hang_timeout_s.*> 0.*or 0 \(off"):
        compose_config(["recipe=grpo_tiny", f"rollout.hang_timeout_s={value}"])


def test_a_boolean_hang_timeout_is_refused_at_composition():
    with pytest.raises(ConfigError, match=r"rollout\.hang_timeout_s=true"):
        compose_config(["recipe=grpo_tiny", "rollout.hang_timeout_s=true"])


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, True, "5"])
def test_rollout_config_refuses_bad_hang_timeouts(value):
    with pytest.raises(ConfigError, match="rollout.hang_timeout_s"):
        RolloutConfig(hang_timeout_s=value)


@pytest.mark.parametrize("value,want", [("0", 0.0), ("30", 30.0), ("0.25", 0.25)])
def test_good_hang_timeouts_are_taken(value, want):
    cfg = compose_config(["recipe=grpo_tiny", f"rollout.hang_timeout_s={value}"])
    assert cfg.rollout.hang_timeout_s == want


def test_default_is_off_and_the_engine_never_gets_the_key():
    """The driver's key (RolloutConfig), not an engine setting: EngineConfig (Engine.from_config) has no such field."""
    assert compose_config(["recipe=grpo_tiny"]).rollout.hang_timeout_s == 0
    assert RolloutConfig().hang_timeout_s == 0
    assert "hang_timeout_s" not in {f.name for f in dataclasses.fields(EngineConfig)}
    assert "hang_timeout_s" not in RolloutConfig(hang_timeout_s=12.0).engine.engine_kwargs()


def test_hang_timeout_is_bit_neutral_for_resume():
    rec = {"rollout": {"hang_timeout_s": 0.0, "max_restarts": 3}, "train": {"steps": 8}}
    req = copy.deepcopy(rec)
    req["rollout"]["hang_timeout_s"] = 120.0
    config, amendments = reconcile_resume(rec, req, completed_step=4)
    assert config["rollout"]["hang_timeout_s"] == 120.0
    assert amendments == [{"key": "rollout.hang_timeout_s", "old": 0.0, "new": 120.0, "from_step": 5}]


# ------------------------------------------------------------------------------- _gather with a fake Ray

class Ref:
    def __init__(self, value, answer_at: float | None):
        self.value, self.answer_at = value, answer_at  # answer_at None: never answers (hung)

    def ready(self) -> bool:
        return self.answer_at is not None and time.monotonic() >= self.answer_at


class FakeRay:
    def __init__(self):
        self.killed, self.waits = [], []

    def wait(self, refs, num_returns, timeout):
        self.waits.append(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = [r for r in refs if r.ready()][:num_returns]
            if ready:
                return ready, [r for r in refs if r not in ready]
            if deadline is None:
                assert any(r.answer_at is not None for r in refs), "an untimed wait on calls that never answer"
            elif time.monotonic() >= deadline:
                return [], list(refs)
            time.sleep(0.005)

    def get(self, ref):
        return ref.value

    def kill(self, actor, no_restart=True):
        assert no_restart
        self.killed.append(actor)


class NoSync:
    def worker_replaced(self):
        pass


class FakeGroup(ActorGroup):
    """An ActorGroup without Ray: worker ``w`` answers call ``n`` (counted per slot) after ``delays[(w, n)]``
    seconds (None: never), default at once."""

    def __init__(self, hang_timeout_s: float, delays: dict, max_restarts: int = 3, workers: int = 2):
        self._ray = FakeRay()
        self._placements = []
        self.hang_timeout_s = hang_timeout_s
        self.max_restarts, self.restarts, self._restarts_in_step = max_restarts, 0, 0
        self.sync = NoSync()
        self.cfg = None
        self.delays = delays
        self.made = workers
        self.workers = [f"worker{i}" for i in range(workers)]
        self.calls = {}

    def _new_worker(self, i):
        self.made += 1
        return f"worker{i}-replacement{self.made}"

    def submit(self, i, what):
        n = self.calls[i] = self.calls.get(i, -1) + 1
        delay = self.delays.get((i, n), 0.0)
        return Ref((what, i, self.workers[i]), None if delay is None else time.monotonic() + delay)

    def run(self, during="generate", version=-1):
        calls = {i: self.submit(i, "part") for i in range(len(self.workers))}
        return self._gather(calls, lambda i: self.submit(i, "part"), during, version)


def test_a_hung_generate_call_is_killed_replaced_and_re_run(capsys):
    group = FakeGroup(0.2, {(0, 0): None})  # worker 0's first call never answers
    start = time.monotonic()
    got = group.run()
    assert time.monotonic() - start >= 0.2
    assert got[1] == ("part", 1, "worker1")
    assert got[0][:2] == ("part", 0) and got[0][2].startswith("worker0-replacement")
    assert group._ray.killed == ["worker0"] and group.restarts == 1
    err = capsys.readouterr().err
    assert "rollout worker 0 has not answered its generate call in" in err
    assert "rollout.hang_timeout_s=0.2" in err and "killed and replaced" in err
    assert "rollout worker 0 lost during generate (WorkerHung" in err and "replacing it (1/3 this step)" in err


def test_a_slow_call_that_answers_in_time_is_not_restarted(capsys):
    group = FakeGroup(0.5, {(0, 0): 0.1, (1, 0): 0.2})
    got = group.run("run_episodes")
    assert got == {0: ("part", 0, "worker0"), 1: ("part", 1, "worker1")}
    assert group.restarts == 0 and group._ray.killed == []
    assert "hang" not in capsys.readouterr().err
    assert all(t is not None and t <= 0.5 for t in group._ray.waits)


def test_without_the_key_nothing_is_timed():
    # (weight-sync calls are timed too since session 36: tests/test_session36_hangs.py)
    off = FakeGroup(0.0, {(0, 0): 0.05})
    assert off.run()[0] == ("part", 0, "worker0")
    assert set(off._ray.waits) == {None} and off.restarts == 0
    sync = FakeGroup(0.0, {(0, 0): 0.05})
    assert sync.run("weight sync")[0] == ("part", 0, "worker0")
    assert set(sync._ray.waits) == {None} and sync.restarts == 0


def test_both_workers_hung_are_replaced_in_one_pass():
    group = FakeGroup(0.1, {(0, 0): None, (1, 0): None})
    got = group.run()
    assert sorted(group._ray.killed) == ["worker0", "worker1"] and group.restarts == 2
    assert all(got[i][2].startswith(f"worker{i}-replacement") for i in (0, 1))


def test_hangs_beyond_max_restarts_stop_the_step_naming_the_key():
    group = FakeGroup(0.05, {(0, 0): None, (0, 1): None}, max_restarts=1)
    with pytest.raises(RolloutWorkerLost, match=r"rollout\.max_restarts=1.*WorkerHung.*rollout\.hang_timeout_s"):
        group.run()
    assert group.restarts == 1


def test_worker_hung_is_a_timeout_error():
    assert issubclass(WorkerHung, TimeoutError)


def test_hang_worker_fault_is_known_to_the_plan(monkeypatch):
    from rlrepro.orchestration.fault_injection import FaultPlan

    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "hang_worker", "step": 2, "worker": 1,
                                                      "seconds": 30}]))
    plan = FaultPlan.from_env()
    assert not plan.has_trainer_faults()
    assert plan.take("hang_worker", 2, worker=0) is None
    assert plan.take("hang_worker", 2, worker=1)["seconds"] == 30
    assert plan.take("hang_worker", 2, worker=1) is None  # fires once


# ------------------------------------------------------------------------------------------ end to end

BASE = ["recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_tokens=6", "warm_start.steps=4", "warm_start.target=answer", "reward.fn=prefix_match",
        "checkpoint.every=0", "logger.progress=false", "train.micro_batch_size=8", "train.warmup_steps=1",
        "rollout.num_workers=2"]


def records(run, name):
    return [json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()]


def numbers(m: dict) -> dict:
    """A metrics record without what measures time or restarts (perf/*, time/*)."""
    return {k: v for k, v in m.items() if not k.startswith(("perf/", "time/"))}


@pytest.mark.slow
def test_a_hung_worker_is_replaced_and_the_run_ends_bitwise_identical(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLREPRO_FAULTS", raising=False)
    ref = tmp_path / "ref"
    assert main(["train", *BASE, f"run.dir={ref}"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "hang_worker", "step": 2, "worker": 1,
                                                      "seconds": 600}]))
    run = tmp_path / "run"
    start = time.monotonic()
    assert main(["train", *BASE, f"run.dir={run}", "rollout.hang_timeout_s=5"]) == 0
    assert time.monotonic() - start < 300  # the 600 s sleep was cut short by the replacement
    err = capsys.readouterr().err
    assert "rollout worker 1 has not answered its generate call in" in err, err
    assert "rollout.hang_timeout_s=5" in err and "rollout worker 1 lost during generate (WorkerHung" in err
    assert records(run, "metrics.jsonl")[-1]["perf/rollout_worker_restarts"] >= 1
    assert main(["diff", str(ref), str(run), "--strict"]) == 0
    assert records(run, "fingerprints.jsonl") == records(ref, "fingerprints.jsonl")
    assert [numbers(m) for m in records(run, "metrics.jsonl")] == [numbers(m) for m in records(ref, "metrics.jsonl")]
