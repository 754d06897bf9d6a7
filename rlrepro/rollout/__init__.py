"""rlrepro.rollout: the embedded deterministic inference engine.

``Engine(model_or_path, ...).generate(prompt_token_ids, SamplingParams(...))`` -> ``list[RequestOutput]``.
The request's tokens and logprobs depend only on the weights, its prompt, its parameters and its seed, never on
the batch it shares (see docs/ENGINE.md). ``request_seed`` derives per-sample seeds for the GRPO driver.
"""
from .config import EngineConfig, SamplingConfig
from .engine import Engine
from .params import RequestOutput, SamplingParams
from .seeds import derive_seed, eval_seed, request_seed

__all__ = ["Engine", "EngineConfig", "SamplingConfig", "SamplingParams", "RequestOutput", "request_seed", "eval_seed",
           "derive_seed"]
