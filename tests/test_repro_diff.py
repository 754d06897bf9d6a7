"""``rlrepro diff`` on fake run directories built with the real writers."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from rlrepro.repro.diff import diff_runs, main_diff
from rlrepro.repro.fingerprint import (
    FingerprintWriter,
    MetricsWriter,
    RolloutWriter,
    fingerprint_from_samples,
)
from rlrepro.repro.records import ReproError

CONFIG = {"run": {"dir": "runs/x", "seed": 1, "resume": False},
          "train": {"steps": 4, "lr": 1e-6},
          "rollout": {"num_workers": 2, "max_num_seqs": 64, "prefix_cache": True},
          "logger": {"wandb": True, "project": "p"}}


def make_samples(step, n=6, length=8):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(n):
        out.append({"prompt_uid": f"q{i // 3}", "sample_index": i % 3, "prompt_token_ids": [5, 6, 7 + i // 3],
                    "token_ids": torch.randint(0, 500, (length,), generator=g).tolist(),
                    "logprobs": (-torch.rand(length, generator=g)).tolist(),
                    "reward": float((i + step) % 2), "advantage": ((i + step) % 2) - 0.5})
    return out


def make_run(path, *, steps=4, config=None, mutate=None, rollouts=True, metrics_extra=None):
    """A run directory as the GRPO driver writes it. ``mutate(step, samples, weights)`` edits a step's data."""
    path.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config or CONFIG), path / "config.yaml")
    fw, mw, rw = FingerprintWriter(path), MetricsWriter(path), RolloutWriter(path)
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.zeros(4)}
    for step in range(1, steps + 1):
        samples = make_samples(step)
        weights = {k: v + 0.125 * step for k, v in weights.items()}
        if mutate:
            mutate(step, samples, weights)
        loss = sum(s["advantage"] * sum(s["logprobs"]) for s in samples) / len(samples)
        grad_norm = float(sum(float(v.abs().sum()) for v in weights.values())) / 100
        if rollouts:
            rw.write(step, samples)
        fw.write(fingerprint_from_samples(step, samples, loss=loss, grad_norm=grad_norm, weights=weights))
        rec = {"step": step, "rollout/reward_mean": sum(s["reward"] for s in samples) / len(samples),
               "rollout/response_length_mean": sum(len(s["token_ids"]) for s in samples) / len(samples),
               "train/loss": loss, "train/grad_norm": grad_norm, "train/kl": 0.001 * step,
               "train/entropy": 1.0 / step, "train/rollout_logprob_abs_diff": 0.0,
               "perf/step_time_s": 0.1 * step + (hash(str(path)) % 100) / 1000}
        rec.update((metrics_extra or {}).get(step, {}))
        mw.write(rec)
    return path


