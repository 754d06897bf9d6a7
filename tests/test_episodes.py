"""Multi-turn episodes on one engine (rlrepro.orchestration.episodes): the same results, bit for bit, whatever
the engine's scheduling settings, the submission order, the tool threads or how long tools take; turns >= 2 have
the trainer's logprobs; the loss mask marks exactly the policy's tokens; single-turn equals engine.generate."""
import random
import time

import pytest
import torch

from rlrepro.data import PromptRecord, load_reward_fn
from rlrepro.envs import (BUILTIN_ENVS, EnvConfig, EnvError, EnvReset, Environment, StepResult, episode_seed,
                          make_calculator_records, load_env, register_env)
from rlrepro.model import load_pretrained, load_tokenizer, write_tiny_checkpoint
from rlrepro.orchestration.episodes import EpisodeRequest, EpisodeResult, episode_metrics, finish_fractions, run_episodes
from rlrepro.rollout import Engine, SamplingParams, request_seed
from rlrepro.trainer import token_logprobs
from rlrepro.trainer.warm_start import supervised_warm_start

pytestmark = pytest.mark.usefixtures("one_thread")

EOT = "<|im_end|>"


# ------------------------------------------------------------------------------------------- test environments
class ScriptedEnv(Environment):
    """An observation after every turn until turn ``turns`` (done, reward from the text's length); optional
    seeded wall-clock sleeps (which must change nothing) and a failure at turn ``fail_at``."""

    def __init__(self, record, seed, turns=2, sleep_s=0.0, fail_at=None):
        self.record, self.seed, self.turns, self.sleep_s, self.fail_at = record, seed, turns, sleep_s, fail_at
        self.n = 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.n += 1
        if self.sleep_s:
            time.sleep(random.Random(f"{self.seed}:{self.n}").uniform(0, self.sleep_s))
        if self.fail_at == self.n:
            raise RuntimeError("scripted failure")
        if self.n >= self.turns:
            return StepResult(done=True, reward=float(len(text) % 5), penalty=0.125 * (self.n % 2))
        return StepResult(messages=[{"role": "tool", "content": f"obs {self.seed % 97} {len(text)} turn {self.n}"}],
                          penalty=0.25, info={"turn": self.n})


def _scripted(record, seed, *, config, reward_fn):
    return ScriptedEnv(record, seed, **config.kwargs)


@pytest.fixture(scope="module", autouse=True)
def scripted_env():
    """``env.name=_test_scripted`` while this module runs (BUILTIN_ENVS is the process's registry)."""
    register_env("_test_scripted")(_scripted)
    yield
    BUILTIN_ENVS.pop("_test_scripted", None)


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_episodes"), seed=7)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_pretrained(model_dir)


@pytest.fixture(scope="module")
def caller(model_dir, tok):
    """The tiny model taught (a deterministic supervised warm-start) the compact calculator episode
    ``[calc: a*b]`` -> ``[= c]`` -> ``c``: sampled at T=1 it makes real calls, some malformed, most answers wrong."""
    model = load_pretrained(model_dir)
    examples = []
    for rec in make_calculator_records(16, seed=9):
        prompt = tok.apply_chat_template([{"role": "user", "content": rec.prompt}])
        call = f"[calc: {rec.prompt[:-1]}]" + EOT
        examples.append((tok.encode(prompt), tok.encode(call)))
        after = prompt + call + f"\n<|im_start|>tool\n[= {rec.answer}]{EOT}\n<|im_start|>assistant\n"
        examples.append((tok.encode(after), tok.encode(rec.answer + EOT)))
    supervised_warm_start(model, examples, steps=30, lr=2e-2, batch_size=8, seed=0)
    return model


def make_engine(model, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 256)
    return Engine(model, **kw)


def spec(name="_test_scripted", **kw):
    kwargs = kw.pop("kwargs", {})
    return load_env(EnvConfig(name=name, kwargs=kwargs, **kw), load_reward_fn("exact_match"))


