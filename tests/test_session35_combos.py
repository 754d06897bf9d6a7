"""Features turned on together stay bitwise reproducible (session 35's combination probe), end to end with Ray on
the tiny recipes:

- pipelined rollouts (``rollout.max_staleness=1``) + dynamic sampling + 2 rollout workers, against 1 worker with
  other engine settings;
- multi-turn episodes (an environment that always makes 3 policy turns with 2 tool turns between them) + pipelining,
  stopped after step 2 and resumed with other engine settings, against the uninterrupted run;
- KL (k2) + entropy bonus + CISPO + micro-batches by samples and tokens + 3 PPO epochs + pipelining with decoupled
  PPO and sequence-level masked IS, stopped and resumed with other engine settings;
- eval during training + dynamic sampling + pipelining, stopped and resumed with other engine settings.

Every pair: ``rlrepro diff`` and ``rlrepro diff --strict`` exit 0, ``fingerprints.jsonl`` byte-equal, and every
non-``perf/*`` metric (eval numbers and ``repro/eval_fingerprint`` included) equal, step by step."""
import json

import pytest

from rlrepro.cli import main
from test_eval_env import ENV_MODULE

# other engine settings than the recipe's (1 worker, 256 seqs, 4096 tokens, prefix cache on)
ENGINE = ["rollout.num_workers=2", "rollout.max_num_seqs=5", "rollout.max_num_batched_tokens=37",
          "rollout.prefix_cache=false"]
SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_tokens=6", "train.warmup_steps=1",
         "logger.progress=false"]

# 3 policy turns, a tool turn after each of the first two (the untrained tiny policy never calls the calculator
# itself); the reward depends on the text and the environment's seed: test_eval_env's Relay
RELAY_ENV = ENV_MODULE


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _no_perf(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("perf/")}


def _assert_identical(a, b, steps: int) -> None:
    assert main(["diff", str(a), str(b)]) == 0
    assert main(["diff", "--strict", str(a), str(b)]) == 0
    fa, fb = (r / "fingerprints.jsonl" for r in (a, b))
    assert [json.loads(x)["step"] for x in fa.read_text().splitlines()] == list(range(1, steps + 1))
    assert fa.read_bytes() == fb.read_bytes()
    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, steps + 1))
    assert [_no_perf(m) for m in ma] == [_no_perf(m) for m in mb]


def _uninterrupted_and_resumed(tmp_path, args: list, stop: int, steps: int) -> tuple:
    """The run of ``steps`` steps, and one stopped after ``stop`` (checkpoint.every=1) and resumed with ENGINE."""
    full, res = tmp_path / "full", tmp_path / "resumed"
    assert main(["train", *args, f"train.steps={steps}", f"run.dir={full}"]) == 0
    assert main(["train", *args, f"train.steps={stop}", f"run.dir={res}"]) == 0
    assert len(_metrics(res)) == stop
    assert main(["train", *args, *ENGINE, f"train.steps={steps}", "run.resume=true", f"run.dir={res}"]) == 0
    return full, res


@pytest.mark.slow
def test_pipelined_dynamic_sampling_two_workers_equals_one_worker_with_other_engine_settings(tmp_path):
    args = ["recipe=grpo_tiny", "train.steps=3", *SMALL, "rollout.prompts_per_step=3", "warm_start.steps=10",
            "warm_start.target=answer", "reward.fn=exact_match", "train.micro_batch_size=12",
            "rollout.dynamic_sampling=true", "rollout.max_generation_rounds=3", "rollout.max_staleness=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *args, "rollout.num_workers=2", f"run.dir={a}"]) == 0
    assert main(["train", *args, *ENGINE[1:], "rollout.num_workers=1", f"run.dir={b}"]) == 0
    _assert_identical(a, b, 3)
    m = _metrics(a)
    assert sum(x["rollout/groups_dropped"] for x in m) > 0 and sum(x["rollout/groups_kept"] for x in m) > 0
    assert any(x["train/grad_norm"] > 0 for x in m)


@pytest.mark.slow
def test_multi_turn_pipelined_run_resumed_with_other_engine_settings_is_the_uninterrupted_run(tmp_path,
                                                                                            monkeypatch):
    (tmp_path / "s35_relay_env.py").write_text(RELAY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["recipe=grpo_tiny_tool", "warm_start.steps=0", *SMALL, "rollout.prompts_per_step=3", "env.name=null",
            "env.fn=s35_relay_env:make", "env.max_turns=4", "env.max_episode_tokens=null",
            "train.micro_batch_size=12", "rollout.max_staleness=1", "checkpoint.every=1"]
    full, res = _uninterrupted_and_resumed(tmp_path, args, 2, 4)
    _assert_identical(full, res, 4)
    m = _metrics(full)
    assert all(x["episodes/turns_mean"] == 3.0 and x["train/grad_norm"] > 0 for x in m)


@pytest.mark.slow
def test_kl_entropy_cispo_micro_batches_ppo_epochs_pipelined_decoupled_resumed(tmp_path):
    args = ["recipe=grpo_tiny", *SMALL, "reward.fn=hash", "train.kl_coef=0.05", "train.kl_estimator=k2",
            "train.entropy_coef=0.01", "train.policy_loss=cispo", "train.clip_low=1.0", "train.micro_batch_size=5",
            "train.micro_batch_tokens=40", "train.ppo_epochs=3", "rollout.max_staleness=1", "train.decoupled=true",
            "train.is_correction=mis", "checkpoint.every=1"]
    full, res = _uninterrupted_and_resumed(tmp_path, args, 2, 4)
    _assert_identical(full, res, 4)
    m = _metrics(full)
    assert all(x["train/kl"] > 0 and x["train/clip_frac"] > 0 for x in m)
    assert any(x["train/is_masked_frac"] > 0 for x in m)   # stale batches: MIS masked some sequences


@pytest.mark.slow
def test_eval_during_training_with_dynamic_sampling_and_pipelining_resumed(tmp_path):
    from rlrepro.data import make_synthetic_records, write_jsonl

    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("first_letter", 6, 7, alphabet="abcd"), held)
    args = ["recipe=grpo_tiny", *SMALL, "reward.fn=hash", "train.micro_batch_size=8", "checkpoint.every=1",
            "eval.every=1", f"eval.source={held}", "eval.num_samples=2", "rollout.max_staleness=1",
            "rollout.dynamic_sampling=true"]
    full, res = _uninterrupted_and_resumed(tmp_path, args, 2, 4)
    _assert_identical(full, res, 4)
    m = _metrics(full)
    assert all(0 < x["eval/avg@2"] < 1 and "repro/eval_fingerprint" in x for x in m)


def test_distributed_optimizer_may_change_at_resume():
    """ZeRO-1 is the unsharded optimizer's bits and its checkpoints load either way (docs/TRAINER.md): turning it
    off (or on) at a resume is an amendment, not a refusal (it was refused as a key that can change numbers)."""
    import copy

    from rlrepro.orchestration.resume import reconcile_resume

    rec = {"train": {"steps": 4, "num_gpus": 2, "distributed_optimizer": True}}
    req = copy.deepcopy(rec)
    req["train"]["distributed_optimizer"] = False
    config, amendments = reconcile_resume(rec, req, completed_step=2)
    assert config["train"]["distributed_optimizer"] is False
    assert amendments == [{"key": "train.distributed_optimizer", "old": True, "new": False, "from_step": 3}]
