"""Resuming and checkpoint files (issue 22, items 5 and 8).

A resume names each checkpoint directory it skips and why; when there are checkpoint directories but none is
usable it refuses (exit 2), naming them and the way out, instead of starting over at step 1 and rewriting every
record; a refused resume leaves config.yaml as it was. A full disk during a checkpoint write says "disk full at
PATH"; a checkpoint file that is a pickle with code is refused naming the file, without torch's advice to load it
with weights_only=False."""
import errno
import json
import os
import subprocess
import sys
import textwrap
import traceback
import types
from pathlib import Path

import pytest
import torch

from rlrepro.cli import compose_config, main
from rlrepro.data import EpochOrder
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration import preflight
from rlrepro.orchestration.config import ConfigError
from rlrepro.trainer import checkpoint as ckpt_mod
from rlrepro.trainer.checkpoint import load_checkpoint, save_checkpoint, scan_checkpoints
from _stub_actors import StubActors

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=3", "train.warmup_steps=0", "logger.progress=false", "data.max_prompt_tokens=24"]


def files(root: Path) -> dict:
    """Every file's bytes, the run directory's (empty) lock file aside."""
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


def small_checkpoint(root: Path, step: int, data_order: dict | None = None) -> Path:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    extra = {"step": step, "data_order": data_order or EpochOrder(8, seed=0).state_dict(), "recipe": "grpo_tiny"}
    return save_checkpoint(root, step, model=model, optimizer=opt, extra_state=extra)


# ------------------------------------------------------------------------------------------ which checkpoint
def test_a_resume_names_every_checkpoint_it_skips_and_why(tmp_path):
    root = tmp_path / "checkpoints"
    small_checkpoint(root, 1)
    two = small_checkpoint(root, 2)
    with open(two / "optimizer.pt", "r+b") as f:  # truncated
        f.truncate(10)
    three = small_checkpoint(root, 3)
    (three / "manifest.json").unlink()
    (root / "step_000004").write_text("not a directory")
    said = []
    assert preflight.resume_checkpoint(root, said.append) == str(root / "step_000001")
    assert len(said) == 3
    assert "step_000004" in said[0] and "not a directory" in said[0]
    assert "step_000003" in said[1] and "manifest.json is missing" in said[1]
    assert "step_000002" in said[2] and "optimizer.pt has 10 bytes" in said[2]
    assert [(s, p is None) for s, _, p in scan_checkpoints(root)] == [(4, False), (3, False), (2, False), (1, True)]


def test_a_failed_resave_of_a_step_keeps_the_copy_it_replaces(tmp_path, monkeypatch):
    # saving a step that exists sets the old copy aside first; when the new one cannot be renamed into place the
    # old one is put back, whole and loadable (before: it stayed as step_N.old-PID and a resume started over)
    root = tmp_path / "checkpoints"
    old = small_checkpoint(root, 5)
    before = files(root)
    rename = os.rename

    def failing(src, dst):
        if ".tmp-" in str(src):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return rename(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "rename", failing)
    with pytest.raises(OSError, match="Input/output error"):
        small_checkpoint(root, 5)
    monkeypatch.setattr(ckpt_mod.os, "rename", rename)
    assert sorted(p.name for p in root.iterdir()) == ["step_000005"]
    assert files(root) == before
    assert preflight.resume_checkpoint(root, print) == str(old)


def test_a_save_killed_while_replacing_a_step_is_repaired_before_a_resume(tmp_path):
    # a process killed between the two renames leaves the step only as step_N.old-PID: a resume puts it back;
    # killed after the second rename, the stale copy beside the new step is removed
    root = tmp_path / "checkpoints"
    five = small_checkpoint(root, 5)
    content = files(root)
    os.rename(five, root / "step_000005.old-4242")
    said = []
    assert preflight.resume_checkpoint(root, said.append) == str(five)
    assert files(root) == content and "put back" in said[0] and "step_000005.old-4242" in said[0]
    stale = root / "step_000005.old-77"
    stale.mkdir()
    (stale / "weights.pt").write_bytes(b"older")
    said.clear()
    preflight.remove_partial_checkpoints(root, said.append)
    assert not stale.exists() and files(root) == content and "removed" in said[0]


