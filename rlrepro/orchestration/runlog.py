"""The run's log: per-step metrics, fingerprints and rollout files, the progress line, and the wandb run.

:meth:`RunLog.record_step` is the one place a finished step is written; :func:`step_metrics` computes the
``metrics.jsonl`` line of a step from its samples, the trainer's metrics and the phase timings.
"""
from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlrepro._files import atomic_write_bytes
from rlrepro.repro.fingerprint import fingerprint_from_samples
from rlrepro.repro.records import FingerprintWriter, MetricsWriter, RolloutWriter, read_step_records
from rlrepro.samples import Sample

__all__ = ["RunLog", "step_metrics", "wandb_run_id"]

# RUN/wandb/<this>: the id of the run's wandb run, so that a resumed run continues it (wandb.init(id=, resume=))
WANDB_ID_FILE = "rlrepro_run_id"
# RUN/wandb/<this>: "<id> <step>", the last step logged to that wandb run (written when it is closed), so that a
# resumed offline run (wandb.init cannot know what earlier invocations logged) does not log a step a second time.
# A run killed before it closed its wandb run never writes it: its offline directories' transaction logs
# (:func:`_persisted_step`) tell what they hold. Not written after each step: wandb's writer keeps the last (up to
# 32 KiB of) records in memory until it closes, so a killed run's last logged steps are not on disk; skipping them
# on resume would lose them for good, while the resumed run logs them again, with the same values.
WANDB_STEP_FILE = "rlrepro_logged_step"
_BLOCK = 32768  # the .wandb transaction log: leveldb's log format, 32 KiB blocks of chunked records
_WANDB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PROJECT_BAD = set("/\\#?%:")  # what wandb refuses in a project name (wandb_settings.validate_project)


def _check_project(project: object) -> None:
    """``logger.project`` must be a name wandb takes: refused here, before any work, naming key, value and fix."""
    from rlrepro.checks import ConfigError

    if not isinstance(project, str):
        why = "is not a string"
    elif not project or project.strip() != project:
        why = "is empty or has leading/trailing spaces"
    elif len(project) > 128:
        why = "is longer than 128 characters"
    elif _PROJECT_BAD & set(project):
        why = f"contains {''.join(sorted(_PROJECT_BAD & set(project)))!r}"
    else:
        return
    raise ConfigError(f"logger.project={project!r} is not a wandb project name: it {why}. Fix: set logger.project "
                      "to a name of 1-128 characters without / \\ # ? % : (e.g. logger.project=rlrepro), or "
                      "logger.wandb=false")


def _logged_step(wandb_dir: Path, run_id: str) -> int:
    """The last step logged to wandb run ``run_id`` by an earlier invocation (:data:`WANDB_STEP_FILE`), else 0."""
    try:
        rid, step = (wandb_dir / WANDB_STEP_FILE).read_text(encoding="utf-8").split()
        return int(step) if rid == run_id else 0
    except (OSError, UnicodeDecodeError, ValueError):
        return 0


def _log_records(data: bytes):
    """The records of a ``.wandb`` file's bytes (a 7-byte file header, then leveldb log blocks: a 7-byte chunk
    header ``crc32c:4 length:2 kind:1``, kind 1 a whole record, 2/3/4 its first/middle/last chunk; a block's tail of
    fewer than 7 bytes is padding; an all-zero chunk header, leveldb's "zero type" of preallocated space, is skipped
    as leveldb's own reader skips it). A torn tail (a run killed while writing) ends the records."""
    pos, parts = 7, None
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:  # a zero-filled stretch (leveldb's "zero type"): skipped, as leveldb's reader does
            continue
        if len(chunk) < n or kind not in (1, 2, 3, 4):
            return
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = [chunk]
        elif parts is not None:
            parts.append(chunk)
            if kind == 4:
                yield b"".join(parts)
                parts = None


def _persisted_step(wandb_dir: Path, run_id: str) -> int:
    """The last step the offline directories of wandb run ``run_id`` (``offline-run-<time>-<id>``) hold on disk, in
    their ``run-<id>.wandb`` transaction logs (what ``wandb sync`` uploads): what a killed invocation logged before
    its kill and wandb wrote; 0 if none or unreadable. The newest directory that holds a row has the last step."""
    try:
        from wandb.proto import wandb_internal_pb2 as pb
    except Exception:  # noqa: BLE001 - no wandb, or another layout: the step file alone counts
        return 0
    found = sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"), key=lambda p: p.parent.name)
    for file in reversed(found):
        try:
            data = file.read_bytes()
        except OSError:
            continue
        steps = []
        for raw in _log_records(data if data[:4] == b":W&B" else b""):
            record = pb.Record()
            try:
                record.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a damaged record: the ones before it count
                break
            if record.WhichOneof("record_type") == "history":
                item = next((i for i in record.history.item if i.key == "_step"), None)
                try:
                    steps.append(int(item.value_json) if item is not None else record.history.step.num)
                except ValueError:
                    break
        if steps:
            return max(steps)
    return 0


