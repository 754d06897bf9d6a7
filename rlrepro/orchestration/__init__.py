"""rlrepro.orchestration: Ray actors, weight sync and the GRPO driver loop (the only package importing ray)."""
from .config import ConfigError, RunSchema, validate
from .driver import GRPODriver, run_training

__all__ = ["ConfigError", "RunSchema", "validate", "GRPODriver", "run_training"]
