"""The deterministic mode's attention with flashinfer's FA3 bits (Hopper, issue #27), off unless
``RLREPRO_ATTENTION=fa3``. The bits hold in every check of ``benchmarks/probe_fa3_invariance.py`` and
``probe_fa3_decode.py``; end to end it runs at par with the Triton attention (docs/BENCHMARKS.md: the engine at 0.99x
on an H100, the 16k train step at 0.995x), so it stays an opt-in that needs flashinfer.

Why it could keep the promises. FA3's forward walks a query row's KV in tiles aligned to position 0, from the last
to the first, in one program (flashinfer's sm90 plan never splits the KV), so a row's reduction order is fixed by
its own position. A tile past a row's diagonal (inside its query tile's reach) is masked with a finite -5e4 and
undone exactly by the next tile's rescale. And flashinfer's paged FA3 kernel gathers K/V token by token (its page
table becomes per-token offsets), so one kernel, with one KV tile (96 positions at D = 128), serves:

* the trainer's packed forward (``packed``), with the log-sum-exp in base 2 of the scaled scores, which is what
  rlrepro's Triton backward reads: at head size 128 on the ragged (TMA) kernel rebuilt with the paged kernel's
  96-position KV tile (:mod:`.fa3_variants`, the same bits: ``benchmarks/probe_fa3_tiles.py``), else on the
  paged kernel with the packed K/V as a cache of 1-token pages;
* the engine's prefill, chunked prefill and mixed steps: the paged cache, causal, a request per sequence;
* decode steps: at head size 128, :mod:`.triton_fa3_decode`, FA3's arithmetic rewritten in Triton (the same bits
  on every row of ``benchmarks/probe_fa3_decode.py``, 1.3x the speed of FA3's own decode, no host work under CUDA
  graphs); at other head sizes FA3 itself with the GQA group's query heads folded into one request's rows,
  non-causal (a decode row sees every cached position), so each KV tile is read once per group (:class:`GraphDecode`
  under CUDA graphs).

The probe showed the same bits across all of these on the H200, and engine == trainer held at 8k on CUDA graphs.
Nothing selects this module by default (it gains nothing end to end and needs flashinfer), and a run that sets the
variable says so in its log.
"""
from __future__ import annotations

import logging
import os

import torch

from . import fa3_variants as _variants
from . import flashinfer_attention as _fi

__all__ = ["requested", "serves", "usable", "packed", "paged", "GraphDecode", "triton_decode"]

_log = logging.getLogger("rlrepro.kernels")
_SAID: list[bool] = []
_KEY = "fa3det"
RAGGED_HEAD_DIM = 128  # the head size whose ragged kernel fa3_variants rebuilds with the paged kernel's KV tile


def requested() -> bool:
    """``RLREPRO_ATTENTION`` is ``fa3`` (``triton`` or unset: rlrepro's Triton kernels)."""
    value = os.environ.get("RLREPRO_ATTENTION", "").strip().lower()
    if value not in ("", "triton", "fa3"):
        raise ValueError(f"RLREPRO_ATTENTION must be 'triton' or 'fa3', not {value!r}")
    order = os.environ.get("RLREPRO_ATTENTION_ORDER", "").strip()
    if value == "fa3" and order:  # FA3 has its own order: the variable would be recorded but change nothing
        raise ValueError(f"RLREPRO_ATTENTION=fa3 computes in FA3's own order; RLREPRO_ATTENTION_ORDER={order!r} "
                         "chooses the order of rlrepro's Triton kernels: unset one of the two")
    return value == "fa3"


