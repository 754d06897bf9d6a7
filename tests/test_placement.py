"""Where trainer ranks and rollout engines go on GPUs (a pure function; Ray's placement group follows it)."""
import pytest

from rlrepro.orchestration.actors import plan_placement


@pytest.mark.parametrize("trainers,workers", [(1, 1), (1, 3), (2, 2), (2, 3), (4, 4), (4, 8)])
def test_colocated_every_gpu_shared_and_never_oversubscribed(trainers, workers):
    plan = plan_placement(trainers, workers, colocate=True)
    assert plan.num_gpus == trainers
    assert plan.trainers == [(g, 0.5) for g in range(trainers)]  # rank g on GPU g
    load = [0.0] * plan.num_gpus
    for bundle, share in plan.trainers + plan.workers:
        load[bundle] += share
    assert all(x <= 1.0 + 1e-12 for x in load)
    assert {b for b, _ in plan.workers} == set(range(min(trainers, workers)))  # spread, round robin


def test_separate_gives_each_engine_its_own_gpu():
    plan = plan_placement(4, 4, colocate=False)
    assert plan.num_gpus == 8
    assert plan.trainers == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)]
    assert plan.workers == [(4, 1.0), (5, 1.0), (6, 1.0), (7, 1.0)]
