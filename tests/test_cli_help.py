"""``rlrepro --help`` is plain usage text; ``rlrepro recipes`` gives one line of description per recipe."""
import pytest

import rlrepro.cli as cli

COMMANDS = ("train", "diff", "verify", "show", "plot", "generate", "export", "eval", "recipes")


def test_help_is_plain_usage_text_with_one_line_per_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "usage: rlrepro COMMAND [ARGS ...]"
    assert "``" not in out and "::" not in out and not any(line.startswith("    ") for line in lines)
    assert all(len(line) <= 120 for line in lines)
    listed = [line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")]
    assert tuple(listed) == COMMANDS
    for cmd in COMMANDS:
        line = next(x for x in lines if x.startswith(f"  {cmd} "))
        assert len(line.split()) > 2, line                    # a description, not a bare name
    assert cli.main(["-h"]) == 0 and capsys.readouterr().out == out
    assert cli.main([]) == 2 and capsys.readouterr().err == out   # no command: usage on stderr, exit 2


def test_unknown_command_names_all_commands(capsys):
    assert cli.main(["shwo"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'shwo'" in err and all(c in err for c in COMMANDS)


def test_recipes_one_description_line_each(capsys):
    assert cli.main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == cli.list_recipes()
    by_name = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    assert by_name["grpo_qwen3_8b"] == ("GRPO on Qwen3-8B, one 8-GPU node (H200/H100 class), math with a "
                                        "math-verify reward.")
    assert by_name["grpo_tiny"].startswith("The embedded default: ") and by_name["grpo_tiny"].endswith(".")
    assert all(len(line) <= 120 for line in lines)


@pytest.mark.parametrize("header, expected", [
    ("# One sentence. Another one.\n# More text.\n", "One sentence."),
    ("#\n# Wrapped first sentence\n# over two lines. Then more.\n#\n# Second paragraph.\n",
     "Wrapped first sentence over two lines."),
    ("# no sentence end\n#\n# other paragraph.\n", "no sentence end"),
    ("defaults:\n  - rlrepro_schema\n", ""),
])
def test_recipe_description_from_header(tmp_path, monkeypatch, capsys, header, expected):
    (tmp_path / "r.yaml").write_text(header + "recipe: r\n")
    monkeypatch.setattr(cli, "RECIPES_DIR", tmp_path)
    assert cli.recipe_description("r") == expected
    assert cli.main(["recipes"]) == 0
    assert capsys.readouterr().out == f"r  {expected or '(no header comment)'}\n"


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["recipe=grpo_tiny", "--help"]])
def test_train_help_is_usage_text_with_the_recipes(capsys, args):
    # it said "name a recipe" (exit 2), or with a recipe hydra's LexerNoViableAltException
    assert cli.main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlrepro train recipe=NAME [key=value ...] [--cfg]\n")
    listed = [line.split()[0] for line in out.split("recipes (rlrepro recipes):\n")[1].splitlines()[:-1]]
    assert listed == cli.list_recipes()


def test_an_unknown_key_gets_no_advice_to_add_it(capsys):
    # hydra suggests "+train.stepz=3", which the schema refuses in turn; the close keys are named instead
    assert cli.main(["train", "recipe=grpo_tiny", "train.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "To append" not in err and "+train.stepz" not in err and "close: train.steps" in err
