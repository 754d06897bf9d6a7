"""Session 32: `rlrepro export` writes config.json last, after the data is on disk, and a failed export removes
only what it made; `rlrepro diff` says a field null in both runs was not compared; bisect pairs module outputs by
name; show, diff, plot, export, verify and eval name a missing run directory in one wording; a resume may change
ray.colocate."""
import copy
import json
import os
from pathlib import Path

import pytest
import torch

from rlrepro.cli import main
from rlrepro.model import load_pretrained, write_tiny_checkpoint
from rlrepro.orchestration import export as export_mod
from rlrepro.orchestration.export import export_checkpoint
from rlrepro.trainer import save_checkpoint

from _io_events import record_io


def _fake_run(root: Path, steps=(2,)) -> Path:
    """A run directory as a model.init=tiny run leaves it (as tests/test_export.py makes it)."""
    run = root / "run"
    base = write_tiny_checkpoint(run / "base_model", seed=5, num_hidden_layers=1)
    (run / "config.yaml").write_text("model:\n  init: tiny\n  path: null\n")
    model = load_pretrained(base)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        save_checkpoint(run / "checkpoints", step, model=model, extra_state={"step": step})
    return run


# ------------------------------------------------------------------ 1. config.json last, after an fsync of the rest
def test_export_fsyncs_every_file_and_the_directory_before_config_json_is_written(tmp_path, monkeypatch):
    run = _fake_run(tmp_path)
    out = tmp_path / "models" / "policy"
    events = record_io(monkeypatch, renames=True)
    final = export_checkpoint(run, out)
    tmp = str(final.parent / f"{final.name}.tmp-{os.getpid()}")
    # the write that left config.json in the export (the last rename onto TMP/config.json)
    cfg = max(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == f"{tmp}/config.json")
    fsynced_before = {e[1] for e in events[:cfg] if e[0] == "fsync"}
    data = sorted(f.name for f in final.iterdir() if f.name != "config.json")
    assert "model.safetensors" in data and "generation_config.json" in data
    for name in data:
        assert f"{tmp}/{name}" in fsynced_before, f"{name} was not fsynced before config.json was written"
    last_data = max(i for i, e in enumerate(events[:cfg]) if e[0] == "fsync" and e[1] in
                    {f"{tmp}/{name}" for name in data})
    assert ("fsync", tmp) in events[last_data:cfg], "the directory was not fsynced between the data and config.json"
    assert events[cfg - 1] == ("fsync", events[cfg][1]), "config.json's own temporary file is fsynced, then renamed"
    commit = events.index(("rename", tmp, str(final)))
    assert ("fsync", tmp) in events[cfg:commit], "the directory is fsynced after config.json's rename"
    assert ("fsync", str(final.parent)) in events[commit:]
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3"
    assert sorted(p.name for p in final.parent.iterdir()) == ["policy"]  # no temporary file left anywhere
    assert not [p for p in final.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------ 2. a failed export removes only what it made
def _fail(*args, **kwargs):
    raise OSError(28, "disk full")


def test_a_failed_export_keeps_the_users_empty_out_directory(tmp_path, monkeypatch):
    run = _fake_run(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    os.chmod(out, 0o750)
    import rlrepro.model

    monkeypatch.setattr(rlrepro.model, "save_pretrained", _fail)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(run, out)
    assert out.is_dir() and list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]  # nor any temporary directory
    monkeypatch.undo()
    # the rename into place fails: OUT was never removed (one rename replaces it), so it is there, as it was
    real_rename = os.rename

    def rename(src, dst):
        if Path(dst) == out:
            raise OSError("disk full")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(run, out)
    assert out.is_dir() and list(out.iterdir()) == [] and (out.stat().st_mode & 0o777) == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]
    monkeypatch.undo()
    # something of the user's appears in OUT while the export runs: the rename is refused, the file stays
    import rlrepro.model

    real_save = rlrepro.model.save_pretrained

    def save_then_user_writes(*a, **kw):
        (out / "notes.txt").write_text("mine")
        return real_save(*a, **kw)

    monkeypatch.setattr(rlrepro.model, "save_pretrained", save_then_user_writes)
    with pytest.raises(OSError):
        export_checkpoint(run, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    monkeypatch.undo()
    assert main(["export", str(run), str(out)]) == 0  # and the export into it still works
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_a_failed_export_removes_the_folders_it_made_for_out_and_nothing_else(tmp_path, monkeypatch):
    run = _fake_run(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "keep.txt").write_text("mine")
    import rlrepro.model

    monkeypatch.setattr(rlrepro.model, "save_pretrained", _fail)
    assert main(["export", str(run), str(tmp_path / "models" / "a" / "b" / "policy")]) == 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["keep.txt"]


# ------------------------------------------------------------------ 3. diff: a field null in both runs
def test_diff_says_a_field_null_in_both_runs_was_not_recorded_not_identical(tmp_path, capsys):
    from test_repro_diff import make_run

    from rlrepro.repro.diff import diff_runs, main_diff

    def no_weights(path):
        run = make_run(path, steps=3)
        lines = [json.loads(ln) for ln in (run / "fingerprints.jsonl").read_text().splitlines()]
        (run / "fingerprints.jsonl").write_text("".join(json.dumps({**r, "weights": None}) + "\n" for r in lines))
        return run

    a, b = no_weights(tmp_path / "a"), no_weights(tmp_path / "b")
    rep = diff_runs(a, b)
    assert rep.fields_not_recorded == {"weights": [1, 2, 3]}
    assert rep.divergence is None and rep.exit_code() == 0  # nothing differs: exit 0, as documented
    assert rep.exit_code(strict=True) == 1
    text = rep.format()
    assert "weights: not recorded in either run (null) at 3 step(s) (1-3): not compared" in text
    verdict = text.splitlines()[-1]
    assert verdict == ("verdict: IDENTICAL in the recorded fields; not recorded in either run, so not compared: "
                       "weights"), verdict
    assert main_diff([str(a), str(b), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fields_not_recorded"] == {"weights": [1, 2, 3]}
    assert main_diff([str(a), str(b), "--strict"]) == 1
    assert "--strict: fingerprint field(s) not recorded in either run: weights" in capsys.readouterr().out
    # runs that recorded every field still say plain IDENTICAL
    full = diff_runs(make_run(tmp_path / "c", steps=2), make_run(tmp_path / "d", steps=2))
    assert full.fields_not_recorded == {} and full.format().splitlines()[-1] == "verdict: IDENTICAL"


# ------------------------------------------------------------------ 4. bisect pairs module outputs by name
def _bisect_with_traces(monkeypatch, tmp_path, trace_a, trace_b):
    import rlrepro.repro.bisect as bisect_mod

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(bisect_mod, "_load_policy", lambda run, cfg, step, dtype=None: model)
    monkeypatch.setattr(bisect_mod, "read_rollouts", lambda run, step: [{"prompt_token_ids": [1], "token_ids": [2]}])
    traces = {str(tmp_path / "a"): trace_a, str(tmp_path / "b"): trace_b}
    calls = []

    def trace(m, tokens, mode):
        calls.append(tokens)
        return traces[str(tmp_path / ("a" if len(calls) == 1 else "b"))]

    monkeypatch.setattr(bisect_mod, "_trace", trace)
    return bisect_mod.bisect_runs(tmp_path / "a", tmp_path / "b", step=1, field="rollout_logprobs")


def test_bisect_pairs_module_outputs_by_name_not_position(tmp_path, monkeypatch):
    t = torch.arange(4.0)
    same = [("embed", "Embedding", t), ("layers.0", "Layer", t + 1), ("norm", "RMSNorm", t + 2),
            ("logits", "lm_head", t + 3)]
    # A runs one more module (same everything else): positional pairing would name "extra" vs layers.0
    with_extra = same[:1] + [("extra", "Dropout", t * 7)] + same[1:]
    res = _bisect_with_traces(monkeypatch, tmp_path, with_extra, same)
    assert res.kind == "model" and res.where == "extra", res
    assert "one run only" in res.note and "A: extra" in res.note
    assert "the module outputs that both runs have agree" in res.format()
    # a real difference after the unpaired module is named, with the unpaired one said
    changed = same[:2] + [("norm", "RMSNorm", t + 2.5)] + same[3:]
    monkeypatch.undo()
    res = _bisect_with_traces(monkeypatch, tmp_path, with_extra, changed)
    assert (res.kind, res.where, res.op, res.max_abs_diff) == ("activation", "norm", "RMSNorm", 0.5)
    assert "A: extra" in res.format()
    # a module B lacks at the end, and one only B has
    monkeypatch.undo()
    res = _bisect_with_traces(monkeypatch, tmp_path, same, same[:2] + [("b_only", "X", t)] + same[2:])
    assert res.kind == "model" and "B: b_only" in res.note


def test_bisect_pairs_the_calls_of_a_module_run_more_than_once(tmp_path, monkeypatch):
    from rlrepro.repro.bisect import first_activation_difference

    t = torch.zeros(3)
    a = [("rope", "Rotary", t), ("layers.0", "L", t), ("rope", "Rotary", t), ("layers.1", "L", t)]
    b = [("rope", "Rotary", t), ("layers.0", "L", t), ("rope", "Rotary", t + 1), ("layers.1", "L", t)]
    first, only_a, only_b = first_activation_difference(a, b)
    assert first == ("rope (call 2)", "Rotary", 1.0) and only_a == only_b == []
    assert first_activation_difference(a, a) == (None, [], [])


# ------------------------------------------------------------------ 5. one wording for a missing run directory
@pytest.mark.parametrize("argv", [["show", "runs/nope"], ["diff", "runs/nope", "runs/nope"], ["plot", "runs/nope"],
                                  ["export", "runs/nope", "out"], ["verify", "runs/nope"], ["eval", "runs/nope"]])
def test_every_command_names_a_missing_run_directory_in_one_wording(tmp_path, monkeypatch, capsys, argv):
    from rlrepro.orchestration.run_dirs import missing_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err
    want = missing_run_dir(argv[0], Path("runs/nope"))
    assert want == ("run directory runs/nope not found; give the directory a training wrote (its run.dir, e.g. "
                    f"`rlrepro {argv[0]} runs/NAME`)")
    # verify and eval name the path resolved: the same words around it
    assert err.startswith(f"rlrepro {argv[0]}") and want.replace("runs/nope", "@") in err.replace(
        str(tmp_path / "runs" / "nope"), "@").replace("runs/nope", "@"), err
    assert not (tmp_path / "out").exists()


def test_the_wording_names_the_runs_beside_a_missing_one_and_the_run_of_a_file(tmp_path):
    from rlrepro.repro.records import missing_run_dir

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.yaml").write_text("run: {}\n")
    (tmp_path / "plain").mkdir()
    msg = missing_run_dir("show", tmp_path / "nope")
    assert msg.endswith("(its run.dir, e.g. `rlrepro show runs/NAME`)"), msg  # no name close to "nope"
    msg = missing_run_dir("show", tmp_path / "ax")
    assert msg.endswith(f"; did you mean {tmp_path / 'a'}?"), msg  # a typo: the run beside it, not "plain"
    sweep = tmp_path / "sweep"
    for i in range(300):  # a sweep's runs: the close names only, at most five
        (sweep / f"lr_{i:03d}").mkdir(parents=True)
        (sweep / f"lr_{i:03d}" / "config.yaml").write_text("run: {}\n")
    msg = missing_run_dir("show", sweep / "lr_1000")
    assert 0 < msg.count(str(sweep)) <= 6 and len(msg) < 600, msg
    assert missing_run_dir("diff", tmp_path / "a" / "config.yaml") == (
        f"{tmp_path / 'a' / 'config.yaml'} is a file, not a run directory; its run directory is {tmp_path / 'a'}: "
        f"rlrepro diff {tmp_path / 'a'}")
    assert missing_run_dir("verify", tmp_path / "plain").endswith("is not a run directory (no config.yaml); give the "
                                                                  "directory a training wrote (its run.dir)")
    assert missing_run_dir("show", tmp_path / "plain", need_config=False) is None
    assert missing_run_dir("verify", tmp_path / "a") is None


# ------------------------------------------------------------------ 6. ray.colocate is bit-neutral on resume
def test_a_resume_may_change_ray_colocate_only(tmp_path):
    from test_resume_config import changed, recorded_config

    from rlrepro.orchestration.resume import BIT_NEUTRAL_KEYS, _bit_neutral, reconcile_resume

    assert "ray.colocate" in BIT_NEUTRAL_KEYS and _bit_neutral("ray.colocate")
    rec = recorded_config()
    req = changed(rec, ray__colocate=False)
    config, amendments = reconcile_resume(rec, copy.deepcopy(req), completed_step=3)
    assert config == req
    assert amendments == [{"key": "ray.colocate", "old": True, "new": False, "from_step": 4}]
    assert all(_bit_neutral(a["key"]) for a in amendments)  # an amendment of a key that changes no bit
