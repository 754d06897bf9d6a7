"""The run configuration: one schema (dataclasses) that hydra composes recipes and overrides against.

The schema is registered in hydra's ConfigStore as ``rlrepro_schema``; each recipe YAML lists it in its
defaults, so a key that is not in the schema fails at composition, before any work starts. ``validate()``
then checks values and cross-field rules and raises :class:`ConfigError` naming the key, the value and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration problem found before any work starts."""


@dataclass
class RunConfig:
    dir: str = "runs/${recipe}"
    seed: int = 0
    resume: bool = False
    device: str = "cpu"  # cpu | cuda
    deterministic: bool = True  # False: stock kernels in engine and trainer (the 'fast' mode, for comparison)
    save_rollouts: bool = True  # rollouts/step_NNNNNN.jsonl.gz, used by `rlrepro diff` to name the token
    # a fresh run (resume=false) refuses a run.dir that already holds records or checkpoints unless this is true
    # (then that run's records, checkpoints, base_model and data are deleted first)
    overwrite: bool = False


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF directory (config.json, *.safetensors, tokenizer files)
    init: str = "pretrained"  # pretrained | random (seeded random weights of the checkpoint's shape) | tiny
    init_seed: int = 0
    dtype: Optional[str] = None  # None: the checkpoint's own; float32 | bfloat16
    tiny_overrides: dict = field(default_factory=dict)  # config.json overrides when init=tiny


@dataclass
class SyntheticConfig:
    task: str = "copy"
    num: int = 512
    seed: int = 0
    kwargs: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    source: Optional[str] = None  # local .jsonl/.parquet (or dir), a hub name with allow_hub, or None for synthetic
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    split: str = "train"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    id_field: Optional[str] = None
    messages_field: Optional[str] = None
    template: Optional[str] = None
    system_prompt: Optional[str] = None
    use_chat_template: bool = True
    on_bad_row: str = "error"  # error | skip
    allow_hub: bool = False
    limit: Optional[int] = None
    shuffle: bool = True
    max_prompt_tokens: int = 512


@dataclass
class RewardConfig:
    fn: str = "exact_match"  # exact_match | prefix_match | math | package.module:function
    on_error: str = "raise"  # raise | zero
    # DAPO's soft overlong punishment (rlrepro.data.overlong_penalty): the last overlong_buffer tokens before
    # rollout.max_tokens cost up to overlong_penalty_factor of reward, linearly; 0 = off
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0


@dataclass
class RolloutConfig:
    num_workers: int = 1
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_cache: bool = True
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    gpu_memory_fraction: float = 0.3  # on CUDA: KV cache size when num_kv_blocks is unset
    # trainer -> engines: auto (CUDA IPC when colocated on CUDA, NCCL broadcast when not, object store on CPU) |
    # object_store | collective (torch.distributed broadcast: NCCL on CUDA, gloo on CPU) | cuda_ipc
    weight_sync: str = "auto"
    max_model_len: Optional[int] = None
    # a rollout worker that dies (process killed, actor lost) is replaced, loaded with the current weights, and
    # its unfinished requests are re-run (same keys, same samples); at most this many replacements per step
    max_restarts: int = 3


@dataclass
class TrainConfig:
    steps: int = 10
    lr: float = 1e-6
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8
    # logits rows per float32 log-softmax chunk in the loss (0 = the whole micro-batch): less memory, the same
    # logprobs and gradients (rlrepro.trainer.logprobs.logprobs_and_entropy; the entropy metric to rounding on CUDA)
    logits_chunk_size: int = 0
    ppo_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    # dual clip (verl's clip_ratio_c): for A < 0 the surrogate is also bounded by -A * dual_clip; 0 = off, else > 1
    dual_clip: float = 0.0
    # entropy bonus (verl's entropy_coeff): loss -= entropy_coef * agg(entropy); 0 = off (entropy only reported)
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    advantage: str = "grpo"  # grpo | dr_grpo
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # data-parallel trainer ranks (order-fixed gradient sum): one GPU each on CUDA, one process each on CPU
    num_gpus: int = 1
    # shard the float32 master weights and AdamW moments over the data-parallel ranks (ZeRO-1; the same bits;
    # with trainer.backend=megatron over its DP replicas; with checkpoint.format=dist each owner writes its share)
    distributed_optimizer: bool = False
    # a non-finite loss or gradient norm: error (stop before the weights change; a checkpoint of the last
    # completed step is kept) | skip (weights and optimizer state untouched, LR schedule advances, step recorded)
    on_nonfinite: str = "error"


