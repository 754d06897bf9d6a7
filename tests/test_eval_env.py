"""rlrepro eval of a run trained with env.* (multi-turn episodes, tools): the eval runs the training episodes
(the rollout's episode runner, several turns, tool calls in the records), scores them with the environment's
reward, repeats itself bit for bit, and a single-turn run's eval keeps its numbers and keys.

The run directories are made by hand (config.yaml as the driver writes it, the tiny base model, one checkpoint
of its weights), no training: CPU, a few seconds."""
import json

import pytest
from safetensors.torch import load_file

from rlrepro.cli import compose_config, main
from rlrepro.data import make_synthetic_records, write_jsonl
from rlrepro.model.base_model import prepare_base_model
from rlrepro.orchestration.config import validate
from rlrepro.orchestration.driver import config_yaml
from rlrepro.orchestration.evaluation import eval_env_seed, evaluate_checkpoint
from rlrepro.trainer.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# An environment that answers the first two turns as one tool call each and ends the episode at the third: so the
# untrained tiny policy still has multi-turn episodes; its reward depends on the text and the env seed.
ENV_MODULE = """
from rlrepro.envs import Environment, EnvReset, StepResult


class Relay(Environment):
    def __init__(self, record, seed):
        self.record, self.seed, self.turn = record, seed, 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            return StepResult(done=True, reward=(len(text) + self.seed) % 3 / 2)
        call = {"name": "relay", "arguments": {"turn": self.turn}}
        return StepResult(messages=[{"role": "tool", "content": "[= %d]" % (len(text) % 7)}],
                          info={"calls": [call]}, penalty=0.125 * (len(text) % 2))


def make(record, seed, *, config, reward_fn):
    return Relay(record, seed)
"""

SMALL = ["rollout.max_tokens=6", "eval.num_samples=2", "logger.progress=false"]


def _run(tmp_path, name, overrides):
    """A run directory as rlrepro train leaves it, with one complete checkpoint (step 1: the base weights)."""
    run = tmp_path / name
    run.mkdir()
    cfg = validate(compose_config([*overrides, f"run.dir={run}"]))
    (run / "config.yaml").write_text(config_yaml(cfg), encoding="utf-8")
    m = cfg.model
    base = prepare_base_model(run, init=m.init, path=m.path, init_seed=m.init_seed, dtype=m.dtype,
                              tiny_overrides=m.tiny_overrides)

    class Weights:
        def state_dict(self):
            return load_file(str(base / "model.safetensors"))

    save_checkpoint(run / "checkpoints", 1, model=Weights())
    return run


def _held(tmp_path, task="multiply", n=3, **kw):
    path = tmp_path / f"held_{task}.jsonl"
    write_jsonl(make_synthetic_records(task, n, 7, **kw), path)
    return path


@pytest.fixture
def relay_run(tmp_path, monkeypatch):
    (tmp_path / "relay_env_for_eval.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return _run(tmp_path, "relay", ["recipe=grpo_tiny_tool", "env.name=null", "env.fn=relay_env_for_eval:make",
                                    "env.max_turns=4", "env.max_episode_tokens=null", *SMALL])


