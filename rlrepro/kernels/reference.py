"""Plain float64 reference implementations, used only by tests to check closeness (never bitwise)."""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def linear(x, weight, bias=None):
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


def rms_norm(x, weight, eps):
    xd = x.double()
    return weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def log_softmax(x):
    return torch.log_softmax(x.double(), dim=-1)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    g = x[..., :d].double()
    return g * torch.sigmoid(g) * x[..., d:].double()


def apply_rope(x, cos, sin):
    d = x.shape[-1] // 2
    xd, c, s = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    return torch.cat((xd[..., :d] * c - xd[..., d:] * s, xd[..., d:] * c + xd[..., :d] * s), dim=-1)


def attention_dense(q: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor, q_positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One sequence: q [n, H, D] at q_positions, k/v [L, Hkv, D] for positions 0..L-1."""
    h, hkv = q.shape[1], k_seq.shape[1]
    kd = k_seq.double().repeat_interleave(h // hkv, dim=1)
    vd = v_seq.double().repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kd) * scale
    allowed = torch.arange(k_seq.shape[0]).unsqueeze(0) <= q_positions.cpu().unsqueeze(1)
    s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vd)


def attention_packed(q, k, v, meta: AttentionMetadata, scale):
    cu = meta.cu_seqlens_q.tolist()
    return torch.cat([attention_dense(q[a:b], k[a:b], v[a:b], meta.positions[a:b], scale)
                      for a, b in zip(cu[:-1], cu[1:])])
