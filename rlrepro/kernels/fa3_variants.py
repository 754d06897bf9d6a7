"""Other tile shapes of flashinfer's FA3 kernel (Hopper), built from its own sources: an experiment of issue #27.

flashinfer 0.5.3 compiles one FA3 kernel per mask mode with fixed tiles: the paged kernel 128 query rows x 96 KV
positions, the ragged (TMA) kernel 128 x 128 when causal. A query row's bits depend on its KV tile (the positions
summed together, walked from the last tile to the first) and on the per-row arithmetic of one consumer
warpgroup, not on how many rows a program holds. So the same KV tile in another kernel should give the same bits:

* ``ragged96``: the ragged kernel (K/V loaded by TMA, the trainer's packed layout as it is) with the paged
  kernel's 96-position KV tile, for the trainer's forward at the ragged kernel's speed;
* ``paged64``: the paged kernel with 64 query rows (one consumer warpgroup), for the folded decode, whose 4 rows a
  request fill a 128-row tile to 3 %;
* ``paged96s3`` / ``paged64s3``: the same with 3 pipeline stages (more K/V in flight).

:func:`module` compiles a variant with flashinfer's JIT (a copy of its headers with the tile constants made
macros, a module name of its own) and returns it in the shape flashinfer's wrappers call (``plan``,
``paged_run``, ``ragged_run``); :func:`use` puts it into a planned wrapper. Whether the bits are those of the
stock paged kernel is what ``benchmarks/probe_fa3_tiles.py`` measures, with ``torch.equal``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

__all__ = ["VARIANTS", "patched_include", "module", "use"]

# name -> macro values (the stock kernel: ragged causal 128 x 128, paged 128 x 96, 2 stages)
VARIANTS: dict[str, dict[str, int]] = {
    "stock": {},
    "ragged96": {"RLREPRO_RAGGED_CAUSAL_CTA_KV": 96},
    "paged64": {"RLREPRO_PAGED_CTA_Q": 64},
    "paged96s3": {"RLREPRO_PAGED_STAGES": 3},
    "paged64s3": {"RLREPRO_PAGED_CTA_Q": 64, "RLREPRO_PAGED_STAGES": 3},
}

_DEFAULTS = """
#ifndef RLREPRO_RAGGED_CAUSAL_CTA_Q
#define RLREPRO_RAGGED_CAUSAL_CTA_Q 128
#endif
#ifndef RLREPRO_RAGGED_CAUSAL_CTA_KV
#define RLREPRO_RAGGED_CAUSAL_CTA_KV 128
#endif
#ifndef RLREPRO_PAGED_CTA_Q
#define RLREPRO_PAGED_CTA_Q 128
#endif
#ifndef RLREPRO_PAGED_CTA_KV
#define RLREPRO_PAGED_CTA_KV 96
#endif
#ifndef RLREPRO_PAGED_STAGES
#define RLREPRO_PAGED_STAGES 2
#endif
"""

_BARRIER = ("  static constexpr bool UseSchedulerBarrier =\n"
            "      cutlass::sizeof_bits_v<DTypeQ> == 8 ? HEAD_DIM_VO >= 128 : HEAD_DIM_VO <= 128;")
_ASSERT = "static_assert(NUM_MMA_THREADS == 2 * cutlass::NumThreadsPerWarpGroup ||"
# (file under include/flashinfer/attention/hopper, old text, new text, how many times the old text occurs there)
_PATCHES = [
    ("prefill_sm90.cuh",
     "      if constexpr (CAUSAL) {\n        return std::make_tuple(128, 128);",
     "      if constexpr (CAUSAL) {\n        return std::make_tuple(RLREPRO_RAGGED_CAUSAL_CTA_Q, "
     "RLREPRO_RAGGED_CAUSAL_CTA_KV);", 1),
    ("prefill_sm90.cuh",
     "                                /*CTA_Q_=*/128,\n                                /*CTA_KV_=*/96,\n"
     "                                /*NUM_STAGES_=*/2,",
     "                                /*CTA_Q_=*/RLREPRO_PAGED_CTA_Q,\n"
     "                                /*CTA_KV_=*/RLREPRO_PAGED_CTA_KV,\n"
     "                                /*NUM_STAGES_=*/RLREPRO_PAGED_STAGES,", 1),
    # one consumer warpgroup has no other warpgroup to take turns with: no scheduler barrier (it orders the
    # warpgroups' issue, not any arithmetic)
    *((name, _BARRIER, _BARRIER.replace("=\n      ", "=\n      Ktraits::NUM_MMA_THREADS > 128 && (")
       .replace(";", ");"), 1) for name in ("mainloop.cuh", "sparse_mainloop.cuh")),
    # one consumer warpgroup beside the producer: the registers the producer gives up go to it (a 64 x 128 output
    # and a 64 x 96 score tile; at flashinfer's 144 ptxas serialises the wgmmas)
    ("prefill_sm90.cuh", "warpgroup_reg_alloc<Ktraits::NUM_WARPS == 12 ? 216 : 144>",
     "warpgroup_reg_alloc<Ktraits::NUM_WARPS == 12 ? 216 : (Ktraits::NUM_WARPS == 8 ? 240 : 144)>", 1),
    ("named_barrier.cuh", _ASSERT, _ASSERT.replace("(", "(!UseSchedulerBarrier || ", 1), 2),
]


def _fi_jit():
    from flashinfer.jit import env as jit_env
    return jit_env


def patched_include() -> Path:
    """A copy of flashinfer's ``include/`` with the tile constants as macros (stock values by default), in
    flashinfer's JIT workspace; rebuilt when flashinfer's headers or the patches change."""
    jit_env = _fi_jit()
    src = Path(jit_env.FLASHINFER_INCLUDE_DIR)
    hopper = Path("flashinfer") / "attention" / "hopper"
    digest = hashlib.sha256(repr(_PATCHES).encode() + _DEFAULTS.encode())
    for name in sorted({p[0] for p in _PATCHES}):
        digest.update((src / hopper / name).read_bytes())
    dest = Path(jit_env.FLASHINFER_WORKSPACE_DIR) / f"rlrepro_include_{digest.hexdigest()[:12]}"
    if (dest / ".ok").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    texts: dict[str, str] = {}
    for name, old, new, count in _PATCHES:
        text = texts.get(name) or (tmp / hopper / name).read_text()
        if text.count(old) != count:
            raise RuntimeError(f"fa3_variants: {name} of this flashinfer has {text.count(old)} places for a patch "
                               f"(expected {count}); it was written for flashinfer 0.5.3: pip install flashinfer-python==0.5.3, "
                               "or unset RLREPRO_ATTENTION")
        texts[name] = text.replace(old, new)
    texts["prefill_sm90.cuh"] = _DEFAULTS + texts["prefill_sm90.cuh"]
    for name, text in texts.items():
        (tmp / hopper / name).write_text(text)
    (tmp / ".ok").write_text("")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _args(dtype: torch.dtype, head_dim: int) -> tuple:
    # flashinfer's module key: q, kv, o dtypes, index dtype, head dims, no RoPE, no sliding window, no soft cap,
    # no fp16 QK reduction
    return (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)


def spec(name: str, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128):
    """flashinfer's JIT spec of variant ``name``: its FA3 batch-prefill sources, the patched headers first on the
    include path, the variant's macros, and a module name of its own."""
    from flashinfer.jit import attention as jit_attention
    from flashinfer.jit.core import JitSpec
    if name not in VARIANTS:
        raise ValueError(f"unknown FA3 variant {name!r}; choose one of {sorted(VARIANTS)}")
    base = jit_attention.gen_batch_prefill_module("fa3", *_args(dtype, head_dim))
    if name == "stock":
        return base
    defines = [f"-D{k}={v}" for k, v in sorted(VARIANTS[name].items())]
    return JitSpec(name=f"{base.name}_rlrepro_{name}", sources=list(base.sources),
                   extra_cflags=base.extra_cflags, extra_cuda_cflags=list(base.extra_cuda_cflags or []) + defines,
                   extra_ldflags=base.extra_ldflags,
                   extra_include_dirs=[patched_include()] + list(base.extra_include_dirs or []),
                   needs_device_linking=base.needs_device_linking)


