"""The chat template's end-of-turn token of multi-turn episodes comes from the template, not from the tokenizer's
EOS (rlrepro.envs.end_of_turn_token, preflight.check_end_of_turn).

A Base-like tokenizer (the tiny model's, with EOS ``<|endoftext|>`` as in Qwen3-*-Base, while its ChatML template
closes an assistant turn with ``<|im_end|>``):

* the end-of-turn token is ``<|im_end|>``; for the standard tiny tokenizer (EOS ``<|im_end|>``) and Qwen3's own
  template it is the EOS, as before;
* a template that closes an assistant turn with no special token is refused at set-up (ConfigError naming the
  eos_token, the text the template renders and the fix), before config.yaml, Ray or any generation;
* a short multi-turn run completes; every policy turn stops at its first ``<|im_end|>`` (the stop ids hold it),
  a turn cut by length is closed by it, the demonstration warm start's targets end with it, and two runs are
  equal bit for bit;
* for the standard tiny tokenizer nothing changes: the stop ids are the EOS alone, and the workers' end of turn is
  the EOS (their default, so the existing multi-turn tests pin the bits).

Single-turn runs with the chat template are in tests/test_session28_single_turn_end_of_turn.py.
"""
import gzip
import json

import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config
from rlrepro.envs import end_of_turn_token
from rlrepro.model import load_tokenizer, write_tiny_checkpoint
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.episodes import turn_stop_token_ids
from test_envs_tools import QWEN3_TEMPLATE  # the tool-calling parts of Qwen3's chat template
from test_review26_pipe_pipeline import LocalActors as PipeLocalActors

pytestmark = pytest.mark.usefixtures("one_thread")

ENDOFTEXT, IM_END = 0, 2  # the tiny tokenizer's ids (rlrepro.model.tiny.SPECIAL_TOKENS)

TOOL = ["recipe=grpo_tiny_tool", "model.init=pretrained", "model.tiny_overrides={}", "train.steps=2",
        "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_tokens=12", "warm_start.steps=20",
        "warm_start.batch_size=16", "checkpoint.every=0", "logger.progress=false", "train.micro_batch_size=8",
        "train.warmup_steps=1", "data.synthetic.num=64", "data.synthetic.kwargs.digits=1"]


def _retokenize(model_dir, **changes):
    """Rewrite the keys ``changes`` of the model directory's tokenizer_config.json."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """Qwen3-*-Base's arrangement: EOS <|endoftext|> (tokenizer_config.json, config.json, generation_config.json),
    the ChatML template closing turns with <|im_end|>."""
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("base") / "model", seed=3, eos_token_id=ENDOFTEXT)
    return _retokenize(model_dir, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def plain_end_dir(tmp_path_factory):
    """A template that closes an assistant turn with a newline (no special token), EOS <|endoftext|>."""
    from rlrepro.model.tiny import CHAT_TEMPLATE

    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("plain") / "model", seed=3, eos_token_id=ENDOFTEXT)
    return _retokenize(model_dir, eos_token="<|endoftext|>",
                       chat_template=CHAT_TEMPLATE.replace("'<|im_end|>' + '\n'", "'\n\n'"))


# ---------------------------------------------------------------------------------------- (a) the function
def test_the_end_of_turn_token_comes_from_the_template(tiny_dir, base_dir):
    tiny, base = load_tokenizer(tiny_dir), load_tokenizer(base_dir)
    assert tiny.eos_token == "<|im_end|>" and end_of_turn_token(tiny) == tiny.eos_token  # as before
    assert base.eos_token == "<|endoftext|>" and base.eos_token_id == ENDOFTEXT
    assert end_of_turn_token(base) == "<|im_end|>" and base.encode("<|im_end|>") == [IM_END]
    assert turn_stop_token_ids(tiny, [tiny.eos_token_id], end_of_turn_token(tiny)) == [IM_END]
    assert turn_stop_token_ids(base, [base.eos_token_id], end_of_turn_token(base)) == [ENDOFTEXT, IM_END]
    assert turn_stop_token_ids(base, [base.eos_token_id], None) == [ENDOFTEXT]


def test_qwen3s_template_ends_a_turn_with_im_end_whatever_the_eos(tmp_path):
    """Qwen3's real template: the instruct models' EOS <|im_end|> is kept; the Base models' <|endoftext|> is not
    what closes a turn, <|im_end|> is."""
    model_dir = write_tiny_checkpoint(tmp_path / "model", seed=3)
    for eos in ("<|im_end|>", "<|endoftext|>"):
        tok = load_tokenizer(_retokenize(model_dir, eos_token=eos, chat_template=QWEN3_TEMPLATE))
        assert end_of_turn_token(tok) == "<|im_end|>"


def test_the_eos_wins_where_the_template_closes_a_turn_with_it(tmp_path):
    """Rule 1 before rule 2: a template that closes a turn with ``eos_token`` (here <|endoftext|>, a special
    token like <|im_end|>) gets the EOS; whitespace between the content and the EOS is allowed."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + ' ' + eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    model_dir = write_tiny_checkpoint(tmp_path / "model", seed=3)
    tok = load_tokenizer(_retokenize(model_dir, eos_token="<|endoftext|>", chat_template=template))
    assert end_of_turn_token(tok) == "<|endoftext|>"


