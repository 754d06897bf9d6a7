"""Session 32: data-loading messages read cleanly, run directories are not data, and rlrepro eval / verify name
their own options (--source, --step, --from-step)."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from rlrepro.data import load_records


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------- 1. clean messages
def test_data_messages_have_no_parenthesised_argument_fragments(tmp_path):
    f = write(tmp_path / "d.jsonl", [{"q": "a", "answer": "1"}, {"q": "b", "answer": None}])
    msgs = []
    for kw in (dict(), dict(prompt_field="q"), dict(on_bad_row="ignore"), dict(limit=0), dict(prompt_field=""),
               dict(split="a/b")):
        with pytest.raises(ValueError) as e:
            load_records(str(f) if "split" not in kw else str(tmp_path), **kw)
        msgs.append(str(e.value))
    with pytest.raises(FileNotFoundError) as e:
        load_records(str(tmp_path / "nope.jsonl"))
    msgs.append(str(e.value))
    for m in msgs:
        assert "=)" not in m and "(on_bad_row=" not in m and "(allow_hub=" not in m and "_field)" not in m, m
        assert "(prompt_field" not in m and "(limit)" not in m and "(split" not in m and "Fix: " in m, m
        assert len(m.splitlines()) == 1
    assert msgs[0].endswith("Fix: set data.prompt_field=<one of those>, e.g. data.prompt_field=q.")
    assert msgs[1].endswith("or set data.on_bad_row=skip to leave such rows out (each one is logged).")
    assert msgs[2].startswith("data.on_bad_row='ignore' is not a choice")
    assert msgs[3].startswith("data.limit=0 is not a positive integer")
    assert msgs[4].startswith("data.prompt_field='' is not a column name")
    assert msgs[5].startswith("data.split='a/b' is not a split name")
    assert msgs[6].startswith(f"data.source={str(tmp_path / 'nope.jsonl')!r} does not exist locally")


def test_no_records_message_has_no_empty_dict(tmp_path):
    f = tmp_path / "blank.jsonl"
    f.write_text("\n")
    d = tmp_path / "d"
    write(d / "x.jsonl", [])
    (d / "x.jsonl").write_text("{}\n")
    with pytest.raises(ValueError) as e:
        load_records(str(write(tmp_path / "w.jsonl", [{"prompt": True, "answer": "1"}])), on_bad_row="skip")
    assert str(e.value).startswith("no records loaded from data.source=") and "1 skipped (1 wrong type)" in str(e.value)
    assert "{" not in str(e.value)


# ------------------------------------------------------------------------------ 2. run directories aren't data
def _run(d):
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("run: {}\n")
    write(d / "metrics.jsonl", [{"step": 1, "loss": 0.5}])
    write(d / "amendments.jsonl", [{"key": "eval.every", "from_step": 2}])
    write(d / "checkpoints" / "step_000001" / "manifest.json", [{"step": 1}])
    return d


def test_a_folder_of_runs_is_refused_as_not_data(tmp_path):
    _run(tmp_path / "runs" / "a")
    with pytest.raises(ValueError) as e:
        load_records(str(tmp_path / "runs"))
    m = str(e.value)
    assert "is a folder of rlrepro run directories" in m and "not data" in m and "amendments" not in m
    assert "prompt field" not in m and len(m.splitlines()) == 1


@pytest.mark.parametrize("rel", ["runs/a", "runs/a/metrics.jsonl", "runs/a/checkpoints"])
def test_a_run_directory_or_its_records_are_refused(tmp_path, rel):
    _run(tmp_path / "runs" / "a")
    with pytest.raises(ValueError, match=r"^data.source=.*(run directory|records of the rlrepro run).*not data\. Fix"):
        load_records(str(tmp_path / rel))


def test_runs_beside_data_are_left_out(tmp_path, caplog):
    _run(tmp_path / "proj" / "runs" / "b")
    write(tmp_path / "proj" / "data" / "train.jsonl", [{"prompt": "p", "answer": "1"}])
    write(tmp_path / "proj" / "runs" / "b" / "train-held.jsonl", [{"prompt": "h", "answer": "2"}])  # the user's own
    recs, stats = load_records(str(tmp_path / "proj"))
    assert [r.uid for r in recs] == ["proj/data/train.jsonl:0", "proj/runs/b/train-held.jsonl:0"]
    assert "left out the records of 1 run directory" in caplog.text


# ---------------------------------------------------------------------- 3. rlrepro eval names --source
def _eval_run(tmp_path, monkeypatch, eval_source=None):
    from rlrepro.orchestration import export
    from rlrepro.orchestration.config import validate

    (tmp_path / "model").mkdir()
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    cfg = OmegaConf.to_container(OmegaConf.structured(validate({"model": {"path": str(tmp_path / "model")}})))
    cfg["eval"]["source"] = eval_source
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setattr(export, "checkpoint_of", lambda run_dir, step: run / "checkpoints" / "step_000002")
    monkeypatch.chdir(tmp_path)
    return run


def test_eval_without_a_source_names_the_option(tmp_path, monkeypatch, capsys):
    from rlrepro.orchestration.evaluation import main_eval

    run = _eval_run(tmp_path, monkeypatch)
    assert main_eval([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlrepro eval: the run ")
    assert "Fix: give the held-out data: rlrepro eval RUN --source FILE" in err
    assert "set eval.source" not in err and len(err.splitlines()) == 1


def test_eval_with_a_missing_source_names_the_option(tmp_path, monkeypatch, capsys):
    from rlrepro.orchestration.evaluation import main_eval

    run = _eval_run(tmp_path, monkeypatch)
    assert main_eval([str(run), "--source", "nope.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlrepro eval: --source nope.jsonl does not exist") and "eval.source" not in err, err
    assert "Fix: point --source at" in err


# ---------------------------------------------------- 4. a checkpoint directory names the run and the step
def test_eval_and_verify_of_a_checkpoint_name_the_run_and_step(tmp_path, monkeypatch, capsys):
    from rlrepro.orchestration.evaluation import main_eval
    from rlrepro.orchestration.verify import main_verify

    run = _eval_run(tmp_path, monkeypatch)
    ckpt = run / "checkpoints" / "step_000002"
    assert main_eval([str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlrepro eval: {ckpt} is a checkpoint of the run directory {run}, not a run directory; give the "
                   f"run directory with the step: rlrepro eval {run} --step 2")
    assert main_verify([str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"rlrepro verify {run} --from-step 3") and len(err.splitlines()) == 1
    assert main_verify([str(run / "checkpoints")]) == 2
    assert f"give the run directory: rlrepro verify {run} (--from-step picks" in capsys.readouterr().err
