"""DAPO's dynamic sampling (rollout.dynamic_sampling): groups with equal rewards are dropped, further prompts are
drawn round after round; which groups are kept is a pure function of the data order and the seeds, the data
cursor counts every prompt drawn, and a resumed run equals the uninterrupted one."""
import json

import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config, main
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.config import to_schema
from rlrepro.rollout import request_seed

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=3", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=1", "logger.progress=false", "data.synthetic.num=20"]


class _Out:
    def __init__(self, seed):
        self.token_ids, self.logprobs, self.finish_reason = [5], [-1.0], "stop"
        self.seed, self.weight_version = seed, 0


class FakeActors:
    """Generates one token per request and records the keys asked for; starts nothing."""
    def __init__(self, *a, **k):
        self.asked = []

    def generate(self, requests):
        self.asked.append([r.key for r in requests])
        return [(r.key, _Out(r.params.seed)) for r in reversed(requests)]  # arrival order is not key order


def _driver(tmp_path, monkeypatch, *overrides, informative=lambda uid: True):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: FakeActors)
    cfg = compose_config([*COMMON, f"run.dir={tmp_path / 'run'}", *overrides])
    d = driver_mod.GRPODriver(cfg)
    d.setup()
    d.log.line = lambda *a, **k: None

    def score(samples, records):  # rewards differ within a group exactly for the "informative" prompts
        for s in samples:
            s.reward = float(s.sample_index % 2) if informative(s.prompt_uid) else 1.0
        return None, 0

    d.score = score
    return d


def _collect(d, step=1):
    return d.collect(step, driver_mod.PhaseTimer())


def test_off_is_one_round_of_prompts_per_step(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, informative=lambda uid: False)
    samples, penalties, errors, metrics = _collect(d)
    assert len(samples) == 6 and metrics == {} and len(d.actors.asked) == 1
    assert d.order.position == 3
    assert [s.key for s in samples] == sorted(s.key for s in samples)


def test_groups_with_equal_rewards_are_dropped_and_more_prompts_drawn(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, "rollout.dynamic_sampling=true", "rollout.max_generation_rounds=10")
    uids = [p.uid for p in d.prompts]
    order = [uids[i] for i in d.order.permutation(0)]
    good = set(order[1::3])  # every third prompt of the draw order has a learning signal
    d.score = _scorer(good)
    samples, _, _, metrics = _collect(d)
    kept_uids = sorted({s.prompt_uid for s in samples})
    assert kept_uids == sorted(order[1:9:3])  # the first three informative prompts, in draw order
    assert metrics == {"rollout/groups_kept": 3, "rollout/groups_dropped": 6, "rollout/generation_rounds": 3,
                       "rollout/prompts_drawn": 9}
    assert d.order.position == 9  # the cursor counts every prompt drawn
    assert [len(a) for a in d.actors.asked] == [6, 6, 6]
    # the first round asked for the same requests, with the same seeds, as a run without dynamic sampling
    assert d.actors.asked[0] == [(u, j) for u in order[:3] for j in range(2)]
    assert all(s.seed == request_seed(0, 1, s.prompt_uid, s.sample_index) for s in samples)


def _scorer(good):
    def score(samples, records):
        for s in samples:
            s.reward = float(s.sample_index % 2) if s.prompt_uid in good else 0.5
        return None, 0
    return score


def test_surplus_of_the_last_round_is_discarded_and_rounds_can_be_larger(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, "rollout.dynamic_sampling=true", "rollout.prompts_per_round=5")
    samples, _, _, metrics = _collect(d)
    assert metrics["rollout/generation_rounds"] == 1 and metrics["rollout/prompts_drawn"] == 5
    assert metrics["rollout/groups_kept"] == 3 and len(samples) == 6
    order = [d.prompts[i].uid for i in d.order.permutation(0)]
    assert sorted({s.prompt_uid for s in samples}) == sorted(order[:3])
    assert d.order.position == 5


@pytest.mark.parametrize("policy,groups", [("fill", 3), ("partial", 1)])
def test_the_round_cap_fills_or_trains_on_what_was_kept(tmp_path, monkeypatch, policy, groups):
    d = _driver(tmp_path, monkeypatch, "rollout.dynamic_sampling=true", "rollout.max_generation_rounds=2",
                f"rollout.on_round_cap={policy}")
    order = [d.prompts[i].uid for i in d.order.permutation(0)]
    d.score = _scorer({order[4]})
    samples, _, _, metrics = _collect(d)
    assert metrics["rollout/groups_kept"] == 1 and metrics["rollout/round_cap_hit"] == 1.0
    assert len({s.prompt_uid for s in samples}) == groups and order[4] in {s.prompt_uid for s in samples}
    if policy == "fill":  # topped up with the first dropped groups, in draw order
        assert {s.prompt_uid for s in samples} == {order[0], order[1], order[4]}


def test_partial_with_nothing_kept_trains_on_the_dropped_groups(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, "rollout.dynamic_sampling=true", "rollout.max_generation_rounds=2",
                "rollout.on_round_cap=partial", informative=lambda uid: False)
    samples, _, _, metrics = _collect(d)
    assert metrics["rollout/groups_kept"] == 0 and len(samples) == 6


def test_the_round_cap_can_stop_the_run_with_a_message(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, "rollout.dynamic_sampling=true", "rollout.max_generation_rounds=2",
                "rollout.on_round_cap=error", informative=lambda uid: False)
    with pytest.raises(RuntimeError, match="rollout.max_generation_rounds=2.*rollout.on_round_cap"):
        _collect(d)


