import math
import signal
import sys
import threading

import numpy as np
import pytest

from rlrepro.data import (
    MathReward,
    PromptRecord,
    RewardError,
    compute_rewards,
    exact_match_reward,
    extract_last_boxed,
    load_reward_fn,
    math_reward,
    overlong_penalty,
    prefix_match_reward,
)


def rec(answer, uid="u:0"):
    return PromptRecord(uid=uid, prompt="q", answer=answer)


def test_exact_match():
    assert exact_match_reward("  abc\n", rec("abc")) == 1.0
    assert exact_match_reward("abc", rec(" abc ")) == 1.0
    assert exact_match_reward("abcd", rec("abc")) == 0.0
    assert exact_match_reward("ABC", rec("abc")) == 0.0


@pytest.mark.parametrize("completion,answer,expected", [
    ("abc", "abc", 1.0),
    (" abc\n", "abc", 1.0),
    ("abd", "abc", 2 / 3),
    ("xbc", "abc", 0.0),       # position by position from the start: stops at the first mismatch
    ("ab", "abc", 2 / 3),
    ("abcd", "abc", 3 / 4),    # extra trailing characters lower the score
    ("abcxyz", "abc", 0.5),
    ("", "abc", 0.0),
    ("", " ", 1.0),
    ("19", "19", 1.0),
    ("1", "19", 0.5),
])
def test_prefix_match(completion, answer, expected):
    assert prefix_match_reward(completion, rec(answer)) == expected


def test_extract_last_boxed():
    assert extract_last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert extract_last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert extract_last_boxed(r"\fbox{7}") == "7"
    assert extract_last_boxed(r"\boxed {x}") == "x"
    assert extract_last_boxed(r"\boxed{1} then \boxed{2") is None
    assert extract_last_boxed("no box") is None


