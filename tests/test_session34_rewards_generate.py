"""Session 34 review: math rewards, user reward functions and `rlrepro generate`, probed as a verl/slime user.

Defects found (each test failed on the code before its fix):

- `rlrepro generate --base DIR` was ignored without a word when there is no --model (the tiny model ran) or when
  --model is an HF directory (its own config.json and tokenizer were used): the user believed DIR was in use.
- `rlrepro generate --max-tokens 0`, `--temperature nan`, `--seed -1` named `SamplingParams.max_tokens` (an
  internal class, not the option typed) and were found only after the model had been built or loaded.
"""
from __future__ import annotations

import logging
import math

import pytest

import rlrepro.model
from rlrepro.cli import main
from rlrepro.data import compute_rewards, math_reward
from rlrepro.data.records import PromptRecord
from rlrepro.model import write_tiny_checkpoint


# ------------------------------------------------------------------------------------------ rlrepro generate

def _no_model_load(monkeypatch):
    """Make building the tiny model or resolving a model directory fail loudly: a bad argument must be refused
    before either."""
    def refuse(*a, **k):
        raise AssertionError("the model was built or loaded before the arguments were checked")
    monkeypatch.setattr(rlrepro.model, "write_tiny_checkpoint", refuse)
    monkeypatch.setattr(rlrepro.model, "resolve_model_dir", refuse)


@pytest.mark.parametrize("argv, flag", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "-5"], "--max-tokens"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2 ** 63)], "--seed"),
])
def test_generate_bad_values_name_the_option_before_any_model_work(monkeypatch, capsys, argv, flag):
    _no_model_load(monkeypatch)
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlrepro generate: ") and flag in err and "SamplingParams" not in err, err
    assert "Traceback" not in err


def test_generate_bad_value_is_refused_before_a_missing_model_dir(monkeypatch, capsys, tmp_path):
    _no_model_load(monkeypatch)
    assert main(["generate", "--model", str(tmp_path / "missing"), "--max-tokens", "-1"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_generate_base_without_model_is_refused(monkeypatch, capsys, tmp_path):
    """Before: exit 0 with the tiny random model, --base never read."""
    _no_model_load(monkeypatch)
    assert main(["generate", "--base", str(tmp_path / "hf"), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--base" in err and "--model" in err and "checkpoint" in err, err


def test_generate_base_with_an_hf_model_dir_is_refused(capsys, tmp_path):
    """Before: exit 0 with the HF directory's own config.json and tokenizer, --base never read."""
    hf = write_tiny_checkpoint(tmp_path / "hf", seed=0)
    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    assert main(["generate", "--model", str(hf), "--base", str(other), "--max-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert "--base" in captured.err and str(hf) in captured.err and captured.out == ""


def test_generate_good_values_still_run_and_repeat_exactly(capsys, tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf", seed=0)
    argv = ["generate", "--model", str(hf), "--temperature", "0.7", "--max-tokens", "5", "--seed", "11",
            "--prompt", "copy: ab=", "--prompt", "12+7="]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first and first.count("->") == 2


def test_generate_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--max-tokens MAX_TOKENS new tokens per prompt", "--seed SEED", "--device DEVICE cpu"):
        assert text in out, (text, out)


# ------------------------------------------------------------------------------------------ math reward (fine)

@pytest.mark.parametrize("gold, completion, want", [
    ("0.5", r"so \boxed{\frac{1}{2}}", 1.0), ("0.5", r"\boxed{1/2}", 1.0), ("1/2", r"\boxed{0.5}", 1.0),
    ("2", r"\boxed{\boxed{2}}", 1.0), ("3", r"first \boxed{2}, finally \boxed{3}", 1.0),
    ("2", r"first \boxed{2}, finally \boxed{3}", 0.0), ("2", r"\boxed{2} then \boxed{}", 0.0),
    ("5", r"\boxed{5\text{ cm}}", 1.0), ("(1,2)", r"\boxed{\left(1,2\right)}", 1.0), ("1000", r"\boxed{1,000}", 1.0),
    ("-3", r"\boxed{-3}", 1.0), ("-3", r"\boxed{3}", 0.0), ("50\\%", r"\boxed{50\%}", 1.0),
    ("2", "\\boxed{2}\nWait, \\boxed{3", 0.0),  # the last \boxed is unclosed: truncated, no answer (documented)
])
def test_math_reward_documented_cases_and_repeatable(gold, completion, want):
    logging.disable(logging.WARNING)
    try:
        record = PromptRecord(uid="u", prompt="p", answer=gold)
        got = [math_reward(completion, record) for _ in range(3)]
    finally:
        logging.disable(logging.NOTSET)
    assert got == [want] * 3


def test_reward_fn_returning_a_tensor_or_nan_is_an_error_naming_the_value():
    torch = pytest.importorskip("torch")
    record = PromptRecord(uid="u", prompt="p", answer="1")
    for value, text in ((torch.tensor(0.5), "Tensor"), (math.nan, "NaN"), (None, "None")):
        def fn(completion, rec, value=value):
            return value
        assert compute_rewards(fn, ["x"], [record], "zero") == ([0.0], 1)
        with pytest.raises(Exception, match=text):
            compute_rewards(fn, ["x"], [record], "raise")
