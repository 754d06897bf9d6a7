"""Pipelined rollouts (rollout.max_staleness=K): the batch trained at step s always comes from weight version
max(0, s - 1 - K), whatever the timing; runs are identical with random wall-clock delays, other worker counts and
engine settings, and a resumed run equals the uninterrupted one (`rlrepro diff --strict`)."""
import json

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.pipeline import pending_from_state, pending_to_state
from rlrepro.rollout import request_seed
from rlrepro.samples import Sample, Turn

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=6", "logger.progress=false", "data.synthetic.num=20"]


class _Out:
    def __init__(self, seed, version):
        self.token_ids, self.logprobs, self.finish_reason = [5], [-1.0], "stop"
        self.seed, self.weight_version = seed, version


class FakeActors:
    """Generates with the weight version it holds (set by the test as the sync would)."""
    def __init__(self, *a, **k):
        self.version = 0

    def generate(self, requests):
        return [(r.key, _Out(r.params.seed, self.version)) for r in requests]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_batch_of_step_s_comes_from_version_s_minus_1_minus_k(tmp_path, monkeypatch, k):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: FakeActors)
    d = driver_mod.GRPODriver(compose_config([*COMMON, f"run.dir={tmp_path / 'run'}", f"rollout.max_staleness={k}"]))
    d.setup()
    trained = {}
    d.train = lambda step, samples: trained.setdefault(step, samples) and {}
    d.compute_advantages = lambda samples: None
    drawn = []
    next_batch = d.order.next_batch
    d.order.next_batch = lambda n: drawn.append(next_batch(n)) or drawn[-1]
    for step in range(1, 7):
        d.pipelined_batch(step, driver_mod.PhaseTimer())
        d.actors.version = step  # the sync at the end of the step
        assert sorted(d.pending) == list(range(step + 1, step + 1 + k))
    for step, samples in trained.items():
        assert {s.weight_version for s in samples} == {max(0, step - 1 - k)}, step
        # the sampling seeds of the step the batch is for, not of the step that generated it
        assert all(s.seed == request_seed(0, step, s.prompt_uid, s.sample_index) for s in samples)
    # prompts are drawn in step order: batch s holds the s-th draw of the data order
    uids = [[d.prompts[i].uid for i in batch] for batch in drawn]
    assert [sorted({s.prompt_uid for s in trained[step]}) for step in range(1, 7)] == [sorted(u) for u in uids[:6]]


def test_pending_batches_round_trip_as_plain_data():
    s = Sample("u", 1, [1, 2], [3, 4, 5], [-0.5, 0.0, -0.25], finish_reason="done", seed=7, weight_version=2,
               reward=1.0, loss_mask=[1, 0, 1], turns=[Turn("policy", [3]), Turn("tool", [4], "x"), Turn("policy", [5])])
    state = pending_to_state({4: ([s], None, 0, {"rollout/groups_kept": 2})})
    assert pending_from_state(state) == {4: ([s], None, 0, {"rollout/groups_kept": 2})}
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)  # what extra_state.pt holds; loads with weights_only
    buf.seek(0)
    assert pending_from_state(torch.load(buf, weights_only=True)) == pending_from_state(state)


def test_max_staleness_is_checked():
    from rlrepro.checks import ConfigError
    from rlrepro.orchestration.config import to_schema

    with pytest.raises(ConfigError, match="max_staleness"):
        to_schema(compose_config(["recipe=grpo_tiny", "rollout.max_staleness=-1"]))


# ---------------------------------------------------------------------------------------- end to end, with Ray
E2E = ["recipe=grpo_tiny", "train.steps=5", "rollout.prompts_per_step=4", "rollout.group_size=4",
       "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
       "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=8"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("k,correction", [(1, []), (2, ["train.decoupled=true", "train.is_correction=tis"])],
                         ids=["k1", "k2-decoupled-tis"])
def test_pipelined_runs_are_identical_under_delays_workers_and_resume(tmp_path, monkeypatch, k, correction):
    from rlrepro.orchestration import GRPODriver

    args = [*E2E, f"rollout.max_staleness={k}", *correction]
    assert main(["train", *args, f"run.dir={tmp_path / 'a'}"]) == 0
    monkeypatch.setenv("RLREPRO_TEST_DELAYS", "7")  # seeded-random wall-clock sleeps in generation and training
    assert main(["train", *args, f"run.dir={tmp_path / 'b'}", "rollout.num_workers=2", "rollout.max_num_seqs=5",
                 "rollout.prefix_cache=false", "rollout.max_num_batched_tokens=37"]) == 0
    assert main(["diff", "--strict", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    r = tmp_path / "r"  # stops after step 3 (the last checkpoint is step 2), resumed from it
    GRPODriver(compose_config([*args, f"run.dir={r}"])).run(last_step=3)
    monkeypatch.delenv("RLREPRO_TEST_DELAYS")
    assert main(["train", *args, f"run.dir={r}", "run.resume=true"]) == 0
    assert main(["diff", "--strict", str(tmp_path / "a"), str(r)]) == 0
    m = _metrics(tmp_path / "a")
    assert m[0]["train/rollout_logprob_abs_diff"] == 0.0  # step 1: version 0 trains on version 0's samples
    assert all(x["train/rollout_logprob_abs_diff"] > 0 for x in m[1:])  # later: behaviour (older) != current
    assert all("perf/overlap_s" in x for x in m)
    if correction:  # the behaviour weights of the stale steps are real importance weights
        assert m[0]["train/is_weight_max"] == 1.0 and any(x["train/is_weight_max"] != 1.0 for x in m[1:])


@pytest.mark.slow
def test_max_staleness_zero_is_the_synchronous_run(tmp_path):
    assert main(["train", *E2E, "train.steps=3", f"run.dir={tmp_path / 'a'}"]) == 0
    assert main(["train", *E2E, "train.steps=3", "rollout.max_staleness=0", f"run.dir={tmp_path / 'b'}"]) == 0
    assert (tmp_path / "a" / "fingerprints.jsonl").read_text() == (tmp_path / "b" / "fingerprints.jsonl").read_text()
    # K = 0 with the decoupled objective and TIS: the proximal logprobs are the rollout's, every weight is 1.0
    assert main(["train", *E2E, "train.steps=3", "train.decoupled=true", "train.is_correction=tis",
                 f"run.dir={tmp_path / 'c'}"]) == 0
    assert (tmp_path / "a" / "fingerprints.jsonl").read_text() == (tmp_path / "c" / "fingerprints.jsonl").read_text()
    assert all(x["train/is_weight_max"] == 1.0 and x["train/is_weight_mean"] == 1.0 for x in _metrics(tmp_path / "c"))


@pytest.mark.slow
def test_a_worker_killed_mid_pipeline_is_replaced_with_the_batchs_weights(tmp_path, monkeypatch):
    """The worker dies while batch 4 is generated (at step 3, from version 2) as the trainer trains step 3: its
    replacement gets version 2 (the trainer kept it), not the weights step 3 produced; the run is identical."""
    args = [*E2E, "rollout.max_staleness=1", "rollout.num_workers=1"]
    assert main(["train", *args, f"run.dir={tmp_path / 'a'}"]) == 0
    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "kill_worker", "step": 3, "at": "generate",
                                                      "delay_s": 0}]))
    assert main(["train", *args, f"run.dir={tmp_path / 'b'}"]) == 0
    assert [x["perf/rollout_worker_restarts"] for x in _metrics(tmp_path / "b")][2] == 1
    monkeypatch.delenv("RLREPRO_FAULTS")
    # not --strict: inputs.json names RLREPRO_FAULTS, an input that can change bits (a nan_grad fault does)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0


