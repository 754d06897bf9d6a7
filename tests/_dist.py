"""Helpers for tests that run a gloo process group over spawned processes on 127.0.0.1.

Imported as ``from _dist import ...``: ``tests/`` has no ``__init__.py``, so pytest (prepend import mode) puts it on
``sys.path``, and spawned children inherit that path when they import the test module holding the worker.
"""
import contextlib
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_process_group(rank: int, world: int, port: int):
    """In a worker: one torch thread, :func:`rlrepro.trainer.enable_determinism`, and the gloo group of ``world``
    ranks for the body (destroyed after, whatever happens)."""
    from rlrepro.trainer import enable_determinism

    torch.set_num_threads(1)
    enable_determinism()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, world: int, *args, out: str, weights_only: bool = False) -> list:
    """Run ``worker(rank, world, port, *args, out)`` in ``world`` spawned processes (a module-level function; it
    saves its result to ``f"{out}.rank{rank}"``) and return the ranks' results in rank order."""
    mp.start_processes(worker, args=(world, free_port(), *args, out), nprocs=world, start_method="spawn", join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=weights_only) for r in range(world)]