def test_identical_runs_exit_0(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", config={**CONFIG, "run": {"dir": "elsewhere", "seed": 1, "resume": True},
                                         "logger": {"wandb": False}})
    rep = diff_runs(a, b)
    assert rep.verdict == "identical" and rep.steps_compared == [1, 2, 3, 4] and rep.config_diffs == []
    assert rep.metrics_compared == 4 and not rep.metric_diffs   # perf/step_time_s differs and is ignored
    assert main_diff([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "verdict: IDENTICAL" in out


def test_changed_token_exit_1_names_step_field_sample_and_position(tmp_path, capsys):
    a = make_run(tmp_path / "a")

    def mutate(step, samples, weights):
        if step == 3:
            samples[4]["token_ids"][5] = 499 if samples[4]["token_ids"][5] != 499 else 0
        if step >= 3:   # the change propagates, as in a real run
            for v in weights.values():
                v += 1

    b = make_run(tmp_path / "b", mutate=mutate)
    rep = diff_runs(a, b)
    assert rep.verdict == "diverged"
    dv = rep.divergence
    assert (dv.step, dv.field, dv.sample_index) == (3, "rollout_token_ids", 4)
    assert "weights" in dv.fields and "grad_norm" in dv.fields
    assert dv.prompt_uid == "q1" and dv.sample_index_in_prompt == 1
    assert dv.token.what == "token_ids" and dv.token.position == 5
    sa = make_samples(3)[4]
    assert dv.token.a == sa["token_ids"][5] and dv.token.b != dv.token.a
    assert dv.token.logprob_a == sa["logprobs"][5]
    assert rep.diverged_steps == [3, 4]
    assert rep.first_divergent_step == 3

    assert main_diff([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "step 3" in out and "rollout_token_ids" in out and "sample 4" in out and "position 5" in out
    assert "verdict: DIVERGED" in out
    assert main_diff([str(a), str(b), "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert j["verdict"] == "diverged" and j["divergence"]["step"] == 3
    assert j["divergence"]["field"] == "rollout_token_ids" and j["divergence"]["sample_index"] == 4
    assert j["divergence"]["token"]["position"] == 5


def test_logprob_divergence_without_rollout_files(tmp_path):
    a = make_run(tmp_path / "a", rollouts=False)

    def mutate(step, samples, weights):
        if step == 2:
            samples[1]["logprobs"][0] = samples[1]["logprobs"][0] * (1 + 2**-40)

    b = make_run(tmp_path / "b", rollouts=False, mutate=mutate)
    rep = diff_runs(a, b)
    assert (rep.divergence.step, rep.divergence.field, rep.divergence.sample_index) == (2, "rollout_logprobs", 1)
    assert rep.divergence.token is None and "no rollout file" in rep.divergence.detail_note


def test_logprob_and_reward_detail_from_rollouts(tmp_path):
    a = make_run(tmp_path / "a")

    def lp(step, samples, weights):
        if step == 1:
            samples[2]["logprobs"][3] = -0.0 if samples[2]["logprobs"][3] == 0.0 else samples[2]["logprobs"][3] / 2

    rep = diff_runs(a, make_run(tmp_path / "b", mutate=lp))
    assert rep.divergence.field == "rollout_logprobs" and rep.divergence.token.what == "logprobs"
    assert rep.divergence.token.position == 3 and rep.divergence.token.token_a == make_samples(1)[2]["token_ids"][3]

    def rw(step, samples, weights):
        if step == 4:
            samples[5]["reward"] = 7.0

    rep = diff_runs(a, make_run(tmp_path / "c", mutate=rw))
    dv = rep.divergence
    assert (dv.step, dv.field, dv.sample_index) == (4, "rewards", 5)
    assert dv.token.what == "reward" and dv.token.b == 7.0


def test_config_difference_is_listed_but_not_a_divergence(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["rollout"]["max_num_seqs"] = 8
    cfg["rollout"]["new_knob"] = "x"
    cfg["repro"] = {"ignore_keys": ["rollout.num_workers"]}
    cfg["rollout"]["num_workers"] = 7
    b = make_run(tmp_path / "b", config=cfg)
    rep = diff_runs(a, b)
    assert rep.verdict == "identical"
    assert [(c.key, c.a, c.b) for c in rep.config_diffs] == [("rollout.max_num_seqs", 64, 8),
                                                             ("rollout.new_knob", "<absent>", "x")]
    assert main_diff([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "rollout.max_num_seqs: A=64  B=8" in out and "num_workers" not in out


def test_metrics_difference_and_extra_steps(tmp_path, capsys):
    a = make_run(tmp_path / "a", steps=4)
    b = make_run(tmp_path / "b", steps=6, metrics_extra={2: {"train/kl": 0.0020000000000000005}})
    rep = diff_runs(a, b)
    assert rep.divergence is None and rep.verdict == "diverged"
    assert [(m.step, m.key) for m in rep.metric_diffs] == [(2, "train/kl")]
    assert rep.steps_only_b == [5, 6] and rep.first_divergent_step == 2
    c = make_run(tmp_path / "c", steps=6)
    rep = diff_runs(a, c)
    assert rep.verdict == "identical" and not rep.complete
    assert main_diff([str(a), str(c)]) == 0
    assert "only in B: 2 step(s) (5-6)" in capsys.readouterr().out
    assert main_diff([str(a), str(c), "--strict"]) == 1
    assert diff_runs(a, c, steps=range(1, 3)).steps_compared == [1, 2]


def test_an_absent_finish_reason_share_equals_zero(tmp_path):
    """Records before 2026-12-04 left out ``episodes/finish_<reason>_frac`` for a reason no episode ended with: an
    absent share against 0.0 is no difference, against anything else it is."""
    a = make_run(tmp_path / "a", steps=2, metrics_extra={1: {"episodes/finish_done_frac": 1.0}})
    b = make_run(tmp_path / "b", steps=2, metrics_extra={1: {"episodes/finish_done_frac": 1.0,
                                                              "episodes/finish_malformed_frac": 0.0}})
    assert diff_runs(a, b).verdict == "identical"
    c = make_run(tmp_path / "c", steps=2, metrics_extra={1: {"episodes/finish_done_frac": 0.75,
                                                              "episodes/finish_malformed_frac": 0.25}})
    rep = diff_runs(a, c)
    assert rep.verdict == "diverged"
    assert [(m.key, m.a, m.b) for m in rep.metric_diffs] == [("episodes/finish_done_frac", 1.0, 0.75),
                                                              ("episodes/finish_malformed_frac", "<absent>", 0.25)]
    d = make_run(tmp_path / "d", steps=2, metrics_extra={1: {"episodes/turns_mean": 0.0}})
    assert diff_runs(make_run(tmp_path / "e", steps=2), d).verdict == "diverged"  # other keys: absent is absent


def test_corrupt_fingerprints_exit_2_with_file_and_line(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b")
    fp = b / "fingerprints.jsonl"
    lines = fp.read_text().splitlines()
    lines[2] = lines[2][:40]
    fp.write_text("\n".join(lines) + "\n")
    assert main_diff([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{fp}:3" in err and "invalid JSON" in err

    rec = json.loads(lines[1])
    del rec["advantages"]
    lines[1] = json.dumps(rec)
    lines[2] = json.dumps({**rec, "step": 3, "advantages": "00"})
    fp.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReproError, match=r"fingerprints.jsonl:2: step 2: missing field\(s\) advantages"):
        diff_runs(a, b)

    (b / "fingerprints.jsonl").unlink()
    assert main_diff([str(a), str(b)]) == 2
    assert "fingerprints.jsonl: file not found" in capsys.readouterr().err
    assert main_diff([str(a), str(tmp_path / "nope")]) == 2
    assert f"run directory {tmp_path / 'nope'} not found" in capsys.readouterr().err
    assert main_diff([str(a)]) == 2          # usage error


def test_corrupt_metrics_is_an_error_too(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b")
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"step": "x"}\n')
    with pytest.raises(ReproError, match=r"metrics.jsonl:5: missing or non-integer 'step'"):
        diff_runs(a, b)