def test_eval_of_a_tool_run_runs_its_episodes_and_repeats_itself(tmp_path, relay_run, capsys):
    held = _held(tmp_path, digits=2)
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["eval", str(relay_run), "--source", str(held), "--json", "--records", str(out_a)]) == 0
    got_a = json.loads(capsys.readouterr().out)
    assert main(["eval", str(relay_run), "--source", str(held), "--json", "--records", str(out_b)]) == 0
    got_b = json.loads(capsys.readouterr().out)
    assert got_a == got_b and out_a.read_bytes() == out_b.read_bytes()   # two evals: identical, bit for bit
    records = [json.loads(line) for line in out_a.read_text().splitlines()]
    assert len(records) == 3 * 3   # 3 prompts x (2 sampled + 1 greedy)
    assert [(r["uid"], r["sample"]) for r in records] == sorted((r["uid"], r["sample"]) for r in records)
    for r in records:   # every episode: 3 policy turns with a tool turn between each two, 2 tool calls
        assert r["num_turns"] == 3 and r["num_tool_calls"] == 2 and r["finish_reason"] == "done"
        assert [t["role"] for t in r["turns"]] == ["policy", "tool"] * 2 + ["policy"]
        assert r["reward"] == r["outcome_reward"] - sum(r["penalties"])
    assert got_a["eval/turns_mean"] == 3 and got_a["eval/tool_calls_mean"] == 2
    assert got_a["eval/finish_done_frac"] == 1.0 and got_a["eval/num_prompts"] == 3
    # every built-in finish reason has its key, 0.0 where no episode ended so (a dashboard's keys stay put)
    assert {k for k in got_a if k.startswith("eval/finish_")} == {
        "eval/finish_done_frac", "eval/finish_malformed_frac", "eval/finish_max_turns_frac",
        "eval/finish_token_budget_frac"}
    assert got_a["eval/finish_malformed_frac"] == got_a["eval/finish_max_turns_frac"] == 0.0
    sampled = [r["reward"] for r in records if not r["greedy"]]
    assert got_a["eval/avg@2"] == sum(sampled) / len(sampled)   # the environment's reward, not reward.fn's
    assert got_a["eval/response_length_mean"] == sum(r["length"] for r in records if not r["greedy"]) / len(sampled)
    assert got_a["matches_run_log"] is None and got_a["step"] == 1


def test_eval_episodes_are_seeded_per_request(tmp_path, relay_run):
    held = _held(tmp_path, digits=2)
    recs: list = []
    step, metrics = evaluate_checkpoint(relay_run, 1, str(held), recs)
    again: list = []
    assert evaluate_checkpoint(relay_run, 1, str(held), again) == (step, metrics) and again == recs
    # the environment seeds are on a stream of their own: not the training episodes' of the same key
    from rlrepro.envs import episode_seed
    assert eval_env_seed(0, 1, "u", 0) != episode_seed(0, 1, "u", 0)
    assert eval_env_seed(0, 1, "u", 0) != eval_env_seed(0, 1, "u", 1) != eval_env_seed(0, 2, "u", 1)
    texts = {(r["uid"], r["sample"]): r["text"] for r in recs}
    assert len(set(texts.values())) > 1   # the samples differ: each request its own seed


def test_eval_of_the_calculator_task_recipe_runs_its_episodes(tmp_path, capsys):
    run = _run(tmp_path, "calc", ["recipe=grpo_tiny_tool", *SMALL])
    held = _held(tmp_path, digits=2)
    out = tmp_path / "calc.jsonl"
    assert main(["eval", str(run), "--source", str(held), "--json", "--records", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"eval/turns_mean", "eval/tool_calls_mean", "eval/outcome_reward_mean", "eval/penalty_mean"} <= set(got)
    assert all(r["num_turns"] >= 1 and r["turns"][0]["role"] == "policy" for r in records)
    # the start is the environment's, rendered with its tools as training renders it: a chat-template prompt
    assert got["eval/turns_mean"] == sum(r["num_turns"] for r in records if not r["greedy"]) / 6


def test_eval_of_a_tool_run_without_a_held_out_file_names_the_key(tmp_path, capsys):
    run = _run(tmp_path, "calc", ["recipe=grpo_tiny_tool", *SMALL])
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert "eval.source" in err and "--source" in err


def test_single_turn_eval_is_unchanged_and_writes_records(tmp_path, capsys):
    run = _run(tmp_path, "tiny", ["recipe=grpo_tiny", *SMALL])
    held = _held(tmp_path, "first_letter", 4, alphabet="abcd")
    assert main(["eval", str(run), "--source", str(held), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    out = tmp_path / "tiny.jsonl"
    assert main(["eval", str(run), "--source", str(held), "--json", "--records", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == plain   # --records changes no number
    assert set(plain) == {"step", "matches_run_log", "eval/avg@2", "eval/pass@2", "eval/greedy_acc",
                          "eval/response_length_mean", "eval/num_prompts"}   # the keys it always had
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 * 3 and "num_turns" not in records[0]
    sampled = [r for r in records if not r["greedy"]]
    assert plain["eval/avg@2"] == sum(r["reward"] for r in sampled) / len(sampled)
    assert plain["eval/response_length_mean"] == sum(r["length"] for r in sampled) / len(sampled)