def test_no_special_token_after_a_turn_is_a_clear_error(plain_end_dir, tmp_path):
    with pytest.raises(ValueError) as e:
        end_of_turn_token(load_tokenizer(plain_end_dir))
    msg = str(e.value)
    assert "eos_token is '<|endoftext|>'" in msg  # the tokenizer's EOS
    assert repr("\n\n<|im_start|>user\n?\n\n<|im_start|>assistant\n") in msg  # what the template renders
    assert "data.use_chat_template=false" in msg and "Fix:" in msg
    # a token that is in the vocabulary but not special (a plain character) is not an end of turn either
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '#' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    model_dir = write_tiny_checkpoint(tmp_path / "hash", seed=3)
    with pytest.raises(ValueError, match="cannot tell the chat template's end-of-turn token"):
        end_of_turn_token(load_tokenizer(_retokenize(model_dir, chat_template=template, eos_token="<|endoftext|>")))


# ------------------------------------------------------------------------------------- (b) refused at set-up
class NoActors:
    """Set-up must fail before any actor (Ray, an engine) is made."""

    def __init__(self, *a, **k):
        raise AssertionError("the actors were started: the end-of-turn check came too late")


def test_a_template_without_an_end_of_turn_token_is_refused_at_set_up(plain_end_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoActors)
    run = tmp_path / "run"
    d = driver_mod.GRPODriver(compose_config([*TOOL, f"model.path={plain_end_dir}", f"run.dir={run}"]))
    with pytest.raises(ConfigError) as e:
        d.setup()
    msg = str(e.value)
    assert msg.startswith("data.use_chat_template=true with env.* (multi-turn episodes)")
    assert "'<|endoftext|>'" in msg and "Fix:" in msg and str(plain_end_dir) in msg
    assert not (run / "config.yaml").exists() and not hasattr(d, "prompts")  # before the data, before any work
    # without the chat template (observations follow as plain text) or with single-turn episodes nothing is asked
    single_turn = ["recipe=grpo_tiny", "model.init=pretrained", "model.tiny_overrides={}", "env.name=single_turn",
                   "data.use_chat_template=true", "rollout.prompts_per_step=2", "logger.progress=false"]
    for i, args in enumerate(([*TOOL, "data.use_chat_template=false"], single_turn)):
        d = driver_mod.GRPODriver(compose_config([*args, f"model.path={plain_end_dir}", f"run.dir={run}_{i}"]))
        with pytest.raises(AssertionError, match="the actors were started"):
            d.setup()
        assert d.end_of_turn is None and d.turn_stop_token_ids == d.stop_token_ids == [ENDOFTEXT]


