"""Evaluation during training (eval.every) of a run with env.* (multi-turn tool episodes): before, refused at set-up
(only ``rlrepro eval`` after the fact ran episodes). Now the driver's Evaluator runs the held-out prompts as episodes
on the rollout workers (``ActorGroup.run_episodes``), through the same ``episode_runner`` as training and
``rlrepro eval``:

* the logged eval/* metrics hold the episode figures (turns, tool calls, finish reasons) and the eval fingerprint;
* two runs log the same eval numbers and fingerprints, bit for bit, and turning eval on changes no training bit;
* ``rlrepro eval RUN --step 2`` after the fact reproduces the logged numbers exactly (``matches_run_log``).
"""
import json

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.data import make_synthetic_records, write_jsonl
from rlrepro.orchestration import driver as driver_mod
from test_evaluation import _metrics
from test_review26_pipe_pipeline import LocalActors

pytestmark = pytest.mark.usefixtures("one_thread")

TOOL = ["recipe=grpo_tiny_tool", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_tokens=10", "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=8",
        "train.warmup_steps=1", "data.synthetic.num=64", "warm_start.steps=20", "warm_start.batch_size=16"]


def _eval_of(m):
    return {k: v for k, v in m.items() if k.startswith("eval/") or k == "repro/eval_fingerprint"}


def test_a_tool_run_is_evaluated_on_its_episodes_during_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: LocalActors)
    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("multiply", 3, 7, digits=2), held)
    ev = ["eval.every=1", f"eval.source={held}", "eval.num_samples=2"]
    runs = {name: tmp_path / name for name in "abc"}
    for name, extra in (("a", ev), ("b", ev), ("c", [])):
        driver_mod.GRPODriver(compose_config([*TOOL, *extra, f"run.dir={runs[name]}"])).run()
    ma, mb, mc = (_metrics(runs[n]) for n in "abc")
    for s in (1, 2):
        got = _eval_of(ma[s])
        assert {"eval/avg@2", "eval/pass@2", "eval/turns_mean", "eval/tool_calls_mean", "eval/finish_done_frac",
                "eval/outcome_reward_mean", "repro/eval_fingerprint"} <= set(got), sorted(got)
        assert got["eval/num_prompts"] == 3 and got["eval/turns_mean"] >= 1
        assert got == _eval_of(mb[s])  # two runs: the same numbers and fingerprints
        assert not _eval_of(mc[s])  # eval off: none
    assert ma[1]["repro/eval_fingerprint"] != ma[2]["repro/eval_fingerprint"]  # the weights moved: not vacuous
    assert max(ma[s]["eval/turns_mean"] for s in (1, 2)) > 1  # episodes of several turns (tool calls, observations)
    # eval on changes no training bit
    assert (runs["a"] / "fingerprints.jsonl").read_bytes() == (runs["c"] / "fingerprints.jsonl").read_bytes()
    # after the fact, on the checkpoint of step 2: exactly the logged numbers
    capsys.readouterr()
    assert main(["eval", str(runs["a"]), "--step", "2", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert after["matches_run_log"] is True
    assert {k: after[k] for k in _eval_of(ma[2]) if k in after} == {k: v for k, v in _eval_of(ma[2]).items()
                                                                      if k in after}
