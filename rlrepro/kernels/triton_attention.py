"""Batch-invariant causal attention in Triton: the names of its forward (:mod:`.triton_attention_fwd`: packed
sequences and the paged KV cache alike, the KV-cache write, the fused QK-norm + RoPE + cache write) and of its
backward (:mod:`.triton_attention_bwd`: the float32 torch recomputation and the deterministic Triton kernels).
Each of the two modules documents its kernels; this one only gathers their public names.

A module constant a caller changes (``LARGE_MIN_TOKENS``, ``LONG_MIN_QUERIES``, ``ATTENTION_CONFIGS``) is read in
:mod:`.triton_attention_fwd`: patch it there.
"""
from __future__ import annotations

from .triton_attention_bwd import (AttentionBwdConfig, attention_bwd_packed, attention_bwd_packed_triton,
                                   pick_attention_bwd_config)
from .triton_attention_fwd import (ATTENTION_CONFIGS, BLOCK_KV, LARGE_MIN_TOKENS, LOG2E, LONG_MAX_HEAD_DIM,
                                   LONG_MIN_QUERIES, AttentionConfig,
                                   attention_fwd, default_scale, pick_attention_config, qk_norm_rope_cache,
                                   qk_norm_rope_cache_supported, tile_shape, write_kv_cache)

__all__ = ["ATTENTION_CONFIGS", "BLOCK_KV", "LARGE_MIN_TOKENS", "LOG2E", "LONG_MAX_HEAD_DIM", "LONG_MIN_QUERIES",
           "AttentionConfig", "AttentionBwdConfig",
           "attention_fwd", "attention_bwd_packed", "attention_bwd_packed_triton", "default_scale",
           "pick_attention_config", "pick_attention_bwd_config", "qk_norm_rope_cache", "qk_norm_rope_cache_supported",
           "tile_shape", "write_kv_cache"]