@dataclass
class TrainerBackendConfig:
    """How the policy is held: ``default`` (the whole model per rank, data parallel over train.num_gpus) or
    ``megatron`` (sharded over ``tensor_parallel`` ranks with order-fixed reductions; data parallel over
    train.num_gpus / tensor_parallel; docs/MEGATRON.md). The engine emulates the trainer's TP reduction."""
    backend: str = "default"
    tensor_parallel: int = 1
    # megatron only: ordered (rlrepro's rank-order gradient sum and AdamW: the same bits as the default backend)
    # | megatron (megatron-core's DistributedDataParallel and optimizer; NCCL's summation order)
    grad_sync: str = "ordered"


@dataclass
class WarmStartConfig:
    """Optional deterministic supervised warm-start before RL (the CPU recipe uses it to learn the format)."""
    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    # format: answers replaced by random strings of the same length over the answers' characters, so the model
    # learns to answer briefly and stop, but nothing about which answer is right; answer: the true answers (SFT)
    target: str = "format"


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end
    keep_last: int = 3
    save_last: bool = True  # also after the last step (false: only every N steps; for benchmarks)
    # full: one file set with the whole state (any backend) | dist: trainer.backend=megatron only, every rank
    # writes its own shards through megatron-core's dist_checkpointing (no gather; loads at another TP size)
    format: str = "full"


@dataclass
class LoggerConfig:
    wandb: bool = False
    project: str = "rlrepro"
    mode: str = "offline"  # offline | online (online needs network and a key)
    progress: bool = True
    num_table_samples: int = 4


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local Ray on 127.0.0.1; else join this cluster
    num_cpus: Optional[int] = None
    colocate: bool = True  # rollout workers and trainer share devices


@dataclass
class RunSchema:
    recipe: str = "grpo_tiny"
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerBackendConfig = field(default_factory=TrainerBackendConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)


_CHOICES = {
    "run.device": ("cpu", "cuda"),
    "model.init": ("pretrained", "random", "tiny"),
    "model.dtype": (None, "float32", "bfloat16"),
    "data.on_bad_row": ("error", "skip"),
    "reward.on_error": ("raise", "zero"),
    "train.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "train.advantage": ("grpo", "dr_grpo"),
    "train.kl_estimator": ("k1", "k2", "k3"),
    "logger.mode": ("offline", "online", "disabled"),
    "warm_start.target": ("format", "answer"),
    "train.on_nonfinite": ("error", "skip"),
    "rollout.weight_sync": ("auto", "object_store", "collective", "cuda_ipc"),
    "trainer.backend": ("default", "megatron"),
    "trainer.grad_sync": ("ordered", "megatron"),
    "checkpoint.format": ("full", "dist"),
}
_POSITIVE = ["rollout.num_workers", "rollout.prompts_per_step", "rollout.group_size", "rollout.max_tokens",
             "rollout.max_num_seqs", "rollout.max_num_batched_tokens", "rollout.block_size", "train.steps",
             "train.micro_batch_size", "train.ppo_epochs", "train.num_gpus", "trainer.tensor_parallel", "data.max_prompt_tokens",
             "checkpoint.keep_last", "warm_start.batch_size", "data.synthetic.num"]