def requests(tok, records, group=2, chat=True, temperature=1.0, max_tokens=8, step=0):
    out = []
    for rec in records:
        text = tok.apply_chat_template([{"role": "user", "content": rec.prompt}]) if chat else rec.prompt
        ids = tok.encode(text)
        for j in range(group):
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                    seed=request_seed(0, step, rec.uid, j), stop_token_ids=(tok.eos_token_id,))
            out.append(EpisodeRequest((rec.uid, j), rec, ids, params, episode_seed(0, step, rec.uid, j)))
    return out


RECORDS = make_calculator_records(3, seed=1)


def run(model, tok, env_spec, reqs, engine_kw=None, chat=True, **kw):
    engine = make_engine(model, **(engine_kw or {}))
    return run_episodes(engine, reqs, env_spec, tok, end_of_turn=EOT if chat else None, **kw)


def check_structure(tok, results, chat=True):
    """(d): the mask is 1 exactly on the policy's tokens, turn by turn; logprobs 0.0 on context tokens."""
    for r in results:
        assert r.completion_token_ids == [t for turn in r.turns for t in turn.token_ids]
        assert len(r.loss_mask) == len(r.rollout_logprobs) == len(r.completion_token_ids)
        assert r.turns[-1].role == "policy"
        assert sum(turn.role == "policy" for turn in r.turns) == r.num_turns == len(r.turn_finish_reasons)
        at = 0
        for turn in r.turns:
            n = len(turn.token_ids)
            want = 1 if turn.role == "policy" else 0
            assert r.loss_mask[at:at + n] == [want] * n
            if turn.role == "policy":
                assert turn.text == tok.decode(turn.token_ids)
            else:
                assert all(lp == 0.0 for lp in r.rollout_logprobs[at:at + n])
                assert tok.encode(turn.text) == turn.token_ids  # the tool turn is exactly its text's tokens
                if chat:
                    assert turn.text.startswith("\n<|im_start|>tool\n") or turn.text.startswith(EOT + "\n")
            at += n
        for prev, nxt in zip(r.turns, r.turns[1:]):  # a turn cut by length is closed by the added EOT token
            if prev.role == "policy" and chat:
                assert (prev.token_ids[-1] == tok.eos_token_id) != (nxt.token_ids[0] == tok.eos_token_id)


# ---------------------------------------------------------------------------------------------------------- tests
ENGINE_SETTINGS = [dict(max_num_seqs=8), dict(max_num_seqs=1), dict(max_num_batched_tokens=5),
                   dict(max_num_batched_tokens=4096, enable_prefix_cache=False),
                   dict(max_num_seqs=4, max_num_batched_tokens=7, num_kv_blocks=48)]  # the last one preempts


def env_case(name, model, caller):
    """(model, EnvSpec) of a test case: the scripted environment on the random model (every episode goes on),
    or calculator_task (compact calls) on the model that learnt to call the calculator."""
    if name == "scripted":
        return model, spec(kwargs={"turns": 3}, max_turns=3)
    return caller, spec("calculator_task", tool_format="compact", max_turns=3)


@pytest.mark.parametrize("env", ["scripted", "calculator"])
def test_same_results_across_engine_settings_and_orders(model, caller, tok, env):
    """(a): max_num_seqs 1 vs 8, token budgets (chunked prefill), prefix cache on/off, a small cache (preemption),
    reversed and shuffled submission orders: equal results (tokens, logprobs, masks, turns, rewards)."""
    model, env_spec = env_case(env, model, caller)
    reqs = requests(tok, RECORDS, max_tokens=24)
    ref = run(model, tok, env_spec, reqs)
    assert [r.key for r in ref] == sorted(r.key for r in reqs)
    check_structure(tok, ref)
    if env == "scripted":
        assert all(r.num_turns == 3 and r.finish_reason == "done" for r in ref)
    else:  # real tool calls: observations from the calculator
        assert sum(r.num_turns >= 2 for r in ref) >= 3
        assert any(t.role == "tool" and "[= " in t.text for r in ref for t in r.turns)
    shuffled = list(reqs)
    random.Random(3).shuffle(shuffled)
    for kw, order in zip(ENGINE_SETTINGS, [reqs[::-1], shuffled, reqs, shuffled, reqs[::-1]]):
        engine = make_engine(model, **kw)
        got = run_episodes(engine, order, env_spec, tok, end_of_turn=EOT)
        assert got == ref, kw
        assert not engine.has_unfinished()  # drained: weights may be loaded next (no step left in flight)
        for a, b in zip(got, ref):
            assert torch.equal(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs))
        if "num_kv_blocks" in kw and env == "scripted":
            assert engine.stats["num_preemptions"] > 0