def test_no_checkpoint_directory_at_all_starts_at_step_one_and_says_so(tmp_path):
    said = []
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_000002.tmp-77").mkdir()  # a write that did not finish is no checkpoint
    assert preflight.resume_checkpoint(tmp_path / "checkpoints", said.append) is None
    assert said == ["run.resume=true but no checkpoint exists yet: starting at step 1"]


def test_checkpoint_directories_none_usable_is_refused_naming_them(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        (small_checkpoint(root, step) / "manifest.json").unlink()
    with pytest.raises(ConfigError) as ei:
        preflight.resume_checkpoint(root, lambda s: None)
    msg = str(ei.value)
    assert "step_000001" in msg and "step_000002" in msg and "none of the 2 checkpoint directories" in msg
    assert "nothing was changed" in msg and "run.overwrite=true" in msg


def recorded_run(tmp_path: Path, *extra) -> tuple[Path, list[str]]:
    run = tmp_path / "run"
    args = [*COMMON, f"run.dir={run}", *extra]
    run.mkdir()
    text = "# recorded by the first run\n" + driver_mod.config_yaml(driver_mod.to_schema(compose_config(args)))
    (run / "config.yaml").write_text(text)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    return run, args


def test_a_resume_with_every_manifest_gone_is_refused_and_changes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)
    run, args = recorded_run(tmp_path)
    for step in (1, 2):
        (small_checkpoint(run / "checkpoints", step) / "manifest.json").unlink()
    before = files(run)
    assert main(["train", *args, "run.resume=true"]) == 2
    err = capsys.readouterr().err
    assert "skipping" in err and "step_000002" in err and "step_000001" in err and "none of the 2" in err
    assert files(run) == before


def test_a_resume_refused_by_the_data_order_leaves_config_yaml_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)
    run, args = recorded_run(tmp_path)
    small_checkpoint(run / "checkpoints", 2, data_order=EpochOrder(999, seed=0).state_dict())  # other data
    before = (run / "config.yaml").read_bytes()
    with pytest.raises(ValueError, match="num_items=999"):
        driver_mod.GRPODriver(compose_config([*args, "run.resume=true"])).run()
    assert (run / "config.yaml").read_bytes() == before


def test_an_accepted_resume_still_writes_config_yaml(tmp_path, monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)
    run, args = recorded_run(tmp_path)
    d = driver_mod.GRPODriver(compose_config([*args, "run.resume=true"]))
    d.setup()
    order = d.order.state_dict()
    d.close()
    small_checkpoint(run / "checkpoints", 3, data_order=order)  # train.steps=3: nothing left to run
    driver_mod.GRPODriver(compose_config([*args, "run.resume=true"])).run()
    assert not (run / "config.yaml").read_text().startswith("# recorded by the first run")


