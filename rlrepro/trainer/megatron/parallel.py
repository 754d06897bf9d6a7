"""Process groups for tensor x data parallelism: megatron-core's ``parallel_state`` when asked (it runs on gloo
too), else the same layout built with ``torch.distributed.new_group``.

Layout (Megatron's default order ``tp-cp-ep-dp-pp`` with CP = EP = PP = 1): TP groups are consecutive ranks
``[i*tp, ..., i*tp + tp - 1]``; DP groups are ``[j, j + tp, j + 2*tp, ...]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ParallelGroups", "init_parallel", "destroy_parallel", "single_process_groups"]


@dataclass
class ParallelGroups:
    tp_group: object | None
    dp_group: object | None
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    megatron: bool = False  # built by megatron-core's parallel_state

    def __deepcopy__(self, memo):  # process groups are shared handles, never copied (deepcopy of a model)
        return self

    @property
    def is_writer(self) -> bool:
        """The one rank that writes checkpoints and exports: TP rank 0 of replica 0."""
        return self.tp_rank == 0 and self.dp_rank == 0


def single_process_groups() -> ParallelGroups:
    """TP=1, DP=1 without torch.distributed (every TP primitive is then the identity)."""
    return ParallelGroups(None, None, 0, 1, 0, 1)


def init_parallel(tensor_parallel: int, *, use_megatron: bool = False) -> ParallelGroups:
    """Build the TP and DP groups on an initialised default process group (world = TP x DP). Every rank calls it.

    ``use_megatron``: through ``megatron.core.parallel_state.initialize_model_parallel`` (the groups megatron-core's
    DDP, optimizer and dist-checkpointing expect); otherwise plain ``new_group`` calls with the same layout.
    """
    if not dist.is_available() or not dist.is_initialized():
        if tensor_parallel == 1:
            return single_process_groups()
        raise RuntimeError("tensor parallelism needs torch.distributed initialised first: call "
                           "torch.distributed.init_process_group('nccl' or 'gloo', ...) on every rank")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel:
        raise ValueError(f"world size {world} is not a multiple of train.tensor_parallel={tensor_parallel}")
    dp = world // tensor_parallel
    if use_megatron:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
        if ps.get_tensor_model_parallel_world_size() != tensor_parallel:
            raise ValueError(f"megatron parallel_state is already initialised with TP="
                             f"{ps.get_tensor_model_parallel_world_size()}, not {tensor_parallel}")
        return ParallelGroups(ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                              ps.get_tensor_model_parallel_rank(), tensor_parallel,
                              ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), megatron=True)
    tp_group = dp_group = None
    for i in range(dp):  # every rank creates every group, in the same order
        ranks = list(range(i * tensor_parallel, (i + 1) * tensor_parallel))
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for j in range(tensor_parallel):
        ranks = list(range(j, world, tensor_parallel))
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    return ParallelGroups(tp_group, dp_group, rank % tensor_parallel, tensor_parallel, rank // tensor_parallel, dp)


def destroy_parallel(groups: ParallelGroups) -> None:
    if groups.megatron:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