def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention of this device, dtype and head size runs on FA3: requested, on CUDA, and FA3's. A request
    that cannot be served is an error naming why (a silent fallback would give other bits than asked for)."""
    if not requested() or device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        raise RuntimeError("RLREPRO_ATTENTION=fa3 needs a Hopper GPU (sm90); unset it to use the Triton kernels")
    if not _fi.serves(device, dtype, head_dim):
        raise RuntimeError(f"RLREPRO_ATTENTION=fa3: flashinfer does not serve {dtype} with head size {head_dim} here"
                           " (pip install 'rlrepro[flashinfer]'; bf16/fp16, head size 64/128/256), or unset it")
    if not _SAID:
        _log.warning("deterministic attention with flashinfer's FA3 bits (RLREPRO_ATTENTION=fa3)")
        _SAID.append(True)
    return True


def triton_decode(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether decode steps run :mod:`.triton_fa3_decode` (FA3's bits in Triton, no host work, as fast as
    rlrepro's own decode) rather than FA3's folded decode: at the head size whose KV tile it reproduces (96
    positions at 128) and at most 16 query heads per KV head. The runner then needs no :class:`GraphDecode`."""
    return head_dim == RAGGED_HEAD_DIM and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16


def usable(q: torch.Tensor) -> bool:
    """``serves`` for the queries ``q`` [N, H, D] of a call."""
    return serves(q.device, q.dtype, q.shape[-1])


def _wrapper(kind: str, device: torch.device):
    key = (device.type, device.index, _KEY, kind)
    if key not in _fi._WRAPPERS:
        fi = _fi.flashinfer_module()
        cls = fi.BatchPrefillWithRaggedKVCacheWrapper if kind == "ragged" else fi.BatchPrefillWithPagedKVCacheWrapper
        _fi._WRAPPERS[key] = cls(_fi._workspace(device), "NHD", backend="fa3")
    return _fi._WRAPPERS[key]


