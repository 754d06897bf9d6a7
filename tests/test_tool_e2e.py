"""Multi-turn tool-calling GRPO end to end through Ray on the CPU (recipe grpo_tiny_tool): two runs identical;
identical across worker counts, engine batch settings, prefix cache on/off, tool threads, a rollout worker killed
mid-episode and a resume mid-run (`rlrepro diff --strict`); exactly on-policy at every step; the loss mask covers
the policy's tokens only; and the single-turn environment gives today's single-turn bits."""
import gzip
import json

import pytest

from rlrepro.cli import compose_config, main

pytestmark = pytest.mark.slow

BASE = ["recipe=grpo_tiny_tool", "train.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "warm_start.steps=60", "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=8",
        "data.synthetic.kwargs.digits=2", "train.warmup_steps=1"]


def _train(run, *extra):
    assert main(["train", *BASE, f"run.dir={run}", *extra]) == 0


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _rollouts(run, step):
    with gzip.open(run / "rollouts" / f"step_{step:06d}.jsonl.gz", "rt") as f:
        return [json.loads(x) for x in f]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    run = tmp_path_factory.mktemp("tool") / "ref"
    _train(run)
    return run


def test_episodes_are_multi_turn_on_policy_and_masked(ref):
    m = _metrics(ref)
    assert all(x["train/rollout_logprob_abs_diff"] == 0.0 for x in m)  # every generated token of every turn
    assert all(x["episodes/turns_mean"] > 1.0 for x in m)  # the warm-started model calls the calculator
    tool_turns = 0
    for step in range(1, 5):
        for rec in _rollouts(ref, step):
            ids, mask, turns = rec["token_ids"], rec["loss_mask"], rec["turns"]
            assert [t for turn in turns for t in turn["token_ids"]] == ids and len(mask) == len(ids)
            pos = 0
            for turn in turns:  # token by token: 1 exactly on the policy's own tokens
                n = len(turn["token_ids"])
                assert mask[pos:pos + n] == [int(turn["role"] == "policy")] * n
                pos += n
                tool_turns += turn["role"] == "tool"
            assert turns[-1]["role"] == "policy"
            assert all(lp == 0.0 for lp, b in zip(rec["logprobs"], mask) if not b)
    assert tool_turns > 0
    trained = [x["train/num_tokens"] for x in m]
    total = [sum(len(r["token_ids"]) for r in _rollouts(ref, s)) for s in range(1, 5)]
    assert all(t < n for t, n in zip(trained, total))  # the observations are not trained


def test_identical_across_workers_engine_settings_prefix_cache_and_threads(ref, tmp_path):
    _train(tmp_path / "b", "rollout.num_workers=2", "rollout.max_num_seqs=5", "rollout.max_num_batched_tokens=37",
           "rollout.prefix_cache=false", "rollout.block_size=4", "env.tool_threads=1")
    assert main(["diff", "--strict", str(ref), str(tmp_path / "b")]) == 0


def test_a_worker_killed_mid_episode_and_a_resume_change_nothing(ref, tmp_path, monkeypatch):
    from rlrepro.orchestration import GRPODriver

    # 0.05 s into the step's run_episodes call: a step's episodes take 0.19 s on a 2-core AMD EPYC (2026-12-07), so a
    # later kill (0.5 s, as before) landed in step 3 there, whose result the resume below rewrites
    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "kill_worker", "step": 2, "at": "generate",
                                                      "delay_s": 0.05}]))
    r = tmp_path / "r"
    GRPODriver(compose_config([*BASE, f"run.dir={r}"])).run(last_step=3)  # stops after step 3; checkpoint 2
    assert _metrics(r)[1]["perf/rollout_worker_restarts"] >= 1
    monkeypatch.delenv("RLREPRO_FAULTS")
    _train(r, "run.resume=true")
    assert main(["diff", str(ref), str(r)]) == 0  # not --strict: RLREPRO_FAULTS is an input that can change bits


def test_the_single_turn_environment_is_the_single_turn_path(tmp_path):
    common = ["recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
              "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
              "logger.progress=false"]
    assert main(["train", *common, f"run.dir={tmp_path / 'plain'}"]) == 0
    assert main(["train", *common, "env.name=single_turn", f"run.dir={tmp_path / 'env'}"]) == 0
    assert (tmp_path / "plain" / "fingerprints.jsonl").read_text() == \
        (tmp_path / "env" / "fingerprints.jsonl").read_text()
    for step in (1, 2):
        a, b = _rollouts(tmp_path / "plain", step), _rollouts(tmp_path / "env", step)
        assert b == a  # every record field: tokens, logprobs, rewards, advantages, texts, finish reasons


def test_a_users_environment_and_reward_module_import_in_the_rollout_workers(tmp_path, monkeypatch):
    """env.fn and reward.fn from a module in a directory only the driver has on its path: the workers import it
    too (the driver names the directory, the workers append it to their sys.path), and it runs multi-turn."""
    pkg = tmp_path / "userland"
    pkg.mkdir()
    (pkg / "my_tool_task.py").write_text("""
from rlrepro.envs import Environment, EnvReset, StepResult


class TwoTurns(Environment):
    def __init__(self, record):
        self.record, self.turns = record, 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return StepResult(messages=[{"role": "tool", "content": "[= " + self.record.answer + "]"}])
        return StepResult(done=True, reward=float(text.strip() == self.record.answer))


def factory(record, seed, *, config, reward_fn):
    return TwoTurns(record)


def reward(completion, record):
    return float(completion.strip() == record.answer)
""")
    monkeypatch.syspath_prepend(str(pkg))
    from rlrepro.orchestration.import_path import module_dirs

    assert module_dirs(["my_tool_task:reward", "exact_match", None, "my_tool_task:factory"]) == [str(pkg)]
    run = tmp_path / "run"
    assert main(["train", *BASE, "train.steps=1", "checkpoint.every=0", "warm_start.steps=0", "env.name=null",
                 "env.fn=my_tool_task:factory", "reward.fn=my_tool_task:reward", f"run.dir={run}"]) == 0
    assert _metrics(run)[0]["episodes/turns_mean"] == 2.0


def test_grpo_tiny_tool_recipe_shows_real_learning(tmp_path):
    """The multi-turn recipe as shipped: every episode calls the calculator, and GRPO lifts the exact-match reward:
    the error (1 - mean reward) over the last 5 steps is at most 0.8 x that over the first 5, exactly on-policy
    throughout. The error, not an absolute gain: where the warm start leaves the policy depends on the CPU's kernels
    (float results differ between AVX-512 and AVX2 builds of the same ops, and 500 warm-start steps at lr 1e-2
    amplify them): measured starts 0.53, 0.72 and 0.78 went to 0.84-0.85, error ratios 0.34, 0.55 and 0.69
    (docs/ENVS.md, section 8)."""
    run = tmp_path / "tool"
    assert main(["train", "recipe=grpo_tiny_tool", f"run.dir={run}", "logger.progress=false"]) == 0
    m = _metrics(run)
    rewards = [x["rollout/reward_mean"] for x in m]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 1.0 - last <= 0.8 * (1.0 - first), rewards
    assert all(x["train/rollout_logprob_abs_diff"] == 0.0 for x in m)
    assert min(x["episodes/turns_mean"] for x in m) > 1.9  # a call, an observation, an answer