@functools.cache
def module(name: str, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128):
    """Variant ``name`` compiled and loaded, wrapped as flashinfer's ``get_batch_prefill_module`` wraps its own
    (the same calling convention, its custom ops named after the variant)."""
    import flashinfer.prefill as fp
    args = _args(dtype, head_dim)
    if name == "stock":
        return fp.get_batch_prefill_module("fa3", *args)
    sp = spec(name, dtype, head_dim)
    prebuilt = Path(os.environ.get("RLREPRO_FA3_PREBUILT", "/nonexistent")) / f"{sp.name}.so"
    source = _Prebuilt(sp, prebuilt) if prebuilt.is_file() else sp
    saved = fp.gen_batch_prefill_module, fp.get_batch_prefill_uri
    fp.gen_batch_prefill_module = lambda *a, **k: source
    fp.get_batch_prefill_uri = lambda *a, **k: sp.name
    try:
        return fp.get_batch_prefill_module.__wrapped__("fa3", *args)
    finally:
        fp.gen_batch_prefill_module, fp.get_batch_prefill_uri = saved


class _Prebuilt:
    """A variant compiled elsewhere for the same flashinfer and GPU (``RLREPRO_FA3_PREBUILT``: a folder of
    ``<module name>.so``), loaded instead of built."""

    def __init__(self, sp, path: Path) -> None:
        self.sp, self.path = sp, path

    def build_and_load(self):
        return self.sp.load(self.path)


def use(wrapper, name: str, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128):
    """Make a planned FA3 ``wrapper`` run variant ``name`` (flashinfer's plan does not depend on the kernel's
    tiles: its scheduler cuts the queries in 128-row tiles, which a 64-row kernel serves only where every
    request has at most 64 query rows, as the folded decode's 4). Returns the wrapper."""
    wrapper._cached_module = module(name, dtype, head_dim)
    return wrapper