def _use_variant(w, name: str, dtype: torch.dtype, head_dim: int):
    """Make the planned wrapper ``w`` run FA3 variant ``name`` (:mod:`.fa3_variants`)."""
    return _variants.use(w, name, dtype, head_dim)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _fold(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[R, H, D] -> [R * G, Hkv, D]: row r * G + g, head j holds query head j * G + g of request r."""
    r, h, d = q.shape
    return q.view(r, hkv, h // hkv, d).transpose(1, 2).reshape(r * (h // hkv), hkv, d)


def _unfold(out: torch.Tensor, h: int) -> torch.Tensor:
    rg, hkv, d = out.shape
    g = h // hkv
    return out.view(rg // g, g, hkv, d).transpose(1, 2).reshape(rg // g, h, d)


def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float,
           return_lse: bool = False):
    """Causal attention over packed sequences (the trainer's forward). Returns out [N, H, D] and, with
    ``return_lse``, the rows' log-sum-exp [N, H] (float32, base 2 of the scaled scores, the Triton backward's
    convention).

    At head size 128: FA3's ragged kernel (K/V by TMA) built with the paged kernel's 96-position KV tiles
    (``ragged96`` of :mod:`.fa3_variants`; its own 128-position tiles give other bits), which gives the paged
    kernel's bits at 0.94-0.98x of the stock ragged kernel's speed (an H100, docs/BENCHMARKS.md). Other head
    sizes: the paged kernel itself, the packed K/V read as 1-token pages."""
    q, k, v = _dense(q.detach()), _dense(k.detach()), _dense(v.detach())
    cu = None
    if q.shape[-1] == RAGGED_HEAD_DIM:
        w = _wrapper("ragged", q.device)
        key = (_KEY, "ragged96", float(scale))
        if not _fi._is_planned(w, meta, key):
            cu = meta.cu_seqlens_q.to(torch.int32)
            w.plan(cu, cu, q.shape[1], k.shape[1], q.shape[2], causal=True, sm_scale=float(scale),
                   q_data_type=q.dtype, kv_data_type=k.dtype)
            _use_variant(w, "ragged96", q.dtype, q.shape[2])
            _fi._mark_planned(w, meta, key)
        out, lse = w.run(q, k, v, return_lse=True)
        return (out, lse) if return_lse else out
    w = _wrapper("packed", q.device)
    key = (_KEY, "packed", float(scale))
    if not _fi._is_planned(w, meta, key):
        cu = meta.cu_seqlens_q.to(torch.int32)
        n = q.shape[0]
        w.plan(cu, cu, torch.arange(n, dtype=torch.int32, device=q.device),
               torch.ones(meta.num_seqs, dtype=torch.int32, device=q.device), q.shape[1], k.shape[1], q.shape[2], 1,
               causal=True, sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=k.dtype)
        _fi._mark_planned(w, meta, key)
    out, lse = w.run(q, (k.unsqueeze(1), v.unsqueeze(1)), return_lse=True)
    return (out, lse) if return_lse else out


def paged(q: torch.Tensor, meta, scale: float, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """This step's queries against the paged cache (already holding their K/V): decode steps with the GQA group
    folded into rows (non-causal), any other step causal with a request per sequence."""
    graph = meta.cache.get(GraphDecode.CACHE_KEY)
    k_cache = kv_cache[0]
    h, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    decode = q.shape[0] == meta.num_seqs
    if decode and q.is_cuda and triton_decode(d, h, hkv):
        from . import triton_fa3_decode as _tdec  # here: a CPU install without triton imports this module

        return _tdec.decode(_dense(q), kv_cache, meta.seq_lens, meta.block_table, scale)
    if graph is not None:
        return _unfold(graph.wrapper.run(_fold(_dense(q), hkv), kv_cache), h)
    kind = "decode" if decode else "prefill"
    w = _wrapper(kind, q.device)
    key = (_KEY, kind, float(scale))
    if not _fi._is_planned(w, meta, key):
        indptr, indices, last = _fi._page_table(meta.seq_lens, meta.block_table, meta.block_size)
        if decode:
            g = h // hkv
            qo = torch.arange(0, (meta.num_seqs + 1) * g, g, dtype=torch.int32, device=q.device)
            w.plan(qo, indptr, indices, last, hkv, hkv, d, meta.block_size, causal=False, sm_scale=float(scale),
                   q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        else:
            w.plan(meta.cu_seqlens_q.to(torch.int32), indptr, indices, last, h, hkv, d, meta.block_size,
                   causal=True, sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        _fi._mark_planned(w, meta, key)
    if decode:
        return _unfold(w.run(_fold(_dense(q), hkv), kv_cache), h)
    return w.run(_dense(q), kv_cache)


class GraphDecode:
    """The folded decode of :func:`paged` for one CUDA-graph batch size ``batch``: a wrapper with fixed device
    buffers (at most ``max_pages`` pages), planned with :meth:`plan` before the capture and before every replay
    (flashinfer's ``plan`` runs on the host)."""

    CACHE_KEY = (_KEY, "graph_decode")  # where the runner puts it in the step's ``meta.cache``

    def __init__(self, batch: int, max_pages: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, scale: float) -> None:
        g = num_heads // num_kv_heads
        self.batch, self.block_size, self.group = batch, block_size, g
        self.shape = (num_kv_heads, head_dim)
        self.dtype, self.scale = dtype, float(scale)
        i32 = dict(dtype=torch.int32, device=device)
        self.qo = torch.arange(0, (batch + 1) * g, g, **i32)
        self.wrapper = _fi.flashinfer_module().BatchPrefillWithPagedKVCacheWrapper(
            _fi._workspace(device), "NHD", use_cuda_graph=True, backend="fa3", qo_indptr_buf=self.qo.clone(),
            paged_kv_indptr_buf=torch.zeros(batch + 1, **i32), paged_kv_indices_buf=torch.zeros(max_pages, **i32),
            paged_kv_last_page_len_buf=torch.zeros(batch, **i32))

    def plan(self, seq_lens: list[int], block_tables: list[list[int]]) -> None:
        """``seq_lens`` / ``block_tables``: the ``batch`` rows' KV lengths and blocks (padding rows included)."""
        indptr, indices, last = _fi.host_page_table(seq_lens, block_tables, self.block_size)
        hkv, d = self.shape
        i32 = dict(dtype=torch.int32)
        self.wrapper.plan(self.qo.cpu(), torch.tensor(indptr, **i32), torch.tensor(indices, **i32),
                          torch.tensor(last, **i32), hkv, hkv, d, self.block_size, causal=False, sm_scale=self.scale,
                          q_data_type=self.dtype, kv_data_type=self.dtype)
