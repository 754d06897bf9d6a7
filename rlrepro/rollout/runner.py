"""The model runner: owns the KV-cache tensors, turns a scheduled step into one model call, samples.

Every step is one ``model.forward_tokens`` over the step's tokens (prefill chunks and decodes mixed), described
by ``AttentionMetadata.paged``. Logits are computed only for the rows that sample (each sampling sequence's last
row); ``kernels.linear`` is batch-invariant, so they equal the rows of a full-sequence forward.

CUDA graphs (CUDA only, ``enable_cuda_graphs``): decode-only steps (every sequence computes one token) replay a
graph captured for the smallest fixed batch size >= the step's size. Padding rows read and write only a scratch
block that no sequence owns, and the kernels are batch-invariant, so padding cannot change a real row. The graph
is captured with ``max_seq_len = max_model_len`` and a block table as wide as ``max_model_len`` needs: the
attention kernel must give the same result for any ``max_seq_len`` >= the true one (the deterministic kernels
reduce over positions ``0..p`` only) and must not synchronise with the host. A capture that fails (e.g. a kernel
that reads a tensor value on the host) falls back to eager decoding with a warning.

Overlap: ``launch`` only enqueues a step (inputs copied through pinned memory, no host-device synchronisation on
the decode path) and returns a :class:`StepOutput` whose values are read back later, so the host schedules and
prepares step t+1 while the device runs step t. A sequence whose last token was sampled by the step still in
flight carries a placeholder (``Sequence.pending_row``); its input id is gathered on the device from that step's
sampled tokens. ``execute`` is ``launch(...).result()``.
"""
from __future__ import annotations

import warnings

import torch
from torch.profiler import record_function

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata, fa3_attention, flashinfer_attention
from rlrepro.kernels.metadata import tensor_to_device

from .sampler import SampleRequest, sample_on_device
from .scheduler import ScheduledSeq
from .sequence import PLACEHOLDER

