"""What a resume checks before Ray starts (no Ray: the actor group is a stub), and what it may change.

* a checkpoint of another data size (or without the batches generated ahead that rollout.max_staleness needs) is
  refused before the actors, the warm start and the checkpoint load, and the "resume amends" lines are printed only
  once the resume is accepted;
* a data set that differs from the one inputs.json recorded is refused; any other input that differs is said on
  stderr whatever logger.progress is, and recorded in inputs.json's ``resumes``;
* a checkpoint of another format version is neither skipped (then replaced by the re-executed step) nor pruned;
* checkpoint.export_hf and repro.* may change on a resume (they cannot change a bit)."""
import json
from pathlib import Path

import pytest
import torch

from rlrepro.cli import compose_config
from rlrepro.data import EpochOrder
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import preflight
from rlrepro.orchestration.config import ConfigError
from rlrepro.orchestration.errors import RunFailed
from rlrepro.orchestration.resume import reconcile_resume
from rlrepro.trainer import checkpoint as ckpt_mod
from rlrepro.trainer.checkpoint import save_checkpoint, scan_checkpoints
from _stub_actors import NoRay, StubActors

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=3", "train.warmup_steps=0", "logger.progress=false", "data.max_prompt_tokens=24"]


def small_checkpoint(root: Path, step: int, data_order: dict, **extra) -> Path:
    model = torch.nn.Linear(4, 3)
    state = {"step": step, "data_order": data_order, "recipe": "grpo_tiny", **extra}
    return save_checkpoint(root, step, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                           extra_state=state)


def write_data(path: Path, answers: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"first: {a}b=", "answer": a}) + "\n" for a in answers))
    return path


def recorded_run(tmp_path: Path, monkeypatch, *extra) -> tuple[Path, list[str], dict]:
    """A run directory as a first start leaves it: config.yaml, inputs.json, two steps of metrics; returns the run,
    its arguments and the data order of its prompts."""
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)
    run = tmp_path / "run"
    data = write_data(tmp_path / "d.jsonl", list("abcdabcd"))
    args = [*COMMON, f"run.dir={run}", f"data.source={data}", *extra]
    d = driver_mod.GRPODriver(compose_config(args))
    d.setup()
    d._record_inputs("ab" * 32)
    order = d.order.state_dict()
    d.close()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    return run, args, order


def files(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


# ------------------------------------------------------------------------------------- data order (before Ray)
def test_a_checkpoint_of_another_data_size_is_refused_before_ray(tmp_path, monkeypatch, capsys):
    run, args, order = recorded_run(tmp_path, monkeypatch)
    small_checkpoint(run / "checkpoints", 2, dict(order, num_items=order["num_items"] + 1))
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoRay)
    before = files(run)
    cfg = compose_config([*args, "run.resume=true", "logger.progress=true"])
    with pytest.raises(ConfigError) as e:  # before: refused in restore(), after Ray, warm start and loading
        driver_mod.GRPODriver(cfg, override_keys=["run.resume", "logger.progress"]).run()
    msg = str(e.value)
    assert "step_000002" in msg and "num_items=9 but this order has num_items=8" in msg and "run.dir" in msg
    assert "resume amends" not in capsys.readouterr().err  # said only once the resume is accepted
    assert files(run) == before


def test_a_checkpoint_without_the_batches_generated_ahead_is_refused_before_ray(tmp_path, monkeypatch):
    run, args, order = recorded_run(tmp_path, monkeypatch, "rollout.max_staleness=1")
    small_checkpoint(run / "checkpoints", 2, order, pending={})
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoRay)
    with pytest.raises(ConfigError, match=r"steps \[\], not the rollout.max_staleness=1 batches after step 2"):
        driver_mod.GRPODriver(compose_config([*args, "run.resume=true"])).run()


def test_an_accepted_resume_says_its_amendments(tmp_path, monkeypatch, capsys):
    run, args, order = recorded_run(tmp_path, monkeypatch)
    small_checkpoint(run / "checkpoints", 2, order)  # a step left to run (a finished run keeps its values)
    cfg = compose_config([*args, "run.resume=true", "logger.progress=true"])
    with pytest.raises(RunFailed, match="step 3 failed"):  # the stub actors generate nothing: the amendment is
        driver_mod.GRPODriver(cfg, override_keys=["run.resume", "logger.progress"]).run()  # said before the step
    assert "resume amends logger.progress: False -> True from step 3" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- inputs.json
def test_a_resume_on_a_changed_data_set_is_refused_before_ray(tmp_path, monkeypatch):
    run, args, order = recorded_run(tmp_path, monkeypatch)
    small_checkpoint(run / "checkpoints", 2, order)
    write_data(tmp_path / "d.jsonl", list("abcdabcc"))  # one answer changed: same row count, same data order
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoRay)
    before = files(run)
    with pytest.raises(ConfigError) as e:  # before: a warning hidden by logger.progress=false, exit 0
        driver_mod.GRPODriver(compose_config([*args, "run.resume=true"])).run()
    msg = str(e.value)
    assert "data file d.jsonl changed" in msg and "data records differ" in msg, msg
    assert "put the recorded data back" in msg and "another run.dir" in msg
    assert files(run) == before


