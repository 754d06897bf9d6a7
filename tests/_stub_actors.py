"""Ray-free stand-ins of the driver's actor group, for tests that run the driver's set-up and resume."""
from rlrepro.trainer.checkpoint import load_checkpoint


class StubActors:
    """Ray-free actors: loading a checkpoint returns its extra state; everything else is a no-op."""

    def __init__(self, cfg, model_dir):
        self.restarts = 0

    def load_checkpoint(self, path):
        return load_checkpoint(path, restore_rng=False).extra_state

    def sync_weights(self, version):
        return "00" * 32

    def warm_start(self, *a, **k):
        return [0.0]

    def shutdown(self):
        pass
