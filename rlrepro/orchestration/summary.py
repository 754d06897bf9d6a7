"""What a finished run did: ``RUN/summary.json``, ``RUN/summary.txt`` and the same text on stderr.

Everything is taken from the run directory's records, so a resumed run's summary covers the whole run (every step
in ``metrics.jsonl``), not only the steps of its last invocation:

* ``steps``: how many steps the records hold, the first and last step, and how many this invocation ran;
* ``reward``: ``rollout/reward_mean`` averaged over the first ``k`` and over the last ``k`` recorded steps, with
  ``k = min(5, max(1, n // 4))`` for ``n`` steps (one step each for a run of under 8 steps);
* ``eval``: for each ``eval/*`` metric, its first and last recorded value;
* ``time``: this invocation's wall time, and the sum of ``perf/step_time_s`` over every recorded step;
* ``throughput``: tokens the trainer processed (prompt + completion) and tokens generated, per second of step time;
* ``status``: ``complete``, or ``failed`` / ``interrupted`` with the error's message and the resume command (a run
  that stops early writes its summary too);
* ``files``: where the records, plots, checkpoints, exported HF model and wandb files are, and the
  ``wandb sync DIR ...`` command of an offline wandb run (every directory of its wandb id: one per invocation).

The summary is informational (``perf``-like): ``rlrepro diff`` does not read it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rlrepro.repro.records import METRICS_FILE, atomic_write_bytes, read_step_records

__all__ = ["SUMMARY_JSON", "SUMMARY_TXT", "run_summary", "format_summary", "write_summary", "edge_window"]

SUMMARY_JSON = "summary.json"
SUMMARY_TXT = "summary.txt"


def edge_window(n: int) -> int:
    """How many of the first and of the last steps the reward's first -> last averages."""
    return min(5, max(1, n // 4))


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, int | float)]
    return sum(values) / len(values) if values else None


def _wandb_runs(run_dir: Path, wandb_dir: str | None) -> tuple[list[str], str | None]:
    """Every wandb run directory under RUN/wandb (``offline-run-*`` and ``run-*``), and this run's."""
    root = run_dir / "wandb"
    runs = sorted(str(p) for p in root.glob("*run-*") if p.is_dir()) if root.is_dir() else []
    return runs, wandb_dir


def _wandb_sync_command(wandb_runs: list[str], this_wandb: str | None) -> str | None:
    """``wandb sync DIR ...`` of an offline run: every offline directory of this run's wandb id (a resumed run
    writes one per invocation, all of one wandb run; ``wandb sync`` uploads them in order of start time), not only
    the last invocation's; None without one."""
    if not this_wandb:
        return None
    run_id = Path(this_wandb).name.rsplit("-", 1)[-1]
    same = [d for d in wandb_runs if Path(d).name.startswith("offline-run-") and Path(d).name.endswith(f"-{run_id}")]
    dirs = sorted(set(same) | {this_wandb}, key=lambda d: Path(d).name)
    return "wandb sync " + " ".join(dirs)