def _recorded_wandb_id(wandb_dir: Path) -> str | None:
    """The id recorded in ``wandb_dir`` (RUN/wandb): :data:`WANDB_ID_FILE`, else (a run started before that file
    existed) the id at the end of the name of wandb's ``latest-run`` (``offline-run-<time>-<id>``); None if none."""
    try:
        text = (wandb_dir / WANDB_ID_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if not text:
        latest = wandb_dir / "latest-run"
        target = latest.resolve().name if latest.is_symlink() or latest.is_dir() else ""
        text = target.rsplit("-", 1)[1] if target.count("-") >= 2 else ""
    return text if _WANDB_ID.match(text) else None


def _last_wandb_dir(wandb_dir: Path) -> str | None:
    """The newest run directory (``offline-run-<time>-<id>`` or ``run-<time>-<id>``) of the recorded wandb id."""
    run_id = _recorded_wandb_id(wandb_dir)
    found = sorted(wandb_dir.glob(f"*run-*-{run_id}"), key=lambda p: p.name.split("run-", 1)[1]) if run_id else []
    found = [p for p in found if p.is_dir()]
    return str(found[-1]) if found else None


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The wandb run id of ``run_dir``: a resumed run's is the recorded one (the same wandb run continues); a fresh
    run (or a resume with none recorded) gets a new random one, recorded in RUN/wandb/:data:`WANDB_ID_FILE`."""
    wandb_dir = Path(run_dir) / "wandb"
    recorded = _recorded_wandb_id(wandb_dir) if resume else None
    run_id = recorded or secrets.token_hex(8)
    if run_id != recorded or not (wandb_dir / WANDB_ID_FILE).is_file():
        atomic_write_bytes(wandb_dir / WANDB_ID_FILE, (run_id + "\n").encode("utf-8"))
    return run_id


def step_metrics(step: int, samples: list[Sample], train_metrics: dict, times: dict[str, float], *,
                 weights_digest: str, num_reward_errors: int, penalties: list[float] | None, restarts: int) -> dict:
    """The ``metrics.jsonl`` line of one step (``perf/*`` are the run environment, not compared by diff)."""
    rewards = [s.reward for s in samples]
    lengths = [len(s.completion_token_ids) for s in samples]
    metrics = {
        "step": step,
        "rollout/reward_mean": sum(rewards) / len(rewards),
        "rollout/reward_max": max(rewards),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": max(lengths),
        "rollout/finish_stop_frac": sum(s.finish_reason == "stop" for s in samples) / len(samples),
        "rollout/reward_errors": num_reward_errors,
        "rollout/num_samples": len(samples),
    }
    if penalties is not None:
        metrics["rollout/overlong_penalty_mean"] = sum(penalties) / len(penalties)
    metrics.update({k: v for k, v in train_metrics.items() if k.startswith("train/")})
    rollout_s, train_s = times["rollout"], times["train"]
    metrics.update({
        "repro/weights_digest": weights_digest[:16],
        "perf/rollout_s": rollout_s, "perf/reward_s": times["reward"], "perf/train_s": train_s,
        "perf/sync_s": times["sync"],
        "perf/rollout_tokens_per_s": sum(lengths) / max(rollout_s, 1e-9),
        # a pipelined step (rollout.max_staleness) generated and trained at once: its "overlap" is counted once
        "perf/step_time_s": sum(v for k, v in times.items() if k != "overlap") - times.get("overlap", 0.0),
        "perf/rollout_worker_restarts": restarts,
        "perf/train_tokens_per_s": sum(s.num_tokens for s in samples) / max(train_s, 1e-9),
    })
    return metrics


def perf_memory_metrics(cfg, train_metrics: dict, train_s: float, memory_stats: dict) -> dict:
    """MFU (model FLOPs over the step's train wall time and the GPUs' bf16 dense peak) and peak GPU memory per
    actor since the last step; nothing on CPU."""
    out = {}
    if cfg.run.device != "cuda":
        return out
    flops, peak = train_metrics.get("perf/train_flops"), train_metrics.get("perf/gpu_peak_flops")
    if flops is not None and peak:
        out["perf/mfu"] = flops / (train_s * peak * cfg.train.num_gpus)
    for actor, stats in memory_stats.items():
        if stats:
            out[f"perf/peak_mem_gib_{actor}"] = stats["peak_allocated_gib"]
    return out


class RunLog:
    """Writers of one run directory, the progress line (``logger.progress``) and the wandb run
    (``logger.wandb``)."""

    def __init__(self, cfg, run_dir: Path, *, steps_left: bool = True) -> None:
        """``steps_left=False``: a resume with no step left to run, which logs nothing to wandb: no wandb run is
        opened (wandb would write an empty offline run directory); ``wandb_dir`` names the run's last one."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics = MetricsWriter(run_dir)
        self.fingerprints = FingerprintWriter(run_dir)
        self.rollouts = RolloutWriter(run_dir)
        self.wandb_run = None
        self.wandb_dir: str | None = None  # this run's wandb directory (RUN/wandb/offline-run-...), for the summary
        self._last_samples: list[Sample] = []
        self._wandb_skipped: list[int] = []  # steps a resumed wandb run already held (not logged twice)
        self._wandb_id: str | None = None
        self._wandb_logged = 0  # the last step an earlier invocation logged to this wandb run (a resume's)
        self._wandb_wanted = steps_left
        if not steps_left and cfg.logger.wandb:
            self.wandb_dir = _last_wandb_dir(Path(run_dir) / "wandb")
        # logger.wandb: opened now (the driver makes the RunLog in set-up, before Ray starts and before any work),
        # so that wandb missing or wandb.init failing refuses the run at once (ConfigError, exit 2)
        self._init_wandb()

    def start(self, done: int) -> None:
        """Drop the records of steps after ``done`` (a resumed run rewrites them); wandb is open already."""
        for writer in (self.metrics, self.fingerprints, self.rollouts):
            writer.truncate_from(done + 1)
        self._init_wandb()  # a RunLog closed and started again
        self._backfill_wandb(done)

    def record_step(self, step: int, samples: list[Sample], metrics: dict, train_metrics: dict,
                    weights_digest: str, *, optimizer_state: str | None = None) -> None:
        fp = fingerprint_from_samples(step, samples, loss=train_metrics["train/loss"],
                                      grad_norm=train_metrics["train/grad_norm"], weights=weights_digest,
                                      optimizer_state=optimizer_state)
        self.fingerprints.write(fp)
        self.metrics.write(metrics)
        if self.cfg.run.save_rollouts:
            self.rollouts.write(step, samples)
        self._last_samples = samples

    # ------------------------------------------------------------------------------------------ console
    def line(self, text: str) -> None:
        if self.cfg.logger.progress:
            print(text, file=sys.stderr, flush=True)

    def progress(self, step: int, last: int, first_done: int, m: dict, elapsed: float) -> None:
        if not self.cfg.logger.progress:
            return
        done = step - first_done
        eta = elapsed / done * (last - step)
        width = 20
        filled = int(width * step / last)
        bar = "#" * filled + "." * (width - filled)
        print(f"[{bar}] step {step}/{last} | reward {m['rollout/reward_mean']:.3f} | loss {m['train/loss']:+.4f} "
              f"| grad {m['train/grad_norm']:.3f} | len {m['rollout/response_length_mean']:.1f} "
              f"| lp_diff {m['train/rollout_logprob_abs_diff']:.1e} | {m['perf/step_time_s']:.2f}s/step "
              f"| ETA {eta:.0f}s", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------------ wandb
    def _init_wandb(self) -> None:
        """Open the wandb run (``logger.wandb``). wandb not importable, or ``wandb.init`` failing (online without
        network or key, a bad project), raises ConfigError, one line naming the fix: the dashboards are part of
        what the run was asked for, so it is refused rather than run without them."""
        lc = self.cfg.logger
        if not lc.wandb or self.wandb_run is not None or not self._wandb_wanted:
            return
        from rlrepro.checks import ConfigError

        _check_project(lc.project)
        fix = "Fix: pip install wandb, or set logger.wandb=false (metrics.jsonl is written either way)"
        os.environ.setdefault("WANDB_MODE", lc.mode)
        try:
            import wandb
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing at import
            raise ConfigError(f"logger.wandb=true but wandb cannot be imported ({_one_line(e)}). {fix}") from None
        # a resumed run continues its wandb run (the id recorded in RUN/wandb), a fresh one starts a new one
        run_id = wandb_run_id(self.run_dir, bool(self.cfg.run.resume))
        self._wandb_id = run_id
        # what earlier invocations logged: the step file of one that closed its wandb run, else (killed) what its
        # offline directories hold on disk
        self._wandb_logged = max(_logged_step(self.run_dir / "wandb", run_id),
                                 _persisted_step(self.run_dir / "wandb", run_id)) if self.cfg.run.resume else 0
        try:
            self.wandb_run = wandb.init(project=lc.project, dir=str(self.run_dir), mode=lc.mode, id=run_id,
                                        resume="allow", name=self.run_dir.name, group=self.cfg.recipe,
                                        config=_plain(self.cfg))
            for group in ("rollout", "train", "repro", "perf", "eval", "episodes"):
                wandb.define_metric(f"{group}/*", step_metric="step")
        except Exception as e:  # noqa: BLE001 - wandb raises its own errors (CommError, UsageError, ...)
            if self.wandb_run is not None:
                self._finish_quietly()
            fixes = [] if lc.mode == "offline" else ["logger.mode=offline (no network; `wandb sync` uploads later)"]
            fixes += ["`wandb login` (online)"] if lc.mode == "online" else []
            fixes.append("logger.wandb=false (metrics.jsonl is written either way)")
            raise ConfigError(f"logger.wandb=true but wandb.init failed (logger.mode={lc.mode}, project "
                              f"{lc.project!r}): {type(e).__name__}: {_one_line(e)}. Fix: set "
                              f"{', or '.join(fixes)}") from None

    def log_wandb(self, step: int, metrics: dict) -> None:
        """Log the step's metrics (its ``metrics.jsonl`` values but the strings: digests, fingerprints) at wandb
        step ``step`` (the training step, also after a resume), plus ``logger.num_table_samples`` samples as a
        table. A step the wandb run already holds (an online run resumed from a checkpoint before its last logged
        step re-executes steps it logged; they are the same values bit for bit) is not logged twice."""
        if self.wandb_run is None:
            return
        import wandb

        held = self._held()
        if step < held:
            if not self._wandb_skipped:
                self.line(f"rlrepro: wandb run already holds steps up to {held - 1} (logged before the resume): "
                          f"step {step} and those after it up to {held - 1} are not logged to wandb again "
                          "(metrics.jsonl has them)")
            self._wandb_skipped.append(step)
            return
        payload = {k: v for k, v in metrics.items() if not isinstance(v, str)}
        n = self.cfg.logger.num_table_samples
        if n:
            table = wandb.Table(columns=["step", "prompt_uid", "prompt", "completion", "reward"])
            for s in self._last_samples[:n]:
                table.add_data(step, s.prompt_uid, s.prompt_text or "", s.completion_text or "", s.reward)
            payload["rollout/samples"] = table
        self.wandb_run.log(payload, step=step)
        self._wandb_logged = max(self._wandb_logged, step)

    def _held(self) -> int:
        """The first step the wandb run does not hold: online, wandb's own count; offline, the record of the earlier
        invocations (``_wandb_logged``)."""
        held = getattr(self.wandb_run, "step", 0)
        return max(held if isinstance(held, int) else 0, self._wandb_logged + 1)

    def _backfill_wandb(self, done: int) -> None:
        """A resume's wandb rows for the steps up to its checkpoint's ``done`` that the wandb run does not hold: an
        earlier invocation killed before wandb wrote its last rows (wandb writes whole 32 KiB blocks) logged them,
        but they never reached the disk, and the resumed run starts after them. They are logged from
        ``metrics.jsonl`` (fsynced per step: the same values), without the samples table; one line says so."""
        if self.wandb_run is None or not self.cfg.run.resume or done < 1:
            return
        first = self._held()
        if first > done:
            return
        records = read_step_records(self.metrics.path) if self.metrics.path.exists() else {}
        steps = [s for s in range(first, done + 1) if s in records]
        for step in steps:
            self.wandb_run.log({k: v for k, v in records[step].items() if not isinstance(v, str)}, step=step)
            self._wandb_logged = max(self._wandb_logged, step)
        if steps:
            self.line(f"rlrepro: wandb run lacked steps {steps[0]}-{steps[-1]} (not written before the earlier run "
                      "stopped): logged now from metrics.jsonl, without their samples tables")

    def _finish_quietly(self) -> None:
        try:
            self.wandb_run.finish(exit_code=1)
        except Exception:  # noqa: BLE001 - the run is being refused for wandb's own failure already
            pass
        self.wandb_run = None

    def close(self) -> None:
        if self.wandb_run is not None:
            files = getattr(self.wandb_run, "dir", None)  # RUN/wandb/<run>/files
            # logger.mode=disabled writes nothing: its run names a directory that is never made
            self.wandb_dir = str(Path(files).parent) if files and Path(files).parent.is_dir() else None
            self.wandb_run.finish()
            self.wandb_run = None
            # recorded once finish() has flushed wandb's rows (a run killed before that is resumed from what its
            # offline directory holds on disk: it re-logs, never loses, the rows wandb had not written);
            # logger.mode=disabled (no directory) wrote no row
            if self._wandb_logged and self.wandb_dir is not None:
                atomic_write_bytes(self.run_dir / "wandb" / WANDB_STEP_FILE,
                                   f"{self._wandb_id} {self._wandb_logged}\n".encode("utf-8"))


def _plain(cfg: Any) -> dict:
    return asdict(cfg)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
