"""run.overwrite=true deletes only what rlrepro wrote into the run directory (issue 22, item 4), and symbolic links
there are never followed, with a log that says what is done with them (item 9).

The attack: a data set kept inside the run directory (``RUN/data/mine.jsonl``) was deleted by run.overwrite=true,
and the run then failed for want of it."""
import json
from pathlib import Path

import pytest

from rlrepro.cli import compose_config
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import preflight
from rlrepro.orchestration.config import ConfigError

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=1", "train.warmup_steps=0", "logger.progress=false", "data.max_prompt_tokens=24"]
RECORDS = ["config.yaml", "metrics.jsonl", "fingerprints.jsonl", "inputs.json", "amendments.jsonl"]


class Reached(Exception):
    pass


class StubActors:
    def __init__(self, *a, **k):
        raise Reached


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)


def old_run(run: Path) -> None:
    """A run directory as rlrepro leaves it, plus the user's own files among rlrepro's."""
    for name in RECORDS:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(json.dumps({"step": 1}) + "\n")
    for d in ("rollouts", "checkpoints/step_000001", "checkpoints/step_000002.tmp-7", "base_model", "verify/from_1",
              "data", "plots", "wandb/offline-run-1"):
        (run / d).mkdir(parents=True, exist_ok=True)
    (run / "rollouts" / "step_000001.jsonl.gz").write_bytes(b"\x1f\x8b")
    (run / "checkpoints" / "step_000001" / "manifest.json").write_text("{}")
    (run / "base_model" / "config.json").write_text("{}")
    (run / "verify" / "from_1" / "metrics.jsonl").write_text("")
    (run / "data" / "synthetic_first_letter.jsonl").write_text("{}\n")
    (run / "plots" / "loss.png").write_bytes(b"png")
    (run / "export" / "step_000001").mkdir(parents=True)
    (run / "export" / "step_000001" / "config.json").write_text("{}")
    (run / "summary.json").write_text("{}")
    (run / "summary.txt").write_text("summary")
    # the user's
    (run / "notes.txt").write_text("mine")
    (run / "data" / "mine.jsonl").write_text(json.dumps({"prompt": "first: abc=", "answer": "a"}) + "\n")
    (run / "rollouts" / "README").write_text("mine too")


def everything(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.name != ".lock"}


def overwrite(run: Path, *extra):
    cfg = driver_mod.to_schema(compose_config([*COMMON, f"run.dir={run}", "run.overwrite=true", *extra]))
    preflight.check_run_dir(cfg, run, fresh=True)


def test_overwrite_deletes_exactly_the_files_rlrepro_wrote(tmp_path, capsys):
    run = tmp_path / "run"
    old_run(run)
    overwrite(run)
    assert everything(run) == {"notes.txt", "data/mine.jsonl", "rollouts/README", "plots/loss.png"}
    assert (run / "wandb" / "offline-run-1").is_dir()
    for gone in ("checkpoints", "base_model", "verify", "export"):
        assert not (run / gone).exists()
    err = capsys.readouterr().err
    # counted, and named up to five: the 7 records, rollouts/step_000001.jsonl.gz and data/synthetic_*.jsonl are
    # the files; checkpoints/step_000001, checkpoints/step_000002.tmp-7, verify/from_1, export/step_000001 and
    # base_model the directories
    assert f"run.overwrite=true: deleting the run in {run}: 9 files and 5 directories: config.yaml, metrics.jsonl, " \
           "fingerprints.jsonl, inputs.json, amendments.jsonl and 9 more\n" in err
    assert "kept" in err and "README" in err  # rollouts/ stays: it holds a file rlrepro did not write


