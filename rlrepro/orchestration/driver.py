"""The GRPO driver: batch -> generate -> reward -> advantages -> train -> sync -> record, step after step.

Everything that decides a number is keyed, never timed: the prompts of step k come from the seeded epoch order
(its cursor is checkpointed), each sample's sampling seed is ``request_seed(run.seed, k, prompt uid, sample
index)``, requests are dealt to rollout workers by position, and results are put back in (prompt uid, sample
index) order whatever order they arrive in. So the number of workers, their batch settings and their speed
cannot change a run, and a resumed run repeats the uninterrupted one.

Set-up checks live in :mod:`.preflight`, the run's records and console output in :mod:`.runlog`, the actors in
:mod:`.actors`.
"""
from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from rlrepro.repro.records import CHECKPOINTS_DIR, CONFIG_FILE, ReproError, atomic_write_bytes
from rlrepro.samples import Sample

from . import preflight
from .actors import ActorGroup
from .config import ConfigError, RunSchema, to_schema, uses_episodes, validate, validate_model_layout  # noqa: F401
from .episodes import turn_stop_token_ids
from .generation import GenerationSteps, PhaseTimer, shaped_penalties
from .pipeline import PipelineSteps, pending_from_state, pending_to_state, test_delay
from .ray_start import restore_sigterm, sigterm_as_interrupt
from .errors import RunFailed, RunInterrupted, TrainerHung, dead_actor_class, describe, is_actor_death, unwrap
from .run_dirs import remove_created_entries, uninterruptible
from .run_lock import RunLock
from .runlog import RunLog, perf_memory_metrics, step_metrics

__all__ = ["GRPODriver", "run_training", "shaped_penalties", "config_yaml"]


