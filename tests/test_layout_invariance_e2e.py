"""`rlrepro train` end to end with train.layout_invariant=true (issue #26): train.num_gpus=1 and 2, the megatron
backend at TP 1 and 2 (train.tp_partials=2; the engines emulate the 2 pieces), and a run stopped at DP=2 and resumed
at DP=1 are one run (`rlrepro diff --strict` exit 0), on-policy at every step."""
import json

import pytest

from rlrepro.cli import main

pytestmark = pytest.mark.slow

# a reward that differs within groups from step 1 (hash), so the weights move; 8 micro-batches of 2
BASE = ["recipe=grpo_tiny", "train.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_tokens=6", "warm_start.steps=0", "reward.fn=hash", "logger.progress=false",
        "train.micro_batch_size=2", "train.warmup_steps=1", "train.layout_invariant=true", "train.tp_partials=2"]


def _train(run_dir, *extra):
    assert main(["train", *BASE, f"run.dir={run_dir}", *extra]) == 0


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_run_on_any_layout_and_resumed_at_another(tmp_path):
    from rlrepro.cli import compose_config
    from rlrepro.orchestration import GRPODriver

    _train(tmp_path / "dp1")
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0
               for m in _metrics(tmp_path / "dp1"))
    _train(tmp_path / "tp2", "train.backend=megatron", "train.tensor_parallel=2", "train.num_gpus=2")
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in _metrics(tmp_path / "tp2"))
    assert main(["diff", "--strict", str(tmp_path / "dp1"), str(tmp_path / "tp2")]) == 0
    # DP=2, stopped after step 2 (checkpoint at 2), resumed at DP=1: the uninterrupted run
    d = tmp_path / "resumed"
    GRPODriver(compose_config([*BASE, f"run.dir={d}", "train.num_gpus=2", "checkpoint.every=2"])).run(last_step=2)
    assert (d / "checkpoints" / "step_000002").is_dir()
    _train(d, "train.num_gpus=1", "checkpoint.every=2", "run.resume=true")
    assert main(["diff", "--strict", str(tmp_path / "dp1"), str(d)]) == 0
    amendments = [json.loads(x) for x in (d / "amendments.jsonl").read_text().splitlines()]
    assert {"key": "train.num_gpus", "old": 2, "new": 1, "from_step": 3} in amendments


def test_a_one_gpu_run_without_the_option_resumes_with_it_on_two(tmp_path):
    """At one trainer rank the option's fold is the plain step: a run recorded on one GPU without it turns it on at
    resume and continues on 2 ranks into the uninterrupted one-GPU run."""
    from rlrepro.cli import compose_config
    from rlrepro.orchestration import GRPODriver

    plain = [k for k in BASE if not k.startswith(("train.layout_invariant", "train.tp_partials"))]
    assert main(["train", *plain, f"run.dir={tmp_path / 'one'}"]) == 0
    d = tmp_path / "moved"
    GRPODriver(compose_config([*plain, f"run.dir={d}", "checkpoint.every=2"])).run(last_step=2)
    # without turning the option on, the layout may not change (refused before any work: exit 2)
    assert main(["train", *plain, f"run.dir={d}", "train.num_gpus=2", "checkpoint.every=2", "run.resume=true"]) == 2
    assert main(["train", *plain, f"run.dir={d}", "train.num_gpus=2", "checkpoint.every=2", "run.resume=true",
                 "train.layout_invariant=true"]) == 0
    assert main(["diff", "--strict", str(tmp_path / "one"), str(d)]) == 0
    amendments = [json.loads(x) for x in (d / "amendments.jsonl").read_text().splitlines()]
    assert {"key": "train.num_gpus", "old": 1, "new": 2, "from_step": 3} in amendments
    assert {"key": "train.layout_invariant", "old": False, "new": True, "from_step": 3} in amendments
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0 for m in _metrics(d))
