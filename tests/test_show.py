"""``rlrepro show RUN [--step K] [--n 8]``: a recorded step's samples as text."""
import pytest
from omegaconf import OmegaConf

from rlrepro.cli import main
from rlrepro.model import load_tokenizer, write_tiny_checkpoint
from rlrepro.repro.records import MetricsWriter, RolloutWriter
from rlrepro.repro.show import show_step
from rlrepro.samples import Sample, Turn


def sample(i, text=True, **kw):
    base = dict(prompt_uid=f"q{i // 2}", sample_index=i % 2, prompt_token_ids=[10, 11, 12 + i // 2],
                completion_token_ids=[20 + i, 21], rollout_logprobs=[-0.5, -0.25], finish_reason="stop",
                reward=float(i % 2), advantage=0.5 - (i % 2),
                prompt_text=f"first: ab{i // 2}=" if text else None, completion_text=f"a{i}" if text else None)
    base.update(kw)
    return Sample(**base)


def make_run(path, steps=(1, 2, 3), n=10, text=True, config=None):
    path.mkdir(parents=True)
    if config is not None:
        OmegaConf.save(OmegaConf.create(config), path / "config.yaml")
    rw, mw = RolloutWriter(path), MetricsWriter(path)
    for step in steps:
        samples = [sample(i, text=text) for i in range(n)]
        samples[0].completion_text = f"step {step}" if text else None
        rw.write(step, samples if text else [s.to_record() for s in samples])
        mw.write({"step": step, "rollout/reward_mean": 0.5, "train/loss": 0.125 * step})
    return path


def test_show_last_step_with_recorded_text(tmp_path, capsys):
    run = make_run(tmp_path / "a")
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{run}  step 3: 10 sample(s), showing 8 in key order (prompt_uid, sample_index)"
    assert "metrics: reward mean 0.5 | loss 0.375" in out and "text: as recorded by the run" in out
    assert "[0] prompt_uid 'q0'  sample_index 0" in out and "[7] prompt_uid 'q3'  sample_index 1" in out
    assert "[8]" not in out
    assert "reward 1.0   advantage -0.5   finish stop   length 2 tokens (prompt 3)" in out
    assert "      | first: ab0=" in out and "      | step 3" in out and "      | a7" in out
    assert main(["show", str(run), "--step", "1", "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 1: 10 sample(s), showing 2" in out and "| step 1" in out and "[2]" not in out
    assert main(["show", str(run), "--n", "0"]) == 0
    assert "[9] prompt_uid 'q4'" in capsys.readouterr().out


def test_show_decodes_with_the_runs_tokenizer_or_prints_ids(tmp_path):
    tiny = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    tok = load_tokenizer(tiny)
    run = make_run(tmp_path / "old", steps=(4,), n=2, text=False, config={"model": {"path": str(tiny)}})
    rw = RolloutWriter(run)
    rw.write(4, [sample(0, text=False, prompt_token_ids=tok.encode("first: cabd="),
                        completion_token_ids=tok.encode("c\nd"), rollout_logprobs=[-0.5] * 3)])
    out = show_step(run)
    assert f"text: decoded with the tokenizer in {tiny}" in out
    assert "      | first: cabd=\n    completion:\n      | c\n      | d" in out
    bare = make_run(tmp_path / "bare", steps=(1,), n=1, text=False)
    out = show_step(bare)
    assert "text: token ids: no tokenizer found (looked in " in out
    assert "      | token ids: 10 11 12" in out and "      | token ids: 20 21" in out


def test_show_turns_and_control_characters(tmp_path):
    run = tmp_path / "mt"
    turns = [Turn("policy", [1, 2], "call calc(2+2)"), Turn("tool", [3], "4"), Turn("policy", [4], "\x1b[2J=4")]
    RolloutWriter(run).write(1, [sample(0, turns=turns, completion_token_ids=[1, 2, 3, 4],
                                        rollout_logprobs=[-0.1] * 4, loss_mask=[1, 1, 0, 1], completion_text="",
                                        advantage=2 / 3, reward=None)])
    out = show_step(run)
    assert "reward -   advantage 0.666667   finish stop   length 4 tokens" in out
    assert "turns (3):" in out and "completion:" not in out
    assert "      1. policy, 2 tokens:\n        | call calc(2+2)" in out
    assert "      2. tool, 1 tokens:\n        | 4" in out
    assert "\x1b" not in out and "| \\x1b[2J=4" in out


@pytest.mark.parametrize("args, message", [
    (["missing"], "run directory {tmp}/missing not found; give the directory a training wrote (its run.dir, e.g. "
                  "`rlrepro show runs/NAME`)"),
    (["norollout"], "run directory {tmp}/norollout not found; give the directory a training wrote (its run.dir, "
                    "e.g. `rlrepro show runs/NAME`); did you mean {tmp}/norollouts?"),
    (["a", "--step", "7"], "{tmp}/a has no rollout file for step 7; steps with rollouts: 1-3, 5"),
    (["norollouts"], "{tmp}/norollouts has no rollout files (rollouts/step_NNNNNN.jsonl.gz): it was run with "
                     "run.save_rollouts=false"),
    (["plain"], "{tmp}/plain is not a run directory"),
    (["a", "--n", "-1"], "--n -1: give a number of samples >= 1, or 0 for all of them"),
])
def test_show_errors_name_what_exists(tmp_path, capsys, args, message):
    make_run(tmp_path / "a", steps=(1, 2, 3, 5), n=2)
    (tmp_path / "plain").mkdir()
    MetricsWriter(tmp_path / "norollouts").write({"step": 1})
    argv = [str(tmp_path / args[0])] + args[1:]
    assert main(["show"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlrepro show: error: ") and message.format(tmp=tmp_path) in err


def test_show_given_a_file_of_the_run_names_the_run_directory(tmp_path, capsys):
    run = make_run(tmp_path / "a", steps=(1,), n=2, config={"model": {"path": None}})
    assert main(["show", str(run / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == (f"rlrepro show: error: {run / 'config.yaml'} is a file, not a run directory; its run directory "
                   f"is {run}: rlrepro show {run}\n")
    assert "not found" not in err
    assert main(["show", str(run / "rollouts" / "step_000001.jsonl.gz")]) == 2
    assert f"its run directory is {run}" in capsys.readouterr().err
    (tmp_path / "loose.txt").write_text("x")
    assert main(["show", str(tmp_path / "loose.txt")]) == 2
    assert capsys.readouterr().err == (f"rlrepro show: error: {tmp_path / 'loose.txt'} is a file, not a run "
                                       "directory; give the directory a training wrote (its run.dir)\n")
