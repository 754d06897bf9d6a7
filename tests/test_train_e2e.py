"""`rlrepro train recipe=grpo_tiny` end to end through Ray on the CPU, and the proofs around it:
two runs identical, identical under other engine settings and worker counts, resume == uninterrupted,
`rlrepro verify` passes (and fails on an altered record), a different seed diverges at step 1."""
import json
import shutil

import pytest

from rlrepro.cli import main

pytestmark = pytest.mark.slow

# Small and quick: 4 prompts x 4 samples, 4 steps, short completions. A short supervised warm-start and a
# partial-credit reward make rewards differ within groups from step 1, so every step changes the weights and
# the optimizer state (what resume and identity must then restore exactly).
BASE = ["recipe=grpo_tiny", "train.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
        "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=8", "train.warmup_steps=1"]


def _train(run_dir, *extra):
    assert main(["train", *BASE, f"run.dir={run_dir}", *extra]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    _train(root / "a")
    _train(root / "b")
    return root


def test_run_directory_layout(runs):
    a = runs / "a"
    for name in ("config.yaml", "metrics.jsonl", "fingerprints.jsonl", "base_model/config.json"):
        assert (a / name).exists(), name
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert len(list((a / "rollouts").glob("step_*.jsonl.gz"))) == 4
    lines = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm",
                    "train/kl", "train/entropy", "train/rollout_logprob_abs_diff", "perf/step_time_s"):
            assert key in m, key
        assert m["train/rollout_logprob_abs_diff"] == 0.0  # exactly on-policy
    assert all(m["train/grad_norm"] > 0 for m in lines)  # the weights move at every step
    fps = [json.loads(x) for x in (a / "fingerprints.jsonl").read_text().splitlines()]
    assert len({fp["weights"] for fp in fps}) == 4


def test_two_runs_identical(runs):
    assert main(["diff", str(runs / "a"), str(runs / "b")]) == 0
    assert (runs / "a" / "fingerprints.jsonl").read_text() == (runs / "b" / "fingerprints.jsonl").read_text()


def test_identical_under_other_engine_settings_and_two_workers(runs):
    _train(runs / "c", "rollout.num_workers=2", "rollout.max_num_seqs=3", "rollout.max_num_batched_tokens=37",
           "rollout.prefix_cache=false", "rollout.block_size=4")
    assert main(["diff", str(runs / "a"), str(runs / "c")]) == 0


def test_resume_equals_uninterrupted(runs):
    from rlrepro.cli import compose_config
    from rlrepro.orchestration import GRPODriver

    d = runs / "d"
    cfg = compose_config([*BASE, f"run.dir={d}"])
    GRPODriver(cfg).run(last_step=3)  # stops after step 3; the last checkpoint is step 2
    assert (d / "checkpoints" / "step_000002").is_dir()
    _train(d, "run.resume=true")
    assert main(["diff", str(runs / "a"), str(d)]) == 0