def test_other_changed_inputs_are_said_and_recorded(tmp_path, monkeypatch, capsys):
    run, args, order = recorded_run(tmp_path, monkeypatch)
    small_checkpoint(run / "checkpoints", 2, order)  # step 3 of 3 left to run
    first = json.loads((run / "inputs.json").read_text())
    monkeypatch.setenv("RLREPRO_TEST_KNOB", "1")  # an environment knob that can change bits
    with pytest.raises(RunFailed, match="step 3 failed"):  # the stub actors generate nothing: the inputs are
        driver_mod.GRPODriver(compose_config([*args, "run.resume=true"])).run()  # recorded before the step
    err = capsys.readouterr().err
    assert "resuming at step 3 with other inputs than the run recorded" in err and "RLREPRO_TEST_KNOB" in err
    now = json.loads((run / "inputs.json").read_text())
    assert {k: v for k, v in now.items() if k != "resumes"} == first  # the first start's record stays
    (resume,) = now["resumes"]
    assert resume["from_step"] == 3
    knob = [d for d in resume["differences"] if d["key"] == "RLREPRO_TEST_KNOB"]
    assert knob == [{"what": "env", "key": "RLREPRO_TEST_KNOB", "a": None, "b": "1", "bits": True,
                     "message": "RLREPRO_TEST_KNOB differs: unset vs '1'"}]


def test_a_resume_with_no_step_left_records_no_inputs(tmp_path, monkeypatch, capsys):
    # before: the checkpoint of the last step (3 of 3) still appended a resumes entry "from step 4" with this
    # invocation's inputs, a step that never runs; rlrepro diff RUN RUN then said the inputs differ
    run, args, order = recorded_run(tmp_path, monkeypatch)
    small_checkpoint(run / "checkpoints", 3, order)
    before = (run / "inputs.json").read_bytes()
    monkeypatch.setenv("RLREPRO_TEST_KNOB", "1")  # an environment knob that can change bits
    assert driver_mod.GRPODriver(compose_config([*args, "run.resume=true"])).run() == []
    assert "other inputs than the run recorded" not in capsys.readouterr().err
    assert (run / "inputs.json").read_bytes() == before


# ------------------------------------------------------------------------------------- checkpoint versions
def _set_version(ckpt: Path, version) -> None:
    m = json.loads((ckpt / "manifest.json").read_text())
    m["version"] = version
    (ckpt / "manifest.json").write_text(json.dumps(m))


def test_a_checkpoint_of_another_version_is_refused_not_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    order = EpochOrder(8, seed=0).state_dict()
    small_checkpoint(root, 2, order)
    three = small_checkpoint(root, 3, order)
    _set_version(three, 2)
    before = files(root)
    said = []
    with pytest.raises(ConfigError) as e:  # before: skipped as damaged, then replaced by the re-executed step 3
        preflight.resume_checkpoint(root, said.append)
    msg = str(e.value)
    assert str(three) in msg and "format version 2" in msg and f"writes and reads version {ckpt_mod.VERSION}" in msg
    assert "another run.dir" in msg and files(root) == before
    assert [problem for step, _, problem in scan_checkpoints(root) if step == 3][0].count("version 2") == 1


def test_a_checkpoint_of_another_version_is_never_replaced_or_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    order = EpochOrder(8, seed=0).state_dict()
    one = small_checkpoint(root, 1, order)
    three = small_checkpoint(root, 3, order)
    _set_version(one, 2)
    _set_version(three, 2)
    before = files(root)
    with pytest.raises(ckpt_mod.CheckpointVersionError, match="format version 2"):
        small_checkpoint(root, 3, order)
    small_checkpoint(root, 4, order)
    ckpt_mod.save_checkpoint(root, 5, model=torch.nn.Linear(4, 3), extra_state={"step": 5}, keep_last=1)
    assert all(files(root)[p] == b for p, b in before.items())  # both still there, byte for byte
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000003", "step_000005"]


# ------------------------------------------------------------------------------------- bit-neutral keys
def test_export_hf_and_repro_keys_may_change_on_a_resume():
    recorded = {"checkpoint": {"export_hf": False, "every": 1}, "repro": {"ignore_keys": []}, "train": {"lr": 0.1}}
    requested = {"checkpoint": {"export_hf": True, "every": 1}, "repro": {"ignore_keys": ["eval.*"]},
                 "train": {"lr": 0.1}}
    config, amendments = reconcile_resume(recorded, requested, completed_step=2)
    assert config == requested
    assert amendments == [{"key": "checkpoint.export_hf", "old": False, "new": True, "from_step": 3},
                          {"key": "repro.ignore_keys", "old": [], "new": ["eval.*"], "from_step": 3}]
    with pytest.raises(ConfigError, match="train.lr"):  # a key that can change bits still cannot
        reconcile_resume(recorded, dict(requested, train={"lr": 0.2}), completed_step=2)
