"""The fast mode's attention on CUDA: flashinfer, as SGLang runs it when determinism is off (optional extra
``.[flashinfer]``). Not batch-invariant: flashinfer splits a long KV over CTAs by the batch's shape and merges the
pieces in an order that follows it (``benchmarks/bench_attention_long.py`` shows the bits).

* packed sequences without a cache and without autograd: the ragged prefill (FA3 backend on Hopper, else FA2);
* the paged cache, decode steps (one query per sequence): the paged decode (tensor cores: GQA);
* the paged cache, other steps (prefill, chunked prefill, mixed): the paged prefill;
* the trainer (autograd) has no flashinfer backward: the caller runs SDPA's flash attention there.

Each call is planned once per forward: the plan is kept in ``meta.cache`` and every layer's call runs it. The
engine's decode CUDA graphs use :class:`GraphDecode`: a decode wrapper with fixed buffers per graph size, planned
from the host's block tables before each replay (flashinfer's ``plan`` cannot run inside a capture).
"""
from __future__ import annotations

import importlib
import logging
import os

import torch

__all__ = ["flashinfer_module", "serves", "supports", "ragged_prefill", "paged", "GraphDecode", "host_page_table"]

_log = logging.getLogger("rlrepro.kernels")
_MODULE: list = []  # [module or None], filled on first use
_WORKSPACE: dict = {}  # device -> the wrappers' shared workspace buffer
_WRAPPERS: dict = {}  # (device, kind) -> wrapper
WORKSPACE_BYTES = 256 << 20


def flashinfer_module():
    """flashinfer if it imports and ``RLREPRO_FLASHINFER`` is not ``0``, else None. The first call says in the log
    which attention the fast mode runs on CUDA."""
    if not _MODULE:
        mod = None
        if os.environ.get("RLREPRO_FLASHINFER", "1") != "0":
            try:
                mod = importlib.import_module("flashinfer")
            except Exception as e:  # noqa: BLE001 - absent, or present without its CUDA pieces
                _log.info("fast mode: flashinfer is not usable (%s: %s); attention runs on torch SDPA and "
                          "rlrepro's paged Triton kernel (pip install 'rlrepro[flashinfer]' for flashinfer)",
                          type(e).__name__, e)
        if mod is not None:
            _log.info("fast mode: attention on flashinfer %s (FA3 prefill on Hopper, paged decode)",
                      getattr(mod, "__version__", "?"))
        _MODULE.append(mod)
    return _MODULE[0]


HEAD_DIMS = (64, 128, 256)  # the head sizes flashinfer's prebuilt and JIT kernels serve


def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flashinfer serves attention of this device, dtype and head size (and imports)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim in HEAD_DIMS
            and flashinfer_module() is not None)


def supports(q: torch.Tensor) -> bool:
    """Whether flashinfer serves this call (``serves`` of the query [N, H, D])."""
    return serves(q.device, q.dtype, q.shape[-1])


def _workspace(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACE[key]


def _prefill_backend(device: torch.device) -> str:
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


def _wrapper(kind: str, device: torch.device):
    key = (device.type, device.index, kind)
    if key not in _WRAPPERS:
        fi = flashinfer_module()
        ws = _workspace(device)
        if kind == "ragged":
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=_prefill_backend(device))
        elif kind == "paged_prefill":
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=_prefill_backend(device))
        else:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        _WRAPPERS[key] = w
    return _WRAPPERS[key]


