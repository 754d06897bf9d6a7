"""Process-wide switches for deterministic training, set by the caller once at start-up."""
from __future__ import annotations

import os

import torch

__all__ = ["enable_determinism"]


def enable_determinism() -> None:
    """Make torch's own kernels deterministic. Call before the first CUDA op (cuBLAS reads its env var at init).

    * ``torch.use_deterministic_algorithms(True)``: ops without a deterministic implementation raise instead of
      silently using atomics (e.g. ``index_add_``, ``scatter_add_`` on CUDA pick a sorted path).
    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS needs a fixed workspace for reproducible GEMMs (CUDA >= 10.2).
    * cuDNN: ``deterministic=True``, ``benchmark=False`` (no autotuned algorithm choice).
    * TF32 off for matmul and cuDNN, so fp32 math in stock kernels is true fp32.

    The batch-invariant kernels in :mod:`rlrepro.kernels` do not depend on these, but autograd's backward of
    stock ops (embedding's index_put, reductions) and the fast mode do.
    """
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