# -------------------------------------------------------------------------------------------- (c) the runs
class LocalActors(PipeLocalActors):
    """The driver's actor group in this process (test_review26_pipe_pipeline's); records the keyword arguments
    and stop ids of every run_episodes call, and the warm start's examples."""
    calls: list = []

    def run_episodes(self, requests, env_config, reward_fn_spec, **kw):
        LocalActors.calls.append((kw, [r.params.stop_token_ids for r in requests]))
        return sorted(self.worker.run_episodes(list(requests), env_config, reward_fn_spec, **kw), key=lambda r: r.key)

    def warm_start(self, examples, **kw):
        LocalActors.examples = examples
        return super().warm_start(examples, **kw)


def _train(monkeypatch, model_dir, run):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: LocalActors)
    LocalActors.calls = []
    driver_mod.GRPODriver(compose_config([*TOOL, f"model.path={model_dir}", f"run.dir={run}"])).run()
    return LocalActors.calls, LocalActors.examples


def _rollouts(run):
    out = []
    for path in sorted((run / "rollouts").glob("step_*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            out += [json.loads(x) for x in f]
    return out


def test_a_base_like_tokenizer_runs_and_its_turns_end_with_im_end(base_dir, tmp_path, monkeypatch):
    calls, examples = _train(monkeypatch, base_dir, tmp_path / "a")
    assert calls and all(kw.get("end_of_turn") == "<|im_end|>" for kw, _ in calls)
    assert all(stops == (ENDOFTEXT, IM_END) for _, per_request in calls for stops in per_request)
    # the demonstration warm start: every target turn ends with <|im_end|>, never with the EOS
    assert examples and all(target[-1] == IM_END and ENDOFTEXT not in target for _, target in examples)
    stopped = closed = 0
    records = _rollouts(tmp_path / "a")
    assert len(records) == 2 * 4 * 2
    for rec in records:
        turns = rec["turns"]
        assert [t for turn in turns for t in turn["token_ids"]] == rec["token_ids"]
        for i, turn in enumerate(turns):
            ids = turn["token_ids"]
            if turn["role"] != "policy":
                continue
            assert IM_END not in ids[:-1]  # a turn stops at its first <|im_end|> (before the fix: never)
            stopped += ids[-1] == IM_END
            if i + 1 < len(turns):  # an observation follows: the turn ends with <|im_end|>, or is closed by one
                assert (ids[-1] == IM_END) != (turns[i + 1]["token_ids"][0] == IM_END)
                closed += turns[i + 1]["token_ids"][0] == IM_END
    assert stopped > 0 and closed > 0  # not vacuous: turns that stopped at <|im_end|>, and turns cut by length
    assert any(len(rec["turns"]) > 1 for rec in records)  # multi-turn episodes (observations after turns)
    # bit for bit: a second run is identical (fingerprints, rollouts)
    _train(monkeypatch, base_dir, tmp_path / "b")
    for name in ("fingerprints.jsonl",):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert _rollouts(tmp_path / "a") == _rollouts(tmp_path / "b")


def test_the_standard_tiny_tokenizer_keeps_its_stop_ids_and_worker_calls(tiny_dir, tmp_path, monkeypatch):
    """EOS = end of turn: the stop ids are the EOS alone and the workers get the EOS as the end of turn (their
    default too: what they always used), so the existing tests' bits (tests/test_tool_e2e.py,
    tests/test_episodes*.py) stay pinned."""
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: LocalActors)
    LocalActors.calls = []
    d = driver_mod.GRPODriver(compose_config([*TOOL, f"model.path={tiny_dir}", f"run.dir={tmp_path / 'run'}"]))
    d.setup()
    assert d.end_of_turn == d.tokenizer.eos_token == "<|im_end|>"
    assert d.turn_stop_token_ids == d.stop_token_ids == [IM_END]
    d.generate_episodes(1, d.prompts[:2], [0, 0])
    ((kw, stops),) = LocalActors.calls
    assert kw["end_of_turn"] == "<|im_end|>" and set(stops) == {(IM_END,)}
    examples = d.demonstration_examples([p.record for p in d.prompts[:4]], [p.token_ids for p in d.prompts[:4]])
    assert examples and all(target[-1] == IM_END for _, target in examples)