def run_summary(run_dir: str | Path, cfg, *, wall_s: float, steps_this_run: int,
                wandb_dir: str | None = None, failure: BaseException | None = None) -> dict:
    """The summary of the run in ``run_dir`` from its records (see the module docstring). ``failure``: the
    ``RunFailed`` / ``RunInterrupted`` the run ended with (``status`` failed / interrupted, its message, the
    command that resumes it); None: the run completed."""
    from rlrepro.trainer import list_checkpoints

    from .export import list_exports

    run_dir = Path(run_dir)
    records = list(read_step_records(run_dir / METRICS_FILE).values()) if (run_dir / METRICS_FILE).is_file() else []
    n = len(records)
    k = edge_window(n)
    rewards = [r.get("rollout/reward_mean") for r in records]
    step_time = sum(r.get("perf/step_time_s", 0.0) for r in records)
    train_tokens = sum(r.get("perf/train_tokens_per_s", 0.0) * r.get("perf/train_s", 0.0) for r in records)
    generated = sum(r.get("rollout/response_length_mean", 0.0) * r.get("rollout/num_samples", 0) for r in records)
    eval_keys = sorted({key for r in records for key in r if key.startswith("eval/")})
    evals = {}
    for key in eval_keys:
        seen = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
        if seen:
            evals[key] = {"first": seen[0][1], "first_step": seen[0][0], "last": seen[-1][1], "last_step": seen[-1][0]}
    ckpts = list_checkpoints(run_dir / "checkpoints")
    last = records[-1]["step"] if records else 0
    exports = [e for e in list_exports(run_dir) if e[0] <= last]  # none of a longer run this one started over
    plots = run_dir / "plots"
    wandb_runs, this_wandb = _wandb_runs(run_dir, wandb_dir)
    offline = bool(cfg.logger.wandb) and cfg.logger.mode == "offline"
    sync = _wandb_sync_command(wandb_runs, this_wandb) if offline else None
    if failure is None:
        status, error, resume = "complete", None, None
    else:
        from .errors import RunInterrupted

        status = "interrupted" if isinstance(failure, RunInterrupted) else "failed"
        error = str(failure)
        resume = f"rlrepro train recipe={getattr(cfg, 'recipe', None)} run.dir={run_dir} run.resume=true"
    return {
        "format": "rlrepro.summary.v1",
        "run_dir": str(run_dir),
        "recipe": getattr(cfg, "recipe", None),
        "status": status, "error": error, "resume_command": resume,
        "steps": {"recorded": n, "first": records[0]["step"] if records else None,
                  "last": records[-1]["step"] if records else None, "this_invocation": steps_this_run,
                  "planned": cfg.train.steps},
        "reward": {"first": _mean(rewards[:k]), "last": _mean(rewards[-k:]), "window": k,
                   "key": "rollout/reward_mean"},
        "eval": evals,
        "time": {"wall_s": wall_s, "step_time_s_total": step_time},
        "throughput": {"train_tokens": round(train_tokens), "generated_tokens": round(generated),
                       "train_tokens_per_s": train_tokens / step_time if step_time > 0 else None,
                       "generated_tokens_per_s": generated / step_time if step_time > 0 else None},
        "files": {
            # None when not written (a run that failed before its first step)
            "metrics": str(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else None,
            "fingerprints": str(run_dir / "fingerprints.jsonl") if (run_dir / "fingerprints.jsonl").is_file() else None,
            "rollouts": str(run_dir / "rollouts") if (run_dir / "rollouts").is_dir() else None,
            "plots": str(plots) if plots.is_dir() else None,
            "plot_command": f"rlrepro plot {run_dir}" if (run_dir / METRICS_FILE).is_file() else None,
            "checkpoints": [str(p) for _, p in ckpts],
            "latest_checkpoint": str(ckpts[-1][1]) if ckpts else None,
            "exports": [str(p) for _, p in exports],
            "exported_model": str(exports[-1][1]) if exports else None,
            "export_command": f"rlrepro export {run_dir} OUT" if ckpts and not exports else None,
            "wandb_runs": wandb_runs, "wandb_run": this_wandb, "wandb_sync": sync,
        },
    }


def _num(x, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _steps(st: dict) -> str:
    """"12 recorded (1-12)", or "0 recorded" for a run that failed before its first step."""
    if not st["recorded"] or st["first"] is None:
        return f"{st['recorded']} recorded"
    return f"{st['recorded']} recorded ({st['first']}-{st['last']})"


def format_summary(s: dict) -> str:
    """The summary as a few readable lines (what is printed and written to summary.txt)."""
    st, rw, t, tp, f = s["steps"], s["reward"], s["time"], s["throughput"], s["files"]
    window = f"mean of the first / last {rw['window']} step(s)"
    status = s.get("status", "complete")
    lines = [f"run summary: {s['run_dir']}" + ("" if status == "complete" else f" ({status.upper()})"),
             f"  steps      {_steps(st)}, {st['this_invocation']} run now",
             f"  reward     {_num(rw['first'])} -> {_num(rw['last'])}  ({window})"]
    for key, e in s["eval"].items():
        lines.append(f"  {key:<10} {_num(e['first'])} (step {e['first_step']}) -> {_num(e['last'])} "
                     f"(step {e['last_step']})")
    lines += [f"  wall time  {t['wall_s']:.1f} s this invocation; {t['step_time_s_total']:.1f} s of step time in all",
              f"  throughput {_num(tp['train_tokens_per_s'], '.1f')} train tokens/s, "
              f"{_num(tp['generated_tokens_per_s'], '.1f')} generated tokens/s (per second of step time)",
              "  records    " + (", ".join(x for x in (f["metrics"], f["fingerprints"]) if x) or "none (no step "
                                   "was recorded)") + (f", {f['rollouts']}/" if f["rollouts"] else ""),
              f"  plots      {f['plots'] or ('none yet: ' + f['plot_command'] if f['plot_command'] else 'none')}",
              f"  checkpoint {f['latest_checkpoint'] or 'none'}" + (f" ({len(f['checkpoints'])} kept)"
                                                                    if f["checkpoints"] else "")]
    if f["exported_model"]:
        lines.append(f"  HF model   {f['exported_model']}")
    elif f["export_command"]:
        lines.append(f"  HF model   not exported (checkpoint.export_hf=false): {f['export_command']}")
    if f["wandb_run"]:
        lines.append(f"  wandb      {f['wandb_run']}")
    if f["wandb_sync"]:
        lines.append(f"  upload     {f['wandb_sync']}")
    if status != "complete":
        error = s["error"] or ""
        if error.startswith(f"{status} "):  # "interrupted during step 6", not "interrupted interrupted during ..."
            error = error[len(status) + 1:]
        lines.append(f"  {status:<10} {error}")
        lines.append(f"  resume     {s['resume_command']}")
    return "\n".join(lines) + "\n"


def write_summary(run_dir: str | Path, summary: dict, *, echo: bool = True) -> str:
    """Write ``summary.json`` and ``summary.txt`` (atomically) and, with ``echo``, print the text to stderr."""
    run_dir = Path(run_dir)
    text = format_summary(summary)
    atomic_write_bytes(run_dir / SUMMARY_JSON, (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
    atomic_write_bytes(run_dir / SUMMARY_TXT, text.encode("utf-8"))
    if echo:
        print(text, end="", file=sys.stderr, flush=True)
    return text
