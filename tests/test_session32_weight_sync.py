"""Review of the weight sync (session 32): ``Engine.load_weights`` is all or nothing (a refused update leaves every
weight bit-identical and the version unchanged), a collective sync whose peer hangs ends with an error naming the
hung member instead of hanging the driver, a tied head that is not the embedding is refused (as the collective path
refuses it), and a weight version never goes backwards."""
import re

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.model.tiny import write_tiny_checkpoint
from rlrepro.orchestration.weight_sync import WeightBroadcaster, WeightsRefused
from rlrepro.orchestration.workers import RolloutWorker
from rlrepro.rollout import Engine, EngineConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=64)


def _engine(seed=5):
    return Engine(tiny_model(seed=seed, initializer_range=0.3), block_size=4, num_kv_blocks=32)


def _snapshot(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _assert_unchanged(engine, before):
    now = dict(engine.model.named_parameters())
    assert sorted(now) == sorted(before)
    for name, t in before.items():
        assert torch.equal(now[name], t), f"{name} changed by a refused update"


@pytest.fixture(scope="module")
def new_weights():
    return {n: p.detach().clone() for n, p in tiny_model(seed=9, initializer_range=0.3).named_parameters()}


# ------------------------------------------------------------------------- 1. Engine.load_weights: all or nothing
def _bad_last(new_weights, how):
    """A complete update whose last tensor (after every good one) is wrong in one way."""
    items = sorted(new_weights.items())
    name, t = items[-1]
    if how == "name":
        return items + [("model.no_such.weight", torch.zeros(1))], "model.no_such.weight"
    if how == "shape":
        return items[:-1] + [(name, torch.zeros(t.shape[0] + 1))], name
    if how == "dtype":
        return items[:-1] + [(name, t.to(torch.bfloat16))], name
    if how == "duplicate":
        return items + [(items[0][0], items[0][1].clone())], items[0][0]
    if how == "not_a_tensor":
        return items + [(name, [0.0])], name
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["name", "shape", "dtype", "duplicate", "not_a_tensor"])
def test_engine_load_weights_refused_late_leaves_every_weight_and_the_version(new_weights, how):
    engine = _engine()
    engine.load_weights(_snapshot(engine), version=4)
    before = _snapshot(engine)
    named, culprit = _bad_last(new_weights, how)
    with pytest.raises(ValueError) as info:
        engine.load_weights(iter(named), version=5)  # a generator: checked whole before any copy all the same
    assert culprit in str(info.value)
    _assert_unchanged(engine, before)
    assert engine.weight_version == 4


def test_engine_load_weights_error_says_what_was_expected(new_weights):
    engine = _engine()
    name = "model.norm.weight"
    want = tuple(new_weights[name].shape)
    expected = rf"expected shape {re.escape(str(want))} and dtype torch\.float32"
    with pytest.raises(ValueError, match=rf"'model\.norm\.weight'.*\(3,\).*{expected}"):
        engine.load_weights([(name, torch.zeros(3))], version=1)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*bfloat16.*expected.*float32"):
        engine.load_weights([(name, new_weights[name].to(torch.bfloat16))], version=1)


def test_engine_load_weights_a_good_update_still_loads_and_partial_loads_stay_allowed(new_weights):
    engine = _engine()
    engine.load_weights(new_weights, version=1)
    _assert_unchanged(engine, new_weights)
    one = torch.full_like(new_weights["model.norm.weight"], 0.5)
    engine.load_weights([("model.norm.weight", one)], version=2)  # a subset: the others stay
    assert torch.equal(dict(engine.model.named_parameters())["model.norm.weight"], one)
    assert engine.weight_version == 2


# ------------------------------------------------------------------------- 3a. a tied head that is not the embedding
def test_tied_engine_refuses_a_head_that_is_not_the_embedding(new_weights):
    engine = _engine()
    assert "lm_head.weight" not in dict(engine.model.named_parameters())  # the tiny model ties its head
    before = _snapshot(engine)
    other = new_weights["model.embed_tokens.weight"] + 1.0  # an untied trainer's own head
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_weights({**new_weights, "lm_head.weight": other}, version=1)
    _assert_unchanged(engine, before)
    assert engine.weight_version == 0
    # the head equal to the embedding (a tied trainer that lists it) is still accepted
    engine.load_weights({**new_weights, "lm_head.weight": new_weights["model.embed_tokens.weight"].clone()}, 1)
    _assert_unchanged(engine, new_weights)


