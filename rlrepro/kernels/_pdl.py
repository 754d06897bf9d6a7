"""Programmatic dependent launch (PDL, Hopper and later) for rlrepro's Triton kernels: an experiment, off unless
``RLREPRO_PDL=1``.

With PDL a kernel may be launched while the one before it in the stream is still running; it must then wait
(``griddepcontrol.wait``) before it touches memory the earlier kernel writes or reads. Every rlrepro kernel
launched this way waits first thing (the matmul may first prefetch weight lines into L2, a hint that cannot
change a value), then lets the next kernel launch. The values computed are the same instructions on the same
data either way: PDL changes when a kernel starts, not what it computes.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - depends on the installed Triton
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _requested() -> bool:
    value = os.environ.get("RLREPRO_PDL", "0").strip().lower()
    if value not in ("0", "1", "off", "on", ""):
        raise ValueError(f"RLREPRO_PDL must be 0 or 1, not {value!r}")
    return value in ("1", "on")


_override: bool | None = None


def set_enabled(value: bool | None) -> None:
    """Benchmarks: turn PDL on or off for the launches (and CUDA-graph captures) that follow; None: back to
    ``RLREPRO_PDL``."""
    global _override
    _override = value


def enabled() -> bool:
    """Whether launches use PDL now (``RLREPRO_PDL=1``, or ``set_enabled``, on a GPU of compute capability >= 9
    with a Triton that supports it)."""
    return (_requested() if _override is None else _override) and _supported()


def launch_kwargs(use_pdl: bool) -> dict:
    """The launch options for a Triton kernel call: ``launch_pdl`` only when used (older Tritons lack it)."""
    return {"launch_pdl": True} if use_pdl else {}


try:  # the Triton side, for the kernel modules (which import Triton anyway)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:
    @triton.jit
    def wait_then_release():
        """First thing in a kernel launched with PDL: wait until the kernel before it has finished and its writes
        are visible, then let the next kernel launch (it waits in turn)."""
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs):
        """Ask L2 to fetch the lines holding ``ptrs`` (no value comes back: a hint that cannot change a result)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
