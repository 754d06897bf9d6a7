"""Review fixes in the reward layer (rlrepro/data/rewards.py, math_cost.py): each test failed before its fix."""
import subprocess
import sys
import textwrap

import pytest

from rlrepro.data import PromptRecord, load_reward_fn

pytest.importorskip("math_verify")

# Two threads score their first math answers at once, and the second reads math-verify's parser just after the
# first has wrapped it, before the first has finished installing: what a thread switch at that moment does.
_RACE = textwrap.dedent("""
    import threading, types
    import latex2sympy2_extended.latex2sympy2
    from math_verify import parser
    from rlrepro.data import PromptRecord, math_reward
    from rlrepro.data.math_cost import parse_guarded
    from rlrepro.data.rewards import MathReward

    written, second_read, readers = threading.Event(), threading.Event(), []

    class Slow(types.ModuleType):
        def __getattribute__(self, name):
            if name == "parse_latex_cached":
                readers.append(1)
                if len(readers) > 1:
                    written.wait(2)
                    second_read.set()
            return super().__getattribute__(name)

        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "parse_expr_cached":
                written.set()
                second_read.wait(2)  # with the install under a lock, the second thread reads nothing: go on

    parser.__class__ = Slow
    threads = [threading.Thread(target=parse_guarded, args=("$1$", MathReward())) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    parser.__class__ = types.ModuleType
    # weight 21 per unparseable candidate: 63 of the 96 allowed once, 126 when every string is charged twice
    completion = "We get $2$" + " and $(((((($" * 3
    print(math_reward(completion, PromptRecord(uid="u", prompt="q", answer="2")))
""")


def test_parser_hooks_install_once_when_threads_race():
    out = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1.0"


async def _async_reward(completion, record):
    return 1.0


def _generator_reward(completion, record):
    yield 1.0


class _AsyncCall:
    async def __call__(self, completion, record):
        return 1.0


_async_instance = _AsyncCall()


@pytest.mark.parametrize("name, kind", [("_async_reward", "async"), ("_generator_reward", "generator"),
                                        ("_async_instance", "async")])
def test_async_or_generator_reward_refused_at_load(name, kind):
    with pytest.raises(ValueError, match=rf"reward.fn='{__name__}:{name}' is an? {kind} function.*Fix: "):
        load_reward_fn(f"{__name__}:{name}")


def test_plain_reward_still_loads():
    fn = load_reward_fn(f"{__name__}:_plain")
    assert fn("x", PromptRecord(uid="u", prompt="q", answer="x")) == 1.0


def _plain(completion, record):
    return 1.0