def _page_table(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """flashinfer's CSR page table (indptr, indices, last_page_len; int32) of the sequences' blocks."""
    pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(pages.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(pages, 0, out=indptr[1:])
    used = torch.arange(block_table.shape[1], device=seq_lens.device).unsqueeze(0) < pages.unsqueeze(1)
    indices = block_table[used].to(torch.int32)
    last = ((seq_lens - 1) % block_size + 1).to(torch.int32)
    return indptr, indices, last


def _is_planned(w, meta, key) -> bool:
    """Whether the shared wrapper ``w`` holds the plan of this forward's ``meta``: its own record says so (a later
    forward may have planned the wrapper for other metadata since) and so does the metadata's."""
    return meta.cache.get(("flashinfer", "planned")) == key and getattr(w, "_rlrepro_plan", None) is meta.cache


def _mark_planned(w, meta, key) -> None:
    meta.cache[("flashinfer", "planned")] = key
    w._rlrepro_plan = meta.cache


def ragged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Causal attention over packed sequences (queries == keys), no cache, no autograd."""
    key = ("flashinfer", "ragged", float(scale))
    w = _wrapper("ragged", q.device)
    if not _is_planned(w, meta, key):
        indptr = meta.cu_seqlens_q.to(torch.int32)
        w.plan(indptr, indptr, q.shape[1], k.shape[1], q.shape[2], causal=True, sm_scale=float(scale),
               q_data_type=q.dtype, kv_data_type=k.dtype)
        _mark_planned(w, meta, key)
    return w.run(q, k.contiguous() if k.stride(-1) != 1 else k, v.contiguous() if v.stride(-1) != 1 else v)


def paged(q: torch.Tensor, meta, scale: float, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Attention of this step's queries against the paged cache (already holding this step's K/V)."""
    graph = meta.cache.get(GraphDecode.CACHE_KEY)
    if graph is not None:  # a captured decode graph: planned by the runner before capture / each replay
        return graph.wrapper.run(q, kv_cache)
    k_cache = kv_cache[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    decode = q.shape[0] == meta.num_seqs  # every sequence has at least one query: one each
    kind = "decode" if decode else "paged_prefill"
    key = ("flashinfer", kind, float(scale))
    w = _wrapper(kind, q.device)
    if not _is_planned(w, meta, key):
        indptr, indices, last = _page_table(meta.seq_lens, meta.block_table, meta.block_size)
        if decode:
            w.plan(indptr, indices, last, q.shape[1], hkv, d, meta.block_size, q_data_type=q.dtype,
                   kv_data_type=k_cache.dtype, sm_scale=float(scale))
        else:
            w.plan(meta.cu_seqlens_q.to(torch.int32), indptr, indices, last, q.shape[1], hkv, d, meta.block_size,
                   causal=True, sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        _mark_planned(w, meta, key)
    return w.run(q, kv_cache)


class GraphDecode:
    """A flashinfer decode wrapper for one CUDA-graph batch size ``batch``: fixed device buffers for the page
    table (at most ``max_pages`` pages), planned with :meth:`plan` before the capture and before every replay."""

    CACHE_KEY = ("flashinfer", "graph_decode")  # where the runner puts it in the step's ``meta.cache``

    def __init__(self, batch: int, max_pages: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, scale: float) -> None:
        fi = flashinfer_module()
        self.batch, self.block_size = batch, block_size
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype, self.scale = dtype, float(scale)
        self.device = torch.device(device)
        self._staged = None  # the event after the last plan's asynchronous copies (CUDA)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(device), "NHD", use_cuda_graph=True,  # one stream, one call at a time: shared
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=device))

    def plan(self, seq_lens: list[int], block_tables: list[list[int]]) -> None:
        """``seq_lens`` / ``block_tables``: the ``batch`` rows' KV lengths and blocks (padding rows included).

        Without making the host wait for the device's queue, so that the engine can launch a step while the last
        one runs, as a serving stack does: flashinfer copies the page table into the graph's buffers with
        ``copy_``, which from pageable host memory (and for the indices, from any host memory) first waits for
        the stream to drain. Here the indices reach the device through pinned memory without blocking and the
        other two vectors are pinned. flashinfer's plan then stages its schedule in a pinned host buffer of the
        wrapper's and copies it to the device asynchronously; the next plan would overwrite that buffer, so it
        first waits for the previous copy to have run (an event: at most the step before)."""
        from .metadata import to_device

        indptr, indices, last = host_page_table(seq_lens, block_tables, self.block_size)
        h, hkv, d = self.shape
        i32 = dict(dtype=torch.int32)
        dev = self.device
        if dev.type == "cuda":
            indptr_t = torch.tensor(indptr, **i32).pin_memory()
            last_t = torch.tensor(last, **i32).pin_memory()
            indices_t = to_device(torch.tensor(indices, **i32), dev)
            if self._staged is not None:
                self._staged.synchronize()
        else:
            indptr_t, indices_t, last_t = (torch.tensor(x, **i32) for x in (indptr, indices, last))
        self.wrapper.plan(indptr_t, indices_t, last_t, h, hkv, d, self.block_size, q_data_type=self.dtype,
                          kv_data_type=self.dtype, sm_scale=self.scale)
        if dev.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()


def host_page_table(seq_lens: list[int], block_tables: list[list[int]],
                    block_size: int) -> tuple[list[int], list[int], list[int]]:
    """:func:`_page_table` from host lists: (indptr, indices, last_page_len)."""
    pages = [-(-n // block_size) for n in seq_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    indices = [b for row, p in zip(block_tables, pages) for b in row[:p]]
    return indptr, indices, [(n - 1) % block_size + 1 for n in seq_lens]
