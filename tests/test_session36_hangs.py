"""rollout.hang_timeout_s bounds every wait on a rollout worker, not only its generation calls: a replacement's start
and weight load, the weight-sync calls (object store, and the collective broadcast and its group's join), and the
driver's memory figures. A timeout only restarts (the worker is killed, replaced within rollout.max_restarts,
loaded with the weights of its version), so a run where a worker hung ends bitwise identical to one where none did.

- units with a fake Ray (rlrepro/orchestration/worker_calls.py): a weight-sync call and a replacement's weight
  load are timed and replaced; past the budget the error names the worker, the call, the timeout and the fix;
  the trainer's time is never counted against a worker; memory_stats does not wait on a hung worker;
- the ``hang_worker`` fault's ``at`` (generate / sync / join) and ``times`` (its replacements hang too);
- through Ray (the tiny model): a hung object-store sync, a replacement hung in its weight load, a hung
  collective receive and a hung collective join are replaced, the engines end with the trainer's exact weights
  and sample exactly as before;
- end to end (slow): grpo_tiny with a worker hung in a weight sync and its replacement hung in its weight load ends
  bitwise identical to the run without either.
"""
import json
import time

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.model import write_tiny_checkpoint
from rlrepro.orchestration.config import validate
from rlrepro.orchestration.errors import RolloutWorkerLost
from test_session35_hang import BASE, FakeGroup, FakeRay, numbers, records


# ------------------------------------------------------------------------------------------ units (fake Ray)
class StrictRay(FakeRay):
    """A fake Ray whose get refuses a call that has not answered (an unbounded wait would hang for ever)."""

    def wait(self, refs, num_returns=1, timeout=None, fetch_local=True):
        return super().wait(refs, num_returns, timeout)

    def get(self, ref, timeout=None):
        if not ref.ready():
            raise AssertionError("ray.get on a call that has not answered: an unbounded wait on a hung worker")
        return ref.value


class Trainer:
    def __init__(self, answer_after: float = 0.0):
        self.answer_after, self.asked = answer_after, []

    @property
    def weights_of_version(self):
        trainer = self

        class Method:
            @staticmethod
            def remote(version):
                from test_session35_hang import Ref

                trainer.asked.append(version)
                return Ref(("weights", version), time.monotonic() + trainer.answer_after)
        return Method


