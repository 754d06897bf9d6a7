"""A new user's natural mistakes in naming the recipe: one line (exit 2) that names the form to use."""
import pytest

from rlrepro.cli import main


@pytest.mark.parametrize("args", [["grpo_tiny"], ["recipe", "grpo_tiny"], ["--recipe", "grpo_tiny"],
                                  ["--recipe=grpo_tiny"], ["--recipe=grpo_tiny", "train.steps=3"]])
def test_recipe_named_in_another_form_says_recipe_equals(capsys, args):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "rlrepro train recipe=grpo_tiny" in err and "available:" in err


def test_no_recipe_at_all_still_lists_them(capsys):
    assert main(["train", "train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert "name a recipe: rlrepro train recipe=NAME" in err and "grpo_tiny_tool" in err


def test_recipe_in_other_case_is_suggested(capsys):
    assert main(["train", "recipe=GRPO_TINY"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'GRPO_TINY' (did you mean grpo_tiny?)" in err
