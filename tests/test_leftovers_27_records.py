"""Rollout records carry the sampling seed and the weight version that generated each sample (the last note's
leftover: ``Sample`` had both, ``rollouts/step_N.jsonl.gz`` kept neither), so a run's files say which policy
produced a completion, pipelined runs included."""
import gzip
import json

import pytest

from rlrepro.repro.records import ROLLOUT_OPTIONAL_KEYS, read_rollout_samples, read_rollouts
from rlrepro.repro.fingerprint import RolloutWriter
from rlrepro.rollout import request_seed
from rlrepro.samples import Sample
from test_review26_pipe_pipeline import BASE, LocalActors, _run, two_turns_env  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _sample(**kw):
    return Sample(prompt_uid="u", sample_index=0, prompt_token_ids=[1, 2], completion_token_ids=[3],
                  rollout_logprobs=[-0.5], **kw)


def test_seed_and_version_round_trip_and_old_files_read_as_none(tmp_path):
    s = _sample(seed=12345678901234, weight_version=7)
    rec = s.to_record()
    assert rec["seed"] == 12345678901234 and rec["weight_version"] == 7
    assert {"seed", "weight_version"} <= set(ROLLOUT_OPTIONAL_KEYS)
    assert Sample.from_record(rec) == s
    RolloutWriter(tmp_path).write(1, [s])
    assert read_rollout_samples(tmp_path, 1) == [s]
    old = dict(rec)
    del old["seed"], old["weight_version"]
    back = Sample.from_record(old)
    assert back.seed is None and back.weight_version is None
    assert "seed" not in _sample().to_record() and "weight_version" not in _sample().to_record()


@pytest.mark.parametrize("k,episodes", [(0, False), (2, False), (1, True)],
                         ids=["sync", "pipelined-2", "episodes-pipelined-1"])
def test_records_name_the_generating_version_and_seed(tmp_path, monkeypatch, k, episodes, two_turns_env):  # noqa: F811
    args = BASE + [f"rollout.max_staleness={k}", f"run.dir={tmp_path}", "train.steps=4"]
    if episodes:
        args += ["env.name=_review26_two_turns", "env.max_turns=2"]
    _run(monkeypatch, LocalActors, args)
    for step in range(1, 5):
        recs = read_rollouts(tmp_path, step)
        assert recs, step
        assert {r["weight_version"] for r in recs} == {max(0, step - 1 - k)}, step
        for r in recs:  # the seed every turn of the sample sampled with (rlrepro.rollout.request_seed)
            assert r["seed"] == request_seed(0, step, r["prompt_uid"], r["sample_index"]), (step, r["prompt_uid"])
    raw = gzip.decompress((tmp_path / "rollouts" / "step_000004.jsonl.gz").read_bytes()).decode()
    assert all("weight_version" in json.loads(x) for x in raw.splitlines())
