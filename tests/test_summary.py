"""The end of a run says what happened: RUN/summary.json and summary.txt (also printed), from the records, so a
resumed run's covers the whole run."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.orchestration.summary import edge_window, format_summary, run_summary, write_summary
from rlrepro.repro.records import MetricsWriter


def _cfg(wandb=False, mode="offline", steps=8):
    return SimpleNamespace(recipe="r", logger=SimpleNamespace(wandb=wandb, mode=mode),
                           train=SimpleNamespace(steps=steps))


def _write_metrics(run: Path, rewards, evals=None):
    w = MetricsWriter(run)
    for i, r in enumerate(rewards, start=1):
        rec = {"step": i, "rollout/reward_mean": r, "rollout/response_length_mean": 3.0, "rollout/num_samples": 4,
               "perf/step_time_s": 0.5, "perf/train_s": 0.25, "perf/train_tokens_per_s": 80.0}
        rec.update((evals or {}).get(i, {}))
        w.write(rec)


def test_reward_first_last_are_the_means_of_the_edge_steps(tmp_path, capsys):
    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9]  # 8 steps: the first and last 2
    _write_metrics(tmp_path, rewards, evals={3: {"eval/pass@4": 0.25}, 7: {"eval/pass@4": 0.75}})
    wandb_run = tmp_path / "wandb" / "offline-run-1"
    wandb_run.mkdir(parents=True)
    s = run_summary(tmp_path, _cfg(wandb=True), wall_s=12.5, steps_this_run=8, wandb_dir=str(wandb_run))
    assert edge_window(8) == 2 and s["reward"]["window"] == 2
    assert s["reward"]["first"] == (0.1 + 0.2) / 2 and s["reward"]["last"] == (0.7 + 0.9) / 2
    assert s["steps"] == {"recorded": 8, "first": 1, "last": 8, "this_invocation": 8, "planned": 8}
    assert s["eval"]["eval/pass@4"] == {"first": 0.25, "first_step": 3, "last": 0.75, "last_step": 7}
    assert s["time"] == {"wall_s": 12.5, "step_time_s_total": 4.0}
    assert s["throughput"]["train_tokens"] == 160 and s["throughput"]["train_tokens_per_s"] == 40.0
    assert s["throughput"]["generated_tokens"] == 96 and s["throughput"]["generated_tokens_per_s"] == 24.0
    assert s["files"]["wandb_sync"] == f"wandb sync {wandb_run}"
    assert s["files"]["latest_checkpoint"] is None and s["files"]["exported_model"] is None
    text = write_summary(tmp_path, s)
    assert capsys.readouterr().err == text
    assert "0.1500 -> 0.8000" in text and f"wandb sync {wandb_run}" in text and "eval/pass@4" in text
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert (tmp_path / "summary.txt").read_text() == text
    # online (or no wandb): no sync command
    assert run_summary(tmp_path, _cfg(wandb=True, mode="online"), wall_s=1, steps_this_run=1,
                       wandb_dir=str(wandb_run))["files"]["wandb_sync"] is None
    assert "upload" not in format_summary(run_summary(tmp_path, _cfg(), wall_s=1, steps_this_run=1))
    # the exported model is the newest export of a recorded step (never a stale one of a longer, earlier run)
    for step in (8, 99):
        (tmp_path / "export" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "export" / f"step_{step:06d}" / "config.json").write_text("{}")
    s = run_summary(tmp_path, _cfg(), wall_s=1, steps_this_run=1)
    assert s["files"]["exported_model"] == str(tmp_path / "export" / "step_000008")
    assert "HF model   " + str(tmp_path / "export" / "step_000008") in format_summary(s)


def test_short_runs_use_one_step_at_each_end(tmp_path):
    _write_metrics(tmp_path, [0.25, 0.5, 1.0])
    s = run_summary(tmp_path, _cfg(), wall_s=1.0, steps_this_run=3)
    assert s["reward"] == {"first": 0.25, "last": 1.0, "window": 1, "key": "rollout/reward_mean"}
    assert [edge_window(n) for n in (1, 7, 8, 19, 20, 400)] == [1, 1, 2, 4, 5, 5]


@pytest.mark.slow
def test_a_resumed_run_summarises_the_whole_run(tmp_path):
    """grpo_tiny for 2 steps, then resumed to 4 with wandb offline: summary.json covers steps 1-4, its reward
    first -> last are those of metrics.jsonl's first and last step, and it names the wandb run to sync."""
    from rlrepro.orchestration.driver import GRPODriver

    run = tmp_path / "run"
    args = ["recipe=grpo_tiny", "train.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
            "checkpoint.every=2", "train.warmup_steps=1", f"run.dir={run}"]
    GRPODriver(compose_config(args)).run(last_step=2)
    first = json.loads((run / "summary.json").read_text())
    assert first["steps"]["recorded"] == 2 and first["steps"]["this_invocation"] == 2
    assert main(["train", *args, "run.resume=true", "logger.wandb=true"]) == 0
    s = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert s["steps"]["recorded"] == 4 and s["steps"]["first"] == 1 and s["steps"]["last"] == 4
    assert s["steps"]["this_invocation"] == 2
    assert s["reward"]["first"] == metrics[0]["rollout/reward_mean"]
    assert s["reward"]["last"] == metrics[-1]["rollout/reward_mean"]
    assert s["time"]["step_time_s_total"] == sum(m["perf/step_time_s"] for m in metrics)
    assert s["files"]["latest_checkpoint"] == str(run / "checkpoints" / "step_000004")
    wandb_dir = Path(s["files"]["wandb_run"])
    assert wandb_dir.is_dir() and wandb_dir.parent == run / "wandb"
    assert s["files"]["wandb_sync"] == f"wandb sync {wandb_dir}"
    assert "wandb sync" in (run / "summary.txt").read_text()