def test_a_prompt_drawn_twice_in_a_step_gets_its_own_sample_indices(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, "rollout.dynamic_sampling=true", "rollout.prompts_per_round=15",
                "rollout.max_generation_rounds=2", "rollout.prompts_per_step=20", informative=lambda uid: False)
    samples, _, _, _ = _collect(d)  # 30 prompts drawn from 20: ten are drawn twice
    keys = [s.key for s in samples]
    assert len(keys) == len(set(keys)) == 40
    twice = [s for s in samples if s.sample_index >= 2]
    assert all(s.seed == request_seed(0, 1, s.prompt_uid, s.sample_index) for s in twice)
    asked = [k for a in d.actors.asked for k in a]
    assert len(asked) == len(set(asked)) == 60  # every request has a key (and seed) of its own
    assert sum(1 for _, j in asked if j >= 2) == 20


def test_config_keys_are_checked():
    for bad, key in [("rollout.max_generation_rounds=0", "max_generation_rounds"),
                     ("rollout.prompts_per_round=0", "prompts_per_round"),
                     ("rollout.on_round_cap=drop", "on_round_cap")]:
        with pytest.raises(ConfigError, match=key):
            to_schema(compose_config(["recipe=grpo_tiny", bad]))


# ---------------------------------------------------------------------------------------- end to end, with Ray
E2E = ["recipe=grpo_tiny", "train.steps=4", "rollout.prompts_per_step=3", "rollout.group_size=4",
       "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=exact_match",
       "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=12", "rollout.dynamic_sampling=true",
       "rollout.max_generation_rounds=3", "train.advantage=rloo"]


@pytest.mark.slow
def test_dynamic_sampling_runs_are_identical_across_workers_and_resume(tmp_path):
    assert main(["train", *E2E, f"run.dir={tmp_path / 'a'}"]) == 0
    assert main(["train", *E2E, f"run.dir={tmp_path / 'b'}", "rollout.num_workers=2", "rollout.max_num_seqs=5",
                 "rollout.prefix_cache=false"]) == 0
    assert main(["diff", "--strict", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    metrics = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all("rollout/groups_kept" in m for m in metrics)
    assert any(m["rollout/groups_dropped"] > 0 for m in metrics)  # the filter had something to drop
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in metrics)
    from rlrepro.orchestration import GRPODriver

    r = tmp_path / "r"  # stops after step 3 (the last checkpoint is step 2), then resumes from it
    GRPODriver(compose_config([*E2E, f"run.dir={r}"])).run(last_step=3)
    assert main(["train", *E2E, f"run.dir={r}", "run.resume=true"]) == 0
    assert main(["diff", "--strict", str(tmp_path / "a"), str(r)]) == 0


class FakeEpisodeActors(FakeActors):
    """Runs "episodes" of one token (env.name=single_turn): rewards differ within a group for even-numbered
    prompts only; each call reports one reward that reward.on_error=zero made 0.0, as a worker does."""
    def run_episodes(self, requests, *a, **k):
        from rlrepro.orchestration.episodes import EpisodeResult
        from rlrepro.samples import Turn

        self.asked.append([r.key for r in requests])
        out = []
        for r in requests:
            informative = int(r.record.uid.rsplit(":", 1)[-1]) % 2 == 0
            out.append(EpisodeResult(r.key, list(r.prompt_token_ids), [5], [-1.0], [1], [Turn("policy", [5], "x")],
                                     "done", float(r.key[1] % 2) if informative else 1.0, [0.0], 1, 1, ["stop"],
                                     [{}], 0, r.params.seed, metrics={"prompt_tokens": 4, "cached_tokens": 1}))
        out[0].metrics["reward_errors"] = 1
        return out


def test_episode_metrics_and_reward_errors_add_up_over_rounds(tmp_path, monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: FakeEpisodeActors)
    cfg = compose_config([*COMMON, f"run.dir={tmp_path / 'run'}", "env.name=single_turn",
                          "rollout.dynamic_sampling=true", "rollout.max_generation_rounds=10"])
    d = driver_mod.GRPODriver(cfg)
    d.setup()
    d.log.line = lambda *a, **k: None
    samples, penalties, errors, metrics = _collect(d)
    rounds = len(d.actors.asked)
    assert rounds >= 2 and metrics["rollout/generation_rounds"] == rounds
    assert errors == rounds  # one per call, every round's
    # the episode figures stay with dynamic sampling (they describe every episode generated, all rounds)
    assert metrics["episodes/turns_mean"] == 1.0 and metrics["perf/prefix_hit_rate"] == 0.25
    assert metrics["episodes/finish_done_frac"] == 1.0 and "episodes/finish_token_budget_frac" in metrics
    assert metrics["rollout/groups_kept"] == 3


def test_a_failure_in_the_users_environment_or_reward_says_to_fix_the_code(tmp_path, monkeypatch):
    from rlrepro.data.rewards import RewardError
    from rlrepro.envs import EnvError

    d = _driver(tmp_path, monkeypatch)
    d._done_step, d._done_order, d._trainer_step, d._saving = 0, None, 0, False
    for error, code in ((EnvError("environment X raised in step()"), "environment (env.name / env.fn)"),
                        (RewardError("reward.fn raised"), "reward function (reward.fn)")):
        message = str(d._failed(1, error))
        assert f"The {code} raised: fix its code first" in message, message
        assert message.startswith("step 1 failed: ") and "The last complete checkpoint is none (a resumed run" in message
    assert "fix its code first" not in str(d._failed(1, RuntimeError("worker lost")))
    d._in_warm_start = True  # Ctrl-C or a failure in the supervised warm start says so, not "step 1"
    assert str(d._failed(1, KeyboardInterrupt())).startswith("interrupted during the warm start (warm_start.steps")