class Group(FakeGroup):
    """FakeGroup with a trainer and ``_call``: a load_weights call answers the version it was given."""

    def __init__(self, *args, trainer_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._ray = StrictRay()
        self.trainer = Trainer(trainer_s)

    def submit(self, i, what, *args):
        ref = super().submit(i, what)
        if what == "load_weights":  # it runs once its argument, the trainer's weights, is there
            ref.value = args[1]
            if ref.answer_at is not None:
                ref.answer_at = max(ref.answer_at, args[0].answer_at)
        return ref

    def _call(self, i, method, *args):
        return self.submit(i, method, *args)

    def run(self, during="generate", version=-1):
        """As FakeGroup's, but a weight sync's replacement is done once loaded (no call is resubmitted)."""
        if during != "weight sync":
            return super().run(during, version)
        calls = {i: self.submit(i, "part") for i in range(len(self.workers))}
        return self._gather(calls, lambda i: None, during, version)


def test_a_hung_weight_sync_call_is_replaced_and_gets_the_weights(capsys):
    group = Group(0.2, {(1, 0): None})  # worker 1's sync call never answers
    got = group.run("weight sync", version=3)
    assert got == {0: ("part", 0, "worker0"), 1: 3}  # the replacement loaded version 3 (nothing to re-run)
    assert group._ray.killed == ["worker1"] and group.restarts == 1
    assert group.trainer.asked == [3]
    err = capsys.readouterr().err
    assert "rollout worker 1 has not answered its weight sync call in" in err
    assert "rollout.hang_timeout_s=0.2" in err and "killed and replaced" in err


def test_a_replacement_hung_in_its_weight_load_is_replaced_again(capsys):
    # worker 0 hangs in generate (call 0), its replacement in its load_weights (call 1); the next one is fine
    group = Group(0.2, {(0, 0): None, (0, 1): None})
    start = time.monotonic()
    got = group.run("generate", version=2)
    assert time.monotonic() - start < 5
    assert got[0][:2] == ("part", 0) and got[0][2] == "worker0-replacement4"  # the second replacement re-ran it
    assert group.restarts == 2 and group._ray.killed == ["worker0", "worker0-replacement3"]
    err = capsys.readouterr().err
    assert ("rollout worker 0 has not answered its load_weights (a replacement's start and weight load) call in"
            in err)
    assert "rollout worker 0 lost during generate (WorkerHung: rollout worker 0's load_weights" in err
    assert "replacing it (2/3 this step)" in err


def test_replacements_hung_past_the_budget_stop_naming_worker_call_timeout_and_fix():
    group = Group(0.1, {(1, 0): None, (1, 1): None}, max_restarts=1)
    with pytest.raises(RolloutWorkerLost) as info:
        group.run("weight sync", version=5)
    text = str(info.value)
    assert "rollout worker 1 was lost during weight sync" in text and "rollout.max_restarts=1" in text
    assert "rollout worker 1's load_weights (a replacement's start and weight load) (weight sync) call" in text
    assert "rollout.hang_timeout_s (now 0.1)" in text and "/tmp/ray/session_latest/logs" in text


def test_the_trainers_time_is_not_counted_against_a_replacement():
    """The trainer answers weights_of_version after 0.4 s (it is training a step): longer than the 0.2 s timeout,
    yet a replacement whose load answers once the weights are there is not taken as hung (its load is submitted
    then); the first replacement, whose load hangs, is."""
    group = Group(0.2, {(0, 0): None, (0, 1): None}, trainer_s=0.4)
    got = group.run("generate", version=1)
    assert group.restarts == 2 and got[0][2] == "worker0-replacement4"


def test_memory_stats_does_not_wait_on_a_hung_worker(capsys):
    from ray.exceptions import GetTimeoutError

    from rlrepro.orchestration.actors import ActorGroup

    class Ref:
        def __init__(self, value):
            self.value = value

    class Ray:
        timeouts = []

        def get(self, ref, timeout=None):
            self.timeouts.append(timeout)
            if ref.value is None:
                if timeout is None:
                    raise AssertionError("an unbounded get on a hung worker")
                raise GetTimeoutError("timed out")
            return ref.value

    class Actor:
        def __init__(self, value):
            self.memory_stats = type("M", (), {"remote": staticmethod(lambda: Ref(value))})

    group = object.__new__(ActorGroup)
    group._ray, group._placements, group.hang_timeout_s = Ray(), [], 0.5
    group.trainers, group.workers = [Actor({"peak": 1})], [Actor({"peak": 2}), Actor(None)]
    group.get = group._ray.get
    assert group.memory_stats() == {"trainer0": {"peak": 1}, "worker0": {"peak": 2}}
    assert all(t is not None for t in Ray.timeouts[1:])
    assert "rollout worker 1 has not answered its memory_stats call" in capsys.readouterr().err


def test_hang_worker_faults_have_a_place_and_a_count(monkeypatch):
    from rlrepro.orchestration.fault_injection import FaultPlan

    plan = FaultPlan([{"kind": "hang_worker", "step": 1}, {"kind": "hang_worker", "step": 2, "at": "sync",
                                                           "times": 2}])
    assert plan.take("hang_worker", 1, at="sync", worker=0) is None  # no `at`: a generation hang, as before
    assert plan.take("hang_worker", 1, at="generate", worker=0) is not None
    assert plan.take("hang_worker", 2, at="sync", worker=0)["times"] == 2
    with pytest.raises(ValueError, match="hang_worker's 'at' is one of"):
        FaultPlan([{"kind": "hang_worker", "step": 1, "at": "train"}])


# ------------------------------------------------------------------------------------------- through Ray
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=3))


def _group(model_dir, *overrides):
    from rlrepro.orchestration.fault_injection import FaultInjectingActorGroup, FaultPlan

    cfg = validate(compose_config(["recipe=grpo_tiny", "ray.num_cpus=2", "rollout.num_workers=2",
                                   "rollout.max_restarts=3", *overrides]))
    return FaultInjectingActorGroup(cfg, model_dir, FaultPlan())


