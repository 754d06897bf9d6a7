"""Session 35: the engine's sampling arguments and the tool environment's constructor, as a user of vLLM/SGLang
and of verl's tool agents writes them: bad input is refused when it is given, naming the value and the fix."""
import pytest

from rlrepro.data import PromptRecord
from rlrepro.envs import Episode, ToolEnv, calculator_tool, execute_calls, make_tool_format
from rlrepro.rollout import SamplingParams

REC = PromptRecord(uid="u1", prompt="123*456=", answer="56088")


def _reward(completion, record):
    return float(completion.strip() == record.answer)


def _env(**kw):
    args = dict(tools=[calculator_tool()], tool_format=make_tool_format("compact"), reward_fn=_reward)
    args.update(kw)
    return ToolEnv(REC, **args)


# ------------------------------------------------------------------ 1. vLLM / SGLang arguments SamplingParams lacks

@pytest.mark.parametrize("kw,fix", [
    ({"n": 4}, r"n=4: submit the prompt n times, each with its own seed"),
    ({"best_of": 2}, r"best_of=2: submit the prompt n times"),
    ({"max_new_tokens": 16}, r"max_new_tokens=16: the argument is called max_tokens here"),
    ({"stop": ["\n"]}, r"stop=\['\\n'\]: stop strings are not offered: pass token ids with stop_token_ids"),
    ({"min_p": 0.1}, r"min_p=0.1: min-p filtering is not offered; use top_k or top_p"),
    ({"repetition_penalty": 1.1}, r"repetition_penalty=1.1: rlrepro samples from the model's own distribution"),
    ({"presence_penalty": 0.5}, r"presence_penalty=0.5: .*penalties are not offered"),
    ({"logprobs": 5}, r"logprobs=5: the chosen token's logprob always comes back in RequestOutput.logprobs"),
    ({"temprature": 0.7}, r"temprature=0.7: the arguments are \['ignore_eos', 'max_tokens', 'seed'"),
])
def test_an_argument_of_vllm_or_sglang_names_what_to_do_instead(kw, fix):
    # before: Python's bare "__init__() got an unexpected keyword argument 'n'", with no way forward
    with pytest.raises(TypeError, match=r"^SamplingParams got the unknown argument " + fix):
        SamplingParams(**kw)


def test_known_arguments_positional_and_replace_still_work():
    import dataclasses
    import inspect

    p = SamplingParams(0.5, 0.9, 3, max_tokens=7, seed=1)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.5, 0.9, 3, 7, 1)
    assert dataclasses.replace(p, top_k=5).top_k == 5
    assert list(inspect.signature(SamplingParams).parameters)[:2] == ["temperature", "top_p"]


def test_stop_token_ids_none_is_no_stop_ids_as_in_vllm():
    # vLLM's and SGLang's default is stop_token_ids=None; it was refused as "not a sequence of token ids"
    assert SamplingParams(stop_token_ids=None) == SamplingParams()
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert hash(SamplingParams(stop_token_ids=None)) == hash(SamplingParams())


# ------------------------------------------------------------------ 2. ToolEnv / execute_calls arguments

@pytest.mark.parametrize("kw,message", [
    ({"max_calls_per_turn": 0}, r"env.max_calls_per_turn=0 \(ToolEnv max_calls_per_turn\) must be a positive "
                                r"integer. Fix: pass an int >= 1"),
    ({"max_calls_per_turn": -1}, r"env.max_calls_per_turn=-1 "),
    ({"max_calls_per_turn": 2.5}, r"env.max_calls_per_turn=2.5 "),
    ({"max_observation_chars": 0}, r"env.max_observation_chars=0 \(ToolEnv max_observation_chars\)"),
    ({"max_observation_chars": -1}, r"env.max_observation_chars=-1 "),
    ({"malformed_penalty": -1.0}, r"env.malformed_penalty=-1.0 \(ToolEnv malformed_penalty\) must be a finite "
                                  r"number >= 0"),
    ({"malformed_penalty": float("nan")}, r"env.malformed_penalty=nan "),
    ({"malformed_penalty": "0.5"}, r"env.malformed_penalty='0.5' "),
    ({"prompt": 5}, r"env.kwargs.prompt=5 \(ToolEnv prompt\) must be text or None"),
])
def test_a_tool_env_with_a_bad_limit_is_refused_when_made(kw, message):
    # before: accepted; the model then read "[error: more than -1 tool calls in one turn ...]" or "the first -1 are
    # shown", a string penalty became a float, and a negative one broke the run at the first malformed turn
    with pytest.raises(ValueError, match="^" + message):
        _env(**kw)


@pytest.mark.parametrize("kw,message", [
    ({"tool_format": "compact"}, r"ToolEnv tool_format must be a ToolCallFormat, got 'compact'. Fix: "
                                 r"tool_format=make_tool_format\(config.tool_format\)"),
    ({"tools": calculator_tool()}, r"ToolEnv tools must be a list of rlrepro.envs.Tool objects, got Tool. Fix: "
                                   r"tools=\[tool, ...\]"),
    ({"reward_fn": None}, r"ToolEnv reward_fn must be callable"),
])
def test_a_tool_env_with_a_wrong_kind_of_argument_names_the_fix(kw, message):
    # before: AttributeError "'str' object has no attribute 'check_tools'", "'Tool' object is not iterable", and a
    # reward_fn of None failed only at the answer turn of the first episode
    with pytest.raises(TypeError, match="^" + message):
        _env(**kw)


def test_execute_calls_refuses_limits_below_one():
    fmt = make_tool_format("compact")
    with pytest.raises(ValueError, match=r"^env.max_calls_per_turn=0 \(execute_calls max_calls\)"):
        execute_calls("[calc: 1]", [calculator_tool()], fmt, max_calls=0, max_observation_chars=10)
    with pytest.raises(ValueError, match=r"^env.max_observation_chars=-5 \(execute_calls max_observation_chars\)"):
        execute_calls("[calc: 1]", [calculator_tool()], fmt, max_calls=1, max_observation_chars=-5)


def test_a_tool_env_with_good_limits_runs_as_before():
    import numpy as np

    env = _env(max_calls_per_turn=np.int64(1), max_observation_chars=2, malformed_penalty=1)
    ep = Episode(env, max_turns=3, uid="u1")
    ep.reset()
    result = ep.step("[calc: 123*456][calc: 1]", 10)
    assert [m["content"] for m in result.messages] == [
        "[= 56][truncated: 5 characters, the first 2 are shown]",
        "[error: mo][truncated: 56 characters, the first 2 are shown]"]
    assert ep.step("56088", 5).reward == 1.0 and ep.outcome.total_reward == 1.0
