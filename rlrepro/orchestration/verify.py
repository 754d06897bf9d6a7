"""``rlrepro verify RUN [--from-step K] [--steps N]``: re-execute recorded steps and diff them against the record.

The run's own resolved config.yaml is re-used (with the ``eval.*`` keys and ``train.steps`` a resume amended put
back, step by step, to the values each step ran with: amendments.jsonl). Execution starts from the newest
complete checkpoint at or before step K-1 (from scratch when there is none), runs through step K+N-1 into
``RUN/verify/from_K/``, and the fingerprints and metrics of steps K..K+N-1 are compared with the recorded ones.
Exit 0 reproduced, 1 diverged, 2 error (a run directory or an input it cannot use), 3 the re-execution itself
failed (nothing was compared: the message names the failure and where its log and records are), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from fnmatch import fnmatchcase
from pathlib import Path

from omegaconf import OmegaConf

from rlrepro.repro.report import _ranges

EXIT_REPRODUCED, EXIT_DIVERGED, EXIT_ERROR, EXIT_REEXECUTION_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# what verify sets in the re-execution's config (bit-neutral: resume.BIT_NEUTRAL_KEYS), left out of its config diff
VERIFY_SET_KEYS = ("checkpoint.every", "checkpoint.save_last", "checkpoint.export_hf")
RAY_LOGS = "/tmp/ray/session_latest/logs"  # where Ray writes the actors' logs (stdout/stderr of each worker)


def _checkpoint_before(ckpt_root: Path, step: int) -> tuple[int, Path | None]:
    from rlrepro.trainer import list_checkpoints

    best = (0, None)
    for s, path in list_checkpoints(ckpt_root):
        if s <= step and s >= best[0]:
            best = (s, path)
    return best


def _load_recorded_config(path: Path) -> dict:
    """The run's resolved config.yaml as a dict; ReproError naming the file when it cannot be read or parsed."""
    from rlrepro.repro.records import ReproError

    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # noqa: BLE001 - yaml and omegaconf errors come in many classes
        raise ReproError(f"{path}: cannot parse the run's config ({type(e).__name__}: "
                         f"{' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ReproError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def verify_run(run_dir: str | os.PathLike, from_step: int = 1, steps: int | None = None, *,
               progress: bool = True):
    from rlrepro.repro.diff import diff_runs, read_fingerprints
    from rlrepro.repro.inputs import read_inputs, write_inputs
    from rlrepro.repro.records import ReproError

    from .config import validate
    from .driver import GRPODriver
    from .resume import EVAL_KEYS, config_at_step, read_amendments
    from .run_dirs import checkpoint_dir_hint, missing_run_dir
    from .run_lock import RunLock

    run = Path(run_dir)
    if steps is not None and steps < 1:
        raise ReproError(f"--steps {steps}: give the number of steps to re-execute, at least 1 (or leave it out: "
                         "every recorded step from --from-step on)")
    missing = missing_run_dir("verify", run)  # "not found", or "no config.yaml" for a directory that holds no run
    if missing is not None:  # a checkpoint directory: the run and --from-step N+1 (re-executed from checkpoint N)
        missing = checkpoint_dir_hint("verify", run, "--from-step {next}") or missing
        raise ReproError(missing)
    recorded = read_fingerprints(run)
    if not recorded:
        raise ReproError(f"{run}: no recorded steps (fingerprints.jsonl is empty): the run has not finished a step, "
                         "so there is nothing to re-execute")
    first_rec, last_rec = min(recorded), max(recorded)
    if from_step not in recorded:
        raise ReproError(f"--from-step {from_step}: step {from_step} is not recorded in {run} (recorded steps: "
                         f"{_ranges(recorded)}); give a recorded step, {first_rec}..{last_rec} (or leave it out: "
                         f"{first_rec})")
    last = last_rec if steps is None else from_step + steps - 1
    if last not in recorded:
        most = sum(1 for s in recorded if from_step <= s <= last_rec)
        raise ReproError(f"--steps {steps}: from step {from_step} that reaches step {last}, but the last recorded "
                         f"step of {run} is {last_rec}; give --steps {most} or fewer (or leave it out: every "
                         f"recorded step from {from_step} on)")
    from .config import migrate_legacy_keys

    # onto the schema: a run recorded before a key existed gets its default; old spellings are read. config.yaml
    # holds the latest values: the eval keys a resume amended (amendments.jsonl) are put back to those each step
    # ran with (from_step's for the start, and a setting of its own from each later amendment on)
    recorded = _load_recorded_config(run / "config.yaml")
    amendments = read_amendments(run)

    def at(step: int, keys=EVAL_KEYS):
        return validate(migrate_legacy_keys(config_at_step(recorded, amendments, step, keys), warn=False))

    cfg = at(from_step, ("eval.*",))  # train.steps stays the latest (an allowed change leaves every rate as it was)
    amended = [a for a in amendments if any(fnmatchcase(a["key"], k) for k in EVAL_KEYS)]
    changes = sorted({a["from_step"] for a in amended if from_step < a["from_step"] <= last})
    # each step's evaluation with the eval keys (and train.steps, whose last step is evaluated) it ran with
    eval_later = [(step, at(step)) for step in [from_step, *changes]] if amended else []
    start_step, ckpt = _checkpoint_before(run / "checkpoints", from_step - 1)
    out = run / "verify" / f"from_{from_step}"
    with RunLock(run):  # verify writes into RUN/verify/: never beside a run (or another verify) of RUN
        for d in (out.parent, out):
            if d.is_symlink():
                raise ReproError(f"{d} is a symbolic link (to {os.readlink(d)!r}); rlrepro verify does not write or "
                                 "delete through links: remove it")
            if d.exists() and not d.is_dir():
                raise ReproError(f"{d} is a file, where rlrepro verify writes its re-execution (a folder): move or "
                                 "remove it")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if ckpt is not None and (run / "base_model").is_dir():
            os.symlink((run / "base_model").resolve(), out / "base_model")  # overwritten by the checkpoint anyway
        if ckpt is not None and (run / "inputs.json").is_file():
            # a re-execution from a checkpoint compares its inputs with the run's record (the starting weights'
            # digest is the record's: they are not rebuilt) instead of writing a record without that digest; the
            # run's own resumes stay out of it (diff says them as run A's; as B's too they would be said twice)
            first_start = {k: v for k, v in (read_inputs(run) or {}).items() if k != "resumes"}
            write_inputs(out, first_start)
        cfg.run.dir = str(out)
        cfg.run.resume = False
        cfg.logger.wandb = False
        cfg.logger.progress = progress
        cfg.checkpoint.every = 0  # nor the last step's checkpoint or HF export: nothing reads them, and a large
        cfg.checkpoint.save_last = False  # model's would fill RUN's disk (its optimizer state too) on every verify
        cfg.checkpoint.export_hf = False
        driver = GRPODriver(cfg, out)
        driver.eval_later = eval_later
        driver.run(start_checkpoint=None if ckpt is None else str(ckpt), last_step=last)
    report = diff_runs(run, out, steps=range(from_step, last + 1), ignore_config_keys=VERIFY_SET_KEYS)
    # the fingerprints are digests of what the run computed, not of the files it kept: a rollout record changed
    # after the run wrote it agrees with them, so the rollout files themselves are compared too
    report.rollout_diffs, missing = compare_rollout_files(run, out, range(from_step, last + 1))
    if missing:
        report.notes.append(f"rollout files not compared at step(s) {_ranges(missing)}: the re-execution wrote none")
    diverged = set(report.diverged_steps)
    for d in report.rollout_diffs:
        report.verdict = "diverged"
        report.notes.append(f"rollouts: {d['message']}" + ("" if d["step"] in diverged else (
            "; the fingerprints agree at this step, so the file is not what the run computed (changed after the "
            "run wrote it?)")))
    return report, start_step


