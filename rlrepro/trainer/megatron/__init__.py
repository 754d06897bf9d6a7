"""The megatron backend (``train.backend=megatron``): Qwen3 sharded over tensor-parallel ranks with order-fixed
reductions, and a ``Trainer`` on it. See docs/MEGATRON.md.

Nothing here imports megatron-core at import time: :func:`init_parallel(..., use_megatron=True)` imports its
``parallel_state`` when called, and :func:`validate_megatron_config` only checks that it is installed.
"""
from .config import BACKENDS, MegatronLayout, megatron_core_version, require_megatron_core, validate_megatron_config
from .model import TPQwen3ForCausalLM, gather_param, shard_spec, shard_tensor
from .parallel import ParallelGroups, destroy_parallel, init_parallel, single_process_groups
from .dist_checkpoint import dist_to_full, dist_to_hf, hf_to_dist, is_dist_checkpoint
from .trainer import CHECKPOINT_FORMATS, MegatronTrainer
from .mcore import GRAD_SYNCS, MegatronCoreOptimizer

__all__ = ["BACKENDS", "MegatronLayout", "validate_megatron_config", "megatron_core_version", "require_megatron_core",
           "TPQwen3ForCausalLM", "shard_spec", "shard_tensor", "gather_param", "ParallelGroups", "init_parallel",
           "destroy_parallel", "single_process_groups", "MegatronTrainer", "build_megatron_trainer",
           "CHECKPOINT_FORMATS", "GRAD_SYNCS", "MegatronCoreOptimizer", "dist_to_full", "dist_to_hf", "hf_to_dist",
           "is_dist_checkpoint"]


def build_megatron_trainer(model_dir, train_config, *, tensor_parallel: int | None = None,
                           num_gpus: int | None = None, device: str = "cpu", dtype=None, param_dtype=None,
                           use_megatron_parallel_state: bool | None = None, with_ref_model: bool | None = None,
                           checkpoint_format: str = "full", distributed_optimizer: bool | None = None,
                           grad_sync: str | None = None, temperature: float = 1.0,
                           max_response_length: int | None = None):
    """What a trainer rank runs after ``torch.distributed.init_process_group`` (world = ``num_gpus`` ranks):
    validate, build the TP/DP groups, load this rank's shard of ``model_dir``, and return a :class:`MegatronTrainer`
    (with a frozen reference copy when ``train_config.kl_coef > 0`` or ``with_ref_model``).
    ``use_megatron_parallel_state``: default True when megatron-core is installed. ``checkpoint_format``: see
    :class:`MegatronTrainer`; ``distributed_optimizer``: shard the optimizer state over the DP replicas;
    ``grad_sync``: ``"ordered"`` (rlrepro's rank-order gradient sum and AdamW) or ``"megatron"`` (megatron-core's
    DistributedDataParallel and optimizer, :mod:`.mcore`)."""
    import torch.distributed as dist

    from rlrepro.model import Qwen3Config

    # None: the config's (train.tensor_parallel, train.num_gpus, train.distributed_optimizer, train.grad_sync)
    tensor_parallel = train_config.tensor_parallel if tensor_parallel is None else tensor_parallel
    num_gpus = train_config.num_gpus if num_gpus is None else num_gpus
    grad_sync = train_config.grad_sync if grad_sync is None else grad_sync
    config = Qwen3Config.from_file(model_dir)
    validate_megatron_config("megatron", tensor_parallel, num_gpus, device, config,
                             check_installed=bool(use_megatron_parallel_state) or grad_sync == "megatron")
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    if world != num_gpus:  # the layout comes from the process group (DP = world / TP), not from num_gpus
        where = (f"the torch.distributed process group has {world} ranks" if initialised
                 else "torch.distributed is not initialised (one process)")
        raise ValueError(f"train.num_gpus={num_gpus} but {where}: call build_megatron_trainer on every rank of a "
                         f"process group of train.num_gpus ranks (init_process_group(..., world_size={num_gpus})), "
                         f"or pass num_gpus={world}")
    if use_megatron_parallel_state is None:
        use_megatron_parallel_state = megatron_core_version() is not None
    groups = init_parallel(tensor_parallel, use_megatron=use_megatron_parallel_state)
    if device == "cuda":
        import torch

        torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    model = TPQwen3ForCausalLM.from_pretrained(model_dir, groups, device=device, dtype=dtype)
    ref = None
    if with_ref_model or (with_ref_model is None and train_config.kl_coef > 0):
        import copy

        ref = copy.deepcopy(model).requires_grad_(False).eval()
    return MegatronTrainer(model, train_config, ref, param_dtype=param_dtype, checkpoint_format=checkpoint_format,
                           distributed_optimizer=distributed_optimizer, grad_sync=grad_sync, temperature=temperature,
                           max_response_length=max_response_length)