def test_a_failed_or_interrupted_run_says_so(tmp_path):
    from rlrepro.orchestration.errors import RunFailed, RunInterrupted

    run = tmp_path / "run"
    run.mkdir()
    _write_metrics(run, [0.1, 0.2])
    for cls, status in ((RunFailed, "failed"), (RunInterrupted, "interrupted")):
        err = cls("step 3 failed: boom. The last complete checkpoint is none", step=3, checkpoint=None,
                  cause=ValueError("boom"))
        s = run_summary(run, _cfg(), wall_s=1.0, steps_this_run=2, failure=err)
        assert s["status"] == status and s["error"] == str(err)
        assert s["resume_command"] == f"rlrepro train recipe=r run.dir={run} run.resume=true"
        text = format_summary(s)
        assert text.splitlines()[0] == f"run summary: {run} ({status.upper()})"
        assert f"  {status:<10} step 3 failed: boom" in text and s["resume_command"] in text
    # an error that starts with the status word is not said twice ("interrupted interrupted during step 6")
    err = RunInterrupted("interrupted during step 6", step=6, checkpoint=None, cause=KeyboardInterrupt())
    text = format_summary(run_summary(run, _cfg(), wall_s=1.0, steps_this_run=2, failure=err))
    assert "  interrupted during step 6" in text and "interrupted interrupted" not in text
    done = run_summary(run, _cfg(), wall_s=1.0, steps_this_run=2)
    assert done["status"] == "complete" and done["error"] is None and "resume " not in format_summary(done)


def test_a_run_with_no_step_lists_no_records_it_did_not_write(tmp_path):
    s = run_summary(tmp_path, _cfg(), wall_s=1.0, steps_this_run=0)
    assert s["files"]["metrics"] is None and s["files"]["fingerprints"] is None and s["files"]["plot_command"] is None
    text = format_summary(s)
    assert "records    none (no step was recorded)" in text and "plots      none" in text
    assert "metrics.jsonl" not in text and "rlrepro plot" not in text
    _write_metrics(tmp_path, [0.5])
    assert "rlrepro plot" in format_summary(run_summary(tmp_path, _cfg(), wall_s=1.0, steps_this_run=1))


def test_a_run_that_failed_before_its_first_step_says_0_recorded(tmp_path):
    from rlrepro.orchestration.errors import RunFailed

    err = RunFailed("step 1 failed: boom. The last complete checkpoint is none", step=1, checkpoint=None,
                    cause=ValueError("boom"))
    s = run_summary(tmp_path, _cfg(), wall_s=1.0, steps_this_run=0, failure=err)
    text = format_summary(s)
    assert "  steps      0 recorded, 0 run now\n" in text
    assert "None" not in text
    _write_metrics(tmp_path, [0.5, 0.25])
    assert "  steps      2 recorded (1-2), 2 run now\n" in format_summary(
        run_summary(tmp_path, _cfg(), wall_s=1.0, steps_this_run=2))
