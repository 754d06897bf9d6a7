"""The driver's pieces without Ray: the warm start draws from the run's own data, `rlrepro verify` ends a failed
re-execution with a message (exit 1), and repro.ignore_keys is a schema key."""
import json

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.errors import RunFailed

COMMON = ["recipe=grpo_tiny", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=4",
          "train.steps=1", "logger.progress=false"]


class StubActors:
    """Records what the driver hands the trainer, starts nothing."""
    examples = None

    def __init__(self, *a, **k):
        pass

    def warm_start(self, examples, **kw):
        StubActors.examples = examples
        return [1.0, 0.5]


def _driver(tmp_path, monkeypatch, *overrides):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: StubActors)
    cfg = compose_config([*COMMON, f"run.dir={tmp_path / 'run'}", *overrides])
    d = driver_mod.GRPODriver(cfg)
    d.setup()
    return d


def test_warm_start_with_a_data_source_uses_the_runs_own_prompts(tmp_path, monkeypatch):
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"q": f"reverse: {w}=", "a": w[::-1]}) + "\n"
                            for w in ("abc", "bca", "cab", "dab")))
    d = _driver(tmp_path, monkeypatch, f"data.source={data}", "data.prompt_field=q", "data.answer_field=a",
                "warm_start.steps=2", "warm_start.target=answer")
    d.warm_start()
    prompts = [ids for ids, _ in StubActors.examples]
    assert prompts == [p.token_ids for p in d.prompts]  # not the synthetic task's prompts
    targets = [d.tokenizer.decode(t) for _, t in StubActors.examples]
    assert [t.replace("<|im_end|>", "") for t in targets] == ["cba", "acb", "bac", "bad"]


def test_warm_start_without_a_data_source_keeps_the_synthetic_task(tmp_path, monkeypatch):
    d = _driver(tmp_path, monkeypatch, "warm_start.steps=2")
    d.warm_start()
    assert len(StubActors.examples) == 256  # drawn from the synthetic task with the warm start's own seed
    assert all(d.tokenizer.decode(ids).startswith("first: ") for ids, _ in StubActors.examples)


def test_verify_ends_a_failed_reexecution_with_a_message(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    cfg = compose_config([*COMMON, f"run.dir={run}"])
    (run / "config.yaml").write_text(driver_mod.config_yaml(driver_mod.to_schema(cfg)))
    from rlrepro.repro.fingerprint import fingerprint_from_samples
    from rlrepro.repro.records import dumps_line
    from rlrepro.samples import Sample

    sample = Sample("u", 0, [1, 2], [3], [-0.5], reward=1.0, advantage=0.0)
    fp = fingerprint_from_samples(1, [sample], loss=0.0, grad_norm=0.0, weights="00" * 32)
    (run / "fingerprints.jsonl").write_text(dumps_line(fp) + "\n")

    def fail(self, **kw):
        raise RunFailed("step 1 failed: FloatingPointError: non-finite loss. The last complete checkpoint is none",
                        step=1, checkpoint=None, cause=FloatingPointError())

    monkeypatch.setattr(driver_mod.GRPODriver, "run", fail)
    assert main(["verify", str(run)]) == 3  # a failed re-execution, not a divergence (1)
    err = capsys.readouterr().err
    assert "rlrepro verify: the re-execution failed" in err and "step 1 failed: FloatingPointError" in err
    assert "Traceback" not in err


def test_verify_refuses_zero_steps_saying_so(tmp_path, capsys):
    # it said "step 0 is not recorded" (the last step, from_step + steps - 1, of an empty range)
    assert main(["verify", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps 0: give the number of steps to re-execute, at least 1" in capsys.readouterr().err


def test_repro_ignore_keys_is_a_schema_key():
    cfg = compose_config(["recipe=grpo_tiny", "repro.ignore_keys=[rollout.num_workers]"])
    assert list(cfg.repro.ignore_keys) == ["rollout.num_workers"]
    with pytest.raises(Exception, match="repro.ignore_keys"):
        compose_config(["recipe=grpo_tiny", "repro.ignore_keys=[1]"])


# ------------------------------------------------------------------------------------------------ resume
def _recorded_run(tmp_path, *overrides):
    run = tmp_path / "run"
    run.mkdir()
    cfg = compose_config([*COMMON, f"run.dir={run}", *overrides])
    (run / "config.yaml").write_text(driver_mod.config_yaml(driver_mod.to_schema(cfg)))
    return run


def _resume(run, *overrides):
    args = ["recipe=grpo_tiny", f"run.dir={run}", "run.resume=true", *overrides]
    keys = [a.split("=", 1)[0] for a in args[1:]]
    d = driver_mod.GRPODriver(compose_config(args), override_keys=keys)
    d._reconcile_resume()
    return d


def test_a_resume_takes_the_recorded_config(tmp_path):
    run = _recorded_run(tmp_path, "rollout.num_workers=2", "train.steps=4", "train.lr=0.01")
    d = _resume(run, "train.steps=4")  # the recipe's defaults are not asked for: the record stands
    assert (d.cfg.rollout.num_workers, d.cfg.train.steps, d.cfg.train.lr) == (2, 4, 0.01)
    assert not (run / "amendments.jsonl").exists()


def test_a_resume_that_would_change_bits_is_refused_and_writes_nothing(tmp_path):
    run = _recorded_run(tmp_path, "train.steps=4")
    before = (run / "config.yaml").read_bytes()
    with pytest.raises(Exception) as e:
        _resume(run, "train.steps=2", "train.warmup_steps=1")
    assert "train.warmup_steps: 10 -> 1" in str(e.value) and "train.steps: 4 -> 2" in str(e.value)
    assert (run / "config.yaml").read_bytes() == before and not (run / "amendments.jsonl").exists()


def test_bit_neutral_changes_on_resume_are_recorded_as_amendments(tmp_path):
    run = _recorded_run(tmp_path, "train.steps=4")
    d = _resume(run, "rollout.max_num_seqs=32", "logger.progress=true")
    assert d.cfg.rollout.max_num_seqs == 32
    assert not (run / "amendments.jsonl").exists()  # written only once the resume is accepted
    d._write_amendments()
    lines = [json.loads(x) for x in (run / "amendments.jsonl").read_text().splitlines()]
    assert {a["key"]: (a["old"], a["new"], a["from_step"]) for a in lines} == {
        "rollout.max_num_seqs": (256, 32, 1), "logger.progress": (False, True, 1)}