def compare_rollout_files(run: Path, out: Path, steps) -> tuple[list[dict], list[int]]:
    """The first difference of each step's rollout file (``rollouts/step_NNNNNN.jsonl.gz``) between the record and
    the re-execution, which writes the same records: [{``step``, ``sample``, ``key``, ``message``}] (``sample``: the
    position in the file; null, with ``key``, for another number of samples), and the steps whose file the
    re-execution did not write. A step the
    run kept no rollout file for is not compared, nor one the re-execution did not write (the second list)."""
    from rlrepro.repro.records import read_rollouts, rollouts_path
    from rlrepro.repro.rollout_check import first_record_difference

    diffs, missing = [], []
    for step in steps:
        rec = read_rollouts(run, step)
        if rec is None:
            continue
        new = read_rollouts(out, step)
        where = rollouts_path(run, step)
        if new is None:  # the re-execution kept none (not a record of it to compare): said, never a divergence
            missing.append(step)
            continue
        if len(rec) != len(new):
            diffs.append({"step": step, "sample": None, "key": None, "message": f"{where}: {len(rec)} "
                          f"sample(s) recorded, {len(new)} re-executed at step {step}"})
            continue
        for i, (x, y) in enumerate(zip(rec, new)):
            found = first_record_difference(x, y, ("recorded", "re-executed"))
            if found is not None:
                uid, idx = x.get("prompt_uid"), x.get("sample_index")
                diffs.append({"step": step, "sample": i, "key": found[0], "message": (
                    f"step {step}, sample {i} (prompt_uid {uid!r}, sample_index {idx}), {found[1]} in {where}")})
                break
    return diffs, missing


