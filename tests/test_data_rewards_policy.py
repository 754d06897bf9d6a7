"""The reward error policy holds whatever a reward function does: returns a value float() cannot convert, exits,
raises a BaseException, or is interrupted (issue 22 item 6a, 6b, 6d)."""
import fractions
import sys
from types import SimpleNamespace

import pytest

from rlrepro.data import PromptRecord, RewardError, compute_rewards, exact_match_reward


def rec(uid):
    return PromptRecord(uid=uid, prompt="q", answer="a")


RECS = [rec("u:0"), rec("u:1"), rec("u:2")]


def returning(value):
    def fn(completion, record):
        return value if record.uid == "u:1" else 0.5
    return fn


class BadFloat(float):
    """A real number whose conversion to float fails."""

    def __float__(self):
        raise ValueError("no float for you")


class ExitingFloat(fractions.Fraction):
    def __float__(self):
        raise SystemExit(4)


@pytest.mark.parametrize("value,problem", [
    (10 ** 400, r"returned an int of 401 digits \(int\), which is not a float in \[0, 1\] \(float\(\) raised "
                r"OverflowError"),
    (10 ** 5000, r"returned an int of 5001 digits"),        # repr() itself would raise beyond 4300 digits
    (-(10 ** 400), r"returned an int of 401 digits"),
    (BadFloat(0.5), r"float\(\) raised ValueError: no float for you"),
    (ExitingFloat(1, 2), r"float\(\) raised SystemExit"),
    (fractions.Fraction(3, 2), r"returned Fraction\(3, 2\) \(Fraction\), outside \[0, 1\]"),
    (2 ** 1000, r"returned an int of 302 digits \(int\), outside \[0, 1\]"),  # float() works, the range fails
], ids=["1e400", "1e5000", "-1e400", "bad-float", "exiting-float", "fraction", "2^1000"])
def test_every_conversion_of_the_value_is_inside_the_policy(value, problem):
    fn = returning(value)
    with pytest.raises(RewardError, match=r"on record uid='u:1' \(item 1\) (returned .*)?" + problem):
        compute_rewards(fn, ["", "", ""], RECS, policy="raise")
    assert compute_rewards(fn, ["", "", ""], RECS, policy="zero") == ([0.5, 0.0, 0.5], 1)


def test_a_value_whose_repr_raises_is_still_named():
    class Hostile:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(RewardError, match=r"returned a Hostile whose repr raised RuntimeError, not a real number"):
        compute_rewards(returning(Hostile()), ["", "", ""], RECS)


def exits(completion, record):
    if record.uid == "u:1":
        sys.exit(3)
    return 1.0


def exits_quietly(completion, record):
    raise SystemExit


class Custom(BaseException):
    pass


def raises_base(completion, record):
    raise Custom("deep")


def test_sys_exit_in_a_reward_is_a_reward_error_naming_the_function():
    with pytest.raises(RewardError, match=r"reward (tests\.)?test_data_rewards_policy:exits raised on record uid='u:1' "
                                          r"\(item 1\): SystemExit \(code 3; a reward must return a number, "
                                          r"not exit\)") as e:
        compute_rewards(exits, ["", "", ""], RECS, policy="raise")
    assert isinstance(e.value.__cause__, SystemExit)
    assert compute_rewards(exits, ["", "", ""], RECS, policy="zero") == ([1.0, 0.0, 1.0], 1)
    assert compute_rewards(exits_quietly, ["", ""], RECS[:2], policy="zero") == ([0.0, 0.0], 2)
    with pytest.raises(RewardError, match=r"raised on record uid='u:0' \(item 0\): Custom: deep"):
        compute_rewards(raises_base, [""], RECS[:1])
    assert compute_rewards(raises_base, [""], RECS[:1], policy="zero") == ([0.0], 1)


def interrupted(completion, record):
    if record.uid == "u:1":
        raise KeyboardInterrupt("signal 15")  # what the driver's SIGTERM handler raises
    return 1.0


def test_an_interrupt_names_the_sample_and_propagates(capsys):
    recs = [rec("u:0"), rec("u:0"), rec("u:1"), rec("u:1")]
    with pytest.raises(KeyboardInterrupt):
        compute_rewards(interrupted, ["", "", "", ""], recs, policy="zero")
    err = capsys.readouterr().err
    assert "interrupted while scoring sample u:1/0 (item 2 of 4) with reward.fn=" in err
    assert err.rstrip().endswith("test_data_rewards_policy:interrupted")
    with pytest.raises(KeyboardInterrupt):
        compute_rewards(interrupted, ["", "", "", ""], recs, policy="raise", sample_indices=[0, 1, 3, 2])
    assert "sample u:1/3 (item 2 of 4)" in capsys.readouterr().err

    def slow_builtin(completion, record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compute_rewards(slow_builtin, [""], [rec("p")])
    assert "sample p/0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 sample indices but 1 records"):
        compute_rewards(exact_match_reward, ["a"], [rec("p")], sample_indices=[0, 1])


def test_a_builtin_is_named_as_reward_fn_spells_it():
    with pytest.raises(RewardError, match=r"reward exact_match raised on record uid='p' \(item 0\): AttributeError"):
        compute_rewards(exact_match_reward, ["a"], [SimpleNamespace(uid="p", answer=None)])


def test_set_up_reports_a_huge_value_as_a_config_error():
    # the driver's pre-flight scores one gold answer under reward.on_error=raise: a ConfigError, no raw traceback
    from rlrepro.orchestration.config import ConfigError
    from rlrepro.orchestration.preflight import check_reward

    cfg = SimpleNamespace(reward=SimpleNamespace(on_error="raise", fn="evil:huge"))
    prompts = [SimpleNamespace(record=rec("u:0"))]
    with pytest.raises(ConfigError, match=r"reward.fn='evil:huge' fails on the gold answer of prompt 'u:0': .*"
                                          r"an int of 401 digits"):
        check_reward(cfg, lambda c, r: 10 ** 400, prompts)
    with pytest.raises(ConfigError, match=r"SystemExit \(code 3"):
        check_reward(cfg, exits, [SimpleNamespace(record=rec("u:1"))])


def test_an_environments_reward_follows_the_same_policy():
    """rlrepro.envs score episodes one at a time through reward_with_policy: the checks and reward.on_error of
    compute_rewards, item by item."""
    from rlrepro.data import reward_with_policy
    from rlrepro.envs import EnvConfig, load_env

    fn = returning(float("nan"))
    assert reward_with_policy(fn, "zero")("x", RECS[1]) == 0.0
    assert reward_with_policy(fn, "zero")("x", RECS[0]) == 0.5
    with pytest.raises(RewardError, match="u:1"):
        reward_with_policy(fn, "raise")("x", RECS[1])
    spec = load_env(EnvConfig(name="single_turn"), reward_with_policy(fn, "zero"))
    env = spec.make(RECS[1], 0)
    env.reset()
    assert env.step("x").reward == 0.0
