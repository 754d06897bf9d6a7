"""rlrepro: bitwise-reproducible GRPO for LLMs."""
__version__ = "0.1.0"
