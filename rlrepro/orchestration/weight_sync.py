"""Weight sync from the trainer to rollout engines over a torch.distributed group.

The trainer is rank 0 and each rollout worker one more rank; every weight is broadcast from rank 0 in sorted
name order, after a header that carries the version and the tensors' names, shapes and dtypes, so a worker
refuses a mismatched model instead of loading it silently. A broadcast is a copy, so the engine receives the
trainer's bits exactly. Backend ``gloo`` on CPU, ``nccl`` between GPUs (the path for an engine on its own
GPU); the object store path in :mod:`.ray_runtime` remains the default.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist


class WeightBroadcaster:
    """One side of the group: ``rank 0`` sends, other ranks receive."""

    def __init__(self, init_method: str, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 300.0) -> None:
        if world_size < 2:
            raise ValueError(f"a weight-sync group needs the trainer and at least one worker; world_size={world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        assert self.rank == 0, "only rank 0 (the trainer) sends"
        items = sorted(named, key=lambda kv: kv[0])
        header = {"version": version, "tensors": [(n, tuple(t.shape), str(t.dtype)) for n, t in items]}
        self._broadcast_object(header)
        if not self._all_accept(True):
            raise ValueError(f"weight sync to version {version}: a worker refused the weights (model mismatch; "
                             "see the worker's error)")
        for _, t in items:
            dist.broadcast(t.detach().to(self.device).contiguous(), src=0)

    def receive(self, params: dict[str, torch.Tensor]) -> int:
        """Receive into ``params`` (name -> tensor, e.g. ``dict(model.named_parameters())``); returns the version."""
        assert self.rank != 0, "rank 0 sends"
        header = self._broadcast_object(None)
        problem = self._check(header, params)
        if not self._all_accept(problem is None):  # every rank agrees before any tensor moves
            raise ValueError(problem or "weight sync: another worker refused the weights (model mismatch)")
        for name, shape, dtype in header["tensors"]:
            target = params[name]
            buf = torch.empty(shape, dtype=target.dtype, device=self.device)
            dist.broadcast(buf, src=0)
            with torch.no_grad():
                target.copy_(buf)
        return int(header["version"])

    @staticmethod
    def _check(header: dict, params: dict[str, torch.Tensor]) -> str | None:
        names = [n for n, _, _ in header["tensors"]]
        if sorted(params) != names:
            missing, extra = sorted(set(names) - set(params)), sorted(set(params) - set(names))
            return (f"weight sync: the trainer sends tensors this engine lacks ({missing[:4]}) or the engine has "
                    f"tensors the trainer does not send ({extra[:4]}); are both the same model?")
        for name, shape, dtype in header["tensors"]:
            target = params[name]
            if tuple(target.shape) != tuple(shape) or str(target.dtype) != dtype:
                return (f"weight sync: {name} is {tuple(target.shape)} {target.dtype} here but {tuple(shape)} "
                        f"{dtype} on the trainer")
        return None

    def _all_accept(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