_NON_NEGATIVE = ["rollout.temperature", "train.lr", "train.warmup_steps", "train.weight_decay", "train.kl_coef",
                 "train.clip_low", "train.clip_high", "checkpoint.every", "warm_start.steps", "train.max_grad_norm",
                 "rollout.max_restarts", "logger.num_table_samples", "train.adam_eps", "warm_start.lr",
                 "train.logits_chunk_size", "train.dual_clip", "train.entropy_coef", "reward.overlong_buffer",
                 "reward.overlong_penalty_factor"]
_POSITIVE_OR_NONE = ["rollout.num_kv_blocks", "rollout.max_model_len", "data.limit", "ray.num_cpus"]
# (key, low, high, low inclusive, high inclusive)
_RANGES = [("train.min_lr_ratio", 0, 1, True, True), ("train.adam_beta1", 0, 1, True, False),
           ("train.adam_beta2", 0, 1, True, False), ("train.clip_low", 0, 1, True, False),
           ("rollout.gpu_memory_fraction", 0, 1, False, True)]
_INTEGERS = ["run.seed", "model.init_seed", "data.synthetic.seed", "warm_start.seed"]


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def validate(cfg: Any) -> None:
    """Check values and cross-field rules of a composed config (an OmegaConf DictConfig or RunSchema)."""
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(choices)}")
    for key in _POSITIVE:
        value = _get(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} must be a positive integer")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{key}={value!r} must be a finite number >= 0")
        if key in ("rollout.max_restarts", "logger.num_table_samples") and not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer >= 0")
    for key in _POSITIVE_OR_NONE:
        value = _get(cfg, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value!r} must be a positive integer or null (unset)")
    for key, lo, hi, lo_in, hi_in in _RANGES:
        value = _get(cfg, key)
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi))
        if not ok:
            raise ConfigError(f"{key}={value!r} must lie in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}")
    for key in _INTEGERS:
        value = _get(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
    if cfg.rollout.max_model_len is not None and cfg.rollout.max_model_len < 2:
        raise ConfigError(f"rollout.max_model_len={cfg.rollout.max_model_len} must be >= 2 (a prompt token and a "
                          "generated one), or null for the model's max_position_embeddings")
    if cfg.train.lr == 0:
        raise ConfigError("train.lr=0 would never change the weights; give a learning rate > 0 (e.g. train.lr=1e-6)")
    if cfg.reward.overlong_buffer >= cfg.rollout.max_tokens:
        raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} must be below rollout.max_tokens="
                          f"{cfg.rollout.max_tokens} (the penalty ramps over the last overlong_buffer tokens; DAPO "
                          "uses a quarter of the length limit)")
    if cfg.train.dual_clip and not cfg.train.dual_clip > 1:
        raise ConfigError(f"train.dual_clip={cfg.train.dual_clip!r} must be 0 (off) or > 1 (the surrogate's bound "
                          "-A * dual_clip for negative advantages; verl uses 3)")
    if cfg.train.adam_eps == 0:
        raise ConfigError("train.adam_eps=0 can divide by zero; give a value > 0 (e.g. train.adam_eps=1e-8)")
    if cfg.warm_start.steps > 0 and cfg.warm_start.lr == 0:
        raise ConfigError(f"warm_start.steps={cfg.warm_start.steps} with warm_start.lr=0 does nothing; give "
                          "warm_start.lr > 0 or set warm_start.steps=0")
    if 0 < cfg.rollout.temperature < 1e-5:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature!r} is too small (logits / T overflows); "
                          "use 0 for greedy decoding or a value >= 1e-5")
    if not 0 < cfg.rollout.top_p <= 1:  # (NaN fails this too)
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p!r} must be in (0, 1]")
    if cfg.rollout.top_k == 0 or cfg.rollout.top_k < -1:
        raise ConfigError(f"rollout.top_k={cfg.rollout.top_k!r} must be -1 (off) or a positive integer")
    if cfg.rollout.group_size < 2:
        raise ConfigError(f"rollout.group_size={cfg.rollout.group_size} must be >= 2: GRPO compares samples "
                          "within a group")
    if cfg.model.init in ("pretrained", "random") and not cfg.model.path:
        raise ConfigError(f"model.init={cfg.model.init} needs model.path=/path/to/hf_model_dir "
                          "(for random weights, a directory with config.json and the tokenizer)")
    if cfg.model.init == "pretrained" and cfg.model.path:
        from pathlib import Path
        if not Path(cfg.model.path).is_dir():
            raise ConfigError(f"model.path={cfg.model.path!r} is not a directory; point it at a local HF model "
                              "directory (rlrepro never downloads weights)")
    if cfg.run.device == "cpu" and cfg.model.dtype == "bfloat16":
        pass  # allowed, slow
    if cfg.train.warmup_steps > cfg.train.steps:
        raise ConfigError(f"train.warmup_steps={cfg.train.warmup_steps} exceeds train.steps={cfg.train.steps}; "
                          f"lower it (e.g. train.warmup_steps={cfg.train.steps // 10})")
    _validate_trainer_layout(cfg)
    if cfg.rollout.weight_sync == "cuda_ipc" and (cfg.run.device != "cuda" or not cfg.ray.colocate):
        raise ConfigError(f"rollout.weight_sync=cuda_ipc needs trainer and engines on the same GPUs "
                          f"(run.device=cuda and ray.colocate=true; here run.device={cfg.run.device}, "
                          f"ray.colocate={cfg.ray.colocate}); use rollout.weight_sync=auto")
    if cfg.rollout.weight_sync == "collective" and cfg.run.device == "cuda" and cfg.ray.colocate:
        raise ConfigError("rollout.weight_sync=collective with ray.colocate=true on CUDA would put the trainer and "
                          "an engine of one GPU into one NCCL communicator, which NCCL refuses (duplicate GPU); "
                          "use rollout.weight_sync=auto (CUDA IPC there) or ray.colocate=false")
    if cfg.rollout.max_num_batched_tokens < cfg.rollout.block_size:
        raise ConfigError(f"rollout.max_num_batched_tokens={cfg.rollout.max_num_batched_tokens} must be >= "
                          f"rollout.block_size={cfg.rollout.block_size}")


