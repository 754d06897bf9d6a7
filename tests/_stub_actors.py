"""Ray-free stand-ins of the driver's actor group, for tests that run the driver's set-up and resume."""
from rlrepro.trainer.checkpoint import load_checkpoint


class Reached(Exception):
    """The driver's set-up passed every check and got as far as starting Ray."""


class NoRay:
    """An actor group whose construction raises :class:`Reached`: set-up stops where Ray would start."""

    def __init__(self, *a, **k):
        raise Reached


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
