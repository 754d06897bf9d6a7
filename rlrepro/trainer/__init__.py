"""rlrepro.trainer: token logprobs on the shared model + kernels, advantages, losses, the train step, the optimizer,
data parallelism with an order-fixed gradient sum, and atomic checkpoints. See docs/TRAINER.md."""
from .advantages import ADVANTAGE_MODES, compute_advantages, group_advantages
from .checkpoint import (LoadedCheckpoint, capture_rng_state, export_hf, latest_checkpoint, list_checkpoints,
                         load_checkpoint, restore_rng_state, save_checkpoint, verify_checkpoint)
from .data_parallel import DataParallel, assign_micro_batches
from .determinism import enable_determinism
from .logprobs import entropy, logprobs_and_entropy, token_logprobs
from .losses import (IS_CORRECTIONS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, BehaviourWeights, LossOutput,
                     aggregate, behaviour_weights, kl_penalty, pad_sequences, policy_loss)
from .optim import MasterWeightAdamW, WarmupCosineLR, clip_grad_norm_, lr_at
from .train import TrainConfig, Trainer, TrainSample, micro_batches

__all__ = [
    "token_logprobs", "logprobs_and_entropy", "entropy",
    "group_advantages", "compute_advantages", "ADVANTAGE_MODES",
    "policy_loss", "aggregate", "kl_penalty", "pad_sequences", "LossOutput", "LOSS_AGG_MODES", "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "behaviour_weights", "BehaviourWeights", "IS_CORRECTIONS",
    "MasterWeightAdamW", "WarmupCosineLR", "lr_at", "clip_grad_norm_",
    "TrainConfig", "Trainer", "TrainSample", "micro_batches", "enable_determinism",
    "DataParallel", "assign_micro_batches",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "verify_checkpoint",
    "capture_rng_state", "restore_rng_state", "export_hf", "LoadedCheckpoint",
]
