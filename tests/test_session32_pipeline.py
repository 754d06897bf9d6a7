"""Session 32, pipelined rollouts (rollout.max_staleness=K) as a demanding AReaL/slime user would try them, without
Ray (the in-process actor group of tests/test_review26_pipe_pipeline.py: one real RolloutWorker and TrainerWorker
of the tiny model):

* a resume at a step whose batches were generated ahead reuses them from the checkpoint (nothing is generated
  again) and equals the uninterrupted run, single-turn and with multi-turn episodes; every rollout record names
  the weight version max(0, s - 1 - K) it was sampled with;
* extending train.steps on resume trains the batches generated at the end of the shorter run, as the longer run;
* changing rollout.max_staleness on resume is refused before anything is written;
* dynamic sampling and eval steps with K > 0: identical runs and resumes, eval bit-neutral;
* a reward function raising in the batch generated ahead ends the run naming that batch and the step it
  happened at; the resume (after the fix) equals the uninterrupted run.
"""
import gzip
import json

import pytest
from test_review26_pipe_pipeline import BASE, LocalActors, TwoTurns, _bits, _run

from rlrepro.checks import ConfigError
from rlrepro.orchestration import driver as driver_mod

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _two_turns_env():
    from rlrepro.envs import BUILTIN_ENVS, register_env

    register_env("_s32_two_turns")(lambda record, seed, *, config, reward_fn: TwoTurns(record))
    yield
    BUILTIN_ENVS.pop("_s32_two_turns", None)


class Counting(LocalActors):
    """Counts the samples generated in this process (single-turn requests and episodes)."""
    generated: list = []

    def generate(self, requests):
        Counting.generated.append(len(requests))
        return super().generate(requests)

    def run_episodes(self, requests, *a, **kw):
        requests = list(requests)
        Counting.generated.append(len(requests))
        return super().run_episodes(requests, *a, **kw)


def _versions(run):
    """{step: sorted set of the weight versions its rollout records name}."""
    out = {}
    for p in sorted((run / "rollouts").iterdir()):  # step_000003.jsonl.gz
        recs = [json.loads(x) for x in gzip.decompress(p.read_bytes()).decode().splitlines() if x.strip()]
        out[int(p.name.split(".")[0].split("_")[1])] = sorted({r.get("weight_version") for r in recs})
    return out


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
def test_a_resume_reuses_the_batches_generated_ahead_and_records_their_versions(tmp_path, monkeypatch, episodes):
    k = 2
    args = BASE + ["train.steps=5", f"rollout.max_staleness={k}", "checkpoint.every=1"] + (
        ["env.name=_s32_two_turns", "env.max_turns=2"] if episodes else [])
    a, r = tmp_path / "a", tmp_path / "r"
    _run(monkeypatch, LocalActors, [*args, f"run.dir={a}"])
    assert _versions(a) == {s: [max(0, s - 1 - k)] for s in range(1, 6)}
    _run(monkeypatch, LocalActors, [*args, f"run.dir={r}"], last_step=2)
    Counting.generated = []
    _run(monkeypatch, Counting, [*args, f"run.dir={r}", "run.resume=true"])
    # batches 3 and 4 come from the checkpoint of step 2 (generated with versions 0 and 1 before the stop); the
    # resumed run generates batches 5, 6, 7 only (one call each)
    assert Counting.generated == [4, 4, 4]
    assert _bits(r) == _bits(a)
    assert _versions(r) == _versions(a)


def test_extending_train_steps_trains_the_batches_generated_at_the_end(tmp_path, monkeypatch):
    args = BASE + ["rollout.max_staleness=1", "train.min_lr_ratio=1.0", "checkpoint.every=0"]
    a, r = tmp_path / "a", tmp_path / "r"
    _run(monkeypatch, LocalActors, [*args, "train.steps=5", f"run.dir={a}"])
    _run(monkeypatch, LocalActors, [*args, "train.steps=3", f"run.dir={r}"])  # save_last: step 3 holds batch 4
    _run(monkeypatch, LocalActors, [*args, "train.steps=5", f"run.dir={r}", "run.resume=true"])
    assert _bits(r) == _bits(a)


