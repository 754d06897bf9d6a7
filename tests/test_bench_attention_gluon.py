"""The Gluon forward's benchmark (``benchmarks/bench_attention_gluon.py``) on the CPU: its round-robin summary and the
checks of its arguments before any GPU work (issue #27: calls on the lent GPUs drift by 5-15 %, so a comparison
times every kernel once a round and takes each round's own FA3 ratio)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_attention_gluon",
                                                  os.path.join(ROOT, "benchmarks", "bench_attention_gluon.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summarise_takes_medians_and_each_rounds_ratio(monkeypatch):
    b = _bench(monkeypatch)
    # a machine 20 % slower in the second round: each round's own ratio is 0.8 for "a" and 0.5 for "b"
    rounds = [{"a": 1.0, "b": 1.6, "FA3": 0.8}, {"a": 1.2, "b": 1.92, "FA3": 0.96}, {"a": 1.1, "b": 1.76, "FA3": 0.88}]
    got = b.summarise(rounds)
    assert list(got) == ["a", "b", "FA3"]
    ms, spread, ratio = got["a"]
    assert ms == 1.1 and spread == pytest.approx(0.2 / 1.1) and ratio == pytest.approx(0.8)
    assert got["b"][0] == 1.76 and got["b"][2] == pytest.approx(0.5)
    assert got["FA3"][2] == 1.0
    # an even count: the middle two averaged; without FA3 no ratio
    two = b.summarise([{"a": 1.0}, {"a": 3.0}])
    assert two == {"a": (2.0, 1.0, None)}


def test_bad_arguments_fail_before_any_work(monkeypatch, capsys):
    b = _bench(monkeypatch)
    for argv, words in ((["--rounds", "0"], "--rounds: 0 is not a positive count"),
                        (["--data", "random,flat"], "--data: ['flat'] not among random, sink, rising")):
        monkeypatch.setattr(sys, "argv", ["bench_attention_gluon.py", *argv])
        with pytest.raises(SystemExit, match=words.replace("[", r"\[").replace("]", r"\]")):
            b.main()
