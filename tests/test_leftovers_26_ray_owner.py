"""rlrepro shuts down only a Ray it started itself: a Ray the caller had initialised before (a notebook, a script
that runs several things on one Ray) stays up after the actor group's shutdown, also when the group's start
failed. Before the fix ActorGroup.shutdown called ray.shutdown() for every local run, the caller's Ray included.

The caller's Ray is started with start_ray, the loopback-only way this repository starts Ray in tests; what
matters is only that it is initialised before the ActorGroup is made."""
import pytest

from rlrepro.cli import compose_config
from rlrepro.model import write_tiny_checkpoint
from rlrepro.orchestration.config import validate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=3))


@pytest.fixture
def callers_ray():
    """A local Ray initialised by the caller, before rlrepro; shut down at the end by the caller (the test)."""
    from rlrepro.orchestration.ray_start import start_ray

    import ray

    if ray.is_initialized():  # a Ray left by an earlier test is not this test's caller's
        ray.shutdown()
    assert start_ray(None, 2) is True  # started here: the caller's
    yield ray
    ray.shutdown()


def config(*overrides):
    return validate(compose_config(["recipe=grpo_tiny", "ray.num_cpus=2", *overrides]))


def _usable(ray) -> int:
    @ray.remote(num_cpus=0)
    def one():
        return 1

    return ray.get(one.remote(), timeout=60)


def test_start_ray_says_it_did_not_start_a_ray_that_is_up_already(callers_ray):
    from rlrepro.orchestration.ray_start import start_ray

    assert start_ray(None, 2) is False
    assert callers_ray.is_initialized()


def test_a_callers_ray_stays_up_after_the_groups_shutdown(callers_ray, model_dir):
    from rlrepro.orchestration.actors import ActorGroup

    gcs = callers_ray.get_runtime_context().gcs_address
    group = ActorGroup(config("rollout.num_workers=1"), model_dir)
    assert group._owns_ray is False
    actors = group.workers + group.trainers
    group.shutdown()
    assert callers_ray.is_initialized()
    assert callers_ray.get_runtime_context().gcs_address == gcs  # the same instance, not a new one
    assert _usable(callers_ray) == 1
    from ray.exceptions import RayActorError

    for actor in actors:  # the group's own actors did go
        with pytest.raises(RayActorError):
            callers_ray.get(actor.memory_stats.remote(), timeout=60)


def test_a_callers_ray_stays_up_when_the_groups_start_fails(callers_ray, model_dir):
    from rlrepro.orchestration.actors import ActorGroup
    from rlrepro.orchestration.placement import PlacementError

    with pytest.raises(PlacementError, match="ray.placement=split"):
        ActorGroup(config("rollout.num_workers=1", "ray.placement=split"), model_dir)
    assert callers_ray.is_initialized()
    assert _usable(callers_ray) == 1


def test_a_ray_the_group_started_is_still_shut_down(model_dir):
    import ray

    from rlrepro.orchestration.actors import ActorGroup

    if ray.is_initialized():
        ray.shutdown()
    group = ActorGroup(config("rollout.num_workers=1"), model_dir)
    assert group._owns_ray is True and ray.is_initialized()
    group.shutdown()
    assert not ray.is_initialized()
