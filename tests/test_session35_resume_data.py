"""A resume of a run recorded before data folders' hidden files were left out of ``data.files`` (its inputs.json
lists ``.gitattributes``): the unchanged hidden file is not a changed data set; a changed data file still is."""
import json

import pytest

from rlrepro.checks import ConfigError
from rlrepro.data.sources import source_files
from rlrepro.orchestration.resume_checks import check_inputs, record_resumed_inputs
from rlrepro.repro.inputs import collect_inputs, read_inputs, write_inputs


def _inputs(files, model_dir):
    return collect_inputs(data_files=files, records_digest="r", data_revision=None, model_dir=model_dir,
                          weights_digest="w", environ={})


@pytest.fixture
def old_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    (data / ".gitattributes").write_text("*.jsonl filter=lfs\n")
    model, run = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    run.mkdir()
    old_list = sorted(p for p in data.rglob("*") if p.is_file())  # the list before source_files: hidden files in
    write_inputs(run, _inputs(old_list, model))
    return data, model, run


def test_an_unchanged_hidden_file_of_an_old_record_does_not_refuse_the_resume(old_run):
    data, model, run = old_run
    now = _inputs(source_files(data), model)
    assert ".gitattributes" in read_inputs(run)["data"]["files"] and ".gitattributes" not in now["data"]["files"]
    check_inputs(run, now)  # refused before: "data file .gitattributes is in A only"
    before = (run / "inputs.json").read_bytes()
    said = []
    assert record_resumed_inputs(run, read_inputs(run), now, 3, say=said.append) == [] and said == []
    assert (run / "inputs.json").read_bytes() == before


def test_a_changed_or_removed_file_is_still_another_data_set(old_run):
    data, model, run = old_run
    (data / ".gitattributes").write_text("changed\n")
    with pytest.raises(ConfigError, match=r"data file \.gitattributes is in A only"):
        check_inputs(run, _inputs(source_files(data), model))
    (data / ".gitattributes").unlink()
    with pytest.raises(ConfigError, match=r"data file \.gitattributes is in A only"):
        check_inputs(run, _inputs(source_files(data), model))
    (data / "train.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"data file train\.jsonl changed"):
        check_inputs(run, _inputs(sorted(p for p in data.rglob("*") if p.is_file()), model))
