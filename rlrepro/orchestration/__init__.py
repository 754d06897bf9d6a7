"""rlrepro.orchestration: the run schema, Ray actors, weight sync and the GRPO driver loop (the only package, with
the CLI, that imports ray, and the only one that imports both rollout and trainer)."""
from .config import ConfigError, RunSchema, to_schema, validate
from .driver import GRPODriver, run_training

__all__ = ["ConfigError", "RunSchema", "to_schema", "validate", "GRPODriver", "run_training"]