def test_tied_head_is_compared_by_bits_and_the_same_tensor_is_accepted_as_is(new_weights):
    """The review's cases: the head that *is* the embedding (transformers' tied state dict) is accepted even when
    the embedding holds a NaN, and a head differing from it only in the sign of a zero is refused (bits, not
    values)."""
    engine = _engine()
    with_nan = {n: t.clone() for n, t in new_weights.items()}
    embed = with_nan["model.embed_tokens.weight"]
    embed[0, 0] = float("nan")
    engine.load_weights({**with_nan, "lm_head.weight": embed}, version=1)  # the same tensor: no comparison at all
    assert torch.equal(dict(engine.model.named_parameters())["model.embed_tokens.weight"].isnan(), embed.isnan())
    engine.load_weights({**with_nan, "lm_head.weight": embed.clone()}, version=2)  # a copy: the same bits
    engine.load_weights(new_weights, version=3)  # no NaN left (torch.equal below compares values)
    before = _snapshot(engine)
    zeros = {n: t.clone() for n, t in new_weights.items()}
    zeros["model.embed_tokens.weight"][0, 0] = 0.0
    head = zeros["model.embed_tokens.weight"].clone()
    head[0, 0] = -0.0  # == 0.0 as a value, other bits
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_weights({**zeros, "lm_head.weight": head}, version=4)
    _assert_unchanged(engine, before)


