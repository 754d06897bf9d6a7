"""Session 38: a resumed run's wandb run gets the rows an earlier, killed invocation logged but wandb never wrote
(wandb writes whole 32 KiB blocks): steps up to the checkpoint the resume starts from are logged from
``metrics.jsonl``, once, with the values it holds."""
import sys
import types
from pathlib import Path

import pytest

from rlrepro.orchestration.runlog import RunLog
from rlrepro.repro.records import MetricsWriter
from test_session36_logdata import RUN_ID, _cfg, _killed_leg
from test_session36_logdata import _Run as _Run36


class _Run(_Run36):
    """Session 36's fake wandb run, recording each row's payload and starting at ``step`` (online, wandb's count
    of the steps the resumed run holds)."""

    def __init__(self, calls, run_dir, step):
        super().__init__(calls, run_dir)
        self.step = step

    def log(self, payload, step=None, **kwargs):
        self.calls.append((step, payload))


@pytest.fixture
def wandb_calls(monkeypatch):
    """wandb.init and its run replaced; ``wandb_calls.server_step``: the step count an online wandb run reports on
    resume (0 offline). wandb.proto stays the real one (the offline reader parses the killed leg's file)."""
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    calls = []
    state = types.SimpleNamespace(calls=calls, server_step=0)
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: _Run(calls, kw["dir"], state.server_step)
    mod.Table, mod.define_metric = None, lambda *a, **k: None
    mod.__path__ = sys.modules["wandb"].__path__ if "wandb" in sys.modules else []
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return state


def _metrics(run_dir: Path, last: int) -> dict[int, dict]:
    rows = {s: {"step": s, "train/loss": 0.1 * s + 1e-17, "rollout/num_samples": 8, "repro/weights_digest": "ab" * 8,
                "perf/step_time_s": 1.0 / 3} for s in range(1, last + 1)}
    w = MetricsWriter(run_dir)
    for s in sorted(rows):
        w.write(rows[s])
    return rows


def test_rows_wandb_never_wrote_before_the_checkpoint_are_logged_from_metrics(tmp_path, wandb_calls, capsys):
    """The killed leg logged steps 1-6, wandb wrote 1-2 to disk; the resume starts from step 5's checkpoint. Old
    code: steps 3-5 were never in the wandb run. Now they are logged once, before 6, with metrics.jsonl's values
    (strings left out, as for every row)."""
    _killed_leg(tmp_path, 2)
    rows = _metrics(tmp_path, 6)
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(5)
    for step in (6, 7):
        log.log_wandb(step, {"step": step})
    log.close()
    assert [s for s, _ in wandb_calls.calls] == [3, 4, 5, 6, 7]
    for step, payload in wandb_calls.calls[:3]:
        want = {k: v for k, v in rows[step].items() if k != "repro/weights_digest"}
        assert payload == want and all(type(payload[k]) is type(want[k]) for k in want)
    assert "lacked steps 3-5" in capsys.readouterr().err
    assert (tmp_path / "wandb" / "rlrepro_logged_step").read_text() == f"{RUN_ID} 7\n"


def test_nothing_is_backfilled_when_the_run_holds_the_steps(tmp_path, wandb_calls, capsys):
    """Rows on disk up to step 5, the resume from step 3's checkpoint: nothing before 6 is logged (as before)."""
    _killed_leg(tmp_path, 5)
    _metrics(tmp_path, 5)
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(3)
    for step in range(4, 8):
        log.log_wandb(step, {"step": step})
    log.close()
    assert [s for s, _ in wandb_calls.calls] == [6, 7]
    assert "lacked" not in capsys.readouterr().err


def test_online_the_servers_count_decides(tmp_path, wandb_calls):
    """Online, wandb's own step count on resume says what the run holds: 4 rows held, resume from step 6."""
    _killed_leg(tmp_path, 0)
    _metrics(tmp_path, 6)
    wandb_calls.server_step = 5  # steps 1-4 held: the next is 5
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(6)
    log.log_wandb(7, {"step": 7})
    log.close()
    assert [s for s, _ in wandb_calls.calls] == [5, 6, 7]


def test_a_fresh_run_backfills_nothing(tmp_path, wandb_calls):
    _metrics(tmp_path, 3)
    log = RunLog(_cfg(tmp_path, resume=False), tmp_path)
    log.start(0)
    log.log_wandb(1, {"step": 1})
    log.close()
    assert [s for s, _ in wandb_calls.calls] == [1]


def test_a_resume_that_turns_wandb_on_gets_the_earlier_steps(tmp_path, wandb_calls):
    """The first leg ran with logger.wandb=false (no wandb directory): the resume's new wandb run gets steps 1-3
    from metrics.jsonl, then its own."""
    _metrics(tmp_path, 3)
    log = RunLog(_cfg(tmp_path, resume=True), tmp_path)
    log.start(3)
    log.log_wandb(4, {"step": 4})
    log.close()
    assert [s for s, _ in wandb_calls.calls] == [1, 2, 3, 4]