@pytest.mark.slow
def test_resume_after_damage_end_to_end(tmp_path):
    """The attack, through `rlrepro train`: the newest checkpoint damaged -> the resume says which it skips and
    repeats the steps after the older one bit for bit; every manifest gone -> refused, exit 2, nothing rewritten
    (before: exit 0, restarted at step 1 and every record rewritten)."""
    run = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0")
    args = [sys.executable, "-m", "rlrepro.cli", "train", "recipe=grpo_tiny", f"run.dir={run}", "train.steps=2",
            "checkpoint.every=1", "logger.progress=false", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_tokens=4", "warm_start.steps=2"]

    def train(*extra):
        return subprocess.run([*args, *extra], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    first = train()
    assert first.returncode == 0, first.stderr[-3000:]
    fingerprints = (run / "fingerprints.jsonl").read_bytes()
    with open(run / "checkpoints" / "step_000002" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    resumed = train("run.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping" in resumed.stderr and "step_000002" in resumed.stderr and "has 100 bytes" in resumed.stderr
    assert (run / "fingerprints.jsonl").read_bytes() == fingerprints  # step 2 repeated bit for bit
    for d in (run / "checkpoints").iterdir():
        (d / "manifest.json").unlink()
    before = files(run)
    refused = train("run.resume=true")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "none of the 2 checkpoint directories" in refused.stderr
    assert files(run) == before


# ------------------------------------------------------------------------------------------ messages (item 8)
def test_a_short_torch_write_on_a_nearly_full_disk_says_disk_full_at_the_file(tmp_path, monkeypatch):
    def short_write(obj, f, *a, **k):
        Path(f).write_bytes(b"PK\x03\x04partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(ckpt_mod.torch, "save", short_write)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=4096))
    with pytest.raises(OSError) as ei:
        small_checkpoint(tmp_path / "checkpoints", 5)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC
    assert f"disk full at {tmp_path / 'checkpoints' / 'step_000005.tmp-'}" in msg and "optimizer.pt" in msg
    assert "the checkpoint of step 5 was not written" in msg and "inline_container" not in msg
    assert list((tmp_path / "checkpoints").iterdir()) == []  # nothing partial left


def test_a_short_torch_write_with_room_left_says_what_it_was(tmp_path, monkeypatch):
    def short_write(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(ckpt_mod.torch, "save", short_write)
    with pytest.raises(OSError, match=r"writing .*optimizer.pt stopped short \(.* MiB still free"):
        small_checkpoint(tmp_path, 5)


def _can_mount_a_small_disk() -> bool:
    probe = "mkdir -p /tmp/.rlrepro-probe && mount -t tmpfs -o size=64k tmpfs /tmp/.rlrepro-probe"
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


DISK_CHILD = textwrap.dedent("""
    import sys, torch
    from rlrepro.trainer.checkpoint import save_checkpoint
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    opt.step()
    save_checkpoint(sys.argv[1], 1, model=model, optimizer=opt)  # ~0.8 MB: fits
    try:  # torch's own writer this time: it reports the short write as "unexpected pos"
        model2 = torch.nn.Linear(512, 512)
        opt2 = torch.optim.AdamW(model2.parameters())
        model2(torch.ones(1, 512)).sum().backward()
        opt2.step()
        save_checkpoint(sys.argv[1], 2, optimizer=opt2)
    except OSError as e:
        print("ERROR", e)
""")


@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="needs unshare -m and a tmpfs mount (root)")
def test_a_really_full_disk_says_disk_full(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=1200k tmpfs {mnt} && {sys.executable} -c \"$CHILD\" {mnt}/checkpoints && "
              f"ls {mnt}/checkpoints")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=dict(os.environ, CHILD=DISK_CHILD),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERROR [Errno 28] disk full at" in proc.stdout and "optimizer.pt" in proc.stdout, proc.stdout
    assert "enforce fail" not in proc.stdout and "unexpected pos" not in proc.stdout
    assert proc.stdout.split()[-1] == "step_000001"  # the older checkpoint is there, nothing partial


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/nonexistent")


def test_a_checkpoint_file_with_pickled_code_is_refused_naming_it(tmp_path, monkeypatch):
    global MARKER
    MARKER = tmp_path / "code_ran"
    path = small_checkpoint(tmp_path / "checkpoints", 1)
    torch.save({"step": 1, "payload": Evil()}, path / "extra_state.pt")  # the manifest is rewritten to match
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["extra_state.pt"] = ckpt_mod._file_digest(path / "extra_state.pt")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as ei:
        load_checkpoint(path, restore_rng=False)
    text = "".join(traceback.format_exception(ei.value))
    assert str(path / "extra_state.pt") in str(ei.value) and "posix.system" in str(ei.value)
    assert "weights_only" not in text and "arbitrary code" not in text
    assert not MARKER.exists()


def test_a_checkpoint_file_that_is_not_a_torch_file_is_named(tmp_path):
    path = small_checkpoint(tmp_path, 1)
    (path / "rng.pt").write_bytes(b"garbage" * 10)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["rng.pt"] = ckpt_mod._file_digest(path / "rng.pt")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"checkpoint file {path / 'rng.pt'} is not a file of tensors .*operand") \
            as ei:
        load_checkpoint(path, restore_rng=False)
    assert "weights_only" not in "".join(traceback.format_exception(ei.value))


@pytest.mark.parametrize("manifest", ["[]", '{"format": "rlrepro-checkpoint", "version": 1, "files": {"a": 3}}'])
def test_a_malformed_manifest_is_a_damaged_checkpoint_not_a_crash(tmp_path, manifest):
    path = small_checkpoint(tmp_path, 1)
    (path / "manifest.json").write_text(manifest)
    assert [p is not None for _, _, p in scan_checkpoints(tmp_path)] == [True]