def test_tool_sleeps_and_thread_counts_change_nothing(model, tok):
    """(b): environment steps sleeping a seeded random wall-clock time, on 1 or 4 threads."""
    reqs = requests(tok, RECORDS)
    ref = run(model, tok, spec(kwargs={"turns": 3}, max_turns=3), reqs)
    sleepy = spec(kwargs={"turns": 3, "sleep_s": 0.02}, max_turns=3)
    one = run(model, tok, sleepy, reqs, tool_threads=1)
    four = run(model, tok, sleepy, reqs[::-1], tool_threads=4, engine_kw=dict(max_num_seqs=2))
    assert one == ref and four == ref
    assert all(r.metrics["tool_seconds"] > 0 for r in four)


@pytest.mark.parametrize("env,temperature", [("scripted", 1.0), ("scripted", 0.7), ("calculator", 1.0)])
def test_later_turns_have_the_trainers_logprobs(model, caller, tok, env, temperature):
    """(c): every policy token's engine logprob (turns >= 2 included) equals a fresh scoring of the whole
    transcript by the trainer's function."""
    model, env_spec = env_case(env, model, caller)
    reqs = requests(tok, RECORDS, temperature=temperature, max_tokens=16)
    results = run(model, tok, env_spec, reqs)
    with torch.no_grad():
        scored = token_logprobs(model, [r.prompt_token_ids for r in results],
                                [r.completion_token_ids for r in results], temperature)
    later = 0
    for r, lp in zip(results, scored):
        mask = torch.tensor(r.loss_mask, dtype=torch.bool)
        assert torch.equal(lp[mask], torch.tensor(r.rollout_logprobs, dtype=torch.float32)[mask])
        first = len(r.turns[0].token_ids)
        later += int(mask[first:].sum())
    assert later > 0


def test_no_chat_template_appends_observations_as_text(model, tok):
    reqs = requests(tok, RECORDS[:2], chat=False)
    results = run(model, tok, spec(kwargs={"turns": 2}, max_turns=2), reqs, chat=False)
    check_structure(tok, results, chat=False)
    for r in results:
        assert r.turns[1].role == "tool" and r.turns[1].text.startswith("obs ")
    assert run(model, tok, spec(kwargs={"turns": 2}, max_turns=2), reqs[::-1], chat=False,
               engine_kw=dict(max_num_seqs=1)) == results


def test_max_turns_and_token_budget(model, tok):
    """(e): the runner cuts an episode at env.max_turns or env.max_episode_tokens, with its finish reason."""
    reqs = requests(tok, RECORDS[:2], max_tokens=6)
    cut = run(model, tok, spec(kwargs={"turns": 5}, max_turns=2), reqs)
    assert all(r.finish_reason == "max_turns" and r.num_turns == 2 and r.reward == 0.0 for r in cut)
    assert all(r.penalties == [0.25, 0.25] for r in cut)
    check_structure(tok, cut)
    prompt_len = len(reqs[0].prompt_token_ids)
    budget = prompt_len + 6 + 3  # the first turn fits, the observation does not leave room for much more
    small = run(model, tok, spec(kwargs={"turns": 5}, max_turns=5, max_episode_tokens=budget), reqs)
    for r in small:
        assert r.finish_reason == "token_budget" and r.reward == 0.0
        assert len(r.prompt_token_ids) + len(r.completion_token_ids) <= budget
        check_structure(tok, [r])
    # a prompt over the budget ends the episode before any turn
    none = run(model, tok, spec(max_turns=2, max_episode_tokens=prompt_len), reqs)
    assert all(r.finish_reason == "token_budget" and r.num_turns == 0 and r.completion_token_ids == [] and
               r.turns == [] for r in none)


