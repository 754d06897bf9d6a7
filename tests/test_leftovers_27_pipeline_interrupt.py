"""Ctrl-C (or SIGTERM, which the driver turns into KeyboardInterrupt) during a pipelined step
(rollout.max_staleness=K): the batch being generated ahead is abandoned, not waited for.

* unit (a stand-in driver on PipelineSteps, no engine): the interrupt, raised by the driver's SIGTERM handler
  while training or while waiting for the generation, leaves ``pipelined_batch`` while the generation is still
  blocked, and the abandoned batch never reaches ``pending``, even once the generation finishes; an ordinary
  failure still waits for the generation first; with a Ray-like group the rollout workers are ended, none is
  replaced, and the thread is gone before the interrupt goes on;
* end to end (the tiny model, in-process actors as in tests/test_review26_pipe_pipeline.py): a K=1 run
  interrupted at step 2, before and during the update, while batch 3's generation hangs, stops with RunInterrupted
  without waiting for it; the checkpoint of step 1 (written by the interrupt's handler) equals the uninterrupted
  run's, the abandoned generation finishing afterwards changes nothing, and the resumed run equals the
  uninterrupted one (fingerprints, metrics, rollouts);
* with Ray (slow): the same while the rollout worker hangs in batch 3's generation; the worker is ended, the
  generation thread is gone and Ray shut down when RunInterrupted is raised (no Ray left behind, none started
  again by the thread), and `rlrepro diff --strict` finds the resumed run identical.
"""
import signal
import threading
import time
import types

import pytest
from test_review26_pipe_pipeline import BASE, LocalActors, _bits, _run, _untimed

from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import pipeline as pipeline_mod
from rlrepro.orchestration.actors import ActorGroup
from rlrepro.orchestration.pipeline import PipelineSteps
from rlrepro.trainer.checkpoint import load_extra_state

pytestmark = pytest.mark.usefixtures("one_thread")

HANG_S = 60.0  # how long a blocked generation waits to be released: far beyond any bound the tests hold