@pytest.mark.slow
def test_a_generate_ahead_failure_names_why_no_checkpoint_and_the_resume_is_identical(tmp_path, monkeypatch, capsys):
    """The generation of batch 4 fails (no restarts left) while step 3 trains: step 3's update is made, so neither
    step 2 (gone from the trainer) nor step 3 (batch 4 missing) can be saved then; the message says so, the last
    periodic checkpoint (step 2) stays, and the resumed run equals the uninterrupted one."""
    args = [*E2E, "rollout.max_staleness=1", "rollout.num_workers=1", "rollout.max_restarts=0"]
    assert main(["train", *args, f"run.dir={tmp_path / 'a'}"]) == 0
    monkeypatch.setenv("RLREPRO_FAULTS", json.dumps([{"kind": "kill_worker", "step": 3, "at": "generate",
                                                      "delay_s": 0}]))
    capsys.readouterr()
    assert main(["train", *args, f"run.dir={tmp_path / 'b'}"]) == 1
    err = capsys.readouterr().err
    assert "generation of batch 4 failed while step 3 trained" in err, err
    assert "no checkpoint is written at such a failure" in err
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_000002"]
    monkeypatch.delenv("RLREPRO_FAULTS")
    assert main(["train", *args, f"run.dir={tmp_path / 'b'}", "run.resume=true"]) == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device")])])
def test_the_trainer_keeps_the_weights_from_before_the_update(tmp_path, device):
    """What a rollout worker replaced mid-pipeline loads: weights_of_version(s - 1) after train_step(s) are the
    weights from before it, bit for bit (on CUDA an asynchronous pinned copy that the update waits for)."""
    import torch

    from rlrepro.model import write_tiny_checkpoint
    from rlrepro.orchestration.workers import TrainerWorker
    from rlrepro.trainer import TrainConfig

    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=3)
    dtype = "bfloat16" if device == "cuda" else None
    w = TrainerWorker(str(model_dir), TrainConfig(lr=1e-2, steps=4, micro_batch_size=4), temperature=1.0,
                      max_response_length=8, device=device, dtype=dtype, deterministic=True)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        before = w.get_weights()
        samples = [Sample("u", j, [1, 2, 3], torch.randint(60, (5,), generator=gen).tolist(), [-1.0] * 5,
                          advantage=a) for j, a in enumerate((1.0, -1.0, 0.5, -0.5))]
        w.train_step(samples, keep_previous=True)
        after = w.get_weights()
        assert any(not torch.equal(before[n], after[n]) for n in before)  # the update moved the weights
        kept = w.weights_of_version(step)
        assert sorted(kept) == sorted(before) and all(torch.equal(kept[n], before[n]) for n in before)
        now = w.weights_of_version(step + 1)
        assert all(torch.equal(now[n], after[n]) for n in after)
        with pytest.raises(RuntimeError, match="not 5"):
            w.weights_of_version(5)


@pytest.mark.slow
def test_resume_at_every_step_of_a_pipelined_run(tmp_path):
    """K=1 with a checkpoint after every step: stopped after step 1, 2 and 3 (each checkpoint holds the batch
    generated ahead) and resumed, each run ends identical to the uninterrupted one."""
    from rlrepro.orchestration import GRPODriver

    args = [*E2E, "train.steps=4", "checkpoint.every=1", "rollout.max_staleness=1", "train.decoupled=true",
            "train.is_correction=tis"]
    assert main(["train", *args, f"run.dir={tmp_path / 'a'}"]) == 0
    for stop in (1, 2, 3):
        r = tmp_path / f"r{stop}"
        GRPODriver(compose_config([*args, f"run.dir={r}"])).run(last_step=stop)
        assert main(["train", *args, f"run.dir={r}", "run.resume=true"]) == 0
        assert main(["diff", "--strict", str(tmp_path / "a"), str(r)]) == 0, stop
