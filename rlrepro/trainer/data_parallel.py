"""Data parallelism with an order-fixed gradient sum.

``torch.distributed.all_reduce`` leaves the summation order to the backend (ring or tree, chunking by message
size, NCCL's algorithm and protocol choice), so the sum of the same per-rank gradients can round differently
from run to run or between ranks. Here every rank instead **all-gathers** every rank's flattened gradients and
adds them itself in rank order ``((g_0 + g_1) + g_2) + ...``: gathering only copies bytes, and the elementwise sum
in a fixed order gives the same bits on every rank and in every run. It costs ``world_size`` times the
gradient memory per bucket and more traffic than a reduce-scatter, which is the price of the guarantee.

Work assignment is a pure function: the batch is cut into consecutive micro-batches of ``micro_batch_size``
samples and micro-batch ``k`` goes to rank ``k % world_size``. Every rank receives the whole batch (so the global
token and sequence counts that scale the loss are known everywhere) and computes only its micro-batches.

Works with gloo (CPU tensors) and nccl (CUDA tensors). All ranks must start from identical weights (same seed
or the same checkpoint); nothing is broadcast.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["assign_micro_batches", "DataParallel"]


def assign_micro_batches(num_micro_batches: int, world_size: int, rank: int) -> list[int]:
    """Indices of the micro-batches rank ``rank`` computes: ``k`` with ``k % world_size == rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    return list(range(rank, num_micro_batches, world_size))


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

    def max_float(self, value: float) -> float:
        flat = torch.tensor([value], dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat, group=self.group)
        return max(float(p) for p in parts)