@pytest.fixture
def sigterm_as_interrupt():
    """The driver's SIGTERM handler (KeyboardInterrupt in the main thread), and a way to deliver SIGTERM to the
    main thread once an event is set (then after a delay)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    previous = driver_mod._sigterm_as_interrupt()
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
    timers, cancel = [], threading.Event()

    def sigterm_after(event: threading.Event, delay_s: float) -> None:
        def send():
            if event.wait(HANG_S) and not cancel.wait(delay_s):
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        timers.append(t)

    yield sigterm_after
    cancel.set()
    for t in timers:
        t.join()
    driver_mod._restore_sigterm(previous)


class StandIn(PipelineSteps):
    """What PipelineSteps reads of the driver: batch 1 is pending; collect of batch 2 blocks until released (then
    returns a batch and advances the data cursor); train takes ``train_s`` seconds or raises ``train_error``."""

    def __init__(self, train_s=0.0, train_error=None, actors=None):
        self.cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(max_staleness=1))
        self.pending = {1: ([], None, 0, {})}
        self.actors = actors
        self._ahead_failed = None
        self.cursor = 0
        self.train_s, self.train_error = train_s, train_error
        self.started, self.release = threading.Event(), threading.Event()
        self.collected = threading.Event()

    def collect(self, step, t):
        self.started.set()
        if self.actors is not None:
            self.actors.generate()  # blocks until the group's workers end (or are released)
        else:
            assert self.release.wait(HANG_S)
        self.cursor += 1  # what the real collect does to the data order
        t.add("rollout", 0.0)
        self.collected.set()
        return [], None, 0, {"batch": step}

    def compute_advantages(self, samples):
        pass

    def train(self, step, samples):
        assert self.started.wait(HANG_S)
        time.sleep(self.train_s)
        if self.train_error is not None:
            raise self.train_error
        return {}


def _generation_thread(step):
    """The generate-ahead thread of batch ``step``, still running (it was not waited for)."""
    thread = next((t for t in threading.enumerate() if t.name == f"rlrepro-generate-step-{step}"), None)
    assert thread is not None and thread.is_alive(), f"the generation of batch {step} was waited for"
    return thread


@pytest.mark.parametrize("train_s", [HANG_S, 0.0], ids=["while-training", "while-waiting-for-the-generation"])
def test_an_interrupt_abandons_the_generation_ahead(sigterm_as_interrupt, train_s):
    d = StandIn(train_s=train_s)
    sigterm_as_interrupt(d.started, 0.2)  # once batch 2's generation has begun
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        d.pipelined_batch(1, driver_mod.PhaseTimer())
    # raised while the generation of batch 2 is still blocked: nothing waited for it
    assert not d.release.is_set() and not d.collected.is_set()
    thread = _generation_thread(2)
    assert thread.daemon
    assert d.pending == {} and d._ahead_failed is None
    d.release.set()  # the abandoned generation finishes: its batch is never read
    thread.join(HANG_S)
    assert d.collected.is_set() and d.cursor == 1
    assert d.pending == {} and d._ahead_failed is None


def test_an_ordinary_failure_still_waits_for_the_generation():
    d = StandIn(train_error=RuntimeError("train failed"))
    threading.Timer(0.5, d.release.set).start()
    with pytest.raises(RuntimeError, match="train failed"):
        d.pipelined_batch(1, driver_mod.PhaseTimer())
    assert d.collected.is_set()  # the generation ended before the failure was raised
    assert d.pending == {}  # and its batch is not kept: the step failed


class RayLikeGroup:
    """ActorGroup's part of an abandonment: ``workers``, ``_ray.kill`` (which ends a blocked generate, as the
    death of its worker does) and ``max_restarts``."""

    abandon_generation = ActorGroup.abandon_generation  # the real method, on this group's stand-ins

    def __init__(self):
        self.workers, self.killed, self.max_restarts = ["w0", "w1"], [], 3
        self._ray = self
        self.ended = threading.Event()

    def kill(self, actor, no_restart=False):
        self.killed.append((actor, no_restart, self.max_restarts))
        self.ended.set()

    def generate(self):
        assert self.ended.wait(HANG_S)
        raise RuntimeError("RolloutWorkerLost (the worker was killed)")


def test_with_ray_the_workers_are_ended_and_the_thread_is_gone_before_the_interrupt_goes_on(sigterm_as_interrupt):
    group = RayLikeGroup()
    d = StandIn(train_s=HANG_S, actors=group)
    sigterm_as_interrupt(d.started, 0.2)  # once batch 2's generation has begun
    with pytest.raises(KeyboardInterrupt):
        d.pipelined_batch(1, driver_mod.PhaseTimer())
    # every worker ended, after replacements were turned off (a replacement would start a new actor)
    assert group.killed == [("w0", True, 0), ("w1", True, 0)]
    assert not any(t.name == "rlrepro-generate-step-2" for t in threading.enumerate())
    assert not d.collected.is_set() and d.pending == {} and d._ahead_failed is None


# ------------------------------------------------------------------------------------------------- end to end
class HangsAtBatch3(LocalActors):
    """Batch 3 is generated at step 2 (K=1) by the engines holding version 1: that generation hangs until the
    test releases it. ``interrupt_in_update``: step 2's train_step is interrupted (before the trainer changes
    anything) once the generation hangs."""
    started = release = finished = None
    interrupt_in_update = False

    def generate(self, requests):
        if self.weight_version == 1:
            type(self).started.set()
            assert type(self).release.wait(HANG_S)
            out = super().generate(requests)
            type(self).finished.set()
            return out
        return super().generate(requests)

    def train_step(self, samples):
        if self.interrupt_in_update and self.weight_version == 1:
            assert type(self).started.wait(HANG_S)
            raise KeyboardInterrupt("signal 15")
        return super().train_step(samples)


@pytest.mark.parametrize("where", ["before-the-update", "in-the-update"])
def test_an_interrupted_pipelined_run_stops_at_once_and_resumes_identical(tmp_path, monkeypatch, where):
    args = BASE + ["rollout.max_staleness=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    _run(monkeypatch, LocalActors, [*args, "checkpoint.every=1", "checkpoint.keep_last=4", f"run.dir={a}"])

    class Actors(HangsAtBatch3):
        started, release, finished = threading.Event(), threading.Event(), threading.Event()
        interrupt_in_update = where == "in-the-update"

    real_delay = pipeline_mod.test_delay

    def delay(what, step):  # the driver's thread, before step 2's update: Ctrl-C once batch 3 hangs
        real_delay(what, step)
        if what == "train" and step == 2 and where == "before-the-update":
            assert Actors.started.wait(HANG_S)
            raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(pipeline_mod, "test_delay", delay)
    # before the update the driver writes step 1's checkpoint itself; in it, the trainer's state is unknown, so
    # the run resumes from the periodic one
    every = "0" if where == "before-the-update" else "1"
    with pytest.raises(driver_mod.RunInterrupted, match="interrupted during step 2") as info:
        _run(monkeypatch, Actors, [*args, f"checkpoint.every={every}", f"run.dir={b}"])
    assert not Actors.release.is_set() and not Actors.finished.is_set()  # stopped while batch 3 still hangs
    abandoned = _generation_thread(3)
    if where == "before-the-update":
        assert "Saved a checkpoint of the last completed step 1" in str(info.value)
    else:  # the message says why step 1 has no checkpoint of its own here
        assert "The update of step 2 was under way when the run stopped" in str(info.value)
    ckpt = b / "checkpoints" / "step_000001"
    assert info.value.checkpoint == str(ckpt)
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_000001"]
    written = (ckpt / "extra_state.pt").read_bytes()
    ref = load_extra_state(a / "checkpoints" / "step_000001")[1]
    got = load_extra_state(ckpt)[1]
    # the data cursor after batch 2 and batch 2 as generated: not where the abandoned thread left self.order
    assert got["data_order"] == ref["data_order"] and sorted(got["pending"]) == [2]
    assert _untimed(got["pending"]) == _untimed(ref["pending"])
    Actors.release.set()  # the abandoned generation of batch 3 now finishes, unread
    abandoned.join(HANG_S)
    assert Actors.finished.is_set()
    assert (ckpt / "extra_state.pt").read_bytes() == written
    monkeypatch.setattr(pipeline_mod, "test_delay", real_delay)
    _run(monkeypatch, LocalActors, [*args, f"checkpoint.every={every}", f"run.dir={b}", "run.resume=true"])
    assert _bits(b) == _bits(a)


# ------------------------------------------------------------------------------------------------- with Ray
E2E = ["recipe=grpo_tiny", "train.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
       "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
       "logger.progress=false", "train.micro_batch_size=8", "rollout.max_staleness=1", "rollout.num_workers=1"]


@pytest.mark.slow
def test_with_ray_the_hanging_rollout_worker_is_ended_and_the_resume_is_identical(tmp_path, monkeypatch):
    import ray

    from rlrepro.cli import compose_config, main
    from rlrepro.orchestration import actors as actors_mod
    from rlrepro.rollout import request_seed

    a, b, marker = tmp_path / "a", tmp_path / "b", tmp_path / "hanging"
    assert main(["train", *E2E, "checkpoint.every=1", "checkpoint.keep_last=4", f"run.dir={a}"]) == 0

    class Hanging(actors_mod.RolloutWorker):  # a Ray actor (pickled by value): hangs in batch 3's generation
        def __init__(self, *args, seed, **kwargs):
            super().__init__(*args, seed=seed, **kwargs)
            self.run_seed = seed

        def generate(self, requests):
            if requests and requests[0].params.seed == request_seed(self.run_seed, 3, *requests[0].key):
                marker.write_text("batch 3")
                time.sleep(HANG_S)
            return super().generate(requests)

    interrupted = []

    def delay(what, step):
        if what == "train" and step == 2:
            t0 = time.perf_counter()
            while not marker.exists():
                assert time.perf_counter() - t0 < HANG_S
                time.sleep(0.05)
            interrupted.append(time.perf_counter())
            raise KeyboardInterrupt("signal 15")

    abandon, ended = PipelineSteps._abandon_generation, []

    def abandon_and_look(self, finished, abandoned):
        abandon(self, finished, abandoned)
        ended.append(finished.is_set())  # the thread ended (its worker killed), not the wait's bound

    monkeypatch.setattr(actors_mod, "RolloutWorker", Hanging)
    monkeypatch.setattr(pipeline_mod, "test_delay", delay)
    monkeypatch.setattr(PipelineSteps, "_abandon_generation", abandon_and_look)
    with pytest.raises(driver_mod.RunInterrupted, match="Saved a checkpoint of the last completed step 1"):
        driver_mod.GRPODriver(compose_config([*E2E, "checkpoint.every=0", f"run.dir={b}"])).run()
    # the interrupt's handler (a checkpoint), the summary and the shut-down of Ray took seconds, not the hang
    assert time.perf_counter() - interrupted[0] < HANG_S / 2
    assert ended == [True]
    assert not any(t.name == "rlrepro-generate-step-3" for t in threading.enumerate())
    time.sleep(2.0)
    assert not ray.is_initialized()  # shut down with the run, and not started again by an abandoned thread
    ref = load_extra_state(a / "checkpoints" / "step_000001")[1]
    got = load_extra_state(b / "checkpoints" / "step_000001")[1]
    assert got["data_order"] == ref["data_order"] and _untimed(got["pending"]) == _untimed(ref["pending"])
    monkeypatch.undo()
    assert main(["train", *E2E, "checkpoint.every=0", f"run.dir={b}", "run.resume=true"]) == 0
    assert main(["diff", "--strict", str(a), str(b)]) == 0
