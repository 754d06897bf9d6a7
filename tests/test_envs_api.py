"""The environment API (rlrepro.envs): the result types and their checks, the episode runner's finish reasons
(done, max_turns, token_budget, malformed) and their precedence, the single-turn adapter equal to the reward
function, the registry and env.fn loading, EnvConfig's checks, and determinism: the same record, seed and
transcript give identical outputs, in this process and in another one."""
import json
import os
import subprocess
import sys

import pytest

from rlrepro.checks import ConfigError
from rlrepro.data import PromptRecord, exact_match_reward, make_synthetic_records, prefix_match_reward, render_prompt
from rlrepro.data.rewards import hash_reward
from rlrepro.envs import (BUILTIN_ENVS, EnvConfig, EnvError, EnvReset, Environment, Episode, StepResult,
                          episode_seed, load_env, load_env_factory, make_calculator_records, register_env, replay,
                          run_episode, transcript_digest)


class Counter(Environment):
    """Says 'again' until it hears 'stop'; then done with reward 0.5 and a penalty of 0.1 per 'bad' turn."""

    def __init__(self, record, seed):
        self.record, self.seed, self.turns = record, seed, 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.turns += 1
        penalty = 0.1 if text == "bad" else 0.0
        if text == "stop":
            return StepResult(done=True, reward=0.5, penalty=penalty, info={"turns": self.turns})
        return StepResult(messages=[{"role": "user", "content": f"again {self.seed}"}], penalty=penalty)


REC = PromptRecord(uid="r0", prompt="go", answer="x")


def episode(max_turns=5, budget=None):
    ep = Episode(Counter(REC, 7), max_turns=max_turns, max_episode_tokens=budget, uid="r0")
    ep.reset()
    return ep


# ------------------------------------------------------------------------------------------ result types

def test_step_result_checks():
    assert StepResult(done=True, reward=1).reward == 1.0 and StepResult(done=True, reward=1).finish_reason == "done"
    assert StepResult(done=True, reward=-0.0).reward == 0.0 and str(StepResult(done=True, reward=-0.0).reward) == "0.0"
    for bad in [dict(done=True), dict(done=True, reward=float("nan")), dict(done=True, reward=True),
                dict(messages=[]), dict(messages=[{"role": "tool"}]), dict(done=False, reward=1.0,
                messages=[{"role": "tool", "content": "x"}]), dict(done=True, reward=1, penalty=-1),
                dict(done=True, reward=1, info={"x": object()}), dict(done=True, reward=1, finish_reason=""),
                dict(messages=[{"role": "tool", "content": "x", "name": "calc"}])]:
        with pytest.raises(ValueError):
            StepResult(**bad)


def test_env_reset_checks_and_prompt_record():
    with pytest.raises(ValueError, match="exactly one of prompt"):
        EnvReset()
    with pytest.raises(ValueError, match="exactly one of prompt"):
        EnvReset(prompt="a", messages=[{"role": "user", "content": "a"}])
    rec = PromptRecord(uid="u", prompt="p", answer="a", meta={"k": 1})
    again = EnvReset(prompt="new").prompt_record(rec)
    assert (again.uid, again.prompt, again.answer, again.meta) == ("u", "new", "a", {"k": 1})


# -------------------------------------------------------------------------------------- episode runner

def test_an_episode_ends_done_with_the_env_reward_and_penalties():
    ep = episode()
    assert ep.add_context_tokens(2) is None
    assert ep.step("bad", 3).messages == [{"role": "user", "content": "again 7"}]
    ep.add_context_tokens(7)
    final = ep.step("stop", 4)
    assert final.done and final.info == {"turns": 2}
    o = ep.outcome
    assert (o.reward, o.finish_reason, o.penalties, o.num_turns, o.num_tokens) == (0.5, "done", [0.1, 0.0], 2, 16)
    assert o.total_reward == 0.5 - 0.1
    assert [m["role"] for m in ep.transcript] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(EnvError, match="after the episode ended"):
        ep.step("more", 1)


def test_max_turns_ends_the_episode_with_its_own_reason():
    ep = episode(max_turns=2)
    assert not ep.step("a", 1).done
    final = ep.step("b", 1)
    assert (final.done, final.finish_reason, final.reward, final.messages) == (True, "max_turns", 0.0, [])
    assert ep.outcome.finish_reason == "max_turns" and ep.transcript[-1] == {"role": "assistant", "content": "b"}