def test_overwrite_of_a_long_run_counts_the_deleted_files_and_names_only_the_first_few(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    for step in range(1, 301):
        (run / "rollouts" / f"step_{step:06d}.jsonl.gz").write_bytes(b"\x1f\x8b")
        if step % 10 == 0:
            (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    overwrite(run)
    assert everything(run) == set() and not (run / "rollouts").exists() and not (run / "checkpoints").exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if "deleting the run" in line]
    assert len(lines) == 1 and len(lines[0]) < 300 + len(str(run))
    assert lines[0].endswith(f"deleting the run in {run}: 301 files and 30 directories: metrics.jsonl, "
                             "rollouts/step_000001.jsonl.gz, rollouts/step_000002.jsonl.gz, "
                             "rollouts/step_000003.jsonl.gz, rollouts/step_000004.jsonl.gz and 326 more")


def test_overwrite_keeps_a_folder_of_foreign_files_and_counts_them(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    for i in range(11):
        (run / "rollouts" / f"mine_{i:02d}.txt").write_text("not rlrepro's")
    overwrite(run)
    assert len(list((run / "rollouts").iterdir())) == 11
    kept = [line for line in capsys.readouterr().err.splitlines() if "kept" in line]
    assert kept == [f"rlrepro: run.overwrite=true: kept {run / 'rollouts'}, which holds 11 entries rlrepro did not write: "
                    + ", ".join(f"mine_{i:02d}.txt" for i in range(8)) + " and 3 more"], kept


def test_describe_deletions_counts_in_words(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "d").mkdir()
    describe = preflight.describe_deletions
    assert describe([], tmp_path) == "nothing"
    assert describe([tmp_path / "a.txt"], tmp_path) == "1 file: a.txt"
    assert describe([tmp_path / "d"], tmp_path) == "1 directory: d"
    assert describe([tmp_path / "a.txt", tmp_path / "d"], tmp_path, shown=2) == "1 file and 1 directory: a.txt, d"
    assert describe([tmp_path / "a.txt", tmp_path / "d"], tmp_path, shown=1) == "1 file and 1 directory: a.txt " \
                                                                                 "and 1 more"


def test_overwrite_keeps_a_data_set_inside_the_run_directory_and_the_run_uses_it(tmp_path):
    run = tmp_path / "run"
    old_run(run)
    mine = run / "data" / "mine.jsonl"
    before = mine.read_bytes()
    cfg = compose_config([*COMMON, f"run.dir={run}", "run.overwrite=true", f"data.source={mine}",
                          "data.template='{prompt}'"])
    with pytest.raises(Reached):  # every set-up check passed, the data set included
        driver_mod.GRPODriver(cfg).run()
    assert mine.read_bytes() == before and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("key,where", [("model.path", "checkpoints/step_000001"),
                                       ("data.source", "data/synthetic_first_letter.jsonl"),
                                       ("data.source", "rollouts/step_000001.jsonl.gz")])
def test_overwrite_refuses_to_delete_an_input_of_the_run(tmp_path, key, where):
    run = tmp_path / "run"
    old_run(run)
    before = everything(run)
    cfg = driver_mod.to_schema(compose_config([*COMMON, f"run.dir={run}", "run.overwrite=true"]))
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, str(run / where))
    with pytest.raises(ConfigError, match=rf"would delete .*{where.split('/')[0]}.*{key}=.*lies inside it"):
        preflight.check_run_dir(cfg, run, fresh=True)
    assert everything(run) == before


def test_overwrite_refuses_to_delete_through_a_symbolic_link(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "big_disk" / "checkpoints"
    old_run(run)
    for d in (run / "checkpoints").iterdir():
        (elsewhere / d.name).mkdir(parents=True)
    import shutil

    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(elsewhere)
    before = everything(run)
    with pytest.raises(ConfigError, match="symbolic link.*never deletes through a link"):
        overwrite(run)
    assert everything(run) == before and sorted(p.name for p in elsewhere.iterdir()) == ["step_000001",
                                                                                        "step_000002.tmp-7"]


def test_a_symlink_named_like_a_partial_checkpoint_is_left_and_the_log_says_so(tmp_path):
    root, target = tmp_path / "checkpoints", tmp_path / "precious"
    (root / "step_000002.tmp-11").mkdir(parents=True)
    target.mkdir()
    (target / "data.bin").write_bytes(b"keep")
    (root / "step_000003.tmp-12").symlink_to(target)
    said = []
    preflight.remove_partial_checkpoints(root, said.append)
    assert not (root / "step_000002.tmp-11").exists() and (root / "step_000003.tmp-12").is_symlink()
    assert (target / "data.bin").read_bytes() == b"keep"
    removing = [s for s in said if "removing" in s]
    assert len(removing) == 1 and "step_000002.tmp-11" in removing[0]
    leaving = [s for s in said if "step_000003.tmp-12" in s]
    assert len(leaving) == 1 and "leaving" in leaving[0] and "symbolic link" in leaving[0]
    assert str(target) in leaving[0]


def test_a_fresh_run_refuses_a_directory_with_only_damaged_checkpoints(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)  # no manifest: not usable, still the run's
    cfg = driver_mod.to_schema(compose_config([*COMMON, f"run.dir={run}"]))
    with pytest.raises(ConfigError, match="already holds a run .*1 damaged checkpoint directories"):
        preflight.check_run_dir(cfg, run, fresh=True)