def config_yaml(cfg: RunSchema) -> str:
    """The resolved config as ``config.yaml`` holds it."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)


def _cluster_info(actors) -> dict | None:
    """Where the actors ran, for inputs.json (informational); None for an actor group that cannot say (tests'
    stand-ins)."""
    info = getattr(actors, "cluster_info", None)
    return info() if callable(info) else None


def actor_group_class():
    """:class:`ActorGroup`, or the fault-injecting one when a test sets ``RLREPRO_FAULTS``."""
    if not os.environ.get("RLREPRO_FAULTS", "").strip():
        return ActorGroup
    from .fault_injection import FaultInjectingActorGroup, FaultPlan

    plan = FaultPlan.from_env()
    return lambda cfg, model_dir: FaultInjectingActorGroup(cfg, model_dir, plan)


class GRPODriver(GenerationSteps, PipelineSteps):
    def __init__(self, cfg: Any, run_dir: str | Path | None = None, *, override_keys: list[str] | None = None) -> None:
        """``override_keys``: the dotted keys the command line set (what a resume may change, rlrepro.cli passes
        them); None compares every key of ``cfg`` with the record on a resume."""
        self.cfg = validate(cfg)  # every rule, as the command line runs them (a Python caller skipped the cross ones)
        self.override_keys = override_keys
        self.run_dir = Path(run_dir or self.cfg.run.dir)
        self.actors: ActorGroup | None = None
        self.pending: dict = {}  # rollout.max_staleness: the batches generated ahead, by step
        self._ahead_failed: int | None = None  # the batch whose generate-ahead failed (pipeline.py)
        self._in_warm_start = False  # the supervised warm start (before step 1) is running
        self.log: RunLog | None = None
        # rlrepro verify: (from_step, config) of each later eval.* setting a resume amended (Evaluator's ``later``)
        self.eval_later: list = []

    # ------------------------------------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Check everything that can be known before work (reward, model directory, tokenizer, data, lengths),
        then write config.yaml and start the actors. A check that fails raises ConfigError / ValueError /
        FileNotFoundError naming the value and the fix, before Ray starts and before config.yaml is written."""
        from rlrepro.data import EpochOrder, load_reward_fn
        from rlrepro.model import load_tokenizer, prepare_base_model
        from rlrepro.model.checkpoint_io import check_pretrained

        cfg = self.cfg
        preflight.check_devices(cfg)
        self.reward_fn = load_reward_fn(cfg.reward.fn)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        m = cfg.model
        self.model_dir = prepare_base_model(self.run_dir, init=m.init, path=m.path, init_seed=m.init_seed,
                                            dtype=m.dtype, tiny_overrides=m.tiny_overrides, overwrite=cfg.run.overwrite)
        self.model_config = check_pretrained(self.model_dir)
        validate_model_layout(cfg, self.model_config)  # e.g. train.tensor_parallel must divide the heads
        self.tokenizer = load_tokenizer(self.model_dir)
        preflight.check_tokenizer(self.model_config, self.tokenizer, self.model_dir)
        # episodes with the chat template: the token that closes a turn (the EOS, or the template's own: Base models)
        self.end_of_turn = preflight.check_end_of_turn(cfg, self.tokenizer, self.model_dir)
        self.prompts, self.data_files = self._load_prompts()
        if len(self.prompts) < cfg.rollout.prompts_per_step:
            raise ConfigError(f"the data set has {len(self.prompts)} prompts < rollout.prompts_per_step="
                              f"{cfg.rollout.prompts_per_step}: a step draws that many distinct prompts. Fix: set "
                              f"rollout.prompts_per_step={max(1, len(self.prompts))} or less, or give more data")
        preflight.check_lengths(cfg, self.prompts, self.model_config)
        preflight.check_micro_batch_tokens(cfg, self.prompts, self.model_config, uses_episodes(cfg))
        preflight.check_reward(cfg, self.reward_fn, self.prompts)
        preflight.warn_rationale_answers(cfg, self.prompts)
        if not cfg.run.resume:  # a resume writes it in run(), once the checkpoint and data order are accepted
            atomic_write_bytes(self.run_dir / CONFIG_FILE, config_yaml(cfg).encode("utf-8"))
        self.order = EpochOrder(len(self.prompts), seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        eos = self.tokenizer.eos_token_id
        self.stop_token_ids = [eos] if eos is not None else []
        self.turn_stop_token_ids = turn_stop_token_ids(self.tokenizer, self.stop_token_ids, self.end_of_turn)
        self.env_spec = None
        if uses_episodes(cfg):  # multi-turn episodes (rlrepro.envs, orchestration.episodes); checked now
            self.env_spec = self.load_environment()
        self.evaluator = None
        if cfg.eval.every or self.eval_later:  # held-out evaluation (orchestration.evaluation); prompts checked now
            from .evaluation import Evaluator

            self.evaluator = Evaluator(cfg, self.tokenizer, self.reward_fn, self.turn_stop_token_ids,
                                       self.model_config, later=self.eval_later, load_prompts=bool(cfg.eval.every),
                                       env_spec=self.env_spec, end_of_turn=self.end_of_turn)
        self._check_resume()  # a resume's checkpoint and data, against this run's (before Ray starts)
        self.log = RunLog(cfg, self.run_dir, steps_left=self._steps_left())
        self.actors = actor_group_class()(cfg, str(self.model_dir))

    def _load_prompts(self) -> tuple[list, list[Path]]:
        """The run's prompts (rlrepro.data.build_prompts) and the data files they came from."""
        from rlrepro.data import build_prompts, load_records
        from rlrepro.data.sources import source_files

        from .synthetic_file import prepare_synthetic_data

        d = self.cfg.data
        source = d.source
        fields = dict(prompt_field=d.prompt_field, answer_field=d.answer_field, id_field=d.id_field,
                      messages_field=d.messages_field)
        if source is None:  # the synthetic task, written as jsonl (checked against its settings), read back
            run = self.cfg.run  # through the same loader
            source = prepare_synthetic_data(self.run_dir, d.synthetic, overwrite=run.overwrite and not run.resume,
                                            resume=run.resume)
            fields = dict(prompt_field="prompt", answer_field="answer", id_field="id", messages_field=None)
        records, self.data_stats = load_records(str(source), split=d.split, on_bad_row=d.on_bad_row,
                                                allow_hub=d.allow_hub, limit=d.limit, revision=d.revision, **fields)
        try:
            prompts, self.prompt_stats = build_prompts(
                records, self.tokenizer, template=d.template, system_prompt=d.system_prompt,
                use_chat_template=d.use_chat_template, max_prompt_tokens=d.max_prompt_tokens,
                on_bad_row=d.on_bad_row, on_unknown_token=d.on_unknown_token, source=str(source))
        except ValueError as e:  # a prompt the data keys cannot make work: bad input, named with its key
            raise ConfigError(str(e)) from None
        return prompts, source_files(Path(source))  # not the records of runs inside a data folder

    # ------------------------------------------------------------------------------------------------ one step
    def run_step(self, step: int) -> dict:
        cfg, t = self.cfg, PhaseTimer()
        if cfg.rollout.max_staleness:  # batch `step` was generated ahead; batch step + K is generated meanwhile
            samples, penalties, num_reward_errors, round_metrics, train_metrics = self.pipelined_batch(step, t)
        else:
            samples, penalties, num_reward_errors, round_metrics = self.collect(step, t)
            self.compute_advantages(samples)
            test_delay("train", step)  # RLREPRO_TEST_DELAYS only (tests): wall-clock time that must change nothing
            train_metrics = self.train(step, samples)
            t("train")
        weights_digest = self.actors.sync_weights(version=step)
        optimizer_state = self.actors.optimizer_state_digest()  # what the weights do not show (float32 masters)
        t("sync")
        t_eval = time.perf_counter()  # eval.every: on the engines, with the weights of this step
        eval_metrics = self.evaluator(self.actors, step) if self.evaluator is not None else {}
        t_eval = time.perf_counter() - t_eval
        metrics = step_metrics(step, samples, train_metrics, t.times, weights_digest=weights_digest,
                               num_reward_errors=num_reward_errors, penalties=penalties,
                               restarts=self.actors.restarts)
        metrics.update(round_metrics)
        metrics.update(perf_memory_metrics(cfg, train_metrics, t.times["train"], self.actors.memory_stats()))
        if eval_metrics:
            metrics.update(eval_metrics, **{"perf/eval_s": t_eval})
        self.log.record_step(step, samples, metrics, train_metrics, weights_digest, optimizer_state=optimizer_state)
        return metrics

    def compute_advantages(self, samples: list[Sample]) -> None:
        """The advantages (``train.advantage``, ``train.advantage_std``) of the step's batch into
        ``sample.advantage``."""
        import torch

        from rlrepro.trainer import compute_advantages

        train = self.cfg.train
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32).view(-1, self.cfg.rollout.group_size)
        advantages = compute_advantages(rewards, mode=train.advantage, std=train.advantage_std)
        for s, a in zip(samples, advantages.view(-1).tolist()):
            s.advantage = a

    def train(self, step: int, samples: list[Sample]) -> dict:
        self._trainer_step = None  # unknown while the update runs
        try:
            metrics = self.actors.train_step(samples)
        except FloatingPointError:
            self._trainer_step = step - 1  # the trainer refused the update before any weight changed
            raise
        self._trainer_step = step
        if metrics.get("train/nonfinite_skipped"):
            self.log.line(f"step {step}: non-finite loss or gradient norm; update skipped (train.on_nonfinite=skip)")
        return metrics

    # ------------------------------------------------------------------------------------------------ warm start
    def warm_start(self) -> None:
        """The supervised warm start (rlrepro.trainer.warm_start) on examples from the run's own data: the
        synthetic task (its own seed) when data.source is null, else the run's prompts and their answers."""
        from rlrepro.data import make_synthetic_records, tokenize_prompt

        cfg, ws = self.cfg, self.cfg.warm_start
        if ws.steps <= 0:
            return
        d = cfg.data
        if d.source is None:
            syn = d.synthetic
            # a demonstration has one example per turn: enough episodes that the warm start sees each about once
            num = min(4096, ws.batch_size * ws.steps // 2) if ws.target == "demonstration" else ws.batch_size * 4
            records = make_synthetic_records(syn.task, max(256, num), syn.seed + 1_000_003 + ws.seed,
                                             **syn.kwargs)
            pairs = [(tokenize_prompt(rec, self.tokenizer, template=d.template, system_prompt=d.system_prompt,
                                      use_chat_template=d.use_chat_template), rec.answer) for rec in records]
        else:
            records = [p.record for p in self.prompts]
            pairs = [(p.token_ids, p.record.answer) for p in self.prompts]
        if ws.target == "demonstration":
            examples = self.demonstration_examples(records, [ids for ids, _ in pairs])
        else:
            rng = random.Random(ws.seed)
            close = self.turn_close_ids()  # the EOS, or the chat template's end of turn
            charset = sorted({c for _, answer in pairs for c in answer})
            examples = []
            for ids, answer in pairs:
                target = answer if ws.target == "answer" else "".join(rng.choice(charset) for _ in answer)
                examples.append((ids, self.tokenizer.encode(target) + close))
        # said first: on a CPU the tool recipe's 500 steps take minutes, with nothing else printed meanwhile
        self.log.line(f"warm start: {ws.steps} supervised steps of {ws.batch_size} examples before step 1 "
                      f"(warm_start.steps; target {ws.target})...")
        losses = self.actors.warm_start(examples, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size, seed=ws.seed)
        self.log.line(f"warm start: {ws.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    # ------------------------------------------------------------------------------------------------ the loop
    def checkpoint_root(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def save_checkpoint(self, step: int, data_order: dict | None = None, pending: dict | None = None) -> str:
        order = self.order.state_dict() if data_order is None else data_order
        extra = {"step": step, "data_order": order, "recipe": self.cfg.recipe}
        if self.cfg.rollout.max_staleness:  # the batches generated ahead (rlrepro.orchestration.pipeline)
            extra["pending"] = pending_to_state(self.pending if pending is None else pending)
        return self.actors.save_checkpoint(str(self.checkpoint_root()), step, extra, self.cfg.checkpoint.keep_last)

    def export_hf(self, step: int) -> Path | None:
        """checkpoint.export_hf: the policy of ``step`` to RUN/export/step_NNNNNN (rlrepro.orchestration.export).
        A failure is reported and the run goes on: the checkpoints are the record, and rlrepro export redoes it."""
        from .export import export_run_step

        t = time.perf_counter()
        try:
            path = export_run_step(self.actors, self.run_dir, step, self.cfg.checkpoint.keep_last, self.model_dir)
        except Exception as e:  # noqa: BLE001 - the run's records and checkpoints do not depend on it
            self.log.line(f"rlrepro: warning: the HF export of step {step} failed ({type(e).__name__}: {e}); the "
                          f"checkpoints are intact, export one with: rlrepro export {self.run_dir} OUT")
            return None
        self.log.line(f"HF export {path}: {time.perf_counter() - t:.1f} s")
        return path

    def write_summary(self, wall_s: float, steps_run: int, *, failure: RunFailed | None = None) -> None:
        """RUN/summary.json and summary.txt, printed to stderr (rlrepro.orchestration.summary); from the records,
        so a resumed run's covers the whole run. Closes the wandb run first (the summary names its directory).
        ``failure``: the error a failed or interrupted run ends with (its status, message and resume command)."""
        from .summary import run_summary, write_summary

        self.log.close()
        try:
            summary = run_summary(self.run_dir, self.cfg, wall_s=wall_s, steps_this_run=steps_run,
                                  wandb_dir=self.log.wandb_dir, failure=failure)
            write_summary(self.run_dir, summary, echo=self.cfg.logger.progress)
        except Exception as e:  # noqa: BLE001 - the run itself is complete and recorded
            self.log.line(f"rlrepro: warning: the run summary could not be written ({type(e).__name__}: {e})")

    def _summary_of_failure(self, failure: RunFailed, t_run: float) -> None:
        """The summary of a run that stopped early (only once its records were opened: a set-up failure has
        none)."""
        if self.log is None or getattr(self, "_start_step", None) is None:
            return
        self.write_summary(time.perf_counter() - t_run, max(0, self._done_step - self._start_step), failure=failure)

    def restore(self, ckpt_path: str) -> int:
        extra = self.actors.load_checkpoint(ckpt_path)
        self.order.load_state_dict(extra["data_order"])
        step = int(extra["step"])
        self.pending = pending_from_state(extra.get("pending"))
        from .resume_checks import check_pending

        check_pending(ckpt_path, step, self.pending, self.cfg.rollout.max_staleness)
        self.actors.sync_weights(version=step)
        return step

    def run(self, *, start_checkpoint: str | None = None, last_step: int | None = None) -> list[dict]:
        """Run steps up to ``last_step`` (default train.steps). Resumes from ``start_checkpoint`` if given, else
        from the latest complete checkpoint when run.resume is true, else from scratch. Ctrl-C or SIGTERM stops
        it with :class:`RunInterrupted` (exit 130 from the CLI), naming the checkpoint left. The run directory
        is locked for the whole run (:class:`~.run_lock.RunLock`): a second run into it is refused first."""
        # SIGTERM is an interrupt from the start, as Ctrl-C is: one that comes while the run directory is being
        # prepared or Ray starts is cleaned up like a refusal (below), not a kill that leaves a half-made run
        previous_sigterm = sigterm_as_interrupt()
        lock, before = None, None
        try:
            lock = RunLock(self.run_dir).acquire()  # before anything is read, written or deleted
            before = set(os.listdir(self.run_dir))  # under the lock: nothing another run made is taken as ours
            return self._run_locked(start_checkpoint, last_step)
        except (ConfigError, ValueError, FileNotFoundError, ReproError, KeyboardInterrupt, RunInterrupted) as e:
            # refused or interrupted in set-up: what this start made goes again, while the lock is still held
            # (released last)
            if getattr(self, "_start_step", None) is not None:
                raise
            if before is not None:
                with uninterruptible():  # a second Ctrl-C or SIGTERM must not stop the removal half-way
                    self._remove_created(before)
                    lock.release(remove_created=True)  # and the directory, if this start made it (run_lock.py)
            if isinstance(e, ReproError):  # a damaged record (a step log, inputs.json): bad input, exit 2
                raise ConfigError(str(e)) from None
            if isinstance(e, KeyboardInterrupt) or (isinstance(e, RunInterrupted)
                                                    and self._fresh_start(start_checkpoint)):
                raise RunInterrupted("interrupted before the run started; nothing was recorded", step=0,
                                     checkpoint=None, cause=e) from None
            raise
        finally:
            if lock is not None:
                lock.release()
            restore_sigterm(previous_sigterm)

    def _fresh_start(self, start_checkpoint: str | None) -> bool:
        return start_checkpoint is None and not self.cfg.run.resume

    def _remove_created(self, before: set[str]) -> None:
        """A start refused before its first step writes nothing: the entries it created in the run directory
        (base_model/, a synthetic data set, config.yaml) are removed (the lock file and a directory this start
        created go when the lock is released: RunLock.release(remove_created=True))."""
        with uninterruptible():
            remove_created_entries(self.run_dir, before)

    def _run_locked(self, start_checkpoint: str | None, last_step: int | None) -> list[dict]:
        resume_from, t_run = None, time.perf_counter()
        if start_checkpoint is None and self.cfg.run.resume:  # names each checkpoint it skips; refuses when
            resume_from = preflight.resume_checkpoint(self.checkpoint_root())  # there are some but none is usable
            self._reconcile_resume()  # the recorded config, with the bit-neutral changes asked for
        cfg = self.cfg
        last_step = self._last_step = cfg.train.steps if last_step is None else last_step
        preflight.check_run_dir(cfg, self.run_dir, fresh=start_checkpoint is None and not cfg.run.resume)
        self._done_step, self._done_order, self._trainer_step, self._saving = 0, None, 0, False
        self._start_step = None
        self._in_warm_start = False  # the supervised warm start (before step 1) is running
        # the checkpoint a resume continues from: setup checks its data order against the data before Ray starts
        self._resume_ckpt = start_checkpoint if start_checkpoint is not None else resume_from
        try:
            self.setup()
            sigterm_as_interrupt()  # again after Ray started (it installs a SIGTERM handler of its own); run() restores
            preflight.remove_partial_checkpoints(self.checkpoint_root(), self.log.line)
            ckpt = self._resume_ckpt
            if cfg.train.warmup_steps > cfg.train.steps:
                self.log.line(f"rlrepro: train.warmup_steps={cfg.train.warmup_steps} > train.steps="
                              f"{cfg.train.steps}: the LR warm-up is capped at {cfg.train.steps} steps")
            if ckpt is not None:
                if cfg.train.kl_coef > 0:
                    self.warm_start()  # rebuilds the KL reference (the warm-started policy) deterministically
                done = self.restore(ckpt)
                self.log.line(f"resumed from {ckpt} (step {done})")
                if done < last_step:  # no step left to run: no inputs of steps that never run are recorded
                    self._record_inputs(None, from_step=done + 1)
            else:
                done = 0
                self._in_warm_start = True
                self.warm_start()
                self._in_warm_start = False
                self._record_inputs(self.actors.sync_weights(version=0))
            if cfg.run.resume:  # written once nothing can refuse the resume any more (setup writes a fresh run's)
                self._write_amendments()
                atomic_write_bytes(self.run_dir / CONFIG_FILE, config_yaml(cfg).encode("utf-8"))
            self.log.start(done)
            self._start_step = done
            history = self._loop(done, last_step)
            self.write_summary(time.perf_counter() - t_run, len(history))
            return history
        except KeyboardInterrupt as e:
            failure = self._failed(self._done_step + 1, e)
            self._summary_of_failure(failure, t_run)
            raise failure from None
        except RunFailed as failure:
            self._summary_of_failure(failure, t_run)
            raise
        finally:
            self.close()

    def _reconcile_resume(self) -> None:
        """A resume runs with the recorded config.yaml. The keys given on the command line (``override_keys``;
        all keys when the driver was built without the list) that differ from the record are refused, except the
        ones that cannot change bits (rlrepro.orchestration.resume), which are applied and appended to
        ``amendments.jsonl`` with the step they take effect from. Refused before anything is written."""
        from omegaconf import OmegaConf

        from rlrepro.trainer import latest_checkpoint

        from .config import migrate_legacy_keys
        from .resume import reconcile_resume, with_keys

        path = self.run_dir / CONFIG_FILE
        if not path.is_file():
            return
        recorded = migrate_legacy_keys(OmegaConf.to_container(OmegaConf.load(path), resolve=True), warn=False)
        composed = OmegaConf.to_container(OmegaConf.create(config_yaml(self.cfg)), resolve=True)
        if self.override_keys is None:
            requested = composed
        else:
            requested = with_keys(recorded, composed, self.override_keys)
        found = latest_checkpoint(self.checkpoint_root())
        done = int(found.name.split("_")[1]) if found is not None else 0
        config, amendments = reconcile_resume(recorded, requested, completed_step=done)
        self.cfg = validate(config)
        # how this command started the run is not an amendment of the run
        amendments = [a for a in amendments if a["key"] not in ("run.resume", "run.dir", "run.overwrite")]
        self._amendments = amendments  # written and said once the resume is accepted (_write_amendments)

    def _write_amendments(self) -> None:
        import json

        amendments = getattr(self, "_amendments", None)
        if not amendments:
            return
        for a in amendments:
            print(f"rlrepro: resume amends {a['key']}: {a['old']!r} -> {a['new']!r} from step {a['from_step']} "
                  "(recorded in amendments.jsonl)", file=sys.stderr)
        log_path = self.run_dir / "amendments.jsonl"
        old = log_path.read_bytes() if log_path.is_file() else b""
        new = "".join(json.dumps(a, sort_keys=True) + "\n" for a in amendments).encode()
        atomic_write_bytes(log_path, old + new)
        self._amendments = None

    def _steps_left(self) -> bool:
        """False for a resume from a checkpoint at or past the last step to run: it runs no step, logs nothing."""
        ckpt = getattr(self, "_resume_ckpt", None)
        try:
            done = int(Path(ckpt).name.split("_")[1]) if ckpt is not None else 0
        except (IndexError, ValueError):
            return True
        return done < (getattr(self, "_last_step", None) or self.cfg.train.steps)

    def _check_resume(self) -> None:
        """Before Ray starts: the checkpoint a resume continues from, its data order and batches generated ahead
        against this run's prompts and config; a resume's data set against inputs.json (rlrepro.orchestration.
        resume_checks). Raises ConfigError naming what differs and the fix."""
        from . import resume_checks

        if getattr(self, "_resume_ckpt", None) is not None:
            resume_checks.check_checkpoint_state(self._resume_ckpt, self.order, self.cfg)
        if self.cfg.run.resume:
            self._inputs_now = self._collect_inputs(None)
            resume_checks.check_inputs(self.run_dir, self._inputs_now)

    def _collect_inputs(self, weights_digest: str | None) -> dict:
        from rlrepro.repro.inputs import collect_inputs

        return collect_inputs(data_files=self.data_files, records_digest=self.data_stats.records_digest,
                              data_revision=self.cfg.data.revision, model_dir=self.model_dir,
                              weights_digest=weights_digest,
                              eval_files=self.evaluator.files if self.evaluator is not None else None,
                              cluster=_cluster_info(self.actors),
                              code={"reward.fn": self.reward_fn,
                                    **({"env.fn": self.env_spec.factory} if self.env_spec is not None else {})})

    def _record_inputs(self, weights_digest: str | None, from_step: int = 1) -> None:
        """``inputs.json``: digests of the data files, records, tokenizer and starting weights, and every
        environment knob that can change bits (rlrepro.repro.inputs). A resumed run keeps the record of the first
        start; what differs now is said on stderr and appended to the record's ``resumes`` (resume_checks)."""
        from rlrepro.repro.inputs import read_inputs, write_inputs

        from .resume_checks import record_resumed_inputs

        recorded = read_inputs(self.run_dir) if weights_digest is None else None
        if recorded is None:
            write_inputs(self.run_dir, self._collect_inputs(weights_digest))
            return
        now = getattr(self, "_inputs_now", None) or self._collect_inputs(None)  # pre-flight's: hashed once
        cluster = _cluster_info(self.actors)
        if cluster is not None:
            now["cluster"] = cluster
        record_resumed_inputs(self.run_dir, recorded, dict(now, weights_digest=recorded.get("weights_digest")),
                              from_step, generated_ahead=sorted(self.pending))

    def _loop(self, done: int, last_step: int) -> list[dict]:
        cfg = self.cfg
        history = []
        t_start = time.perf_counter()
        # what a checkpoint of the last completed step needs, should a later step fail
        self._done_step, self._done_order, self._trainer_step = done, self.order.state_dict(), done
        self._done_pending = dict(self.pending)
        for step in range(done + 1, last_step + 1):
            self._saving = False
            try:
                metrics = self.run_step(step)
                self._done_step, self._done_order = step, self.order.state_dict()
                self._done_pending = dict(self.pending)
                history.append(metrics)
                self.log.log_wandb(step, metrics)
                every = cfg.checkpoint.every
                if (every and step % every == 0) or (step == last_step and cfg.checkpoint.save_last):
                    self._saving = True
                    t_ckpt = time.perf_counter()
                    path = self.save_checkpoint(step)
                    self.log.line(f"checkpoint {path}: {time.perf_counter() - t_ckpt:.1f} s")
                    self._saving = False
                    if cfg.checkpoint.export_hf:
                        self.export_hf(step)
            except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure of a step ends the run
                raise self._failed(step, e) from e
            self.log.progress(step, last_step, done, metrics, time.perf_counter() - t_start)
        if cfg.checkpoint.export_hf and self._done_step > 0:  # the end's model, when no checkpoint exported it
            from .export import export_path

            if not export_path(self.run_dir, self._done_step).is_dir():
                self.export_hf(self._done_step)
        return history

    def _failed(self, step: int, error: BaseException) -> RunFailed:
        """The error a failed or interrupted step ends the run with. When the trainer still holds the state of the
        last completed step (the failure came before the update, or the update was refused as non-finite) and
        that step has no checkpoint, one is written first, so a resumed run repeats nothing that was recorded."""
        from rlrepro.trainer import latest_checkpoint
        from rlrepro.trainer.checkpoint import checkpoint_dir_name

        if isinstance(error, RunFailed):
            return error
        interrupted = isinstance(error, KeyboardInterrupt)
        cause = unwrap(error)
        notes, saved = [], None
        done = self._done_step
        # rollout workers are replaced during generate and weight sync: a death that ends the run is the trainer's,
        # unless Ray names a RolloutWorker (one that died between phases)
        trainer_died = not interrupted and is_actor_death(error) and dead_actor_class(error) != "RolloutWorker"
        trainer_died = trainer_died or isinstance(cause, TrainerHung)  # stopped already: asked for no checkpoint
        if (self.actors is not None and self._trainer_step == done and done > 0 and not self._saving
                and not trainer_died and not (self.checkpoint_root() / checkpoint_dir_name(done)).is_dir()):
            try:
                saved = self.save_checkpoint(done, data_order=self._done_order, pending=self._done_pending)
                notes.append(f"saved a checkpoint of the last completed step {done}: {saved}")
            except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
                notes.append(f"a checkpoint of the last completed step {done} could not be saved ({describe(e)})")
        if self._saving:
            notes.append(f"the checkpoint of step {step} was not written (nothing partial is ever loaded)")
        ahead = self._ahead_failed
        if ahead is not None and self._trainer_step == step:
            notes.append(f"the generation of batch {ahead} failed while step {step} trained (rollout.max_staleness="
                         f"{self.cfg.rollout.max_staleness}): the update of step {step} was made, so the trainer no "
                         f"longer holds step {done}, and step {step} cannot be saved without batch {ahead}; no "
                         "checkpoint is written at such a failure (checkpoint.every bounds the steps repeated)")
        if interrupted and done < step and self._trainer_step != done and not self._saving and not self._in_warm_start:
            made = "was under way" if self._trainer_step is None else "was made"
            notes.append(f"the update of step {step} {made} when the run stopped, so the trainer no longer holds step "
                         f"{done} and no checkpoint of it could be written (checkpoint.every bounds the steps "
                         "repeated)")
        if trainer_died and not isinstance(cause, TrainerHung):
            notes.append("the trainer process died (out of memory? killed?)")
        kind_of = type(cause).__name__ if cause is not None else ""
        if kind_of in ("EnvError", "RewardError"):  # the same inputs fail the same way: a resume alone repeats it
            code = "environment (env.name / env.fn)" if kind_of == "EnvError" else "reward function (reward.fn)"
            notes.append(f"the {code} raised: fix its code first (a resume runs the same episode again, bit for bit)")
        latest = latest_checkpoint(self.checkpoint_root())
        where = f"{latest}" if latest is not None else "none (a resumed run starts from step 1)"
        if saved is not None and latest is not None and Path(saved) == Path(latest):  # named once, in its note
            where = None
        during = "the warm start (warm_start.steps, before step 1)" if self._in_warm_start else f"step {step}"
        what = (f"interrupted during {during}" if interrupted else f"{during} failed: {describe(error)}")
        message = (what + ". " + "".join(n[0].upper() + n[1:] + ". " for n in notes)
                   + (f"The last complete checkpoint is {where}; rerun" if where else "Rerun")
                   + " with run.resume=true to continue from it (the steps after it are repeated bit for bit).")
        kind = RunInterrupted if interrupted else RunFailed
        return kind(message, step=step, checkpoint=None if latest is None else str(latest), cause=cause)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.actors is not None:
            self.actors.shutdown()
            self.actors = None


_sigterm_as_interrupt, _restore_sigterm = sigterm_as_interrupt, restore_sigterm  # the older private names


def run_training(cfg: Any, *, override_keys: list[str] | None = None) -> list[dict]:
    return GRPODriver(cfg, override_keys=override_keys).run()