def test_the_token_budget_ends_the_episode_with_its_own_reason():
    ep = episode(budget=10)
    assert ep.add_context_tokens(4) is None and ep.tokens_left == 6
    ep.step("a", 3)
    final = ep.add_context_tokens(3)  # the observation fills the budget: no room for a generated token
    assert (final.finish_reason, ep.outcome.num_tokens, ep.tokens_left) == ("token_budget", 10, 0)
    ep = episode(budget=10)
    ep.add_context_tokens(4)
    assert ep.step("a", 6).finish_reason == "token_budget"  # the turn itself used the rest
    ep = episode(budget=3)
    assert ep.add_context_tokens(5).finish_reason == "token_budget" and ep.outcome.num_turns == 0


def test_precedence_env_done_then_max_turns_then_token_budget():
    ep = episode(max_turns=1, budget=5)
    ep.add_context_tokens(1)
    assert ep.step("stop", 9).finish_reason == "done"  # answered: scored even though over budget
    ep = episode(max_turns=1, budget=5)
    ep.add_context_tokens(1)
    assert ep.step("a", 9).finish_reason == "max_turns"


def test_an_env_that_breaks_its_contract_raises_env_error():
    class Raises(Counter):
        def step(self, text):
            raise KeyError("boom")

    class WrongType(Counter):
        def step(self, text):
            return {"done": True}

    for cls, needle in ((Raises, "raised in step() for record 'r0' at turn 1: KeyError"),
                        (WrongType, "returned dict, not a StepResult")):
        ep = Episode(cls(REC, 0), max_turns=3, uid="r0")
        ep.reset()
        with pytest.raises(EnvError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            ep.step("x", 1)
    with pytest.raises(EnvError, match="before reset"):
        Episode(Counter(REC, 0), max_turns=1).step("x", 1)
    with pytest.raises(ValueError, match="env.max_turns"):
        Episode(Counter(REC, 0), max_turns=0)


# ---------------------------------------------------------------------------------- single-turn adapter

COMPLETIONS = ["", "q", " q ", "qbz", "abc", "19", " 19\n", "zz top", "first: q"]


@pytest.mark.parametrize("reward_fn", [exact_match_reward, prefix_match_reward, hash_reward])
def test_the_single_turn_adapter_equals_the_reward_function(reward_fn):
    spec = load_env(EnvConfig(), reward_fn)
    assert spec.name == "single_turn" and spec.is_single_turn
    records = make_synthetic_records("first_letter", 6, seed=0) + make_synthetic_records("add", 4, seed=1)
    for rec in records:
        for text in COMPLETIONS + [rec.answer]:
            ep = spec.episode(rec, seed=episode_seed(0, 1, rec.uid, 0))
            ep.reset()
            final = ep.step(text, len(text))
            assert final.done and final.finish_reason == "done" and final.messages == []
            assert final.reward == reward_fn(text, rec) and ep.outcome.total_reward == reward_fn(text, rec)


def test_the_single_turn_prompt_renders_as_the_record_does():
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return json.dumps(messages) + "|gen"
    chat = PromptRecord(uid="c", answer="a", messages=[{"role": "system", "content": "s"},
                                                       {"role": "user", "content": "hi"}])
    spec = load_env(EnvConfig(name="single_turn"), exact_match_reward)
    for rec in make_synthetic_records("copy", 3, seed=0) + [chat]:
        start = spec.make(rec, 0).reset()
        assert start.tools == []
        for kw in (dict(use_chat_template=True, template="Q: {prompt}"), dict(use_chat_template=True)):
            assert render_prompt(start.prompt_record(rec), Tok(), **kw) == render_prompt(rec, Tok(), **kw)
        if rec.prompt is not None:
            plain = render_prompt(rec, template="{prompt}!")
            assert render_prompt(start.prompt_record(rec), template="{prompt}!") == plain


# ------------------------------------------------------------------------------------ registry, config

def test_builtin_names_and_errors():
    assert sorted(BUILTIN_ENVS) == ["calculator_task", "single_turn", "tool"]
    assert load_env(EnvConfig(name="tool", max_turns=4), exact_match_reward).name == "tool"
    with pytest.raises(ValueError, match="env.name='nope' is not a built-in environment"):
        load_env(EnvConfig(name="nope"), exact_match_reward)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_env(EnvConfig(fn="no_such_module_xyz:make"), exact_match_reward)
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_env_factory("json:missing")
    with pytest.raises(ValueError, match="must accept \\(record, seed, \\*, config, reward_fn\\)"):
        load_env_factory("json:dumps")
    with pytest.raises(ValueError, match="unknown environment 'nodots'"):
        load_env_factory("nodots")
    with pytest.raises(ValueError, match="calculator_task takes no options"):
        load_env(EnvConfig(name="calculator_task", kwargs={"x": 1}), exact_match_reward).make(REC, 0)


def test_env_fn_loads_a_user_factory_and_runs_its_module(tmp_path, monkeypatch):
    (tmp_path / "my_env_mod.py").write_text(
        "from pathlib import Path\n"
        "Path(__file__).with_name('imported.txt').write_text('top-level code ran')\n"
        "from rlrepro.envs import Environment, EnvReset, StepResult\n"
        "class Echo(Environment):\n"
        "    def __init__(self, record, seed, scale):\n"
        "        self.record, self.seed, self.scale = record, seed, scale\n"
        "    def reset(self):\n"
        "        return EnvReset(prompt=self.record.prompt + '?')\n"
        "    def step(self, text):\n"
        "        return StepResult(done=True, reward=self.scale * (text == self.record.answer))\n"
        "def make(record, seed, *, config, reward_fn):\n"
        "    return Echo(record, seed, config.kwargs.get('scale', 1.0))\n"
        "def not_an_env(record, seed, **kw):\n"
        "    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_env(EnvConfig(fn="my_env_mod:make", kwargs={"scale": 0.5}), exact_match_reward)
    assert (tmp_path / "imported.txt").read_text() == "top-level code ran"
    assert spec.name == "my_env_mod:make" and not spec.is_single_turn
    ep = run_episode(spec.make(REC, 0), lambda t: "x", max_turns=1)
    assert ep.transcript[0] == {"role": "user", "content": "go?"} and ep.outcome.reward == 0.5
    with pytest.raises(EnvError, match="returned int, not an rlrepro.envs.Environment"):
        load_env(EnvConfig(fn="my_env_mod.not_an_env"), exact_match_reward).make(REC, 0)


def test_register_env():
    @register_env("counter_for_test")
    def make(record, seed, *, config, reward_fn):
        return Counter(record, seed)
    try:
        spec = load_env(EnvConfig(name="counter_for_test", max_turns=9), exact_match_reward)
        assert isinstance(spec.make(REC, 3), Counter)
        with pytest.raises(ValueError, match="registered already"):
            register_env("counter_for_test")(lambda *a, **k: None)
    finally:
        BUILTIN_ENVS.pop("counter_for_test")


@pytest.mark.parametrize("kwargs, key", [
    (dict(name="tool", fn="m:f"), "env.fn"), (dict(name=""), "env.name"), (dict(max_turns=0), "env.max_turns"),
    (dict(max_episode_tokens=0), "env.max_episode_tokens"), (dict(tool_format="xml"), "env.tool_format"),
    (dict(on_malformed="ignore"), "env.on_malformed"), (dict(malformed_penalty=-1), "env.malformed_penalty"),
    (dict(tools=["web"]), "env.tools"), (dict(tools=["python", "python"]), "env.tools"),
    (dict(max_calls_per_turn=0), "env.max_calls_per_turn"), (dict(kwargs=[1]), "env.kwargs"),
    (dict(python={"max_steps": 5}), "env.python"),
])
def test_env_config_checks_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + "="):
        EnvConfig(**kwargs)


def test_env_config_defaults_are_single_turn():
    cfg = EnvConfig()
    assert (cfg.env_name, cfg.max_turns, cfg.max_episode_tokens, cfg.tool_format) == ("single_turn", 1, None, "qwen3")
    assert cfg.python.max_steps == 100_000 and cfg.calculator.max_digits == 1000


def test_env_config_works_as_a_structured_config_with_overrides():
    """What the run schema will do with the env: section (omegaconf structured config + dotlist overrides)."""
    omegaconf = pytest.importorskip("omegaconf")
    base = omegaconf.OmegaConf.structured(EnvConfig)
    over = omegaconf.OmegaConf.from_dotlist(["name=calculator_task", "tool_format=compact", "max_turns=3",
                                             "tools=[calculator]", "python.max_steps=5000", "calculator.max_digits=9",
                                             "max_episode_tokens=256"])
    cfg = omegaconf.OmegaConf.to_object(omegaconf.OmegaConf.merge(base, over))
    assert isinstance(cfg, EnvConfig) and cfg.tools == ["calculator"] and cfg.max_episode_tokens == 256
    assert (cfg.python.max_steps, cfg.calculator.max_digits, cfg.max_turns) == (5000, 9, 3)
    with pytest.raises(ConfigError, match="env.python.max_steps=0"):
        omegaconf.OmegaConf.to_object(omegaconf.OmegaConf.merge(base, {"python": {"max_steps": 0}}))


def test_episode_seed_is_pinned_and_apart_from_the_sampling_seed():
    from rlrepro.rollout.seeds import request_seed
    s = episode_seed(1, 2, "copy-s0:3", 4)
    assert s == episode_seed(1, 2, "copy-s0:3", 4) == 5544664989923327541
    assert 0 <= s < 2 ** 63 and s != request_seed(1, 2, "copy-s0:3", 4)
    assert len({episode_seed(1, 2, u, i) for u in ("a", "b", 7) for i in range(3)}) == 9
    with pytest.raises(ValueError):
        episode_seed(1, True, "a", 0)


# ------------------------------------------------------------------------------------------ determinism

SCRIPTS = [
    ("calculator_task", {"tool_format": "compact"}, ["[calc: 108*152]", "16416"]),
    ("calculator_task", {"tool_format": "compact", "malformed_penalty": 0.5},
     ["[calc 1]", "[calc: 1/0][foo: 2][calc: 2**3000]", "[calc: (1+", "x"]),
    ("calculator_task", {}, ['<tool_call>{"name": "calculator", "arguments": {"expression": "108*152"}}</tool_call>',
                             "16416"]),
    ("tool", {"tools": ["python", "calculator"]},
     ['<tool_call>{"name": "python", "arguments": {"code": "s = set(\'abcdefghijklmnop\')\\nprint(s, [w for w in s])"}}'
      '</tool_call><tool_call>{"name": "python", "arguments": {"code": "while True:\\n    pass"}}</tool_call>',
      '<tool_call>{"name": "python", "arguments": {"code": "import os"}}</tool_call><tool_call>{bad</tool_call>',
      "16416"]),
    ("single_turn", {}, ["16416"]),
]


def digests():
    rec = make_calculator_records(1, seed=0)[0]
    out = []
    for name, kw, turns in SCRIPTS:
        spec = load_env(EnvConfig(name=name, max_turns=8, **kw), hash_reward if name == "single_turn" else
                        exact_match_reward)
        start, results = replay(spec.make(rec, episode_seed(0, 0, rec.uid, 0)), turns)
        out.append(transcript_digest(start, results))
    return out


def test_same_record_seed_and_transcript_give_identical_outputs():
    rec = make_calculator_records(1, seed=0)[0]
    for name, kw, turns in SCRIPTS:
        spec = load_env(EnvConfig(name=name, max_turns=8, **kw), exact_match_reward)
        a = replay(spec.make(rec, 5), turns)
        b = replay(spec.make(rec, 5), turns)
        assert [r.to_json() for r in a[1]] == [r.to_json() for r in b[1]] and a[0] == b[0]
        ep = run_episode(spec.make(rec, 5), _script(turns), max_turns=8)
        assert [r.to_json() for r in ep.results] == [r.to_json() for r in a[1]]  # the runner adds nothing
    assert digests() == digests()


def _script(turns):
    it = iter(turns)
    return lambda transcript: next(it)


def test_identical_outputs_in_another_process():
    here = digests()
    code = "import json, tests.test_envs_api as t; print(json.dumps(t.digests()))"
    for seed in ("0", "98765"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == here


def test_the_layer_imports_no_engine_trainer_ray_or_torch():
    code = ("import sys, rlrepro.envs\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'triton') or "
            "m.startswith(('rlrepro.rollout', 'rlrepro.trainer', 'rlrepro.orchestration', 'rlrepro.model', "
            "'rlrepro.kernels', 'rlrepro.repro')))\nprint(bad)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_a_file_path_given_as_a_module_is_answered_with_the_module_spelling():
    from rlrepro.data import load_reward_fn
    from rlrepro.envs.registry import load_env_factory

    with pytest.raises(ValueError, match=r"reward.fn='my_reward.py:reward' names a file; give the module's name "
                                         r"instead \(reward.fn=my_reward:reward\)"):
        load_reward_fn("my_reward.py:reward")
    with pytest.raises(ValueError, match=r"env.fn='mods/myenv.py:factory' names a file.*\(env.fn=myenv:factory\)"):
        load_env_factory("mods/myenv.py:factory")
    with pytest.raises(ValueError, match=r"env.fn='myenv factory' must look like env.fn=pkg.module:factory"):
        load_env_factory("myenv factory")