def main_verify(argv: list[str] | None = None) -> int:
    from rlrepro.repro.records import ReproError

    ap = argparse.ArgumentParser(prog="rlrepro verify", description="re-execute a run's recorded steps and diff them "
                                 "against the record: exit 0 reproduced, 1 diverged, 2 error, 3 the re-execution "
                                 "failed (nothing compared), 130 interrupted")
    ap.add_argument("run", help="the run directory")
    ap.add_argument("--from-step", type=int, default=1, metavar="K",
                    help="the first step to re-execute (from the newest checkpoint before it; default 1)")
    ap.add_argument("--steps", type=int, default=None, metavar="N",
                    help="how many steps (default: every recorded step from K on)")
    ap.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    ns = ap.parse_args(argv)
    from rlrepro.repro.inputs import in_launch_dir

    from .errors import RunInterrupted

    try:
        with in_launch_dir(ns.run) as run:
            report, start = verify_run(run, ns.from_step, ns.steps)
    except RunInterrupted as e:
        print(f"rlrepro verify: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ReproError, ValueError, FileNotFoundError) as e:
        print(f"rlrepro verify: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # noqa: BLE001 - the re-execution crashed (RunFailed: a step failed; or its set-up)
        if os.environ.get("RLREPRO_DEBUG"):
            raise
        print(f"rlrepro verify: {reexecution_failed(e, Path(ns.run).absolute(), ns.from_step)}", file=sys.stderr)
        return EXIT_REEXECUTION_FAILED
    if ns.json:
        data = json.loads(report.to_json())
        data["verify"] = {"from_step": ns.from_step, "last_step": max(report.steps_compared),
                          "started_from_checkpoint": start or None, "dir": str(report.run_b),
                          "rollout_diffs": report.rollout_diffs}
        print(json.dumps(data, indent=2))
    else:
        origin = f"checkpoint step {start}" if start else "scratch"
        print(f"re-executed from {origin}; compared steps {ns.from_step}..{max(report.steps_compared)}")
        print(report.format())
    return EXIT_REPRODUCED if report.verdict == "identical" else EXIT_DIVERGED


def reexecution_failed(error: BaseException, run: Path, from_step: int) -> str:
    """The message of a re-execution that failed (exit 3, not 1: nothing was compared, so nothing diverged):
    the failure, and where the re-execution's log and records are."""
    from .errors import RunFailed

    out = run / "verify" / f"from_{from_step}"
    what = str(error) if isinstance(error, RunFailed) else f"{type(error).__name__}: {error}"
    summary = out / "summary.txt"
    records = f"{summary} says what it did" if summary.is_file() else f"its records are in {out}"
    return (f"the re-execution failed, so nothing was compared (exit {EXIT_REEXECUTION_FAILED}; exit "
            f"{EXIT_DIVERGED} means the steps ran and differ): {what.rstrip('.')}. Its log is the output above; "
            f"{records}; the Ray actors' logs are under {RAY_LOGS}")
