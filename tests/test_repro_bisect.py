"""``rlrepro diff --bisect`` on hand-built run directories with a tiny model: what it says before replaying
(inputs), where it refuses (another device), models of other shapes, the trainer side, and failures (exit 2)."""
import json

import torch
from omegaconf import OmegaConf

from rlrepro.model import write_tiny_checkpoint
from rlrepro.repro.bisect import bisect_runs, conclusion
from rlrepro.repro.diff import diff_runs, load_config, main_diff
from rlrepro.repro.fingerprint import FingerprintWriter, MetricsWriter, RolloutWriter, fingerprint_from_samples
from rlrepro.repro.inputs import INPUTS_FORMAT, write_inputs


def samples(step, bump=0):
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(4):
        toks = torch.randint(3, 50, (5,), generator=g).tolist()
        out.append({"prompt_uid": f"q{i // 2}", "sample_index": i % 2, "prompt_token_ids": [7, 8, 9 + i // 2],
                    "token_ids": toks, "logprobs": (-torch.rand(5, generator=g)).tolist(),
                    "reward": float(i % 2), "advantage": (i % 2) - 0.5})
    if bump:
        out[1]["token_ids"][2] += bump
    return out


def make_run(path, *, steps=1, device="cpu", hidden=64, bump=0, loss_offset=0.0, env=None, metrics_extra=None):
    """A run directory with a tiny base model (seed 0) and ``steps`` recorded steps, no checkpoints."""
    path.mkdir(parents=True)
    write_tiny_checkpoint(path / "base_model", seed=0, hidden_size=hidden)
    cfg = {"run": {"dir": str(path), "device": device, "deterministic": True}, "model": {"dtype": None}}
    OmegaConf.save(OmegaConf.create(cfg), path / "config.yaml")
    fw, mw, rw = FingerprintWriter(path), MetricsWriter(path), RolloutWriter(path)
    for step in range(1, steps + 1):
        s = samples(step, bump)
        rw.write(step, s)
        fw.write(fingerprint_from_samples(step, s, loss=0.25 + loss_offset, grad_norm=1.0, weights=None))
        mw.write({"step": step, "train/loss": 0.25 + loss_offset, **(metrics_extra or {}).get(step, {})})
    if env is not None:
        write_inputs(path, {"format": INPUTS_FORMAT, "env": env})
    return path


def test_bit_relevant_input_differences_come_first_and_nothing_is_replayed(tmp_path, capsys):
    a = make_run(tmp_path / "a", env={"PYTHONHASHSEED": "0"})
    b = make_run(tmp_path / "b", bump=1, env={"PYTHONHASHSEED": "0", "RLREPRO_ATTENTION_BWD": "torch"})
    assert main_diff([str(a), str(b), "--bisect", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["bisect"]
    assert found["kind"] == "recorded_inputs" and found["replayed_from"] == "not replayed"
    assert found["note"] == "RLREPRO_ATTENTION_BWD differs: unset vs 'torch'"
    assert found["field"] == "rollout_token_ids"
    assert main_diff([str(a), str(b), "--bisect"]) == 1
    assert "not replayed: inputs that can change bits differ (RLREPRO_ATTENTION_BWD differs" in capsys.readouterr().out


def test_models_of_other_shapes_are_named_not_a_traceback(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    d = make_run(tmp_path / "d", hidden=32, bump=1)
    assert main_diff([str(a), str(d), "--bisect", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["bisect"]
    assert found["kind"] == "model" and found["where"] == "model.embed_tokens.weight"
    vocab = json.loads((a / "base_model" / "config.json").read_text())["vocab_size"]
    assert found["note"] == f"model.embed_tokens.weight has shape [{vocab}, 64] in A, [{vocab}, 32] in B"


def test_a_trainer_side_field_is_blamed_on_the_trainer_not_sampling(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    same_tokens = make_run(tmp_path / "l", loss_offset=2.0 ** -20)   # the loss differs, the rollout does not
    assert main_diff([str(a), str(same_tokens), "--bisect", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["field"] == "loss"
    found = report["bisect"]
    assert found["kind"] == "none" and found["field"] == "loss" and found["replayed_from"] == "starting weights"
    assert found["note"].startswith("trainer side: the policy is identical") and "sampling" not in found["note"]
    # a train/* metric that differs first counts as the trainer side too; rollout fields stay sampling
    assert conclusion("train/entropy").startswith("trainer side: the policy is identical")
    assert conclusion("grad_norm") == conclusion("weights") == conclusion("loss")
    assert "sampling or scheduling" in conclusion("rollout_token_ids")
    tokens = make_run(tmp_path / "t", bump=1)
    res = bisect_runs(a, tokens, step=1, sample_index=1, config_a=load_config(a), config_b=load_config(tokens),
                      field="rollout_token_ids")
    assert res.kind == "none" and "sampling or scheduling" in res.note


def test_a_metric_that_differs_first_is_bisected_at_its_step(tmp_path, capsys):
    a = make_run(tmp_path / "a", steps=1)
    e = make_run(tmp_path / "e", steps=1, metrics_extra={1: {"train/entropy": 1.0}})
    assert diff_runs(a, e).divergence is None   # only a metric differs
    assert main_diff([str(a), str(e), "--bisect", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["bisect"]
    assert found["step"] == 1 and found["field"] == "train/entropy" and found["kind"] == "none"
    assert found["note"].startswith("trainer side: the policy is identical")


def test_a_run_on_another_device_is_refused_with_exit_2_after_the_report(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    g = make_run(tmp_path / "g", device="cuda", bump=1)
    assert main_diff([str(a), str(g), "--bisect"]) == 2
    captured = capsys.readouterr()
    assert "verdict: DIVERGED" in captured.out and "bisect at step" not in captured.out
    assert "rlrepro diff: bisect error: run B" in captured.err and "ran on cuda" in captured.err
    assert "no conclusion drawn" in captured.err


def test_bisect_failures_exit_2_after_the_report(tmp_path, capsys):
    a = make_run(tmp_path / "a", steps=2)
    b = make_run(tmp_path / "b", steps=2)
    fp = b / "fingerprints.jsonl"
    lines = fp.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["rollout_token_ids"] = "0" * 64      # step 2 diverges; neither run has a checkpoint before it
    lines[1] = json.dumps(rec)
    fp.write_text("\n".join(lines) + "\n")
    assert main_diff([str(a), str(b), "--bisect", "--json"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["verdict"] == "diverged" and "bisect" not in report
    assert report["bisect_error"].startswith("no checkpoint common to both runs before step 2")
    assert "rlrepro diff: bisect error: no checkpoint common" in captured.err
    # anything the replay raises is a bisect error too, never a traceback
    (b / "base_model" / "model.safetensors").write_bytes(b"not safetensors")
    c = make_run(tmp_path / "c", bump=1)
    (c / "base_model" / "model.safetensors").write_bytes(b"not safetensors")
    assert main_diff([str(a), str(c), "--bisect"]) == 2
    captured = capsys.readouterr()
    assert "verdict: DIVERGED" in captured.out and "rlrepro diff: bisect error: " in captured.err
