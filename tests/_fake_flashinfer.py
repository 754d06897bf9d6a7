"""A float64 stand-in for flashinfer's two FA3 prefill wrappers (paged and ragged), on the CPU: each query row
computed alone, so no row depends on the call. It checks the arguments it is planned with against the call (int32
page tables, query count, heads), so that code planning the real wrappers is tested for its bookkeeping here."""
from __future__ import annotations

import math

import torch


def _attend(q, k, v, n_kv: int, causal: bool, scale: float, drift: float):
    """float64, one query row at a time (so no row depends on the call): out in q's dtype, lse in base 2."""
    g = q.shape[1] // k.shape[1]
    k, v = k[:n_kv].double().repeat_interleave(g, 1), v[:n_kv].double().repeat_interleave(g, 1)
    outs, lses = [], []
    for j in range(q.shape[0]):
        last = n_kv - q.shape[0] + j if causal else n_kv - 1
        s = torch.einsum("hd,khd->hk", q[j].double(), k[: last + 1]) * scale
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hk,khd->hd", torch.exp(s - lse[:, None]), v[: last + 1]) + drift)
        lses.append(lse / math.log(2.0))
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


class Wrapper:
    drift_per_request = 0.0  # > 0: a kernel whose rows depend on the call (the probe must see it)

    def __init__(self, ws, layout, backend=None, use_cuda_graph=False, **buffers):
        assert layout == "NHD" and backend == "fa3", (layout, backend)
        self.use_cuda_graph, self.buffers = use_cuda_graph, buffers

    def _out(self, q, pieces, return_lse: bool):
        drift = self.drift_per_request * (len(pieces) - 1)
        outs = [_attend(q[a:b], k, v, n_kv, self.causal, self.scale, drift) for (a, b), k, v, n_kv in pieces]
        out, lse = torch.cat([o for o, _ in outs]), torch.cat([ls for _, ls in outs])
        return (out, lse) if return_lse else out


class Paged(Wrapper):
    def plan(self, qo, kv_indptr, indices, last, h, hkv, d, page, causal=False, sm_scale=None, q_data_type=None,
             kv_data_type=None):
        assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, indices, last))
        self.t = (qo.tolist(), kv_indptr.tolist(), indices.tolist(), last.tolist(), page)
        self.heads = (h, hkv, d)
        self.causal, self.scale = causal, sm_scale

    def run(self, q, cache, return_lse=False):
        qo, kvp, idx, last, page = self.t
        assert q.shape[0] == qo[-1] and tuple(q.shape[1:]) == (self.heads[0], self.heads[2]), (q.shape, self.heads)
        assert cache[0].shape[1] == page and cache[0].shape[2] == self.heads[1]
        pieces = []
        for i in range(len(qo) - 1):
            pages = idx[kvp[i]:kvp[i + 1]]
            n_kv = (len(pages) - 1) * page + last[i]
            k, v = (c[pages].reshape(-1, *c.shape[2:]) for c in cache)
            pieces.append(((qo[i], qo[i + 1]), k, v, n_kv))
        return self._out(q, pieces, return_lse)


class Ragged(Wrapper):
    def plan(self, qo, kv, h, hkv, d, causal=False, sm_scale=None, q_data_type=None, kv_data_type=None):
        self.t, self.causal, self.scale = (qo.tolist(), kv.tolist()), causal, sm_scale

    def run(self, q, k, v, return_lse=False):
        qo, kv = self.t
        return self._out(q, [((qo[i], qo[i + 1]), k[kv[i]:kv[i + 1]], v[kv[i]:kv[i + 1]], kv[i + 1] - kv[i])
                             for i in range(len(qo) - 1)], return_lse)


class FakeFlashinfer:
    BatchPrefillWithPagedKVCacheWrapper = Paged
    BatchPrefillWithRaggedKVCacheWrapper = Ragged


class Decode(Paged):
    """The decode wrapper: one query a request against all of its KV (so no causal mask is needed)."""

    def __init__(self, ws, layout, use_tensor_cores=False, **buffers):  # not an FA3 wrapper: no backend check
        self.use_cuda_graph, self.buffers = False, buffers

    def plan(self, indptr, indices, last, h, hkv, d, page, q_data_type=None, sm_scale=None, **split):
        qo = torch.arange(len(indptr), dtype=torch.int32)
        super().plan(qo, indptr, indices, last, h, hkv, d, page, causal=False, sm_scale=sm_scale)


FakeFlashinfer.BatchDecodeWithPagedKVCacheWrapper = Decode
