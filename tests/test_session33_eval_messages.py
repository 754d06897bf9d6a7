"""Session 33: a data problem met through evaluation (``rlrepro eval RUN --source FILE``, a run's ``eval.source``,
eval during training) names the key the user controls there (``--source``, ``eval.source``, ``eval.prompt_field``,
...) with the fix text of the data layer; training's messages keep naming ``data.*``."""
from __future__ import annotations

import json
import logging

import pytest
from omegaconf import OmegaConf

from rlrepro.checks import ConfigError
from rlrepro.data import load_records


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, data=None, **eval_keys):
    from rlrepro.orchestration.config import validate

    (tmp_path / "model").mkdir(exist_ok=True)
    return validate({"model": {"path": str(tmp_path / "model")}, "data": data or {}, "eval": eval_keys})


def _eval_error(cfg, flag=False) -> str:
    from rlrepro.orchestration.evaluation import load_eval_prompts

    with pytest.raises(ConfigError) as e:
        load_eval_prompts(cfg, None, flag=flag)
    return str(e.value)


# ------------------------------------------------------------------- eval during training (eval.source)
def test_a_missing_prompt_field_names_eval_prompt_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "held.jsonl", [{"q": "a", "answer": "1"}])
    fix = "Fix: set {k}.prompt_field=<one of those>, e.g. {k}.prompt_field=q."
    err = _eval_error(_cfg(tmp_path, source="held.jsonl"))
    assert err == ("eval.source='held.jsonl': held.jsonl: the prompt field 'prompt' is not in the data set; fields "
                   "that exist: ['q', 'answer']. " + fix.format(k="eval"))
    with pytest.raises(ValueError) as e:  # training's message is as it was
        load_records("held.jsonl")
    assert str(e.value).endswith(fix.format(k="data")) and "eval." not in str(e.value)


def test_a_missing_answer_field_names_eval_answer_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "held.jsonl", [{"prompt": "a", "answer": "1"}])
    err = _eval_error(_cfg(tmp_path, source="held.jsonl", answer_field="solution"))
    assert err.endswith("the answer field 'solution' is not in the data set; fields that exist: ['prompt', "
                        "'answer']. Fix: set eval.answer_field=<one of those>, e.g. eval.answer_field=answer.")


def test_a_wrong_split_names_eval_split(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "held" / "test.jsonl", [{"prompt": "a", "answer": "1"}])
    err = _eval_error(_cfg(tmp_path, source="held"))
    assert err == ("eval.source='held': held: no files for split 'train'; splits found: ['test']; files: "
                   "['test.jsonl']. Fix: set eval.split=<one of the splits found>.")


def test_a_bad_answer_value_keeps_the_data_key_that_applies_to_eval(tmp_path, monkeypatch):
    # data.on_bad_row applies to eval as it is (there is no eval.on_bad_row): its fix stays data.on_bad_row; the
    # bad answer field of the fix is named as eval reads it
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "held.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "1", "id": "x"},
                                    {"prompt": "c", "answer": "2", "id": "x"}])
    err = _eval_error(_cfg(tmp_path, source="held.jsonl", id_field="id"))
    assert err.endswith("line 1: field 'id': the value is missing (null or absent). Fix: give every row a non-empty "
                        "text id in 'id', or set data.on_bad_row=skip to leave such rows out (each one is logged).")
    # a duplicate uid: a null eval.id_field takes data.id_field, so the fix names both
    (tmp_path / "held.jsonl").write_text(json.dumps({"prompt": "b", "answer": "1", "id": "x"}) + "\n"
                                         + json.dumps({"prompt": "c", "answer": "2", "id": "x"}) + "\n")
    err = _eval_error(_cfg(tmp_path, source="held.jsonl", id_field="id"))
    assert err.endswith("Fix: make the 'id' column unique, or set eval.id_field=null and data.id_field=null to use "
                        "'<source>:<row index>' uids.")


def test_an_empty_file_names_eval_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "held.jsonl").write_text("")
    err = _eval_error(_cfg(tmp_path, source="held.jsonl"))
    assert err == ("eval.source='held.jsonl': no records loaded from eval.source='held.jsonl' (eval.split=train): "
                   "0 rows read, 0 skipped. Fix: check eval.source, eval.split and the field names "
                   "(eval.prompt_field, eval.answer_field, eval.messages_field).")


def test_runs_left_out_of_an_eval_source_are_logged_under_eval_source(tmp_path, monkeypatch, caplog):
    from rlrepro.orchestration.evaluation import load_eval_prompts

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "held" / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    write(run / "metrics.jsonl", [{"step": 1}])
    write(tmp_path / "held" / "data.jsonl", [{"prompt": "a", "answer": "1"}])

    with caplog.at_level(logging.WARNING):
        load_eval_prompts(_cfg(tmp_path, data={"use_chat_template": False}, source="held"), Tok())
    assert "eval.source=held: left out the records of 1 run directory in it (held/runs/a)" in caplog.text
    assert "data.source=" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_records("held")  # training's warning is as it was
    assert "data.source=held: left out the records of 1 run directory" in caplog.text