def test_verify_passes_and_catches_an_altered_record(runs, capsys):
    assert main(["verify", str(runs / "a"), "--from-step", "3", "--steps", "2"]) == 0
    bad = runs / "a_altered"
    shutil.copytree(runs / "a", bad, ignore=shutil.ignore_patterns("verify"))
    lines = (bad / "fingerprints.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])
    rec["loss"] = "0" * len(rec["loss"])
    lines[3] = json.dumps(rec)
    (bad / "fingerprints.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["verify", str(bad), "--from-step", "3", "--steps", "2"]) == 1
    assert "loss" in capsys.readouterr().out


def test_different_seed_diverges_at_step_one(runs, capsys):
    _train(runs / "e", "run.seed=1", "train.steps=1", "checkpoint.every=0")
    capsys.readouterr()
    assert main(["diff", str(runs / "a"), str(runs / "e"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["step"] == 1
    assert report["divergence"]["field"] == "prompt_ids"


def test_bisect_names_the_first_differing_op(runs, capsys):
    """A run on stock kernels diverges from the deterministic one; bisect replays step 1 from the starting
    weights (identical) and names the first op whose activations differ."""
    _train(runs / "fast", "run.deterministic=false", "train.steps=1", "checkpoint.every=0", "warm_start.steps=0")
    _train(runs / "det", "train.steps=1", "checkpoint.every=0", "warm_start.steps=0")
    capsys.readouterr()
    assert main(["diff", str(runs / "det"), str(runs / "fast"), "--bisect", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bisect"]["kind"] == "activation"
    assert report["bisect"]["replayed_from"] == "starting weights"
    assert report["bisect"]["where"].startswith("model.layers.0.")


def test_grpo_tiny_recipe_shows_real_learning(tmp_path):
    """The embedded default as shipped: mean reward over the last 5 steps >= that over the first 5 + 0.3."""
    run = tmp_path / "tiny"
    assert main(["train", "recipe=grpo_tiny", f"run.dir={run}", "logger.progress=false"]) == 0
    rewards = [json.loads(x)["rollout/reward_mean"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 80
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.3, rewards


# Layouts with several trainer ranks (gloo on the CPU). No warm start (the megatron backend trains the sharded
# model only) and the `hash` reward, so that advantages and gradients are non-zero from step 1.
LAYOUT = ["recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
          "rollout.max_tokens=6", "warm_start.steps=0", "reward.fn=hash", "checkpoint.every=0",
          "logger.progress=false", "train.micro_batch_size=4", "train.warmup_steps=1", "train.num_gpus=2",
          "rollout.num_workers=2"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_weight_sync_path_does_not_change_the_run(tmp_path):
    """Two data-parallel trainer ranks; weights to two engines through the object store vs a collective
    broadcast (the NCCL code path, here on gloo): identical runs, exactly on-policy at every step."""
    assert main(["train", *LAYOUT, f"run.dir={tmp_path / 'obj'}", "rollout.weight_sync=object_store"]) == 0
    assert main(["train", *LAYOUT, f"run.dir={tmp_path / 'coll'}", "rollout.weight_sync=collective"]) == 0
    assert main(["diff", str(tmp_path / "obj"), str(tmp_path / "coll")]) == 0
    for m in _metrics(tmp_path / "coll"):
        assert m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0
    # the optimizer state sharded over the two ranks (ZeRO-1), with a checkpoint at every step (a collective):
    # the same run
    zero = tmp_path / "zero"
    assert main(["train", *LAYOUT, f"run.dir={zero}", "train.distributed_optimizer=true", "checkpoint.every=1"]) == 0
    assert main(["diff", str(tmp_path / "obj"), str(zero)]) == 0
    assert sorted(p.name for p in (zero / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    # the same with the megatron backend at TP=1 (its DP replicas share the optimizer state): still the same run
    mz = tmp_path / "megatron_zero"
    assert main(["train", *LAYOUT, f"run.dir={mz}", "train.backend=megatron", "train.tensor_parallel=1",
                 "train.distributed_optimizer=true", "checkpoint.every=1"]) == 0
    assert main(["diff", str(tmp_path / "obj"), str(mz)]) == 0


def test_megatron_core_grad_sync_runs_are_identical_on_policy_and_resume(tmp_path):
    """train.grad_sync=megatron (megatron-core's DDP and DistributedOptimizer, here on gloo under its CPU
    stand-in) through `rlrepro train`: exactly on-policy, two runs identical, a run stopped after step 1 and resumed
    from its dist checkpoint is the same run; against the order-fixed path only the grad norm's rounding differs
    at step 1 (so the step's loss is the same)."""
    from rlrepro.cli import compose_config
    from rlrepro.orchestration import GRPODriver

    mc = ["train.backend=megatron", "train.grad_sync=megatron", "train.distributed_optimizer=true"]
    assert main(["train", *LAYOUT, *mc, f"run.dir={tmp_path / 'a'}"]) == 0
    assert main(["train", *LAYOUT, *mc, f"run.dir={tmp_path / 'b'}"]) == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    for m in _metrics(tmp_path / "a"):
        assert m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0
    d = tmp_path / "resumed"  # (sharded checkpoints: each DP owner writes the optimizer tensors it owns)
    ck = ["checkpoint.every=1", "checkpoint.format=dist"]
    GRPODriver(compose_config([*LAYOUT, *mc, f"run.dir={d}", *ck])).run(last_step=1)
    assert main(["train", *LAYOUT, *mc, f"run.dir={d}", *ck, "run.resume=true"]) == 0
    assert main(["diff", str(tmp_path / "a"), str(d)]) == 0
    assert main(["train", *LAYOUT, f"run.dir={tmp_path / 'o'}", "train.backend=megatron"]) == 0
    ordered, ours = _metrics(tmp_path / "o")[0], _metrics(tmp_path / "a")[0]
    assert ours["train/loss"] == ordered["train/loss"]
    assert ours["train/grad_norm"] == pytest.approx(ordered["train/grad_norm"], rel=1e-6)


def test_megatron_tensor_parallel_runs_are_identical_and_on_policy(tmp_path, capsys):
    """train.backend=megatron with TP=2: the engines emulate the trainer's reduction, so trainer logprobs equal
    rollout logprobs exactly; two runs are identical."""
    tp = ["train.backend=megatron", "train.tensor_parallel=2", "train.steps=3"]
    assert main(["train", *LAYOUT, *tp, f"run.dir={tmp_path / 'm1'}"]) == 0
    assert main(["train", *LAYOUT, *tp, f"run.dir={tmp_path / 'm2'}"]) == 0
    assert main(["diff", str(tmp_path / "m1"), str(tmp_path / "m2")]) == 0
    for m in _metrics(tmp_path / "m1"):
        assert m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0
    # sharded checkpoints (megatron-core dist_checkpointing): stop after step 2, resume, same run
    from rlrepro.cli import compose_config
    from rlrepro.orchestration import GRPODriver

    d = tmp_path / "m3"
    cfg = compose_config([*LAYOUT, *tp, f"run.dir={d}", "checkpoint.format=dist", "checkpoint.every=2"])
    GRPODriver(cfg).run(last_step=2)
    manifest = json.loads((d / "checkpoints" / "step_000002" / "manifest.json").read_text())
    assert manifest["layout"] == "megatron-dist"
    assert main(["train", *LAYOUT, *tp, f"run.dir={d}", "checkpoint.format=dist", "run.resume=true"]) == 0
    assert main(["diff", str(tmp_path / "m1"), str(d)]) == 0
    # bisect reads a dist checkpoint as the step's weights (the digest recorded at step 2) and replays a megatron
    # run with its engines' TP emulation
    from rlrepro.repro import bisect
    from rlrepro.repro.diff import load_config
    from rlrepro.repro.fingerprint import weights_digest

    policy = bisect._load_policy(d, load_config(d), 2)
    step2 = [json.loads(x) for x in (d / "fingerprints.jsonl").read_text().splitlines()][1]
    assert weights_digest(dict(policy.named_parameters())) == step2["weights"]
    assert policy.tensor_parallel_emulation == 2
    # a TP=2 run against the same run on the default backend: they differ in the forward pass (the reduction
    # order), which bisect finds in the first layer instead of calling the forward passes identical
    assert main(["train", *LAYOUT, "train.steps=1", f"run.dir={tmp_path / 'p1'}"]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "m1"), str(tmp_path / "p1"), "--bisect", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["bisect"]
    assert found["kind"] == "activation" and found["where"].startswith("model.layers.0."), found


def test_overlong_reward_shaping_enters_the_rewards(runs, tmp_path):
    """reward.overlong_buffer (DAPO's soft overlong punishment): step 1's rollouts are those of run "a" (the same
    weights), and its rewards are a's plus the length penalties, which completions of 2 or more tokens pay with a
    buffer of 5 of the 6 tokens."""
    run_dir = tmp_path / "overlong"
    _train(run_dir, "train.steps=1", "reward.overlong_buffer=5", "reward.overlong_penalty_factor=0.5")
    shaped, plain = _metrics(run_dir)[0], _metrics(runs / "a")[0]
    assert shaped["rollout/response_length_mean"] == plain["rollout/response_length_mean"]
    assert shaped["rollout/overlong_penalty_mean"] < 0
    assert "rollout/overlong_penalty_mean" not in plain
    assert shaped["rollout/reward_mean"] == pytest.approx(plain["rollout/reward_mean"]
                                                          + shaped["rollout/overlong_penalty_mean"], abs=1e-12)
