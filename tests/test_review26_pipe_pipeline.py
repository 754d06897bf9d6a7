"""Review 26, pipelined rollouts (rollout.max_staleness=K), without Ray: the driver runs with an in-process actor
group (one real RolloutWorker and TrainerWorker of the tiny model), so a run, a failure and a resume take seconds.

* the checkpoint a failed step's handler writes holds the batches generated ahead exactly as generated (it held
  the advantages the failed step had written into them), equal to the periodic checkpoint of that step, and the
  resumed run equals the uninterrupted one (fingerprints, metrics, rollouts), with multi-turn episodes;
* every sample trained at step s records weight version max(0, s - 1 - K), and a wrong version or a batch missing
  after step 1 stops the step before its update instead of training on another policy's samples;
* step 1's perf/step_time_s counts the generation of batches 1..K (perf/pipeline_fill_s).
"""
import copy
import gzip
import json
import time

import pytest

from rlrepro.cli import compose_config
from rlrepro.envs import BUILTIN_ENVS, EnvReset, Environment, StepResult, register_env
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.pipeline import check_staleness
from rlrepro.orchestration.runlog import step_metrics
from rlrepro.samples import Sample
from rlrepro.trainer.checkpoint import load_extra_state

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["recipe=grpo_tiny", "train.steps=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_tokens=4", "warm_start.steps=0", "reward.fn=prefix_match", "logger.progress=false",
        "data.synthetic.num=20", "train.warmup_steps=1"]


class LocalActors:
    """The driver's actor group in this process: one RolloutWorker and one TrainerWorker (what ActorGroup runs as
    Ray actors), with the weight sync and the trainer's kept weights as ActorGroup uses them."""

    def __init__(self, cfg, model_dir):
        from rlrepro.orchestration.workers import RolloutWorker, TrainerWorker

        self.cfg = cfg
        common = dict(device=cfg.run.device, dtype=cfg.model.dtype, deterministic=cfg.run.deterministic)
        self.worker = RolloutWorker(model_dir, cfg.rollout.engine, seed=cfg.run.seed, **common)
        self.trainer = TrainerWorker(model_dir, cfg.train, temperature=cfg.rollout.temperature,
                                     max_response_length=cfg.rollout.max_tokens, **common)
        self.restarts, self.weight_version = 0, -1

    def generate(self, requests):
        return [(r.key, out) for r, out in zip(requests, self.worker.generate(requests))]

    def run_episodes(self, requests, env_config, reward_fn_spec, *, max_tokens=None, use_chat_template=True,
                     tool_threads=2, reward_on_error="raise", import_dirs=None, end_of_turn=None):
        return sorted(self.worker.run_episodes(list(requests), env_config, reward_fn_spec, max_tokens,
                                               use_chat_template, tool_threads, reward_on_error, import_dirs,
                                               end_of_turn),
                      key=lambda r: r.key)

    def train_step(self, samples):  # a copy, as Ray's object store gives the trainer
        return self.trainer.train_step(copy.deepcopy(samples), keep_previous=bool(self.cfg.rollout.max_staleness))

    def warm_start(self, examples, **kw):
        return self.trainer.warm_start(examples, **kw)

    def sync_weights(self, version):
        self.worker.load_weights(self.trainer.get_weights(), version)
        self.weight_version = version
        return self.trainer.weights_digest()

    def optimizer_state_digest(self):
        from rlrepro.repro.fingerprint import optimizer_state_digest

        return optimizer_state_digest(self.trainer.optimizer_state_digests())

    def memory_stats(self):
        return {}

    def save_checkpoint(self, root, step, extra, keep_last):
        return self.trainer.save_checkpoint(root, step, extra, keep_last)

    def load_checkpoint(self, path):
        return self.trainer.load_checkpoint(path)

    def shutdown(self):
        pass


class RefusedAtStep3(LocalActors):
    """The trainer refuses step 3's update (a non-finite loss, before any weight changes): the driver then writes
    the checkpoint of step 2 itself."""

    def train_step(self, samples):
        if self.weight_version == 2:
            raise FloatingPointError("non-finite loss (injected)")
        return super().train_step(samples)


class TwoTurns(Environment):
    """An observation after the first turn, done after the second (reward from the text: groups differ)."""

    def __init__(self, record):
        self.record, self.turns = record, 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return StepResult(messages=[{"role": "tool", "content": "[= " + self.record.answer + "]"}])
        return StepResult(done=True, reward=float(len(text) % 2))


@pytest.fixture(scope="module", autouse=True)
def two_turns_env():
    register_env("_review26_two_turns")(lambda record, seed, *, config, reward_fn: TwoTurns(record))
    yield
    BUILTIN_ENVS.pop("_review26_two_turns", None)


def _run(monkeypatch, actors, args, **kw):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: actors)
    return driver_mod.GRPODriver(compose_config(args)).run(**kw)


def _lines(path):
    return path.read_text().splitlines()


def _untimed(pending):
    """A checkpoint's batches generated ahead without their timing figures (perf/*: tool seconds, cache hits)."""
    return {step: dict(b, metrics={k: v for k, v in b["metrics"].items() if not k.startswith("perf/")})
            for step, b in pending.items()}


