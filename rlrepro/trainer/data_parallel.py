"""Data parallelism with an order-fixed gradient sum.

``torch.distributed.all_reduce`` leaves the summation order to the backend (ring or tree, chunking by message
size, NCCL's algorithm and protocol choice), so the sum of the same per-rank gradients can round differently
from run to run or between ranks. Here every rank instead **all-gathers** every rank's flattened gradients and
adds them itself in rank order ``((g_0 + g_1) + g_2) + ...``: gathering only copies bytes, and the elementwise sum
in a fixed order gives the same bits on every rank and in every run. It costs ``world_size`` times the
gradient memory per bucket and more traffic than a reduce-scatter, which is the price of the guarantee.

Work assignment is a pure function: the batch is cut into consecutive micro-batches of ``micro_batch_size``
samples (or by ``micro_batch_tokens``) and micro-batch ``k`` goes to rank ``k % world_size``. With
``train.mini_batch_size`` (several optimizer updates a step) each mini-batch is cut so, within itself, and its
micro-batches are dealt the same way (its ``k``-th to rank ``k % world_size``); every update sums its own gradients
over the ranks. Every rank receives the whole batch (so the token and sequence counts that scale the loss are known
everywhere) and computes only its micro-batches.

Works with gloo (CPU tensors) and nccl (CUDA tensors). All ranks must start from identical weights (same seed
or the same checkpoint); nothing is broadcast (except by the sharded optimizer, below).

Optimizer-state sharding (``Trainer(..., distributed_optimizer=True)``, ZeRO-1): :func:`assign_owners` gives each
parameter tensor one owner rank, a pure function of the names, their sizes and the world size; only the owner
holds its float32 master and AdamW moments (:class:`rlrepro.trainer.optim.ShardedMasterWeightAdamW`) and
broadcasts the updated weight (:meth:`DataParallel.broadcast_`: a byte copy) to the other ranks.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

__all__ = ["assign_micro_batches", "assign_owners", "DataParallel"]


def assign_micro_batches(num_micro_batches: int, world_size: int, rank: int) -> list[int]:
    """Indices of the micro-batches rank ``rank`` computes: ``k`` with ``k % world_size == rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    return list(range(rank, num_micro_batches, world_size))


def assign_owners(numels: Mapping[str, int] | Iterable[tuple[str, int]], world_size: int) -> dict[str, int]:
    """The owner rank of each parameter tensor for optimizer-state sharding: in name order, each tensor goes to the
    rank with the fewest elements so far (ties: the lowest rank). A pure function of the names, their sizes and
    ``world_size`` (not of the input order); the ranks' loads differ by at most the largest tensor's size."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    items = sorted(dict(numels).items())
    load = [0] * world_size
    owners = {}
    for name, numel in items:
        if numel < 0:
            raise ValueError(f"parameter {name!r} has numel {numel}; sizes must be >= 0")
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += int(numel)
    return owners


class DataParallel:
    """Ordered collectives over a ``torch.distributed`` process group (the default group when ``group`` is None).

    ``bucket_numel``: gradients are flattened into buckets of at most this many elements (a tensor larger than that
    is its own bucket) and gathered bucket by bucket, bounding the extra memory to ``world_size`` buckets.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, bucket_numel: int = 1 << 26) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialised first: call "
                               "torch.distributed.init_process_group('gloo' or 'nccl', ...) on every rank")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.bucket_numel = bucket_numel
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def my_micro_batches(self, num_micro_batches: int) -> list[int]:
        return assign_micro_batches(num_micro_batches, self.world_size, self.rank)

    def _gather_sum(self, flat: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat.contiguous(), group=self.group)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    @torch.no_grad()
    def sum_tensors_(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its sum over ranks, added in rank order. All ranks pass the same list layout."""
        start = 0
        while start < len(tensors):
            end, numel = start, 0
            dtype = tensors[start].dtype
            while end < len(tensors) and tensors[end].dtype == dtype and (
                    end == start or numel + tensors[end].numel() <= self.bucket_numel):
                numel += tensors[end].numel()
                end += 1
            bucket = tensors[start:end]
            total = self._gather_sum(torch.cat([t.reshape(-1) for t in bucket]))
            offset = 0
            for t in bucket:
                t.copy_(total[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            start = end

    def sum_floats(self, values: list[float]) -> list[float]:
        """Sum over ranks (in rank order, in float64) of a list of Python floats."""
        flat = torch.tensor(values, dtype=torch.float64, device=self.device)
        return [float(v) for v in self._gather_sum(flat)]

    @torch.no_grad()
    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s (a rank of this group): a byte copy, so every rank
        ends with the same bits. A tensor on another device than the group's (a CPU tensor with NCCL) or not
        contiguous travels through a temporary copy."""
        if tensor.device == self.device and tensor.is_contiguous():
            dist.broadcast(tensor, group=self.group, group_src=src)
            return tensor
        buf = tensor.detach().to(self.device).contiguous()
        dist.broadcast(buf, group=self.group, group_src=src)
        tensor.copy_(buf)
        return tensor

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (small metadata only)."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def max_float(self, value: float) -> float:
        flat = torch.tensor([value], dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat, group=self.group)
        return max(float(p) for p in parts)
