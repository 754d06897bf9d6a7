"""Session 39: a rollout worker hung before a collective weight broadcast costs one restart, not one per worker. The
members waiting on it in the broadcast cannot answer either, and with rollout.hang_timeout_s every one of them was
killed and replaced (each a model load, each counted against rollout.max_restarts). Now each member counts on the
group's store the syncs it has entered (``WeightBroadcaster._enter``); when the broadcast does not end, the driver
reads the counts (``behind_in_sync``), kills only the workers behind the furthest member, and gives the others
another timeout: they fail as soon as the hung one is gone and load the weights from the object store. The weights
are the trainer's bits either way (the slow test through Ray in tests/test_session36_hangs.py checks them and the
samples with exact equality, and now also that one worker was replaced)."""
import datetime
import time

import torch
import torch.distributed as dist

from rlrepro.orchestration.weight_sync import (ENTERED_KEY, CollectiveSync, Rendezvous, WeightBroadcaster,
                                               behind_in_sync, group_prefix)
from test_leftovers_26_sync_join import _in_thread
from test_session36_hangs import Group


def _store(generation: int, counts: dict[int, int]):
    rdv = Rendezvous("127.0.0.1")
    server = rdv.store(1, datetime.timedelta(seconds=10))
    prefix = dist.PrefixStore(group_prefix(generation), server)
    for rank, count in counts.items():
        prefix.set(f"{ENTERED_KEY}/{rank}", str(count))
    return rdv, server


def test_behind_in_sync_names_the_members_that_have_not_entered():
    rdv, server = _store(4, {0: 3, 1: 3, 3: 2})  # rank 2 never entered a sync, rank 3 not this one
    try:
        assert behind_in_sync(rdv.host, rdv.port, 4, 4) == {2, 3}
        assert behind_in_sync(rdv.host, rdv.port, 4, 2) == set()  # all level: none can be told apart
        assert behind_in_sync(rdv.host, rdv.port, 5, 4) == set()  # another generation's keys are never met
    finally:
        del server
        rdv.served = None


def test_behind_in_sync_without_a_store_is_none():
    rdv = Rendezvous("127.0.0.1")
    host, port = rdv.host, rdv.port
    rdv.sock.close()  # nobody listens there
    assert behind_in_sync(host, port, 1, 3, timeout_s=0.5) is None


def test_hung_among_keeps_the_late_workers_behind_or_all_of_them():
    rdv, server = _store(2, {0: 5, 1: 5, 2: 4, 3: 5})
    try:
        sync = CollectiveSync()
        assert sync.hung_among({0, 1}) == {0, 1}  # never formed: nothing to read, every late one
        sync.address, sync.world, sync.generation = (rdv.host, rdv.port), 4, 2
        assert sync.hung_among({0, 1, 2}) == {1}  # worker 1 is rank 2
        assert sync.hung_among({0, 2}) == {0, 2}  # the one behind is not late: none told apart
    finally:
        del server
        rdv.served = None


class BroadcastGroup(Group):
    """Three workers whose weight-sync calls never answer; ``hung_among`` answers ``hung`` once, then the late set."""

    def __init__(self, hung: set[int], spared_answer: bool):
        super().__init__(0.2, {(0, 0): None, (1, 0): None, (2, 0): None}, workers=3)
        self.hung, self.spared_answer, self.asked, self.refs = hung, spared_answer, [], {}

    def submit(self, i, what, *args):
        ref = super().submit(i, what, *args)
        if what == "part":
            self.refs[i] = ref
        return ref

    def hung_among(self, late):
        self.asked.append(sorted(late))
        if len(self.asked) > 1:
            return late
        if self.spared_answer:  # the members that waited fail (here: answer) once the hung one is killed
            import time
            for i in late - self.hung:
                self.refs[i].answer_at = time.monotonic() + 0.05
        return self.hung

    def run_sync(self):
        calls = {i: self.submit(i, "part") for i in range(3)}
        return self._gather(calls, lambda i: None, "weight sync", 7, None, self.hung_among)


def test_only_the_worker_behind_is_killed_and_the_others_get_another_timeout(capsys):
    group = BroadcastGroup({1}, spared_answer=True)
    got = group.run_sync()
    assert group._ray.killed == ["worker1"] and group.restarts == 1 and group.asked == [[0, 1, 2]]
    assert got == {0: ("part", 0, "worker0"), 1: 7, 2: ("part", 2, "worker2")}
    err = capsys.readouterr().err
    assert "rollout worker 0 has not answered its weight sync call in" in err and "not restarted" in err
    assert "rollout worker 1 has not answered its weight sync call" in err and "killed and replaced" in err


def test_workers_spared_once_and_still_silent_are_killed_at_the_next_timeout():
    group = BroadcastGroup({1}, spared_answer=False)
    got = group.run_sync()
    assert group._ray.killed == ["worker1", "worker0", "worker2"] and group.restarts == 3
    assert group.asked == [[0, 1, 2], [0, 2]] and got == {0: 7, 1: 7, 2: 7}


def test_a_real_group_counts_the_syncs_its_members_enter():
    """A gloo group of the trainer and two receivers (threads): while receiver 2 has not entered the sync, the
    driver's reading names it alone (rank 2); once it has, and the sync is over, all are level."""
    rdv = Rendezvous("127.0.0.1")
    members = {}

    def member(rank):
        members[rank] = WeightBroadcaster("127.0.0.1", rdv.port, rank, 3, generation=3, timeout_s=60.0,
                                          rendezvous=rdv if rank == 0 else None)

    for t, out in [_in_thread(member, r) for r in (0, 1, 2)]:
        t.join(timeout=60)
        assert "error" not in out
    sent = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    got = {1: {"w": torch.zeros(2, 3)}, 2: {"w": torch.zeros(2, 3)}}
    running = [_in_thread(members[0].send, sent.items(), 4), _in_thread(members[1].receive, got[1])]
    deadline = time.monotonic() + 30
    while (behind := behind_in_sync(rdv.host, rdv.port, 3, 3)) != {2} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert behind == {2}
    running.append(_in_thread(members[2].receive, got[2]))
    for t, out in running:
        t.join(timeout=60)
        assert "error" not in out
    assert behind_in_sync(rdv.host, rdv.port, 3, 3) == set()
    assert torch.equal(got[1]["w"], sent["w"]) and torch.equal(got[2]["w"], sent["w"])
    for m in members.values():
        m.close()
