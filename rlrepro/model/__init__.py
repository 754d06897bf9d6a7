"""rlrepro.model: dense Qwen3 on rlrepro.kernels, HF checkpoint I/O, the tokenizer, tiny test checkpoints,
the run's base_model and the resolution of model paths (HF directory, run directory, checkpoint)."""
from .base_model import BaseModelError, prepare_base_model, verify_base_model
from .checkpoint_io import load_pretrained, save_pretrained, write_config_last
from .config import Qwen3Config
from .model_dirs import ModelDirError, ResolvedModel, load_resolved, resolve_model_dir
from .qwen3 import Qwen3ForCausalLM, init_random_weights
from .tiny import tiny_model, write_tiny_checkpoint
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["load_pretrained", "save_pretrained", "write_config_last", "Qwen3Config", "Qwen3ForCausalLM",
           "init_random_weights", "Tokenizer", "load_tokenizer", "write_tiny_checkpoint", "tiny_model",
           "prepare_base_model", "verify_base_model", "BaseModelError", "resolve_model_dir", "ResolvedModel",
           "load_resolved", "ModelDirError"]