@pytest.mark.parametrize("completion,answer,expected", [
    (r"so the answer is \boxed{1/2}", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"\boxed{3}", "0.5", 0.0),
    (r"first \boxed{1} then \boxed{2}", "2", 1.0),      # the last box counts
    (r"first \boxed{1} then \boxed{2}", "1", 0.0),
    (r"\boxed{x+1}", "1+x", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    ("The final answer is 42.", "42", 1.0),             # no box: math-verify's final-answer extraction
    ("The final answer is 41.", "42", 0.0),
    (r"\boxed{42", "42", 0.0),                           # unclosed last box: truncated, no answer
    ("", "1", 0.0),
    (r"\boxed{7}", r"\boxed{7}", 1.0),                    # a boxed gold answer is parsed as is
])
def test_math_reward_cases(completion, answer, expected):
    assert math_reward(completion, rec(answer)) == expected


@pytest.mark.parametrize("answer", [
    r"9^{9^{9}}", r"9^{9^{9^{9}}}", r"100!!!", r"(x+y+z+w)^{100}", r"(x+1)^{1000}", r"\binom{10^9}{10^5}",
    r"10^{-10^{10}}", r"e^{e^{e^{10}}}", r"\sin(10^{10^{5}})", "1" * 300,
])
def test_math_reward_refuses_costly_answers_deterministically(answer):
    # each of these keeps sympy busy for minutes without the limits (math-verify relies on a timeout there)
    assert math_reward(rf"\boxed{{{answer}}}", rec("1")) == 0.0


def test_math_reward_limits_are_configurable():
    # the bound for 2^{100} / 2^{99} is 100 + 99 bits: refused under 150 even though it equals 2
    assert MathReward()(r"\boxed{\frac{2^{100}}{2^{99}}}", rec("2")) == 1.0
    assert MathReward(max_number_bits=150)(r"\boxed{\frac{2^{100}}{2^{99}}}", rec("2")) == 0.0
    assert MathReward(max_answer_chars=3)(r"\boxed{1000}", rec("1000")) == 0.0
    assert MathReward(max_answer_chars=4)(r"\boxed{1000}", rec("1000")) == 1.0
    # (x+1)(x+1) expands to 4 terms, the gold x^2+2x+1 has 3
    assert MathReward(max_expansion_terms=3)(r"\boxed{(x+1)(x+1)}", rec("x^2+2x+1")) == 0.0
    assert MathReward(max_expansion_terms=4)(r"\boxed{(x+1)(x+1)}", rec("x^2+2x+1")) == 1.0
    assert MathReward(max_expansion_terms=3)(r"\boxed{(x+1)^2}", rec("x^2+2x+1")) == 1.0
    with pytest.raises(ValueError, match="exceeds the deterministic limits"):
        MathReward(max_number_bits=64)(r"\boxed{1}", rec("2^{100}"))
    with pytest.raises(ValueError, match="does not parse"):
        math_reward(r"\boxed{1}", rec("\\text{}"))
    with pytest.raises(ValueError, match="max_answer_chars must be a positive integer"):
        MathReward(max_answer_chars=0)


def test_math_reward_never_uses_a_timer(monkeypatch):
    def no_alarm(*a, **k):
        raise AssertionError("signal.alarm called: a wall-clock timeout would decide a reward")

    monkeypatch.setattr(signal, "alarm", no_alarm)
    assert math_reward(r"\boxed{\frac{3}{6}}", rec("0.5")) == 1.0
    # math-verify refuses to run in a thread when its signal timeouts are on; here it must work
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{0.25}", rec(r"\frac{1}{4}"))))
    t.start()
    t.join()
    assert out == [1.0]


def test_load_reward_fn_builtins_and_paths(tmp_path, monkeypatch):
    assert load_reward_fn("exact_match") is exact_match_reward
    assert load_reward_fn("prefix_match") is prefix_match_reward
    assert load_reward_fn("math") is math_reward
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fns.py").write_text(
        "def length_reward(completion, record):\n    return min(len(completion), 10) / 10\n"
        "def wrong_sig(completion):\n    return 0.0\n"
        "NOT_CALLABLE = 3\n"
        "class Holder:\n    @staticmethod\n    def score(completion, record):\n        return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("myrewards.fns:length_reward")
    assert fn("abcde", rec("x")) == 0.5
    assert load_reward_fn("myrewards.fns.length_reward") is fn
    assert load_reward_fn("myrewards.fns:Holder.score")("", rec("x")) == 1.0
    with pytest.raises(ValueError, match=r"unknown reward 'exactmatch' \(reward.fn=exactmatch\). Fix: set reward.fn "
                                         r"to one of the built-ins \['exact_match', 'hash', 'math', 'prefix_match'\] "
                                         r"\(e.g. reward.fn=exact_match\)"):
        load_reward_fn("exactmatch")
    with pytest.raises(ValueError, match="reward.fn='nopkg.mod:fn': cannot import module 'nopkg.mod' "
                                         ".*ModuleNotFoundError.*PYTHONPATH"):
        load_reward_fn("nopkg.mod:fn")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'; callables there: .*'length_reward'.*\. "
                                         r"Fix: set reward.fn=myrewards.fns:<one of those>"):
        load_reward_fn("myrewards.fns:missing")
    with pytest.raises(ValueError, match="names a int, not a function"):
        load_reward_fn("myrewards.fns:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"must accept \(completion: str, record: PromptRecord\)"):
        load_reward_fn("myrewards.fns:wrong_sig")
    with pytest.raises(ValueError, match="reward.fn must be a non-empty string"):
        load_reward_fn("")


RECS = [rec("a", "u:0"), rec("b", "u:1"), rec("c", "u:2")]


def test_compute_rewards_ok():
    rewards, errors = compute_rewards(exact_match_reward, ["a", "x", " c "], RECS)
    assert (rewards, errors) == ([1.0, 0.0, 1.0], 0)
    assert all(type(r) is float for r in rewards)
    rewards, _ = compute_rewards(lambda c, r: np.float32(0.25) if r.uid != "u:1" else -0.0, ["", "", ""], RECS)
    assert rewards == [0.25, 0.0, 0.25] and math.copysign(1.0, rewards[1]) == 1.0


def test_compute_rewards_exception_policy():
    def flaky(completion, record):
        if record.uid == "u:1":
            raise KeyError("boom")
        return 1.0

    with pytest.raises(RewardError,
                       match=r"reward .*flaky raised on record uid='u:1' \(item 1\): KeyError: 'boom'") as e:
        compute_rewards(flaky, ["a", "b", "c"], RECS, policy="raise")
    assert isinstance(e.value.__cause__, KeyError)
    assert compute_rewards(flaky, ["a", "b", "c"], RECS, policy="zero") == ([1.0, 0.0, 1.0], 1)


@pytest.mark.parametrize("value,problem", [
    (float("nan"), "returned NaN"),
    (1.5, "returned 1.5, outside [0, 1]"),
    (-0.1, "returned -0.1, outside [0, 1]"),
    ("1.0", "returned '1.0' (str), not a real number"),
    (None, "returned None (NoneType), not a real number"),
    (True, "returned True (bool), not a real number"),
])
def test_compute_rewards_invalid_values(value, problem):
    fn = lambda c, r: value if r.uid == "u:2" else 0.5  # noqa: E731
    with pytest.raises(RewardError, match=r"on record uid='u:2' \(item 2\) " + problem.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        compute_rewards(fn, ["", "", ""], RECS)
    assert compute_rewards(fn, ["", "", ""], RECS, policy="zero") == ([0.5, 0.5, 0.0], 1)


def test_compute_rewards_argument_errors():
    with pytest.raises(ValueError, match=r"reward.on_error \(policy\) must be raise or zero"):
        compute_rewards(exact_match_reward, ["a"], RECS[:1], policy="skip")
    with pytest.raises(ValueError, match="2 completions but 3 records"):
        compute_rewards(exact_match_reward, ["a", "b"], RECS)
    with pytest.raises(TypeError, match="completion 0 .* is list, not str"):
        compute_rewards(exact_match_reward, [[1]], RECS[:1], policy="zero")


def test_data_package_imports_nothing_forbidden():
    import ast
    import pathlib

    import rlrepro.data

    forbidden = ("ray", "rlrepro.rollout", "rlrepro.trainer", "rlrepro.orchestration", "rlrepro.repro", "rlrepro.cli")
    for path in pathlib.Path(rlrepro.data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in forbidden), (path.name, name)


def test_importing_the_data_package_does_not_import_ray():
    import subprocess

    code = ("import sys, rlrepro.data\n"
            "print(sorted(m for m in ('ray', 'torch', 'rlrepro.rollout', 'rlrepro.trainer', 'rlrepro.orchestration',"
            " 'rlrepro.repro', 'rlrepro.cli') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_overlong_penalty_by_hand():
    """DAPO eq. 13 with L_max = 100, L_cache = 20: 0 up to 80 tokens, then linear to -factor at 100."""
    assert [overlong_penalty(n, 100, 20) for n in (0, 50, 80)] == [0.0, 0.0, 0.0]
    assert overlong_penalty(81, 100, 20) == -0.05
    assert overlong_penalty(90, 100, 20) == -0.5
    assert overlong_penalty(100, 100, 20) == -1.0
    assert overlong_penalty(90, 100, 20, factor=0.5) == -0.25
    assert overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off
    for args, needle in [((-1, 100, 20), "length must be an int"),
                         ((10, 100, 100), r"reward.overlong_buffer=100 \(buffer\) must lie"),
                         ((10, 100, -1), r"overlong_buffer=-1 \(buffer\) must lie in \[0, rollout.max_tokens=100\)"),
                         ((True, 100, 20), "length must be an int")]:
        with pytest.raises(ValueError, match=needle):
            overlong_penalty(*args)


def test_driver_shaping_adds_the_penalty_only_when_configured():
    from omegaconf import OmegaConf

    from rlrepro.orchestration.driver import shaped_penalties

    cfg = OmegaConf.create({"reward": {"overlong_buffer": 0, "overlong_penalty_factor": 1.0},
                            "rollout": {"max_tokens": 16}})
    assert shaped_penalties([3, 16], cfg) is None
    cfg.reward.overlong_buffer = 4
    cfg.reward.overlong_penalty_factor = 2.0
    assert shaped_penalties([3, 12, 14, 16], cfg) == [0.0, 0.0, -1.0, -2.0]
