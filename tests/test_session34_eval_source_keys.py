"""``rlrepro eval RUN --source FILE eval.KEY=VALUE``: the held-out file read with its own columns. The loader's fix
text ("set eval.prompt_field=q") had no way to be followed through ``rlrepro eval``, which took no keys."""
from __future__ import annotations

import json

import pytest

from test_session33_eval_messages import _eval_run, _main_eval_error, write


def test_a_source_files_columns_are_named_after_it(tmp_path, monkeypatch, capsys):
    """eval.prompt_field=q is applied (the next missing column, the answer's, is what the error names now), and the
    fix it names for the answer can be given the same way."""
    run = _eval_run(tmp_path, monkeypatch)
    f = write(tmp_path / "held.jsonl", [{"q": "a", "sol": "1"}])
    err = _main_eval_error(capsys, str(run), "--source", "held.jsonl", "eval.prompt_field=q")
    assert err == (f"rlrepro eval: --source {f}: {f}: the answer field 'answer' is not in the data set; fields that "
                   "exist: ['q', 'sol']. Fix: set eval.answer_field=<one of those>, e.g. eval.answer_field=sol.")
    # the keys may come before the option too
    assert _main_eval_error(capsys, str(run), "eval.prompt_field=q", "--source", "held.jsonl") == err


@pytest.mark.parametrize("argv,expected", [
    (["eval.prompt_field=q"], "eval.prompt_field=q: these say how to read a --source file; the run's own eval "
                              "reads its eval.source with the keys it recorded. Fix: add --source FILE, or leave "
                              "them out"),
    (["--source", "held.jsonl", "eval.every=3"], "'eval.every=3' is not eval.KEY=VALUE with KEY one of split, "
                                                 "prompt_field, answer_field, id_field, messages_field, template, "
                                                 "system_prompt, limit (how to read the --source file), e.g. "
                                                 "eval.prompt_field=question"),
    (["--source", "held.jsonl", "prompt_field=q"], "'prompt_field=q' is not eval.KEY=VALUE"),
    (["--source", "held.jsonl", "eval.limit=abc"], "eval.limit=abc: eval.limit takes a positive integer (the first "
                                                   "N rows) or null"),
])
def test_keys_that_cannot_apply_are_refused_naming_the_fix(tmp_path, monkeypatch, capsys, argv, expected):
    run = _eval_run(tmp_path, monkeypatch)
    write(tmp_path / "held.jsonl", [{"q": "a", "answer": "1"}])
    err = _main_eval_error(capsys, str(run), *argv)
    assert err.startswith("rlrepro eval: " + expected), err


@pytest.mark.slow
def test_renamed_columns_give_the_same_numbers(tmp_path):
    """End to end (about 30 s): a one-step run, then its checkpoint evaluated on a file with the standard columns
    and on the same rows under other column names with eval.prompt_field / eval.answer_field: equal numbers (==)."""
    from _cli_run import run_cli

    rows = [{"id": f"p{i}", "prompt": p, "answer": p[0]} for i, p in enumerate(["ab=", "cd=", "ef="])]
    write(tmp_path / "std.jsonl", rows)  # with an id field, the ids name the requests (their seeds), not the file
    write(tmp_path / "other.jsonl", [{"key": r["id"], "question": r["prompt"], "solution": r["answer"]}
                                     for r in rows])
    run = tmp_path / "run"
    first = run_cli(["train", "recipe=grpo_tiny", "train.steps=1", "checkpoint.every=1", f"run.dir={run}",
                     "rollout.prompts_per_step=2", "train.warmup_steps=0"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    std = run_cli(["eval", str(run), "--source", str(tmp_path / "std.jsonl"), "eval.id_field=id", "--json"],
                  cwd=tmp_path)
    other = run_cli(["eval", str(run), "--source", str(tmp_path / "other.jsonl"), "eval.prompt_field=question",
                     "eval.answer_field=solution", "eval.id_field=key", "--json"], cwd=tmp_path)
    assert std.returncode == 0 and other.returncode == 0, (std.stderr[-1500:], other.stderr[-1500:])
    a, b = json.loads(std.stdout.strip().splitlines()[-1]), json.loads(other.stdout.strip().splitlines()[-1])
    assert a == b and a["eval/num_prompts"] == 3, (a, b)


@pytest.mark.parametrize("step", [0, -1])
def test_a_step_below_one_names_no_odd_directory(tmp_path, step):
    """``rlrepro eval/export --step -1`` named the path ``checkpoints/step_-00001``."""
    from rlrepro.orchestration.export import checkpoint_of

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: grpo_tiny\n")
    with pytest.raises(ValueError) as e:
        checkpoint_of(run, step)
    assert str(e.value) == f"--step {step}: checkpoints are of steps 1 and up; complete ones of run {run}: none"


def test_a_missing_answer_column_is_not_guessed_as_the_id_column(tmp_path):
    """A file of prompts and ids only: the fix suggested data.answer_field=id (scoring completions against ids)."""
    from rlrepro.data import load_records

    f = write(tmp_path / "held.jsonl", [{"prompt": "ab=", "id": "p0"}])
    with pytest.raises(ValueError) as e:
        load_records(str(f))
    assert str(e.value).endswith("fields that exist: ['prompt', 'id']. Fix: set data.answer_field=<one of those>."), \
        str(e.value)
    g = write(tmp_path / "other.jsonl", [{"prompt": "ab=", "id": "p0", "gold": "a"}])
    with pytest.raises(ValueError, match=r"e\.g\. data\.answer_field=gold\.$"):
        load_records(str(g))
