"""A rollout worker that dies between the collective weight sync's liveness check and its join of the weight-sync
group is replaced within seconds, and the sync completes with the trainer's exact weights. Before the fix the
sync failed with the worker's ActorDiedError, and the trainer stayed blocked in its join for the group's 300 s
timeout (every later trainer call waited behind it).

The units pin the two phases of the join (rlrepro/orchestration/weight_sync.py): a check-in that the driver's
abort key ends at once, and a communicator that, once everyone checked in, is built under a short timeout while
the broadcasts keep the group's own."""
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rlrepro.cli import compose_config
from rlrepro.model import write_tiny_checkpoint
from rlrepro.orchestration.config import validate
from test_ray_review_actors import _samples  # the same six requests and their outputs by key


def _store(world):
    from rlrepro.orchestration.weight_sync import Rendezvous, tcp_store

    rdv = Rendezvous("127.0.0.1")
    host, port = rdv.host, rdv.port
    return host, port, tcp_store(host, port, world, rdv, datetime.timedelta(seconds=300))


def _in_thread(fn, *args, **kwargs):
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            e.__traceback__ = None  # its frames would keep the objects of the failed call alive
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_drivers_abort_ends_a_members_check_in_at_once():
    from rlrepro.orchestration.weight_sync import SyncGroupAborted, abort_join, check_in, group_prefix

    host, port, master = _store(3)
    t, out = _in_thread(check_in, dist.PrefixStore(group_prefix(5), master), 3, 300.0)
    time.sleep(0.5)
    assert t.is_alive()  # 1 of 3 members joined: it waits
    assert abort_join(host, port, 5, "rollout worker 1 failed to join: ActorDiedError") is True
    t.join(timeout=10)
    assert not t.is_alive()
    assert isinstance(out["error"], SyncGroupAborted)
    assert str(out["error"]) == ("weight-sync group join aborted: rollout worker 1 failed to join: "
                                 "ActorDiedError")
    assert out["took"] < 5


def test_another_generations_abort_is_not_this_groups():
    from rlrepro.orchestration.weight_sync import abort_join, check_in, group_prefix

    host, port, master = _store(2)
    assert abort_join(host, port, 4, "an old group's") is True
    threads = [_in_thread(check_in, dist.PrefixStore(group_prefix(5), master), 2, 30.0) for _ in range(2)]
    for t, out in threads:
        t.join(timeout=20)
        assert out == {"value": None, "took": out["took"]}


def test_a_member_late_to_an_aborted_join_finds_the_store_and_its_abort():
    """Rank 0's join was aborted before member 1 connected to its store. The trainer keeps its Rendezvous after
    a failed join (the store it serves stays); member 1 then sees the abort at once. Before the fix the store went
    with rank 0's failed constructor and member 1's connection retried for twice the timeout."""
    import gc

    from rlrepro.orchestration.weight_sync import Rendezvous, SyncGroupAborted, WeightBroadcaster, abort_join

    rdv = Rendezvous("127.0.0.1")  # what TrainerWorker._rendezvous holds
    t, out = _in_thread(WeightBroadcaster, "127.0.0.1", rdv.port, 0, 2, generation=7, timeout_s=15.0,
                        rendezvous=rdv)
    time.sleep(0.5)
    assert abort_join("127.0.0.1", rdv.port, 7, "rollout worker 1 failed to join") is True
    t.join(timeout=10)
    assert isinstance(out["error"], SyncGroupAborted)
    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(SyncGroupAborted, match="rollout worker 1 failed to join"):
        WeightBroadcaster("127.0.0.1", rdv.port, 1, 2, generation=7, timeout_s=15.0)
    assert time.monotonic() - t0 < 5


def test_a_member_that_checked_in_and_died_costs_the_form_timeout_not_the_groups():
    """Member 1 checks in and then never builds its communicator (it died there): rank 0 fails after the form
    timeout (2 s here), not after the group's timeout (300 s)."""
    from rlrepro.orchestration.weight_sync import Rendezvous, WeightBroadcaster, check_in, group_prefix

    rdv = Rendezvous("127.0.0.1")
    t, out = _in_thread(WeightBroadcaster, "127.0.0.1", rdv.port, 0, 2, generation=1, timeout_s=300.0,
                        rendezvous=rdv, form_timeout_s=2.0)
    client = dist.TCPStore("127.0.0.1", rdv.port, None, False, datetime.timedelta(seconds=30))
    check_in(dist.PrefixStore(group_prefix(1), client), 2, 30.0)  # member 1: checked in, then nothing
    t.join(timeout=60)
    assert not t.is_alive()
    assert "error" in out and 1.5 < out["took"] < 30


def test_the_broadcasts_keep_the_groups_timeout():
    """The form timeout (1 s) is not the broadcasts': a member 3 s late to a broadcast is still met."""
    from rlrepro.orchestration.weight_sync import Rendezvous, WeightBroadcaster

    rdv = Rendezvous("127.0.0.1")
    members = {}

    def member(rank):
        members[rank] = WeightBroadcaster("127.0.0.1", rdv.port, rank, 2, generation=2, timeout_s=60.0,
                                          rendezvous=rdv if rank == 0 else None, form_timeout_s=1.0)

    threads = [_in_thread(member, r) for r in (0, 1)]
    for t, out in threads:
        t.join(timeout=60)
        assert "error" not in out
    sent = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    got = {"w": torch.zeros(2, 3)}
    t0, out0 = _in_thread(members[0].send, sent.items(), 9)
    time.sleep(3.0)
    assert members[1].receive(got) == 9
    t0.join(timeout=30)
    assert "error" not in out0
    assert torch.equal(got["w"], sent["w"])
    for m in members.values():
        m.close()


# ------------------------------------------------------------------------------------------- through Ray
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=3))


@pytest.mark.parametrize("how", ["sigkill", pytest.param("ray_kill", marks=pytest.mark.slow)])
def test_a_worker_dead_before_its_join_is_replaced_within_seconds(model_dir, how):
    from rlrepro.orchestration.fault_injection import FaultInjectingActorGroup, FaultPlan

    cfg = validate(compose_config(["recipe=grpo_tiny", "ray.num_cpus=2", "rollout.num_workers=2",
                                   "rollout.weight_sync=collective", "rollout.max_restarts=2"]))
    group = FaultInjectingActorGroup(cfg, model_dir, FaultPlan())
    try:
        group.warm_start([([5, 9, 11], [12, 13, 14])] * 2, steps=2, lr=0.05, batch_size=2, seed=0)
        digest = group.sync_weights(0)  # the warm-started weights, not the model directory's
        want = _samples(group)
        gen = group.sync.generation
        group.sync.worker_replaced()  # the group is formed again at the next sync: its join is where the kill is
        group.fault_plan = FaultPlan([{"kind": "kill_worker", "step": 0, "at": "join", "worker": 1, "how": how}])
        t0 = time.perf_counter()
        assert group.sync_weights(0) == digest
        assert time.perf_counter() - t0 < 60  # not the group's 300 s timeout
        assert group.restarts == 1
        assert group.sync.generation == gen + 2  # the aborted group, then the one formed with the replacement
        t0 = time.perf_counter()
        assert group.get(group.trainer.weights_digest.remote()) == digest
        assert time.perf_counter() - t0 < 30  # the trainer is not held in a join
        assert _samples(group) == want
        assert group.sync_weights(0) == digest and group.restarts == 1  # the formed group is used again
        assert _samples(group) == want
    finally:
        group.shutdown()
