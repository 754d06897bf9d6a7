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


# ------------------------------------------------------------------ placement groups across nodes (placement.py)
from rlrepro.checks import ConfigError  # noqa: E402
from rlrepro.orchestration.placement import NodeInfo, PlacementError, check_capacity, plan_layout  # noqa: E402


def node(name, head=False, **res):
    return NodeInfo(f"{name}{'0' * 40}", f"10.0.0.{len(name)}", {k: float(v) for k, v in res.items()}, name, head)


def test_layout_split_pins_the_trainer_to_one_node_and_excludes_it_for_engines():
    lay = plan_layout(num_trainers=2, num_workers=3, placement="split", trainer_node="t", rollout_node="r")
    trainer, rollout = lay.groups
    assert trainer.strategy == "STRICT_PACK" and trainer.bundles == [{"CPU": 1.0, "t": 0.001}] * 2
    assert rollout.exclude_trainer_nodes and rollout.bundles == [{"CPU": 1.0, "r": 0.001}] * 3
    assert lay.trainers == [(0, 0, 0.0), (0, 1, 0.0)] and lay.workers == [(1, i, 0.0) for i in range(3)]


def test_layout_tensor_parallel_groups_are_strict_pack_each_and_replicas_spread():
    lay = plan_layout(num_trainers=4, num_workers=2, tensor_parallel=2, device="cuda", placement="spread")
    assert [(g.role, g.strategy, len(g.bundles)) for g in lay.groups] == [
        ("trainer", "STRICT_PACK", 2), ("trainer", "STRICT_PACK", 2), ("rollout", "SPREAD", 2)]
    assert lay.trainers == [(0, 0, 1.0), (0, 1, 1.0), (1, 0, 1.0), (1, 1, 1.0)]


def test_layout_colocated_gpu_engines_share_the_trainer_bundles_as_plan_placement_says():
    lay = plan_layout(num_trainers=2, num_workers=3, device="cuda", colocate=True)
    assert len(lay.groups) == 1 and lay.groups[0].bundles == [{"GPU": 1.0}] * 2
    plan = plan_placement(2, 3, colocate=True)
    assert [(b, s) for _, b, s in lay.workers] == plan.workers and [(b, s) for _, b, s in lay.trainers] == plan.trainers


def test_capacity_names_what_is_missing_before_work():
    two = [node("head", True, CPU=2, t=1), node("second", CPU=2, r=1)]
    check_capacity(plan_layout(num_trainers=2, num_workers=2, placement="split", trainer_node="t", rollout_node="r"),
                   two, num_nodes=2)
    with pytest.raises(PlacementError, match=r"ray.num_nodes=3 but the Ray cluster has 2 alive node"):
        check_capacity(plan_layout(num_trainers=1, num_workers=1), two, num_nodes=3)
    with pytest.raises(PlacementError, match=r"trainer rank 0, trainer rank 1, trainer rank 2 together.*missing: CPU"):
        check_capacity(plan_layout(num_trainers=3, num_workers=1, placement="split"), two)
    with pytest.raises(PlacementError, match=r"rollout worker 0 .*missing: r \(no node has it\)"):
        check_capacity(plan_layout(num_trainers=1, num_workers=1, rollout_node="r"), [node("head", True, CPU=4)])
    with pytest.raises(PlacementError, match=r"ray.placement=split puts the trainer on one node"):
        check_capacity(plan_layout(num_trainers=1, num_workers=1, placement="split"), [node("head", True, CPU=8)])
    gpus = [node("a", GPU=2), node("b", GPU=3)]
    with pytest.raises(PlacementError, match=r"no node has room for rollout worker 1 \(\{GPU: 1\}\).*GPU"):
        check_capacity(plan_layout(num_trainers=4, num_workers=2, tensor_parallel=2, device="cuda"), gpus)


def test_capacity_split_tries_every_node_for_the_trainer():
    # first fit would put the trainer on "big" and leave no node for the engines' GPUs
    nodes = [node("big", GPU=4), node("small", GPU=2)]
    check_capacity(plan_layout(num_trainers=2, num_workers=4, device="cuda", placement="split"), nodes)


def test_ray_keys_are_checked():
    from rlrepro.orchestration.config import RayConfig

    with pytest.raises(ConfigError, match="ray.placement"):
        RayConfig(placement="scatter")
    with pytest.raises(ConfigError, match="ray.trainer_node"):
        RayConfig(trainer_node="GPU")
    with pytest.raises(ConfigError, match="ray.num_nodes"):
        RayConfig(num_nodes=0)
    assert RayConfig(placement="split", trainer_node="t", rollout_node="r", num_nodes=2).num_nodes == 2


def test_split_on_cuda_needs_engines_on_their_own_gpus():
    from rlrepro.cli import compose_config

    with pytest.raises(ConfigError, match="ray.placement=split .* ray.colocate=false"):
        compose_config(["recipe=grpo_tiny", "run.device=cuda", "ray.placement=split"])
    compose_config(["recipe=grpo_tiny", "run.device=cuda", "ray.placement=split", "ray.colocate=false"])


def test_diff_reports_another_cluster_as_informational():
    from rlrepro.repro.inputs import input_differences

    one = {"cluster": {"num_nodes": 1, "placement": "local", "nodes": [
        {"address": "127.0.0.1", "hostname": "h", "actors": ["trainer rank 0", "rollout worker 0"]}]}}
    two = {"cluster": {"num_nodes": 2, "placement": "split", "nodes": [
        {"address": "10.0.0.2", "hostname": "b", "actors": ["rollout worker 0"]},
        {"address": "10.0.0.1", "hostname": "a", "actors": ["trainer rank 0"]}]}}
    (d,) = input_differences(one, two)
    assert d.what == "cluster" and not d.bits
    assert d.message.startswith("cluster differs: 1 node(s), placement local (h: trainer rank 0, rollout worker 0) vs "
                                "2 node(s), placement split (b: rollout worker 0; a: trainer rank 0)")
    assert input_differences(one, {}) == []  # a run recorded before the field: nothing to say
