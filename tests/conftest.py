import os

# No network, ever: every test runs offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture
def deterministic_torch():
    """Deterministic algorithms on and one CPU thread for the test, restored after (tiny models gain nothing from
    more threads, and a shared 2-core machine makes torch's thread pool stall)."""
    import torch

    from rlrepro.trainer import enable_determinism

    before, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    enable_determinism()
    torch.set_num_threads(1)
    yield
    torch.use_deterministic_algorithms(before)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests (far faster than OpenMP hand-offs per small op)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
