"""Ray orchestration review: a failed start of the actor group leaves no Ray behind, a local Ray asked for as
``ray.address=local`` is shut down like the default, and a rollout worker that dies around a collective weight
sync is replaced (the sync completes with the trainer's exact weights) instead of holding the run for the group's
timeout."""
import pytest

from rlrepro.cli import compose_config
from rlrepro.model import write_tiny_checkpoint
from rlrepro.orchestration.config import validate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=3))


def config(*overrides):
    return validate(compose_config(["recipe=grpo_tiny", "ray.num_cpus=2", *overrides]))


def test_a_start_that_fails_after_ray_started_shuts_the_local_ray_down(model_dir):
    import ray

    from rlrepro.orchestration.actors import ActorGroup
    from rlrepro.orchestration.placement import PlacementError

    with pytest.raises(PlacementError, match="ray.placement=split"):
        ActorGroup(config("rollout.num_workers=1", "ray.placement=split"), model_dir)
    assert not ray.is_initialized()


def test_ray_address_local_is_shut_down_as_the_default_is(model_dir):
    import ray

    from rlrepro.orchestration.actors import ActorGroup

    group = ActorGroup(config("rollout.num_workers=1", "ray.address=local"), model_dir)
    assert ray.is_initialized()
    group.shutdown()
    assert not ray.is_initialized()


def test_ray_num_nodes_is_checked_for_a_local_cpu_run_too(model_dir):
    import ray

    from rlrepro.orchestration.actors import ActorGroup
    from rlrepro.orchestration.placement import PlacementError

    with pytest.raises(PlacementError, match="ray.num_nodes=2 but the Ray cluster has 1 alive node"):
        ActorGroup(config("rollout.num_workers=1", "ray.num_nodes=2"), model_dir)
    assert not ray.is_initialized()


def _requests():
    from rlrepro.orchestration.workers import Request
    from rlrepro.rollout import SamplingParams

    return [Request((f"p{i}", j), [5 + i, 9, 11 + j], SamplingParams(max_tokens=5, seed=100 * i + j))
            for i in range(3) for j in range(2)]


def _samples(group):
    """The step's samples by key: what the engine's request counter and prefix cache leave alone."""
    return [(key, out.token_ids, out.logprobs, out.finish_reason, out.seed, out.weight_version)
            for key, out in sorted(group.generate(_requests()), key=lambda kv: kv[0])]


@pytest.mark.parametrize("when", ["between_syncs", "during_sync"])
def test_a_worker_dead_around_a_collective_sync_is_replaced_with_the_trainers_weights(model_dir, when):
    """The weights are the warm-started policy (not the model directory's), so a replacement that missed them
    would sample otherwise. Before the fix: the group waited 300 s for the dead member, then the run failed."""
    import time

    from rlrepro.orchestration.fault_injection import FaultInjectingActorGroup, FaultPlan

    cfg = config("rollout.num_workers=2", "rollout.weight_sync=collective", "rollout.max_restarts=2")
    group = FaultInjectingActorGroup(cfg, model_dir, FaultPlan())
    try:
        group.warm_start([([5, 9, 11], [12, 13, 14])] * 2, steps=2, lr=0.05, batch_size=2, seed=0)
        digest = group.sync_weights(0)
        want = _samples(group)
        if when == "between_syncs":
            group._ray.kill(group.workers[1], no_restart=True)
        else:  # SIGKILL as its receive is submitted, the trainer's broadcast under way
            group.fault_plan = FaultPlan([{"kind": "kill_worker", "step": 0, "at": "sync", "worker": 1}])
        t0 = time.perf_counter()
        assert group.sync_weights(0) == digest
        assert time.perf_counter() - t0 < 120  # not the group's 300 s timeout
        assert group.restarts == 1
        assert _samples(group) == want
        assert group.sync_weights(0) == digest  # the group is formed again, with the replacement
        assert _samples(group) == want
    finally:
        group.shutdown()


def test_a_worker_whose_constructor_raises_is_named_with_that_exception(model_dir, tmp_path):
    """Before: 'last error: ActorDiedError: The actor died because of an error raised in its creation task,
    ray::RolloutWorker.__init__() (pid=..., repr=<rl...' -- the constructor's exception cut off."""
    from rlrepro.orchestration.actors import ActorGroup
    from rlrepro.orchestration.errors import RolloutWorkerLost

    group = ActorGroup(config("rollout.num_workers=1", "rollout.max_restarts=1"), model_dir)
    try:
        (_, engine_config), kwargs = group._worker_args
        group._worker_args = (str(tmp_path / "gone"), engine_config), kwargs  # every new worker fails to start
        group._ray.kill(group.workers[0], no_restart=True)
        group.workers[0] = group._new_worker(0)
        with pytest.raises(RolloutWorkerLost, match=r"constructor raised FileNotFoundError: model path .*gone"):
            group.generate(_requests())
    finally:
        group.shutdown()