GRAPH_BATCH_SIZES = (1, 2, 4, 8, *range(16, 513, 16))


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 enable_cuda_graphs: bool) -> None:
        cfg = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        # One block past the allocator's range: the scratch block that CUDA-graph padding rows write into.
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=model.dtype, device=self.device),
                           torch.zeros(shape, dtype=model.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._fi_graphs: dict = {}  # graph size -> flashinfer_attention.GraphDecode (fast mode with flashinfer)
        self.num_graph_steps = 0
        self._prev_tokens: torch.Tensor | None = None  # the last launch's sampled tokens, on the device
        if enable_cuda_graphs and self.device.type == "cuda":
            try:
                self._capture_decode_graphs(max_num_seqs)
            except Exception as e:  # noqa: BLE001 - any capture failure means: decode eagerly
                self.graphs, self._fi_graphs = {}, {}
                torch.cuda.synchronize(self.device)
                warnings.warn(f"CUDA graph capture failed, decoding runs eagerly: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=2)

    # ---- one step -----------------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledSeq]) -> list[tuple[int, float]]:
        """Run one step; returns (token, logprob) for each sampling entry, in order."""
        return self.launch(scheduled).result()

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq]) -> "StepOutput":
        """Enqueue one step on the device; its sampled (token, logprob) pairs come from ``.result()``."""
        ids: list[int] = []
        sample_rows: list[int] = []
        requests: list[SampleRequest] = []
        patch_rows: list[int] = []  # rows whose input id is a token still on the device
        patch_src: list[int] = []  # ... and its row in the previous launch's sampled tokens
        for s in scheduled:
            seq = s.seq
            ids.extend(seq.token_ids[s.start:s.end])
            if seq.pending_row is not None and s.end == len(seq):
                patch_rows.append(len(ids) - 1)
                patch_src.append(seq.pending_row)
                ids[-1] = 0
            if s.samples:
                sample_rows.append(len(ids) - 1)
                p = seq.params
                requests.append(SampleRequest(p.temperature, p.top_k, p.top_p, seq.seed, s.end))
        if PLACEHOLDER in ids:
            raise RuntimeError("runner: a step feeds a placeholder token that is not the previous step's output")
        if patch_rows and self._prev_tokens is None:
            raise RuntimeError("runner: a placeholder token but no previous step to take it from")
        graph_size = self._graph_size(scheduled)
        if graph_size is not None:
            logits = self._replay_decode_graph(scheduled, ids, graph_size, patch_rows, patch_src)
            rows = [i for i, s in enumerate(scheduled) if s.samples]
            if len(rows) != len(scheduled):
                logits = logits.index_select(0, tensor_to_device(rows, torch.int64, self.device))
        else:
            meta = AttentionMetadata.paged(
                [s.num_new_tokens for s in scheduled], [s.end for s in scheduled],
                [s.seq.block_table for s in scheduled], self.block_size, self.device)
            input_ids = tensor_to_device(ids, torch.int64, self.device)
            self._patch_ids(input_ids, patch_rows, patch_src)
            hidden = self.model.forward_tokens(input_ids, meta, self.kv_caches, check_ids=False)
            if not sample_rows:
                self._prev_tokens = None
                return StepOutput(None, None)
            rows = tensor_to_device(sample_rows, torch.int64, self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        with record_function("rlrepro.sample"):
            tokens, logprobs = sample_on_device(logits, requests)
        self._prev_tokens = tokens
        return StepOutput(tokens, logprobs)

    def _patch_ids(self, input_ids: torch.Tensor, rows: list[int], src: list[int]) -> None:
        """Put the previous step's sampled tokens into the rows that feed them (on the device, no sync)."""
        if rows:
            src_t = tensor_to_device(src, torch.int64, self.device)
            rows_t = tensor_to_device(rows, torch.int64, self.device)
            input_ids.index_copy_(0, rows_t, self._prev_tokens.index_select(0, src_t))

    # ---- CUDA graphs for decode ---------------------------------------------------------------------------
    def _graph_size(self, scheduled: list[ScheduledSeq]) -> int | None:
        if not self.graphs or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        n = len(scheduled)
        return next((b for b in sorted(self.graphs) if b >= n), None)

    def _graph_forward(self, b: int) -> torch.Tensor:
        """``forward_tokens`` + ``compute_logits`` on the static buffers. Nothing in it reads a device value on the
        host (capture forbids it): the ids are not range-checked (the engine validated them) and the rope table is
        sized from ``max_seq_len`` (grown by the uncaptured warm-up call)."""
        meta = AttentionMetadata(
            cu_seqlens_q=self._cu[: b + 1], seq_lens=self._seq_lens[:b], positions=self._positions[:b],
            seq_idx=self._seq_idx[:b], max_seq_len=self.max_model_len, slot_mapping=self._slots[:b],
            block_table=self._block_table[:b], block_size=self.block_size)
        if b in self._fi_graphs:  # attention on flashinfer: the decode wrapper planned for this graph size
            meta.cache[self._fi_graphs[b].CACHE_KEY] = self._fi_graphs[b]
        hidden = self.model.forward_tokens(self._ids[:b], meta, self.kv_caches, check_ids=False)
        return self.model.compute_logits(hidden)

    def _reset_graph_inputs(self) -> None:
        self._ids.zero_()
        self._positions.zero_()
        self._seq_lens.fill_(1)
        self._slots.fill_(self.scratch_block * self.block_size)
        self._block_table.fill_(self.scratch_block)

    def _capture_decode_graphs(self, max_num_seqs: int) -> None:
        limit = min(max_num_seqs, GRAPH_BATCH_SIZES[-1])
        sizes = [b for b in GRAPH_BATCH_SIZES if b < limit] + [next(b for b in GRAPH_BATCH_SIZES if b >= limit)]
        max_b = sizes[-1]
        dev = self.device
        width = -(-self.max_model_len // self.block_size)
        self._ids = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self._seq_lens = torch.ones(max_b, dtype=torch.int64, device=dev)
        self._slots = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self._block_table = torch.zeros(max_b, width, dtype=torch.int64, device=dev)
        self._cu = torch.arange(max_b + 1, dtype=torch.int64, device=dev)
        self._seq_idx = torch.arange(max_b, dtype=torch.int64, device=dev)
        self._reset_graph_inputs()
        cfg = self.model.config
        graph_decode = None  # attention on flashinfer: the fast mode's decode, or the FA3 experiment's (#27)
        if kernels.current_mode() == "fast" and flashinfer_attention.serves(dev, self.model.dtype, cfg.head_dim):
            graph_decode = flashinfer_attention.GraphDecode
        elif (kernels.current_mode() == "deterministic" and fa3_attention.serves(dev, self.model.dtype, cfg.head_dim)
              and not fa3_attention.triton_decode(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)):
            graph_decode = fa3_attention.GraphDecode  # FA3's own folded decode (its Triton rewrite needs no plan)
        if graph_decode is not None:
            for b in sizes:
                fg = graph_decode(
                    b, b * width, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, self.block_size,
                    self.model.dtype, dev, cfg.head_dim ** -0.5)
                fg.plan([1] * b, [[self.scratch_block] * width] * b)
                self._fi_graphs[b] = fg
        with torch.inference_mode():
            pool = None
            for b in reversed(sizes):  # largest first, so the smaller graphs fit in its memory pool
                self._graph_forward(b)  # warm-up: lazy initialisation must not happen during capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._graph_forward(b)
                pool = graph.pool() if pool is None else pool
                self.graphs[b] = (graph, out)
            torch.cuda.synchronize(dev)
        # the graphs gather cos/sin from this table: keep it alive should the model grow a longer one for another
        # caller (another engine, a longer forward), which would free it while the graphs still read it
        self._graph_rope = self.model._rope
        self._reset_graph_inputs()

    def _replay_decode_graph(self, scheduled: list[ScheduledSeq], ids: list[int], b: int, patch_rows: list[int],
                             patch_src: list[int]) -> torch.Tensor:
        n, bs = len(scheduled), self.block_size
        width = max(len(s.seq.block_table) for s in scheduled)
        pad = [self.scratch_block] * width
        rows, positions, slots = [], [], []
        for s in scheduled:
            pos, blocks = s.start, s.seq.block_table
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            rows.append(blocks + pad[len(blocks):])
        rows += [pad] * (b - n)
        scratch = self.scratch_block * bs
        # padding rows: token 0 at position 0 of the scratch block
        inputs = [ids + [0] * (b - n), positions + [0] * (b - n), [p + 1 for p in positions] + [1] * (b - n),
                  slots + [scratch] * (b - n)]
        # one pinned host-to-device copy for the four vectors and the block table, then device-side copies
        staged = tensor_to_device([v for row in inputs for v in row] + [v for row in rows for v in row],
                                  torch.int64, self.device)
        vectors = staged[: 4 * b].view(4, b)
        self._ids[:b].copy_(vectors[0])
        self._patch_ids(self._ids[:b], patch_rows, patch_src)
        self._positions[:b].copy_(vectors[1])
        self._seq_lens[:b].copy_(vectors[2])
        self._slots[:b].copy_(vectors[3])
        # Columns past a row's blocks keep stale but valid block ids; the kernels mask positions >= seq_len.
        self._block_table[:b, :width].copy_(staged[4 * b:].view(b, width))
        if b in self._fi_graphs:  # flashinfer plans on the host, outside the graph, into the graph's buffers
            self._fi_graphs[b].plan([p + 1 for p in positions] + [1] * (b - n),
                                    rows)
        graph, out = self.graphs[b]
        graph.replay()
        self.num_graph_steps += 1
        return out[:n]


class StepOutput:
    """A launched step's sampled tokens and logprobs: copied to pinned host memory without waiting, read by
    ``result()`` (which waits for that copy only)."""

    def __init__(self, tokens: torch.Tensor | None, logprobs: torch.Tensor | None) -> None:
        self._event = None
        if tokens is None:
            self._host = None
        elif tokens.is_cuda:
            self._host = (torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                          torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True))
            self._host[0].copy_(tokens, non_blocking=True)
            self._host[1].copy_(logprobs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = (tokens, logprobs)

    def result(self) -> list[tuple[int, float]]:
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return list(zip(self._host[0].tolist(), self._host[1].tolist()))