def _bits(run):
    """What two identical runs share: fingerprints, metrics (perf/* aside) and rollout records."""
    metrics = [{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")}
               for x in _lines(run / "metrics.jsonl")]
    rollouts = {p.name: gzip.decompress(p.read_bytes()) for p in sorted((run / "rollouts").iterdir())}
    return _lines(run / "fingerprints.jsonl"), metrics, rollouts


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
def test_a_failed_steps_checkpoint_holds_the_batches_as_generated_and_the_resume_is_identical(
        tmp_path, monkeypatch, episodes):
    args = BASE + ["rollout.max_staleness=2"] + (["env.name=_review26_two_turns", "env.max_turns=2"] if episodes
                                                 else [])
    a, b = tmp_path / "a", tmp_path / "b"
    _run(monkeypatch, LocalActors, [*args, "checkpoint.every=1", f"run.dir={a}"])
    with pytest.raises(driver_mod.RunFailed, match="Saved a checkpoint of the last completed step 2"):
        _run(monkeypatch, RefusedAtStep3, [*args, "checkpoint.every=0", f"run.dir={b}"])
    periodic = load_extra_state(a / "checkpoints" / "step_000002")[1]["pending"]
    written_at_failure = load_extra_state(b / "checkpoints" / "step_000002")[1]["pending"]
    assert sorted(written_at_failure) == [3, 4]
    # batch 3 was being trained when the step failed: its samples are kept as generated (no advantages)
    assert all(s["advantage"] is None for s in written_at_failure[3]["samples"])
    assert _untimed(written_at_failure) == _untimed(periodic)
    if episodes:
        assert all(len(s["turns"]) == 3 for s in written_at_failure[3]["samples"])
    _run(monkeypatch, LocalActors, [*args, "checkpoint.every=0", f"run.dir={b}", "run.resume=true"])
    assert _bits(b) == _bits(a)


# ------------------------------------------------------------------------------------------- without an engine
class _Out:
    def __init__(self, seed, version):
        self.token_ids, self.logprobs, self.finish_reason = [5], [-1.0], "stop"
        self.seed, self.weight_version = seed, version


class FakeActors:
    """Generates with the weight version the test sets (as the weight sync would), ``delay_s`` per call."""
    delay_s = 0.0

    def __init__(self, *a, **k):
        self.version, self.calls = 0, 0

    def generate(self, requests):
        self.calls += 1
        time.sleep(self.delay_s)
        return [(r.key, _Out(r.params.seed, self.version)) for r in requests]


def _driver(tmp_path, monkeypatch, k, actors=FakeActors):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: actors)
    d = driver_mod.GRPODriver(compose_config([*BASE, f"run.dir={tmp_path / 'run'}", f"rollout.max_staleness={k}"]))
    d.setup()
    d.train = lambda step, samples: {}
    return d


def test_a_sample_of_another_weight_version_is_never_trained(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, 1)
    trained = []
    d.train = lambda step, samples: trained.append(step) or {}
    d.pipelined_batch(1, driver_mod.PhaseTimer())
    d.actors.version = 1  # the sync of step 1
    d.pipelined_batch(2, driver_mod.PhaseTimer())  # batch 2 came from version 0 = max(0, 2 - 1 - 1)
    d.actors.version = 2
    d.pending[3][0][1].weight_version = 2  # as if an engine had generated it with the newer weights
    with pytest.raises(RuntimeError, match=r"sample \('.*', 1\) of step 3 was generated by weight version 2, not 1"):
        d.pipelined_batch(3, driver_mod.PhaseTimer())
    assert trained == [1, 2]
    s = Sample("u", 0, [1], [2], [-1.0], weight_version=None)
    check_staleness(9, 2, [s])  # not recorded (an older record): nothing to check
    with pytest.raises(RuntimeError, match="version 5, not 6"):
        check_staleness(9, 2, [Sample("u", 0, [1], [2], [-1.0], weight_version=5)])


def test_a_batch_missing_after_step_1_is_not_generated_late(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, 2)
    d.pipelined_batch(1, driver_mod.PhaseTimer())
    d.actors.version = 1
    calls = d.actors.calls
    d.pending.pop(3)
    with pytest.raises(RuntimeError, match=r"batches of steps \[3\] were not generated ahead before step 2"):
        d.pipelined_batch(2, driver_mod.PhaseTimer())
    assert d.actors.calls == calls  # nothing generated with version 1 for batch 3 (it needs version 0)


def test_step_one_counts_the_generation_of_the_first_k_batches(tmp_path, monkeypatch):
    class Slow(FakeActors):
        delay_s = 0.05

    d = _driver(tmp_path, monkeypatch, 2, Slow)
    t = driver_mod.PhaseTimer()
    samples, penalties, errors, gen, train = d.pipelined_batch(1, t)
    t("sync")
    fill = gen["perf/pipeline_fill_s"]
    assert fill >= 2 * Slow.delay_s and t.times["pipeline_fill"] == fill  # batches 1 and 2, before step 1 trains
    m = step_metrics(1, samples, {}, t.times, weights_digest="00" * 32, num_reward_errors=errors,
                     penalties=penalties, restarts=0)
    # the step's time holds the fill, then generating batch 3 while training (overlapped: counted once)
    assert m["perf/step_time_s"] >= fill + m["perf/rollout_s"] >= 3 * Slow.delay_s
    t2 = driver_mod.PhaseTimer()
    _, _, _, gen2, _ = d.pipelined_batch(2, t2)
    assert "perf/pipeline_fill_s" not in gen2 and "pipeline_fill" not in t2.times