def test_prefix_cache_hits_on_later_turns(model, tok):
    """(f): with the prefix cache on, turn >= 2 requests find their transcript's earlier blocks."""
    reqs = requests(tok, RECORDS)
    results = run(model, tok, spec(kwargs={"turns": 3}, max_turns=3), reqs, max_tokens=8)
    for r in results:
        m = r.metrics
        assert len(m["turn_cached_tokens"]) == len(m["turn_prompt_tokens"]) == r.num_turns
        assert all(c > 0 for c in m["turn_cached_tokens"][1:])
        assert m["prompt_tokens"] == sum(m["turn_prompt_tokens"])
    stats = episode_metrics(results)
    assert 0 < stats["perf/prefix_hit_rate_later_turns"] <= 1 and stats["episodes/turns_mean"] == 3
    off = run(model, tok, spec(kwargs={"turns": 3}, max_turns=3), reqs, engine_kw=dict(enable_prefix_cache=False))
    assert off == results and episode_metrics(off)["perf/prefix_hit_rate"] == 0


@pytest.mark.parametrize("chat", [True, False])
def test_single_turn_equals_engine_generate(model, tok, chat):
    """(g): single_turn with max_turns=1 gives engine.generate's tokens, logprobs and finish reasons, and the
    reward function's reward of the decoded completion."""
    records = RECORDS + [PromptRecord(uid="plain", prompt="12+3=", answer="15")]
    reqs = requests(tok, records, group=3, chat=chat, max_tokens=10)
    results = run(model, tok, spec("single_turn"), reqs, chat=chat)
    outs = make_engine(model).generate([r.prompt_token_ids for r in reqs], [r.params for r in reqs])
    reward_fn = load_reward_fn("exact_match")
    for req, res, out in zip(reqs, results, outs):
        assert res.key == req.key and res.num_turns == 1 and res.finish_reason == "done"
        assert res.completion_token_ids == out.token_ids and res.rollout_logprobs == out.logprobs
        assert torch.equal(torch.tensor(res.rollout_logprobs), torch.tensor(out.logprobs))
        assert res.turn_finish_reasons == [out.finish_reason] and res.loss_mask == [1] * len(out.token_ids)
        assert res.reward == reward_fn(tok.decode(out.token_ids), req.record) and res.seed == out.seed


def test_a_broken_environment_raises_and_leaves_the_engine_usable(model, tok):
    reqs = requests(tok, RECORDS)
    engine = make_engine(model)
    with pytest.raises(EnvError, match=r"calculator_task-s1:0.*turn 2"):
        run_episodes(engine, reqs, spec(kwargs={"turns": 3, "fail_at": 2}, max_turns=3), tok, end_of_turn=EOT)
    assert not engine.has_unfinished()
    ref = run(model, tok, spec(kwargs={"turns": 3}, max_turns=3), reqs)
    assert run_episodes(engine, reqs, spec(kwargs={"turns": 3}, max_turns=3), tok, end_of_turn=EOT) == ref


def test_bad_inputs(model, tok):
    reqs = requests(tok, RECORDS[:1])
    env_spec = spec()
    engine = make_engine(model)
    unseeded = EpisodeRequest(reqs[0].key, reqs[0].record, reqs[0].prompt_token_ids, SamplingParams(), 0)
    with pytest.raises(ValueError, match="seed is None"):
        run_episodes(engine, [unseeded], env_spec, tok)
    with pytest.raises(ValueError, match="unique"):
        run_episodes(engine, [reqs[0], reqs[0]], env_spec, tok)
    with pytest.raises(ValueError, match="tool_threads"):
        run_episodes(engine, reqs, env_spec, tok, tool_threads=0)
    with pytest.raises(ValueError, match="one token"):
        run_episodes(engine, reqs, env_spec, tok, end_of_turn="ab")
    assert isinstance(run_episodes(engine, [], env_spec, tok), list)
    long = spec(kwargs={"turns": 3}, max_turns=3)
    reqs = requests(tok, RECORDS, max_tokens=24)
    engine = make_engine(model, num_kv_blocks=28)  # turn 1 fits, a later transcript does not fit the KV cache
    with pytest.raises(ValueError, match="KV blocks"):
        run_episodes(engine, reqs, long, tok, end_of_turn=EOT)
    assert not engine.has_unfinished()