def _hang_then_sync(group, fault: dict, timeout_s: float = 12.0, version: int = 0, reform: bool = False):
    """Warm-start, sync, sample; then the same sync again with ``fault`` and ``rollout.hang_timeout_s``: returns
    (seconds the sync took, restarts) after checking that the weights and the samples are exactly the same."""
    from rlrepro.orchestration.fault_injection import FaultPlan
    from test_ray_review_actors import _samples

    group.warm_start([([5, 9, 11], [12, 13, 14])] * 2, steps=2, lr=0.05, batch_size=2, seed=0)
    digest = group.sync_weights(version)  # the warm-started weights, not the model directory's
    want = _samples(group)
    group.hang_timeout_s = timeout_s  # from here on (a first sync includes the workers' start)
    group.fault_plan = FaultPlan([fault])
    if reform:  # a collective group is formed again at the next sync: its join is where the fault is
        group.sync.worker_replaced()
    t0 = time.perf_counter()
    assert group.sync_weights(version) == digest
    took = time.perf_counter() - t0
    assert [group._ray.get(w.weights_digest.remote()) for w in group.workers] == [digest] * len(group.workers)
    assert _samples(group) == want
    return took, group.restarts


@pytest.mark.slow
def test_a_worker_hung_in_an_object_store_sync_is_replaced(model_dir):
    group = _group(model_dir, "rollout.weight_sync=object_store")
    try:
        took, restarts = _hang_then_sync(group, {"kind": "hang_worker", "step": 0, "at": "sync", "worker": 1,
                                                 "seconds": 150})
        assert restarts == 1 and took < 100  # not the 150 s hang
    finally:
        group.shutdown()


@pytest.mark.slow
def test_a_replacement_hung_in_its_weight_load_is_replaced_again_through_ray(model_dir):
    group = _group(model_dir, "rollout.weight_sync=object_store")
    try:  # worker 0 hangs in its sync call, its first replacement in its start and weight load
        took, restarts = _hang_then_sync(group, {"kind": "hang_worker", "step": 0, "at": "sync", "worker": 0,
                                                 "seconds": 150, "times": 2})
        assert restarts == 2 and took < 100
    finally:
        group.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("at", ["sync", "join"])
def test_a_worker_hung_in_a_collective_sync_or_its_join_is_replaced(model_dir, at):
    group = _group(model_dir, "rollout.weight_sync=collective")
    try:
        fault = {"kind": "hang_worker", "step": 0, "at": at, "worker": 1, "seconds": 150}
        took, restarts = _hang_then_sync(group, fault, reform=at == "join")
        assert took < 100  # not the 150 s hang, nor the group's 300 s timeout
        # a join's abort tells the hung worker from those waiting on it, and so does a broadcast since session 39
        # (the hung one has not entered it: behind_in_sync); before, every worker in the broadcast was killed
        assert restarts == 1
        assert group.sync_weights(0) and group.restarts == restarts  # the group formed again is used
    finally:
        group.shutdown()


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_run_with_a_hung_sync_and_a_hung_replacement_load_is_bitwise_identical(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RLREPRO_FAULTS", raising=False)
    ref = tmp_path / "ref"
    assert main(["train", *BASE, f"run.dir={ref}"]) == 0
    capsys.readouterr()
    # the sync after step 1: worker 1 hangs in its weight load, and so does its first replacement
    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "hang_worker", "step": 1, "at": "sync", "worker": 1,
                                                      "seconds": 600, "times": 2}]))
    run = tmp_path / "run"
    start = time.monotonic()
    assert main(["train", *BASE, f"run.dir={run}", "rollout.hang_timeout_s=12"]) == 0
    assert time.monotonic() - start < 300  # the 600 s sleeps were cut short
    err = capsys.readouterr().err
    assert "rollout worker 1 has not answered its weight sync call in" in err, err
    assert "rollout worker 1 has not answered its load_weights (a replacement's start and weight load) call" in err
    assert records(run, "metrics.jsonl")[-1]["perf/rollout_worker_restarts"] >= 2
    assert main(["diff", str(ref), str(run), "--strict"]) == 0
    assert records(run, "fingerprints.jsonl") == records(ref, "fingerprints.jsonl")
    assert [numbers(m) for m in records(run, "metrics.jsonl")] == [numbers(m) for m in records(ref, "metrics.jsonl")]
