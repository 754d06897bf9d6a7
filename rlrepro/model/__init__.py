"""rlrepro.model: dense Qwen3 on rlrepro.kernels, HF checkpoint I/O, the tokenizer, tiny test checkpoints."""
from .checkpoint_io import load_pretrained, save_pretrained
from .config import Qwen3Config
from .qwen3 import Qwen3ForCausalLM, init_random_weights
from .tiny import tiny_model, write_tiny_checkpoint
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["load_pretrained", "save_pretrained", "Qwen3Config", "Qwen3ForCausalLM", "init_random_weights",
           "Tokenizer", "load_tokenizer", "write_tiny_checkpoint", "tiny_model"]