def _validate_trainer_layout(cfg: Any, model_config: Any = None) -> None:
    """trainer.backend / trainer.tensor_parallel against train.num_gpus (and the model's shape when given)."""
    from rlrepro.trainer.megatron import validate_megatron_config

    if cfg.trainer.grad_sync == "megatron" and cfg.trainer.backend != "megatron":
        raise ConfigError("trainer.grad_sync=megatron (megatron-core's DistributedDataParallel and optimizer) needs "
                          "trainer.backend=megatron; set trainer.backend=megatron or trainer.grad_sync=ordered")
    try:
        validate_megatron_config(cfg.trainer.backend, cfg.trainer.tensor_parallel, cfg.train.num_gpus,
                                 cfg.run.device, model_config)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None
    if cfg.checkpoint.format == "dist" and cfg.trainer.backend != "megatron":
        raise ConfigError("checkpoint.format=dist writes tensor-parallel shards: it needs trainer.backend=megatron; "
                          "use checkpoint.format=full")
    if cfg.trainer.backend == "megatron" and cfg.warm_start.steps > 0:
        raise ConfigError(f"warm_start.steps={cfg.warm_start.steps} is not supported with trainer.backend=megatron "
                          "(the warm start trains the unsharded model); set warm_start.steps=0 or "
                          "trainer.backend=default")


def validate_model_layout(cfg: Any, model_config: Any) -> None:
    """The checks that need the model's shape (heads, KV heads, MLP width and vocabulary divisible by TP); run
    once the model directory exists, before any actor starts."""
    _validate_trainer_layout(cfg, model_config)
