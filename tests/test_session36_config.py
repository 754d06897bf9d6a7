"""Session 36, config validation made consistent with what the code does:

* ``rollout.max_staleness=K >= train.steps`` is allowed (every batch then comes from the starting weights; a note
  says so once): a short first leg (``train.steps=2``, ``K=2`` or ``3``) extended by a resume to more steps equals
  the uninterrupted longer run bit for bit (fingerprints, metrics, rollouts), each batch from version
  ``max(0, s - 1 - K)``;
* ``rollout.max_num_batched_tokens`` below ``rollout.block_size`` is accepted by ``EngineConfig`` as by the
  ``Engine``, and gives the tokens and logprobs of a large budget, bitwise (engine and in-process run);
* ``train.micro_batch_tokens`` with ``env.*`` is checked against ``env.max_episode_tokens`` (the bound of every
  trained sample: turns are cut to it, an observation passing it is dropped), not the whole context; without a
  budget the error says why the context is needed and to set ``env.max_episode_tokens``.
"""
import gzip
import json
from types import SimpleNamespace

import pytest
from test_review26_pipe_pipeline import BASE, LocalActors, _bits, _run

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config
from rlrepro.envs import BUILTIN_ENVS, EnvReset, Environment, StepResult, register_env
from rlrepro.orchestration import preflight
from rlrepro.orchestration.config import to_schema, validate
from rlrepro.trainer.checkpoint import load_extra_state

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = SimpleNamespace(max_position_embeddings=1024)  # the tiny model's context


def _records(run):
    """{step: [rollout record, ...]} of a run directory."""
    out = {}
    for p in sorted((run / "rollouts").iterdir()):  # step_000003.jsonl.gz
        out[int(p.name.split(".")[0].split("_")[1])] = [
            json.loads(x) for x in gzip.decompress(p.read_bytes()).decode().splitlines() if x.strip()]
    return out


# ------------------------------------------------------------------------ 1. rollout.max_staleness >= train.steps
@pytest.mark.parametrize("k,steps", [(2, 2), (5, 2), (1, 1)])
def test_max_staleness_at_or_above_train_steps_is_allowed_with_one_note(capsys, monkeypatch, k, steps):
    import rlrepro.orchestration.config as config_module

    monkeypatch.setattr(config_module, "_SAID", set())  # notes said earlier in this process (other tests) forgotten
    cfg = compose_config(["recipe=grpo_tiny", f"train.steps={steps}", f"rollout.max_staleness={k}"])
    s = validate(cfg)
    validate(cfg)  # the CLI and the driver both validate: the note is said once
    assert s.rollout.max_staleness == k and s.train.steps == steps
    err = capsys.readouterr().err
    note = f"rollout.max_staleness={k} >= train.steps={steps}: every batch of this run comes from the starting weights"
    assert err.count(note) == 1, err
    assert "trained only if a resume raises train.steps" in err


def test_max_staleness_below_train_steps_says_nothing(capsys):
    from rlrepro.orchestration.config import staleness_note

    s = validate(compose_config(["recipe=grpo_tiny", "train.steps=3", "rollout.max_staleness=2"]))
    assert staleness_note(s) is None
    assert staleness_note(to_schema(compose_config(["recipe=grpo_tiny", "train.steps=1"]))) is None  # K = 0
    assert "max_staleness" not in capsys.readouterr().err


@pytest.mark.parametrize("k", [2, 3])
def test_a_short_leg_with_max_staleness_at_train_steps_extended_by_resume_equals_the_longer_run(
        tmp_path, monkeypatch, k):
    """train.steps=2 with K=2 (K=3: more than the steps) generates batches 1..2+K, trains 1 and 2 on version 0's
    samples, and keeps batches 3..2+K in its last checkpoint; the resume to train.steps=5 trains them: the run is
    the uninterrupted 5-step run, bit for bit."""
    args = BASE + [f"rollout.max_staleness={k}", "train.min_lr_ratio=1.0", "checkpoint.every=0"]
    a, r = tmp_path / "a", tmp_path / "r"
    _run(monkeypatch, LocalActors, [*args, "train.steps=5", f"run.dir={a}"])
    _run(monkeypatch, LocalActors, [*args, "train.steps=2", f"run.dir={r}"])
    pending = load_extra_state(r / "checkpoints" / "step_000002")[1]["pending"]
    assert sorted(pending) == list(range(3, 3 + k))  # the batches generated after the last step, kept
    _run(monkeypatch, LocalActors, [*args, "train.steps=5", f"run.dir={r}", "run.resume=true"])
    assert _bits(r) == _bits(a)
    versions = {step: {x["weight_version"] for x in recs} for step, recs in _records(r).items()}
    assert versions == {s: {max(0, s - 1 - k)} for s in range(1, 6)}