def test_a_broken_collective_raises_the_workers_refusal_not_the_trainers_summary(monkeypatch):
    """When no worker died, the error that stands is a worker's ``WeightsRefused`` (it says why: an older version,
    a shape) rather than the trainer's "a worker refused", which came first in the list."""
    group = _group(monkeypatch)
    why = WeightsRefused("weight sync: the update is version 2 but this engine holds version 3, which is newer")
    calls = {0: _Ref("w0", why), 1: _Ref("w1", why), 2: _Ref("w2", 4)}
    trainer = _Ref("trainer", ValueError("weight sync to version 2: a worker refused the weights"))
    with pytest.raises(WeightsRefused, match="which is newer"):
        group._after_broken_collective(calls, trainer, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(d, seed=0)
    return str(d)


def _worker(model_dir):
    return RolloutWorker(model_dir, CONFIG, device="cpu", dtype=None, deterministic=True, seed=0)


def test_worker_refuses_an_untied_head_for_a_tied_engine_as_the_collective_check_does(model_dir, new_weights):
    worker = _worker(model_dir)
    before = _snapshot(worker.engine)
    sent = {**new_weights, "lm_head.weight": new_weights["model.embed_tokens.weight"] * 2}
    header = {"tensors": sorted((n, tuple(t.shape), str(t.dtype)) for n, t in sent.items())}
    assert WeightBroadcaster._check(header, dict(worker.engine.model.named_parameters())) is not None
    with pytest.raises(WeightsRefused, match="lm_head.weight"):
        worker.load_weights(sent, 1)
    _assert_unchanged(worker.engine, before)
    worker.generate([])  # refused before any copy: the worker is whole


# ------------------------------------------------------------------------- 3b. a version never goes backwards
def test_worker_refuses_a_weight_version_that_goes_backwards(model_dir, new_weights):
    worker = _worker(model_dir)
    assert worker.load_weights(new_weights, 3) == 3
    assert worker.load_weights(new_weights, 3) == 3  # the same version again (a reload after a broken sync): fine
    old = {n: t + 1.0 for n, t in new_weights.items()}
    with pytest.raises(WeightsRefused, match=r"version 2.*holds version 3"):
        worker.load_weights(old, 2)
    _assert_unchanged(worker.engine, new_weights)
    assert worker.engine.weight_version == 3
    worker.generate([])


def test_collective_receive_refuses_a_version_that_goes_backwards_before_any_tensor(new_weights):
    class Receiver(WeightBroadcaster):
        def __init__(self, version):
            self.rank, self.device, self.header, self.accepted = 1, torch.device("cpu"), version, None

        def _broadcast_object(self, obj):
            return {"version": self.header,
                    "tensors": sorted((n, tuple(t.shape), str(t.dtype)) for n, t in new_weights.items())}

        def _all_accept(self, ok):
            self.accepted = ok
            return ok

        def _broadcast(self, t):
            raise AssertionError("no tensor may move after a refusal")

    engine = _engine()
    engine.load_weights(_snapshot(engine), version=7)
    before = _snapshot(engine)
    rx = Receiver(6)
    rx.held_version = 7  # as RolloutWorker.sync_receive sets it: the engine's version
    with pytest.raises(WeightsRefused, match=r"version 6.*holds version 7"):
        rx._receive(dict(engine.model.named_parameters()))
    assert rx.accepted is False
    _assert_unchanged(engine, before)


def test_a_real_gloo_broadcast_of_an_older_version_is_refused_on_both_sides(model_dir, new_weights):
    """The trainer (rank 0, in a thread) broadcasts version 2 to a worker holding version 3: the worker refuses
    before any tensor moves, the trainer learns it and sends nothing, the worker stays whole."""
    import threading

    from rlrepro.orchestration.weight_sync import Rendezvous

    worker = _worker(model_dir)
    worker.load_weights(new_weights, 3)
    rdv = Rendezvous("127.0.0.1")
    out = {}

    def trainer():
        try:
            sync = WeightBroadcaster("127.0.0.1", rdv.port, 0, 2, generation=1, rendezvous=rdv, timeout_s=60.0)
            sync.send(sorted((n, t + 1.0) for n, t in new_weights.items()), 2)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    worker._sync = WeightBroadcaster("127.0.0.1", rdv.port, 1, 2, generation=1, timeout_s=60.0)
    with pytest.raises(WeightsRefused, match=r"version 2.*holds version 3"):
        worker.sync_receive()
    t.join(timeout=60)
    assert not t.is_alive() and "refused" in str(out.get("error"))
    _assert_unchanged(worker.engine, new_weights)
    assert worker.engine.weight_version == 3
    worker.generate([])  # refused before any copy: still whole


# ------------------------------------------------------------------------- 2. a hung peer after a broken collective
class _Ref:
    def __init__(self, name, value=None, hung=False):
        self.name, self.value, self.hung = name, value, hung


class _FakeRay:
    def __init__(self):
        self.waits = []

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits.append(timeout)
        if timeout is None:
            raise AssertionError("an unbounded wait: a hung peer would hang the driver for ever")
        ready = [r for r in refs if not r.hung]
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    def get(self, ref, timeout=None):
        if ref.hung:
            raise AssertionError("ray.get on a call that never returns")
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value


def _group(monkeypatch):
    from rlrepro.orchestration import actors

    monkeypatch.setattr(actors, "BROKEN_SYNC_WAIT_S", 0.05, raising=False)  # raising: the fix adds it
    group = object.__new__(actors.ActorGroup)
    group._ray = _FakeRay()
    group._placements = []
    group.workers = [object(), object(), object()]
    group.sync = type("Sync", (), {"worker_replaced": lambda self: None})()
    group.check_nodes = lambda during, error=None: None
    return group


def test_after_broken_collective_names_the_hung_worker_instead_of_waiting_for_ever(monkeypatch):
    from ray.exceptions import ActorDiedError

    group = _group(monkeypatch)
    calls = {0: _Ref("w0", ActorDiedError()), 1: _Ref("w1", hung=True), 2: _Ref("w2", ConnectionError("reset"))}
    trainer = _Ref("trainer", ConnectionError("reset"))
    with pytest.raises(TimeoutError, match=r"rollout worker 1\b.*did not answer") as info:
        group._after_broken_collective(calls, trainer, 4)
    assert "rollout worker 0" not in str(info.value) and "rollout worker 2" not in str(info.value)
    assert "run.resume=true" in str(info.value)
    assert all(t is not None for t in group._ray.waits)


def test_after_broken_collective_names_a_hung_trainer(monkeypatch):
    group = _group(monkeypatch)
    calls = {0: _Ref("w0", ConnectionError("reset")), 1: _Ref("w1", 4), 2: _Ref("w2", 4)}
    with pytest.raises(TimeoutError, match=r"the trainer .*did not answer"):
        group._after_broken_collective(calls, _Ref("trainer", hung=True), 4)


def test_after_broken_collective_without_a_hang_keeps_its_behaviour(monkeypatch):
    group = _group(monkeypatch)
    calls = {0: _Ref("w0", ConnectionError("reset")), 1: _Ref("w1", 4), 2: _Ref("w2", 4)}
    with pytest.raises(ConnectionError, match="reset"):  # no death: the error stands
        group._after_broken_collective(calls, _Ref("trainer", 4), 4)