@pytest.mark.parametrize("other", [0, 1, 3])
def test_changing_max_staleness_on_resume_is_refused(tmp_path, monkeypatch, other):
    args = BASE + ["train.steps=5", "rollout.max_staleness=2", "checkpoint.every=1"]
    r = tmp_path / "r"
    _run(monkeypatch, LocalActors, [*args, f"run.dir={r}"], last_step=2)
    before = {p.relative_to(r): p.read_bytes() for p in r.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(ConfigError, match=rf"rollout.max_staleness: 2 -> {other}"):
        _run(monkeypatch, LocalActors, [*args, f"rollout.max_staleness={other}", f"run.dir={r}", "run.resume=true"])
    after = {p.relative_to(r): p.read_bytes() for p in r.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_dynamic_sampling_with_max_staleness(tmp_path, monkeypatch):
    ds = ["rollout.dynamic_sampling=true", "rollout.prompts_per_round=2", "rollout.max_generation_rounds=2",
          "rollout.on_round_cap=fill", "checkpoint.every=1", "train.steps=4"]
    a, b, r, z = (tmp_path / n for n in "abrz")
    _run(monkeypatch, LocalActors, [*BASE, *ds, "rollout.max_staleness=1", f"run.dir={a}"])
    _run(monkeypatch, LocalActors, [*BASE, *ds, "rollout.max_staleness=1", f"run.dir={b}"])
    assert _bits(b) == _bits(a)
    assert _versions(a) == {s: [max(0, s - 2)] for s in range(1, 5)}
    m = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert all("rollout/generation_rounds" in x for x in m)
    _run(monkeypatch, LocalActors, [*BASE, *ds, "rollout.max_staleness=1", f"run.dir={r}"], last_step=2)
    _run(monkeypatch, LocalActors, [*BASE, *ds, "rollout.max_staleness=1", f"run.dir={r}", "run.resume=true"])
    assert _bits(r) == _bits(a)
    # step 1 is trained on version 0 both ways: the synchronous run's step 1, bit for bit
    _run(monkeypatch, LocalActors, [*BASE, *ds, f"run.dir={z}"], last_step=1)
    (fa, ma, ra), (fz, mz, rz) = _bits(a), _bits(z)
    assert len(fz) == 1 and fz[0] == fa[0] and mz[0] == ma[0] and list(rz) == list(ra)[:1]
    assert rz == {name: ra[name] for name in rz}


def test_eval_steps_with_max_staleness_are_bit_neutral_and_resume(tmp_path, monkeypatch):
    from rlrepro.data import make_synthetic_records, write_jsonl

    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("first_letter", 3, 7, alphabet="abcd"), held)
    ev = ["eval.every=1", f"eval.source={held}", "eval.num_samples=2"]
    args = BASE + ["rollout.max_staleness=1", "checkpoint.every=1"]
    a, b, r = tmp_path / "a", tmp_path / "b", tmp_path / "r"
    _run(monkeypatch, LocalActors, [*args, *ev, f"run.dir={a}"])
    _run(monkeypatch, LocalActors, [*args, f"run.dir={b}"])
    fa, ma, ra = _bits(a)
    fb, mb, rb = _bits(b)
    assert ra == rb  # the rollouts: eval changes no sampled token
    assert [{k: v for k, v in x.items() if not k.startswith(("eval/", "repro/eval"))} for x in ma] == mb
    assert all("eval/avg@2" in x for x in ma)
    _run(monkeypatch, LocalActors, [*args, *ev, f"run.dir={r}"], last_step=2)
    _run(monkeypatch, LocalActors, [*args, *ev, f"run.dir={r}", "run.resume=true"])
    assert _bits(r) == _bits(a)


def test_a_reward_error_in_the_batch_generated_ahead(tmp_path, monkeypatch):
    """K=1: batch 3 is scored while step 2 trains. Its reward function raising ends the run at step 2 (after step
    2's update), naming batch 3 and the reward function; the resume after the fix equals the uninterrupted run."""
    import rlrepro.data as data_mod

    args = BASE + ["rollout.max_staleness=1", "checkpoint.every=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    _run(monkeypatch, LocalActors, [*args, f"run.dir={a}"])
    real, calls = data_mod.compute_rewards, []

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(data_mod, "compute_rewards", counted)
    _run(monkeypatch, LocalActors, [*args, f"run.dir={tmp_path / 'count'}"])
    third = len(calls) - 5 + 3  # the calls before the first batch (set-up checks), then batches 1..5 in order
    calls.clear()

    def broken(fn, completions, records, *a, **kw):
        calls.append(1)
        if len(calls) == third:  # batch 3, scored while step 2 trains
            def fn(completion, record):
                raise ZeroDivisionError("injected")
        return real(fn, completions, records, *a, **kw)

    monkeypatch.setattr(data_mod, "compute_rewards", broken)
    with pytest.raises(driver_mod.RunFailed) as info:
        _run(monkeypatch, LocalActors, [*args, f"run.dir={b}"])
    msg = str(info.value)
    assert "generation of batch 3 failed while step 2 trained" in msg, msg
    assert "reward function (reward.fn) raised" in msg, msg
    assert "ZeroDivisionError" in msg or "injected" in msg, msg
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_000001"]
    monkeypatch.setattr(data_mod, "compute_rewards", real)
    _run(monkeypatch, LocalActors, [*args, f"run.dir={b}", "run.resume=true"])
    assert _bits(b) == _bits(a)


def test_a_resume_with_another_reward_fn_records_the_batches_generated_ahead(tmp_path, monkeypatch, capsys):
    """The reward function's code changes between the stop (K=2, after step 2) and the resume: the batches of steps
    3 and 4 were scored by the old code before the stop and are reused, so the resume's record says so
    (``generated_ahead``), as its warning and ``rlrepro diff``'s input note do, instead of only "from step 3"."""
    import importlib
    import sys

    from rlrepro.repro.inputs import resumed_differences

    mods = tmp_path / "mods"
    mods.mkdir()
    src = "def reward(completion, record):\n    return {}\n"
    (mods / "s32rew_ahead.py").write_text(src.format("0.0"))
    monkeypatch.syspath_prepend(str(mods))
    run = tmp_path / "run"
    args = [a for a in BASE if not a.startswith("reward.fn")] + [
        "reward.fn=s32rew_ahead:reward", "train.steps=5", "rollout.max_staleness=2", "checkpoint.every=1",
        f"run.dir={run}"]
    _run(monkeypatch, LocalActors, args, last_step=2)
    (mods / "s32rew_ahead.py").write_text(src.format("1.0"))
    sys.modules.pop("s32rew_ahead", None)
    importlib.invalidate_caches()
    capsys.readouterr()
    _run(monkeypatch, LocalActors, args + ["run.resume=true"])
    err = capsys.readouterr().err
    rewards = {}
    for p in sorted((run / "rollouts").iterdir()):
        recs = [json.loads(x) for x in gzip.decompress(p.read_bytes()).decode().splitlines()]
        rewards[p.name] = sorted({r["reward"] for r in recs})
    assert list(rewards.values()) == [[0.0], [0.0], [0.0], [0.0], [1.0]]  # steps 3-4 scored before the stop
    resumes = json.loads((run / "inputs.json").read_text())["resumes"]
    assert resumes[-1]["from_step"] == 3 and resumes[-1]["generated_ahead"] == [3, 4]
    assert "reaches the rollouts from step 5" in err, err
    notes = [d.message for d in resumed_differences(json.loads((run / "inputs.json").read_text()), "B")]
    assert notes and all("changed from step 5" in m for m in notes), notes
