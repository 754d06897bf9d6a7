"""A directory written by datasets' save_to_disk used to be read as data: its metadata .json files were taken for
rows, and the error suggested a wrong fix (``data.prompt_field=citation``). Now it is refused with the export."""
import json

import pytest

from rlrepro.data import load_records


def _save(tmp_path, dict_=True):
    import datasets

    train = datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": ["1", "2"]})
    out = tmp_path / "saved"
    if dict_:
        test = datasets.Dataset.from_dict({"prompt": ["c"], "answer": ["3"]})
        datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(out))
    else:
        train.save_to_disk(str(out))
    return out


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_saved_dataset_dict_is_refused_with_the_export(tmp_path, split):
    out = _save(tmp_path)
    with pytest.raises(ValueError) as e:
        load_records(str(out), split=split)
    msg = str(e.value)
    assert "save_to_disk" in msg and "citation" not in msg
    assert f"datasets.load_from_disk('{out}')['{split}'].to_parquet('{split}.parquet')" in msg
    assert f"data.source={split}.parquet" in msg


def test_one_split_folder_and_a_metadata_file_are_refused_too(tmp_path):
    out = _save(tmp_path)
    for source in (out / "train", out / "train" / "state.json", out / "dataset_dict.json"):
        with pytest.raises(ValueError, match=r"save_to_disk .*load_from_disk\('" + str(out)):
            load_records(str(source))


def test_a_saved_dataset_is_refused(tmp_path):
    out = _save(tmp_path, dict_=False)
    with pytest.raises(ValueError, match=r"save_to_disk .*load_from_disk\('" + str(out) + r"'\)\.to_parquet"):
        load_records(str(out))


def test_a_saved_dataset_deeper_in_a_directory_is_refused(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    _save(tmp_path / "more")
    with pytest.raises(ValueError, match="save_to_disk"):
        load_records(str(tmp_path))


def test_its_export_loads_and_plain_directories_are_unchanged(tmp_path):
    import datasets

    out = _save(tmp_path)
    datasets.load_from_disk(str(out))["train"].to_parquet(str(tmp_path / "train.parquet"))
    recs, _ = load_records(str(tmp_path / "train.parquet"))
    assert [(r.uid, r.prompt, r.answer) for r in recs] == [("train.parquet:0", "a", "1"), ("train.parquet:1", "b", "2")]
    # a directory with a file named state.json but no Arrow files is not a saved data set: loaded as before
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    (plain / "state.json").write_text(json.dumps({"prompt": "c", "answer": "3"}))
    first, second = load_records(str(plain))[0], load_records(str(plain))[0]
    assert first == second
    assert [(r.uid, r.prompt) for r in first] == [("plain/train.jsonl:0", "a"), ("plain/train.jsonl:1", "b")]
    # a hidden folder is ignored by the loader, so a saved data set there changes nothing
    _save(plain / ".cache")
    assert load_records(str(plain))[0] == first
