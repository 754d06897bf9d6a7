"""Session 34: defects a demanding new user found in the data pipeline and the run directory (CPU).

1. A folder of data beside run directories (``data.source=.`` in a project with ``runs/``) read the files those runs
   wrote that are not in RUN_FOLDERS: each run's ``data/synthetic_<task>.jsonl`` was silently mixed into the
   training data (the warning even said the runs' records were left out), and ``base_model/config.json`` (or an
   ``export/step_N/`` model) ended the load with "the prompt field 'prompt' is not in the data set; fields that
   exist: ['architectures', ...]. Fix: set data.prompt_field=architectures".
2. A parquet file with no rows (a valid file: an empty shard of a sharded export) was refused as "datasets could
   not read this parquet file ... Fix: rewrite it with pyarrow/pandas as a valid parquet file", and a directory
   holding one beside non-empty shards could not be loaded at all; an empty .jsonl is an empty file, no rows.
3. ``rlrepro plot RUN`` of a run that has not finished a step (an empty ``metrics.jsonl``) wrote seven empty
   PNGs and exited 0 without a word.
"""
import json

import pytest

from rlrepro.data.loading import load_records


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _fake_run(run, *, base_model=True, export=True):
    """The files ``rlrepro train`` writes for a grpo_tiny run (data.source null, model.init tiny)."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: grpo_tiny\n")
    _jsonl(run / "metrics.jsonl", [{"step": 1, "rollout/reward_mean": 0.0}])
    _jsonl(run / "fingerprints.jsonl", [{"step": 1, "format": "rlrepro.fingerprint.v1"}])
    (run / "inputs.json").write_text(json.dumps({"format": "rlrepro.inputs.v1"}))
    _jsonl(run / "data" / "synthetic_first_letter.jsonl",
           [{"id": f"first_letter-s0:{i}", "prompt": f"first: ab{i}=", "answer": "a", "kind": "first_letter"}
            for i in range(3)])
    model_config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}
    if base_model:
        (run / "base_model").mkdir()
        (run / "base_model" / "config.json").write_text(json.dumps(model_config))
        (run / "base_model" / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
        (run / "base_model" / "manifest.json").write_text(json.dumps({"format": "rlrepro-base-model"}))
    if export:
        (run / "export" / "step_000001").mkdir(parents=True)
        (run / "export" / "step_000001" / "config.json").write_text(json.dumps(model_config))
    return run


def _mine(proj):
    _jsonl(proj / "mine.jsonl", [{"prompt": "what is 1+1?", "answer": "2"}, {"prompt": "and 2+2?", "answer": "4"}])


# ----------------------------------------------------------------------- 1. a folder with run directories in it


def test_a_runs_synthetic_data_file_is_not_mixed_into_a_folder_of_data(tmp_path):
    proj = tmp_path / "proj"
    _mine(proj)
    _fake_run(proj / "runs" / "r1", base_model=False, export=False)  # a synthetic run from a pretrained model
    records, stats = load_records(str(proj))
    assert [r.uid for r in records] == ["proj/mine.jsonl:0", "proj/mine.jsonl:1"]
    assert [f["path"] for f in stats.files] == [str((proj / "mine.jsonl").resolve())]


def test_a_runs_model_directories_are_not_read_as_data_of_a_folder(tmp_path):
    proj = tmp_path / "proj"
    _mine(proj)
    _fake_run(proj / "runs" / "r1")
    (proj / "runs" / "r1" / "base_model.tmp-123-abc").mkdir()  # left by a killed start
    (proj / "runs" / "r1" / "base_model.tmp-123-abc" / "config.json").write_text('{"hidden_size": 64}')
    records, _ = load_records(str(proj))
    assert [r.prompt for r in records] == ["what is 1+1?", "and 2+2?"]


def test_a_folder_holding_only_runs_with_models_and_synthetic_data_is_refused(tmp_path):
    _fake_run(tmp_path / "runs" / "r1")
    with pytest.raises(ValueError, match=r"is a folder of rlrepro run directories .* holds no data files"):
        load_records(str(tmp_path / "runs"))


def test_a_runs_base_model_named_as_the_source_is_refused_as_a_record_of_the_run(tmp_path):
    run = _fake_run(tmp_path / "r1")
    for source in (run / "base_model", run / "base_model" / "config.json", run / "export" / "step_000001"):
        with pytest.raises(ValueError) as e:
            load_records(str(source))
        msg = str(e.value)
        assert f"of the records of the rlrepro run directory {run.resolve()}" in msg, msg
        assert "data.prompt_field" not in msg


def test_a_runs_synthetic_data_file_named_directly_still_loads(tmp_path):
    run = _fake_run(tmp_path / "r1")
    records, _ = load_records(str(run / "data" / "synthetic_first_letter.jsonl"), id_field="id")
    assert [r.uid for r in records] == ["first_letter-s0:0", "first_letter-s0:1", "first_letter-s0:2"]
    records, _ = load_records(str(run / "data"), id_field="id")  # its data/ folder, named
    assert len(records) == 3


# ---------------------------------------------------------------------------------------- 2. an empty parquet


def _parquet(path, prompts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": pa.array(prompts, pa.string()),
                             "answer": pa.array(["a"] * len(prompts), pa.string())}), path)


def test_an_empty_parquet_shard_beside_others_is_no_rows_not_an_error(tmp_path):
    d = tmp_path / "ds"
    _parquet(d / "train-00000-of-00002.parquet", ["p0", "p1"])
    _parquet(d / "train-00001-of-00002.parquet", [])
    records, stats = load_records(str(d))
    assert [r.prompt for r in records] == ["p0", "p1"]
    assert [f["num_rows"] for f in stats.files] == [2, 0]
    assert any("train-00001-of-00002.parquet" in w and "no rows" in w for w in stats.warnings)


def test_an_empty_parquet_file_is_refused_as_empty_like_an_empty_jsonl(tmp_path):
    _parquet(tmp_path / "e.parquet", [])
    (tmp_path / "e.jsonl").write_text("")
    messages = []
    for name in ("e.parquet", "e.jsonl"):
        with pytest.raises(ValueError) as e:
            load_records(str(tmp_path / name))
        messages.append(str(e.value))
    assert all("no records loaded" in m and "0 rows read" in m for m in messages), messages
    assert "rewrite it" not in messages[0]


def test_a_damaged_parquet_file_is_still_named_as_unreadable(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(ValueError, match=r"bad.parquet: datasets could not read this parquet file"):
        load_records(str(tmp_path / "bad.parquet"))


# -------------------------------------------------------------------------------- 3. plot of a run without steps


def test_plot_of_a_run_with_no_step_yet_says_so_and_writes_nothing(tmp_path, capsys):
    from rlrepro.repro.plot import main_plot

    run = _fake_run(tmp_path / "r1", base_model=False, export=False)
    (run / "metrics.jsonl").write_text("")
    out = tmp_path / "plots"
    assert main_plot([str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no step recorded" in err and str(run) in err, err
    assert not out.exists() or not any(out.iterdir())


def test_plot_of_a_run_with_no_step_beside_one_with_steps_draws_the_other(tmp_path, capsys):
    from rlrepro.repro.plot import main_plot

    a = _fake_run(tmp_path / "a", base_model=False, export=False)
    b = _fake_run(tmp_path / "b", base_model=False, export=False)
    (b / "metrics.jsonl").write_text("")
    out = tmp_path / "plots"
    assert main_plot([str(a), str(b), "--out", str(out), "--no-divergence"]) == 0
    err = capsys.readouterr().err
    assert "no step recorded" in err and str(b) in err, err
    assert (out / "overview.png").is_file()


# ------------------------------------------------------------- 4. a folder inside a run given for the run


@pytest.mark.parametrize("inner", ["rollouts", "checkpoints", "checkpoints/step_000002", "base_model"])
def test_show_and_plot_of_a_folder_inside_a_run_name_the_run_directory(tmp_path, capsys, inner):
    from rlrepro.repro.plot import main_plot
    from rlrepro.repro.show import main_show

    run = _fake_run(tmp_path / "r1")
    (run / "rollouts").mkdir()
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    folder = run / inner
    assert main_show([str(folder)]) == 2
    err = capsys.readouterr().err
    step = " --step 2" if inner.endswith("step_000002") else ""
    assert f"is inside the run directory {run.resolve()}" in err and f"rlrepro show {run.resolve()}{step}" in err, err
    assert main_plot([str(folder), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert f"is inside the run directory {run.resolve()}" in err and f"rlrepro plot {run.resolve()}\n" in err, err


def test_export_of_a_checkpoint_directory_names_the_run_and_the_step(tmp_path):
    from rlrepro.repro.records import missing_run_dir

    run = _fake_run(tmp_path / "r1")
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    msg = missing_run_dir("export", run / "checkpoints" / "step_000002", need_config=False)
    assert msg is not None and msg.endswith(f"give the run directory: rlrepro export {run.resolve()} --step 2 OUT")
    assert missing_run_dir("export", run, need_config=False) is None  # the run itself is one
    verify_run = run / "verify" / "from_1"  # a run directory of its own inside a run
    _fake_run(verify_run, base_model=False, export=False)
    assert missing_run_dir("show", verify_run, need_config=False) is None


def test_a_folder_beside_a_project_config_yaml_is_not_called_inside_a_run(tmp_path):
    from rlrepro.repro.records import missing_run_dir

    (tmp_path / "config.yaml").write_text("a: 1\n")  # a hydra project, not a run: no metrics or fingerprints
    (tmp_path / "notarun").mkdir()
    assert missing_run_dir("verify", tmp_path / "notarun") == (
        f"{tmp_path / 'notarun'} is not a run directory (no config.yaml); give the directory a training wrote "
        "(its run.dir)")


@pytest.mark.parametrize("with_config", [False, True])
def test_a_run_being_started_inside_the_data_folder_is_left_out(tmp_path, with_config):
    """data.source=. with run.dir=runs/x: while the run loads its data it holds its .lock and base_model/ (the
    driver writes config.yaml after the data loaded), no record yet; its base_model/config.json ended the load with
    a wrong data.prompt_field fix."""
    proj = tmp_path / "proj"
    _mine(proj)
    run = proj / "runs" / "x"
    (run / "base_model").mkdir(parents=True)
    if with_config:
        (run / "config.yaml").write_text("recipe: grpo_tiny\n")
    (run / ".lock").write_text("")
    (run / "base_model" / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (run / "base_model" / "manifest.json").write_text(json.dumps({"format": "rlrepro-base-model"}))
    _jsonl(run / "data" / "synthetic_first_letter.jsonl", [{"id": "s:0", "prompt": "first: ab=", "answer": "a"}])
    records, stats = load_records(str(proj))
    assert [r.uid for r in records] == ["proj/mine.jsonl:0", "proj/mine.jsonl:1"]
    assert len(stats.files) == 1


def test_source_files_leave_out_the_runs_inside_a_data_folder(tmp_path):
    """inputs.json's data.files (the driver's digest list, ``source_files``) left in the runs inside a data folder:
    a run started there (run.dir=proj/runs/x) found its own .lock and checkpoints "changed" at its resume, which
    was refused; every start hashed the runs' checkpoints. A folder without runs keeps every file (any type)."""
    from rlrepro.data.sources import source_files

    proj = tmp_path / "proj"
    _mine(proj)
    (proj / "README.md").write_text("about the data\n")
    plain = source_files(proj)
    assert plain == [proj / "README.md", proj / "mine.jsonl"]
    run = proj / "runs" / "x"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "step_000001" / "model.safetensors").write_bytes(b"\0" * 64)
    (run / "base_model").mkdir()
    (run / "base_model" / "manifest.json").write_text("{}")
    (run / ".lock").write_text("")
    (run / "config.yaml").write_text("recipe: grpo_tiny\n")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "inputs.json").write_text("{}")
    _jsonl(run / "data" / "synthetic_first_letter.jsonl", [{"id": "s:0", "prompt": "first: ab=", "answer": "a"}])
    assert source_files(proj) == plain
    assert source_files(proj / "mine.jsonl") == [proj / "mine.jsonl"]
    assert source_files(tmp_path / "nothing") == []


@pytest.mark.slow
def test_a_run_inside_its_data_folder_resumes(tmp_path):
    """End to end (about 20 s): data.source=proj with run.dir=proj/runs/x, one step, then run.resume=true to step
    2. The resume was refused: "data file .lock changed ... checkpoints/... is in B only" (the digest list held the
    run's own files)."""
    from _cli_run import run_cli

    proj = tmp_path / "proj"
    _jsonl(proj / "mine.jsonl", [{"prompt": "ab=", "answer": "a"}, {"prompt": "cd=", "answer": "c"}])
    args = ["train", "recipe=grpo_tiny", f"data.source={proj}", f"run.dir={proj / 'runs' / 'x'}", "checkpoint.every=1",
            "rollout.prompts_per_step=2", "train.warmup_steps=0"]
    first = run_cli(args + ["train.steps=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(args + ["train.steps=2", "run.resume=true"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (proj / "runs" / "x" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