class Tok:  # enough of a tokenizer for plain-text prompts
    unk_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_template_and_system_prompt_messages_name_eval_keys(tmp_path, monkeypatch):
    from rlrepro.orchestration.evaluation import load_eval_prompts

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "held.jsonl", [{"prompt": "a", "answer": "1"}])
    plain = {"use_chat_template": False}
    with pytest.raises(ConfigError) as e:
        load_eval_prompts(_cfg(tmp_path, data=plain, source="held.jsonl", template="{x}"), Tok(), flag=True)
    assert str(e.value) == ("--source held.jsonl: eval.template='{x}' uses the fields ['x']; only {prompt} is filled "
                            "in. Fix: write literal braces doubled in eval.template ({{ and }}), e.g. \\boxed{{}}.")
    with pytest.raises(ConfigError) as e:  # data.use_chat_template applies as it is; a null eval key takes data's
        load_eval_prompts(_cfg(tmp_path, data=plain, source="held.jsonl", system_prompt="hi"), Tok())
    assert str(e.value) == ("eval.source='held.jsonl': eval.system_prompt needs data.use_chat_template=true, and it "
                            "is false. Fix: set data.use_chat_template=true, or set eval.system_prompt=null and "
                            "data.system_prompt=null and put the text in eval.template "
                            "(e.g. 'You are ...\\n{prompt}').")


# -------------------------------------------------------------------------------- rlrepro eval --source FILE
def _eval_run(tmp_path, monkeypatch, eval_source=None, **eval_keys):
    """A run directory with a (fake) checkpoint, as tests/test_session32_data_eval.py builds it; the model's
    loaders are stubbed: the data fails before any model is needed."""
    from rlrepro.model import checkpoint_io, model_dirs
    from rlrepro.orchestration import export, preflight
    import rlrepro.model as model

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    cfg = OmegaConf.to_container(OmegaConf.structured(_cfg(tmp_path)))
    cfg["eval"].update(source=eval_source, **eval_keys)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    monkeypatch.setattr(export, "checkpoint_of", lambda run_dir, step: run / "checkpoints" / "step_000002")
    monkeypatch.setattr(model_dirs, "checkpoint_base", lambda ckpt, run_dir: tmp_path / "model")
    monkeypatch.setattr(model, "load_tokenizer", lambda base: type("Tok", (), {"eos_token_id": None})())
    monkeypatch.setattr(preflight, "check_end_of_turn", lambda cfg, tok, base: None)
    monkeypatch.setattr(checkpoint_io, "check_pretrained", lambda base: None)
    monkeypatch.chdir(tmp_path)
    return run


def _main_eval_error(capsys, *argv) -> str:
    from rlrepro.orchestration.evaluation import main_eval

    assert main_eval(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_eval_source_option_names_itself_and_the_eval_field(tmp_path, monkeypatch, capsys):
    run = _eval_run(tmp_path, monkeypatch)
    f = write(tmp_path / "held.jsonl", [{"q": "a", "answer": "1"}])
    err = _main_eval_error(capsys, str(run), "--source", "held.jsonl")
    assert err == (f"rlrepro eval: --source {f}: {f}: the prompt field 'prompt' is not in the data set; fields that "
                   "exist: ['q', 'answer']. Fix: set eval.prompt_field=<one of those>, e.g. eval.prompt_field=q.")


def test_eval_source_option_of_an_empty_file(tmp_path, monkeypatch, capsys):
    run = _eval_run(tmp_path, monkeypatch)
    f = tmp_path / "held.jsonl"
    f.write_text("")
    err = _main_eval_error(capsys, str(run), "--source", "held.jsonl")
    assert err == (f"rlrepro eval: --source {f}: no records loaded from --source {f} (eval.split=train): 0 rows "
                   "read, 0 skipped. Fix: check --source, eval.split and the field names (eval.prompt_field, "
                   "eval.answer_field, eval.messages_field).")


def test_eval_source_option_of_a_run_directory(tmp_path, monkeypatch, capsys):
    run = _eval_run(tmp_path, monkeypatch)
    write(run / "metrics.jsonl", [{"step": 2}])
    err = _main_eval_error(capsys, str(run), "--source", "run")
    assert err == (f"rlrepro eval: --source {run}: --source {run} is a run directory that rlrepro train wrote "
                   "(config.yaml, metrics.jsonl, checkpoints/, ...): its files are the run's records, not data. "
                   "Fix: point --source at your data set: a .jsonl/.json/.parquet file with a prompt and an answer "
                   "per row, or a directory of them.")


def test_the_runs_own_eval_source_names_eval_keys(tmp_path, monkeypatch, capsys):
    write(tmp_path / "held" / "test.jsonl", [{"prompt": "a", "answer": "1"}])
    run = _eval_run(tmp_path, monkeypatch, eval_source=str(tmp_path / "held"), split="dev")
    err = _main_eval_error(capsys, str(run))
    held = tmp_path / "held"
    assert err == (f"rlrepro eval: eval.source={str(held)!r}: {held}: no files for split 'dev'; splits "
                   "found: ['test']; files: ['test.jsonl']. Fix: set eval.split=<one of the splits found>.")
