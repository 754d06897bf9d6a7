"""A new user's mistakes on the command line (session 32): each is one line naming the value and the fix, exit 2,
before any work (in-process, composition only: seconds)."""
from __future__ import annotations

import pytest

import rlrepro.cli as cli


def _train_error(capsys, *args: str) -> str:
    assert cli.main(["train", "recipe=grpo_tiny", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("args, fix", [
    (["--steps", "3"], "train.steps=3"),            # argparse habit: hydra's lexer said "token recognition error"
    (["--train.steps=3"], "train.steps=3"),         # was: "quote the value for hydra: --train.steps='3'" (wrong)
    (["--steps=3"], "train.steps=3"),
    (["--lr", "0.1"], "train.lr=0.1"),
    (["train.steps", "3"], "train.steps=3"),        # was: "'train.steps' is not KEY=VALUE (missing EQUAL ...)"
    (["train.steps", "=", "3"], "train.steps=3"),
    (["train.steps = 3"], "train.steps=3"),         # was: "quote the value for hydra: train.steps =' 3'" (wrong)
])
def test_train_option_forms_name_the_key_value_form(capsys, args, fix):
    err = _train_error(capsys, *args)
    assert (f": {fix}." in err or f": one of {fix}, " in err) and "KEY=VALUE" in err, err  # train.* first
    assert "token recognition" not in err, err


@pytest.mark.parametrize("args, fix", [
    (["--temperature", "0.7"], "one of rollout.temperature=0.7, eval.temperature=0.7."),  # not eval's alone
    (["--seed", "1"], "one of run.seed=1, data.synthetic.seed=1, warm_start.seed=1."),
    (["--resume"], "run.resume=true."),                     # a bare flag of a boolean key
    (["--cfg=job"], "--cfg takes no value here"),            # hydra's form
    (["--max_response_length", "64"], ": rollout.max_tokens=64."),  # verl's spelling: the CLI's alias table
])
def test_train_option_hints_name_every_key_of_that_name(capsys, args, fix):
    err = _train_error(capsys, *args)
    assert fix in err, err


def test_train_config_flag_points_to_cfg(capsys):
    err = _train_error(capsys, "--config")
    assert "'--config'" in err and "--cfg" in err, err


def test_train_recipe_flag_forms_still_name_recipe_form(capsys):
    for args in (["--recipe", "grpo_tiny"], ["--recipe=grpo_tiny"]):
        assert cli.main(["train", *args]) == 2
        assert "rlrepro train recipe=grpo_tiny" in capsys.readouterr().err


def test_quoted_value_with_spaced_equals_still_composes(capsys):
    assert cli.main(["train", "recipe=grpo_tiny", "data.template='a = {prompt}'", "--cfg"]) == 0
    assert "template: a = {prompt}" in capsys.readouterr().out


def test_unknown_command_suggests_the_close_one(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian' (did you mean train?)" in err, err
    assert cli.main(["xyz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_unknown_option_without_a_close_key_says_so(capsys):
    err = _train_error(capsys, "--multirun")
    assert "'--multirun' is not an option of rlrepro train" in err and "KEY=VALUE" in err, err
