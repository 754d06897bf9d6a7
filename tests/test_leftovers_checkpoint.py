"""A ``step_N.old-PID`` directory (a copy set aside by a checkpoint save killed before its replacement landed) in
the directory of a *fresh* run: preflight.check_run_dir did not count it (scan_checkpoints lists ``step_N`` names
only), so a fresh run without records was accepted, and remove_partial_checkpoints then put the other run's
checkpoint back as ``step_N`` of the fresh run (a later resume of the fresh run would continue from it, and
keep_last would prune the fresh run's own checkpoints in its favour). check_run_dir now counts such directories, so
a fresh run is refused without run.overwrite=true (whose plan deletes ``checkpoints/step_*``)."""
import os

import pytest

from rlrepro.checks import ConfigError
from rlrepro.orchestration import preflight
from rlrepro.orchestration.config import ModelConfig, RunConfig, RunSchema
from rlrepro.trainer.checkpoint import latest_checkpoint, save_checkpoint


def _stray_aside(run):
    root = run / "checkpoints"
    path = save_checkpoint(root, 5, extra_state={"run": "an earlier run"})
    os.rename(path, root / "step_000005.old-4242")
    return root


def test_a_resume_puts_back_the_only_copy_of_a_step(tmp_path):
    root = _stray_aside(tmp_path)
    assert preflight.resume_checkpoint(root, say=lambda _: None) == str(root / "step_000005")


def test_a_fresh_run_does_not_adopt_a_stray_set_aside_checkpoint(tmp_path):
    root = _stray_aside(tmp_path)
    cfg = RunSchema(model=ModelConfig(init="tiny"), run=RunConfig(dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="set aside by an interrupted save"):
        preflight.check_run_dir(cfg, tmp_path, fresh=True)
    cfg.run.overwrite = True  # the user decides: overwrite deletes it
    preflight.check_run_dir(cfg, tmp_path, fresh=True)
    preflight.remove_partial_checkpoints(root, lambda _: None)
    assert latest_checkpoint(root) is None