def test_the_engines_context_ends_an_episode_as_a_budget_does(model, tok):
    """A transcript that fills max_model_len (no env.max_episode_tokens) ends "token_budget" instead of failing the
    run, with exactly the results of env.max_episode_tokens=max_model_len on an engine with a longer context."""
    reqs = requests(tok, RECORDS, max_tokens=24)
    full = run(model, tok, spec(kwargs={"turns": 3}, max_turns=3), reqs, engine_kw=dict(max_model_len=60))
    assert sum(r.finish_reason == "token_budget" for r in full) >= 2, [r.finish_reason for r in full]
    check_structure(tok, full)
    budget = run(model, tok, spec(kwargs={"turns": 3}, max_turns=3, max_episode_tokens=60), reqs)
    assert full == budget
    assert [r.rollout_logprobs for r in full] == [r.rollout_logprobs for r in budget]


def test_to_sample(model, tok):
    reqs = requests(tok, RECORDS[:1], group=1)
    (r,) = run(model, tok, spec(kwargs={"turns": 2}, max_turns=2), reqs)
    s = r.to_sample(tok.decode)
    assert s.key == r.key and s.loss_mask == r.loss_mask and s.completion_token_ids == r.completion_token_ids
    assert s.reward == r.total_reward == r.reward - 0.25 - 0.0 and [t.role for t in s.turns] == ["policy", "tool",
                                                                                                    "policy"]
    assert s.to_record()["loss_mask"] == r.loss_mask
    assert EpisodeResult.__dataclass_fields__["metrics"].compare is False


def test_rollout_worker_runs_episodes(model_dir, model, tok):
    """RolloutWorker.run_episodes (in process): the environment and reward loaded from their specs, the tokenizer
    from the model directory, EOS as the end of turn; the runner's results on an engine of the same weights."""
    from rlrepro.orchestration.workers import RolloutWorker
    from rlrepro.rollout import EngineConfig

    worker = RolloutWorker(str(model_dir), EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=128),
                           device="cpu", dtype=None, deterministic=True, seed=0)
    torch.set_num_threads(1)
    reqs = requests(tok, RECORDS)
    env_config = EnvConfig(name="_test_scripted", kwargs={"turns": 2}, max_turns=2)
    got = worker.run_episodes(reqs[::-1], env_config, "exact_match", None, True, 3)
    assert got == run(model, tok, spec(kwargs={"turns": 2}, max_turns=2), reqs)
    assert worker.run_episodes(reqs, env_config, "exact_match") == got and len(worker._env_specs) == 1
    plain = worker.run_episodes(reqs, env_config, "exact_match", use_chat_template=False)
    assert plain == run(model, tok, spec(kwargs={"turns": 2}, max_turns=2), reqs, chat=False)
    assert worker.run_episodes([], env_config, "exact_match") == []


def test_finish_fractions_name_every_built_in_reason_and_any_other():
    from types import SimpleNamespace as NS

    from rlrepro.envs import FINISH_REASONS

    got = finish_fractions([NS(finish_reason="done"), NS(finish_reason="done"), NS(finish_reason="solved"),
                            NS(finish_reason="max_turns")], "episodes/")
    assert set(got) == {f"episodes/finish_{r}_frac" for r in (*FINISH_REASONS, "solved")}
    assert got["episodes/finish_done_frac"] == 0.5 and got["episodes/finish_solved_frac"] == 0.25
    assert got["episodes/finish_malformed_frac"] == 0.0 and got["episodes/finish_token_budget_frac"] == 0.0
    assert set(finish_fractions([], "eval/")) == {f"eval/finish_{r}_frac" for r in FINISH_REASONS}