# ---------------------------------------------------------- 2. rollout.max_num_batched_tokens below block_size
def test_engine_config_accepts_a_token_budget_below_the_block_size_and_the_tokens_are_the_same():
    import torch

    from rlrepro.model import tiny_model
    from rlrepro.rollout import Engine, EngineConfig, SamplingParams

    s = to_schema(compose_config(["recipe=grpo_tiny", "rollout.block_size=16", "rollout.max_num_batched_tokens=3"]))
    assert (s.rollout.max_num_batched_tokens, s.rollout.block_size) == (3, 16)
    model = tiny_model(seed=5, initializer_range=0.3)
    # prompts longer than a block (chunked over several steps), copies of one prompt (a group sharing its blocks)
    prompts = [list(range(3, 40)), list(range(3, 40)), [7] * 21, [5, 6, 7], list(range(10, 28)) * 2]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=i) for i in range(4)] + [
        SamplingParams(temperature=0.0, max_tokens=10)]

    def outputs(budget, block):
        engine = Engine.from_config(model, EngineConfig(max_num_batched_tokens=budget, block_size=block,
                                                        num_kv_blocks=256 // block, max_num_seqs=4))
        outs = engine.generate(prompts, params)
        return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs], engine.stats

    want, _ = outputs(8192, 16)
    for budget, block in ((3, 16), (1, 16), (7, 8)):
        got, stats = outputs(budget, block)
        assert got == want, (budget, block)
    assert stats["num_prefix_hit_blocks"] > 0  # the copies shared their prompt blocks at the small budget too
    assert any(torch.tensor(lp).ne(0).any() for _, lp, _ in want)


def test_a_run_with_a_token_budget_below_the_block_size_is_the_same_run(tmp_path, monkeypatch):
    args = BASE + ["train.steps=2", "rollout.block_size=16"]
    a, b = tmp_path / "a", tmp_path / "b"
    _run(monkeypatch, LocalActors, [*args, f"run.dir={a}"])
    _run(monkeypatch, LocalActors, [*args, "rollout.max_num_batched_tokens=5", f"run.dir={b}"])
    assert _bits(b) == _bits(a)


# -------------------------------------------------------------- 3. train.micro_batch_tokens with env.* episodes
def _episode_cfg(*overrides):
    return to_schema(compose_config(["recipe=grpo_tiny", "env.name=calculator_task", *overrides]))


def test_micro_batch_tokens_with_episodes_is_checked_against_the_episode_budget():
    cfg = _episode_cfg("env.max_episode_tokens=64", "train.micro_batch_tokens=64")
    preflight.check_micro_batch_tokens(cfg, [], TINY, True)  # the budget bounds every sample, not the context
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=63 is below the longest sample this run can "
                                          r"produce, 64 tokens \(.*env.max_episode_tokens=64.*not trained\).*"
                                          r"Fix: set train.micro_batch_tokens>=64, or lower env.max_episode_tokens"):
        preflight.check_micro_batch_tokens(_episode_cfg("env.max_episode_tokens=64", "train.micro_batch_tokens=63"),
                                           [], TINY, True)
    # a budget above the engine's context: the context binds
    cfg = _episode_cfg("env.max_episode_tokens=100", "rollout.max_model_len=100", "train.micro_batch_tokens=100")
    preflight.check_micro_batch_tokens(cfg, [], TINY, True)


@pytest.mark.parametrize("extra,shown", [([], "null"), (["env.max_episode_tokens=2000"], "2000, above the context")])
def test_micro_batch_tokens_with_unbounded_episodes_names_why_and_the_budget_to_set(extra, shown):
    with pytest.raises(ConfigError) as e:
        preflight.check_micro_batch_tokens(_episode_cfg(*extra, "train.micro_batch_tokens=256"), [], TINY, True)
    msg = str(e.value)
    assert "1024 tokens (an episode's transcript can fill the engine's context (the model's " \
           f"max_position_embeddings), its only bound with env.max_episode_tokens={shown})" in msg, msg
    assert "Fix: set train.micro_batch_tokens>=1024, or set env.max_episode_tokens<=256" in msg, msg


class Talker(Environment):
    """An observation after every turn (the gold answer), never done: the turn count or the token budget ends it
    (scored by ``truncated_reward``, 0)."""

    def __init__(self, record):
        self.record = record

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        return StepResult(messages=[{"role": "tool", "content": "[= " + self.record.answer + "]"}])


@pytest.fixture
def talker_env():
    register_env("_s36_talker")(lambda record, seed, *, config, reward_fn: Talker(record))
    yield "_s36_talker"
    BUILTIN_ENVS.pop("_s36_talker", None)


def test_episodes_never_produce_a_sample_past_env_max_episode_tokens(tmp_path, monkeypatch, talker_env):
    """A run whose micro-batch budget is env.max_episode_tokens (refused before: it asked for the whole context):
    episodes end by the budget, mid-turn or on an observation, and no trained sample is longer than it."""
    budget = 20
    args = BASE + ["train.steps=1", f"env.name={talker_env}", "env.max_turns=4", f"env.max_episode_tokens={budget}",
                   f"train.micro_batch_tokens={budget}", "rollout.prompts_per_step=4", "rollout.group_size=4",
                   f"run.dir={tmp_path / 'r'}"]
    _run(monkeypatch, LocalActors, args)
    recs = _records(tmp_path / "r")[1]
    lengths = [len(x["prompt_token_ids"]) + len(x["token_ids"]) for x in recs]
    assert max(lengths) <= budget, lengths
    assert {x["finish_reason"] for x in recs} == {"token_budget"}
    assert all(x["turns"][-1]["role"] == "policy" for x in recs)  # an observation past the budget is dropped
    assert max(lengths) == budget  # some episode filled the budget exactly (its last turn cut to the room left)
    # and some ended on an observation that reached the budget: ended token_budget with room left, it was dropped
    assert min(lengths) < budget, lengths
