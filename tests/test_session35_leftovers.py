"""Session 35 leftovers.

* rlrepro diff leaves out a resume entry of inputs.json whose step never ran (a resume of a finished run, which
  older rlrepro recorded: the driver no longer does, tests/test_resume_preflight.py), and says so in a note;
* the megatron TP loader checks its dtype as load_pretrained does (one helper, checkpoint_io.load_dtype);
* README's "Command line" usage lines list every option of every subcommand's --help."""
import re
from pathlib import Path

import pytest
import torch

import rlrepro.cli as cli
from rlrepro.model import load_pretrained, write_tiny_checkpoint
from rlrepro.repro.diff import diff_runs, main_diff
from rlrepro.repro.inputs import read_inputs, write_inputs
from rlrepro.trainer.megatron.model import TPQwen3ForCausalLM
from rlrepro.trainer.megatron.parallel import ParallelGroups, single_process_groups
from test_repro_diff import make_run
from test_repro_inputs import collect, env, setup  # noqa: F401 (fixtures)

COMMANDS = ("train", "diff", "verify", "show", "plot", "generate", "export", "eval", "recipes")
README = Path(__file__).resolve().parents[1] / "README.md"


# ------------------------------------------------------------------------------------- diff: resumes that ran
def _resumed(run: Path, from_step: int, env, model, data) -> None:
    """A resume at ``from_step`` with an environment knob that can change bits set (unset at the first start)."""
    from rlrepro.orchestration.resume_checks import record_resumed_inputs
    env.setenv("RLREPRO_ATTENTION_BWD", "torch")
    record_resumed_inputs(run, read_inputs(run), collect(model, data), from_step, say=lambda _: None)
    env.delenv("RLREPRO_ATTENTION_BWD")


def test_diff_leaves_out_a_resume_that_ran_no_step(tmp_path, env, setup, capsys):  # noqa: F811
    # before: a resume of a finished run (4 of 4 steps) recorded "from step 5"; diff RUN RUN said the inputs
    # differ and --strict-inputs exited 1, although no recorded step ran with them
    model, data = setup
    a = make_run(tmp_path / "a", steps=4)
    write_inputs(a, collect(model, data))
    _resumed(a, 5, env, model, data)
    rep = diff_runs(a, a)
    assert rep.input_diffs == [] and rep.verdict == "identical"
    assert ("run A: its resume at step 5 ran no step (the run's last fingerprinted step is 4): the inputs it "
            "recorded are not compared") in rep.notes
    assert main_diff([str(a), str(a), "--strict-inputs"]) == 0
    capsys.readouterr()


def test_diff_still_names_a_resume_that_ran_a_step(tmp_path, env, setup):  # noqa: F811
    model, data = setup
    a = make_run(tmp_path / "a", steps=4)
    write_inputs(a, collect(model, data))
    _resumed(a, 4, env, model, data)
    _resumed(a, 5, env, model, data)
    rep = diff_runs(a, a)
    # the step-4 resume, once as run A and once as run B; the step-5 one is left out
    assert [(d.key, d.bits) for d in rep.input_diffs] == [("RLREPRO_ATTENTION_BWD", True)] * 2
    assert all(d.message.startswith("run A resumed at step 4") or d.message.startswith("run B resumed at step 4")
               for d in rep.input_diffs)
    assert main_diff([str(a), str(a), "--strict-inputs"]) == 1


# ------------------------------------------------------------------------------------- megatron loader dtype
GROUPS = {"tp1": single_process_groups, "tp2rank1": lambda: ParallelGroups(None, None, 1, 2, 0, 1)}


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("bad", [torch.float64, "float64", torch.int8, "fp8"])
def test_tp_from_pretrained_refuses_a_dtype_load_pretrained_refuses(tmp_path, groups, bad):
    # before: torch.float64 loaded a float64 model, and a string failed inside torch's .to()
    d = write_tiny_checkpoint(tmp_path / "m")
    msg = f"dtype={bad!r} is not one of None, 'auto', float32, float16, bfloat16"
    for load in (lambda: TPQwen3ForCausalLM.from_pretrained(d, GROUPS[groups](), dtype=bad),
                 lambda: load_pretrained(d, dtype=bad)):
        with pytest.raises(ValueError) as e:
            load()
        assert str(e.value) == msg


@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_tp_from_pretrained_takes_a_dtype_name_as_load_pretrained_does(tmp_path, groups):
    from rlrepro.model.checkpoint_io import load_dtype
    d = write_tiny_checkpoint(tmp_path / "m")
    for name, dtype in (("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), (None, torch.float32)):
        assert load_dtype(name) == (dtype if name is not None else None)
        tp = TPQwen3ForCausalLM.from_pretrained(d, GROUPS[groups](), dtype=name)
        assert {p.dtype for p in tp.parameters()} == {dtype} == {load_pretrained(d, dtype=name).dtype}


# ------------------------------------------------------------------------------------- README usage lines
def _readme_usage() -> dict[str, set[str]]:
    """Each command's options named in README's "Command line" block (its lines and their comment lines)."""
    text = README.read_text().split("## Command line", 1)[1].split("```")[1]
    out: dict[str, set[str]] = {}
    cmd = None
    for line in text.splitlines():
        m = re.match(r"rlrepro (\w+)", line)
        if m:
            cmd = m.group(1)
        if cmd is not None:
            out.setdefault(cmd, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
    return out


def _help_options(cmd: str, capsys) -> set[str]:
    try:
        rc = cli.main([cmd, "--help"])
    except SystemExit as e:  # argparse's --help
        rc = e.code
    assert rc in (0, None), cmd
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out)) - {"--help"}


def test_readme_usage_lines_name_every_option_of_every_command(capsys):
    # before: diff lacked --no-detail; plot --no-divergence, --wandb, --project; generate --base, --temperature,
    # --seed, --device; eval --records (in a comment only)
    usage = _readme_usage()
    assert set(usage) == set(COMMANDS)
    for cmd in COMMANDS:
        assert usage[cmd] == _help_options(cmd, capsys), cmd
