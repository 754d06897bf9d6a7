"""Rollout files and fingerprints from typed ``Sample`` objects (issue 21), and from the dicts they replace."""
import gzip
import json

import pytest

from rlrepro.repro.diff import diff_runs
from rlrepro.repro.fingerprint import FingerprintWriter, MetricsWriter, RolloutWriter, fingerprint_from_samples
from rlrepro.repro.records import ReproError, read_rollout_samples, read_rollouts, rollout_steps
from rlrepro.samples import Sample, Turn

# Computed with the code before Sample support existed (commit 07f72b1): the digest definition must not move.
FIXED_DIGESTS = {
    "prompt_ids": "4a5c8cbe348de816be860497be211fee23417a8d7c62526b0e6a1d5c7029d64f",
    "rollout_token_ids": "1f8581b53429fd7a73773c06b20e75fca952a2db76648136d3062f169bbcbc23",
    "rollout_logprobs": "a6676290332370ef02d38ac8f6aabb0e7036a17a84d80f670b4252222e6029b7",
    "rewards": "8ebcc341588d2069420236c058bc8822d4c0aaf4c47a6da947173e5f2a01ef0b",
    "advantages": "b77eff298d916bc7ce5ded3579a2d93d1adbdf94212ac930d421fa525d3cf4d9",
    "loss": "9e29c08079c78dc9ff6b1ddf5c402d1e4a46143437aae5cb98cfe681e44ab9c6",
    "grad_norm": "85991174bcf9af6ef0b2a6dace5fdc8fee7dff252e77f718bf91eefbf6e1cdcc",
    "sample_token_ids": ["e3f996a7eecaf3a3", "7f338a9704c945d4"],
    "sample_logprobs": ["af1bb01047a64d43", "580442c8cc73f6d3"],
    "sample_prompt_ids": ["405cc83b94645946", "405cc83b94645946"],
}


def fixed_dicts():
    return [{"prompt_uid": "a", "sample_index": 0, "prompt_token_ids": [1, 2, 3], "token_ids": [4, 5],
             "logprobs": [-0.5, -0.25], "reward": 1.0, "advantage": 0.5},
            {"prompt_uid": "a", "sample_index": 1, "prompt_token_ids": [1, 2, 3], "token_ids": [6],
             "logprobs": [-1.0 / 3], "reward": 0.0, "advantage": -0.5}]


def fixed_samples(text=True):
    out = []
    for d in fixed_dicts():
        out.append(Sample(prompt_uid=d["prompt_uid"], sample_index=d["sample_index"],
                          prompt_token_ids=d["prompt_token_ids"], completion_token_ids=d["token_ids"],
                          rollout_logprobs=d["logprobs"], finish_reason="stop", reward=d["reward"],
                          advantage=d["advantage"], prompt_text="abc=" if text else None,
                          completion_text=f"c{d['sample_index']}" if text else None))
    return out


def test_fingerprint_of_samples_equals_dicts_and_fixed_digest():
    kw = dict(loss=0.125, grad_norm=1.5, weights=None)
    from_dicts = fingerprint_from_samples(2, fixed_dicts(), **kw)
    from_samples = fingerprint_from_samples(2, fixed_samples(), **kw)
    assert from_samples == from_dicts
    assert fingerprint_from_samples(2, fixed_samples(text=False), **kw) == from_dicts   # text is not hashed
    for k, v in FIXED_DIGESTS.items():
        assert from_samples[k] == v, k
    assert from_samples["num_samples"] == 2 and from_samples["weights"] is None
    # one ulp in one logprob moves the digest
    s = fixed_samples()
    s[1].rollout_logprobs = [-0.3333333333333333 + 5.551115123125783e-17]
    assert fingerprint_from_samples(2, s, **kw)["rollout_logprobs"] != FIXED_DIGESTS["rollout_logprobs"]


def test_rollout_writer_takes_samples_and_keeps_text(tmp_path):
    samples = fixed_samples()
    samples[0].turns = [Turn("policy", [4], "c"), Turn("tool", [5], "0")]
    samples[0].loss_mask = [1, 0]
    p = RolloutWriter(tmp_path).write(3, samples)
    lines = [json.loads(x) for x in gzip.decompress(p.read_bytes()).decode().splitlines()]
    assert lines[0]["prompt_text"] == "abc=" and lines[1]["completion_text"] == "c1"
    assert lines[0]["token_ids"] == [4, 5] and lines[0]["logprobs"] == [-0.5, -0.25]   # historical key names
    assert lines[0]["turns"][1] == {"role": "tool", "token_ids": [5], "text": "0"}
    assert read_rollouts(tmp_path, 3) == [s.to_record() for s in samples]
    assert read_rollout_samples(tmp_path, 3) == samples
    assert rollout_steps(tmp_path) == [3]
    # dicts still work, and a mixed list too; a dict written without text reads back as a Sample without text
    RolloutWriter(tmp_path).write(4, fixed_dicts())
    RolloutWriter(tmp_path).write(5, [fixed_dicts()[0], samples[1]])
    back = read_rollout_samples(tmp_path, 4)
    assert [s.prompt_text for s in back] == [None, None] and back[1].completion_token_ids == [6]
    assert back[0].finish_reason == "length"   # files from before finish_reason was recorded
    assert rollout_steps(tmp_path) == [3, 4, 5] and read_rollout_samples(tmp_path, 6) is None
    with pytest.raises(TypeError):
        RolloutWriter(tmp_path).write(6, [("a", 0)])
    (tmp_path / "rollouts" / "step_000007.jsonl.gz").write_bytes(gzip.compress(b'{"prompt_uid": "a"}\n'))
    with pytest.raises(ReproError, match="step_000007.jsonl.gz: sample 0: missing key"):
        read_rollout_samples(tmp_path, 7)


def _run(path, samples_of_step, steps=3):
    path.mkdir(parents=True)
    fw, mw, rw = FingerprintWriter(path), MetricsWriter(path), RolloutWriter(path)
    for step in range(1, steps + 1):
        samples = samples_of_step(step)
        rw.write(step, samples)
        fw.write(fingerprint_from_samples(step, samples, loss=0.5 * step, grad_norm=1.0, weights=None))
        mw.write({"step": step, "train/loss": 0.5 * step})
    return path


def test_diff_reads_rollouts_with_and_without_text(tmp_path):
    def typed(step, change=False):
        s = fixed_samples()
        if change and step >= 2:
            s[1].completion_token_ids = [7]
            s[1].completion_text = "c7"
        return s

    a = _run(tmp_path / "a", typed)
    b = _run(tmp_path / "b", lambda step: fixed_dicts())           # an older run: no text fields
    assert diff_runs(a, b).verdict == "identical"
    c = _run(tmp_path / "c", lambda step: typed(step, change=True))
    rep = diff_runs(b, c)
    dv = rep.divergence
    assert rep.verdict == "diverged" and dv.step == 2 and dv.field == "rollout_token_ids"
    assert dv.sample_index == 1 and dv.token.position == 0 and (dv.token.a, dv.token.b) == (6, 7)
