"""What the GPU benchmark scripts share: a report printed line by line as it goes and written to ``--out`` at the
end, and ``triton.testing.do_bench`` medians (milliseconds, L2 flushed between runs)."""
from __future__ import annotations

from pathlib import Path

import torch

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def write(path: str | None) -> None:
    """The report so far into ``path`` (nothing without one)."""
    if path:
        Path(path).write_text("\n".join(LINES) + "\n")


def bench(fn, warmup: int = 10, rep: int = 60) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``|a - b| / |b|`` in float32 (Frobenius norms)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def causal_references(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, length: int, scale: float,
                      fi=None) -> dict[str, float]:
    """Milliseconds of the reference causal forwards on ``batch`` packed sequences of ``length`` tokens
    (q [N, H, D], k/v [N, Hkv, D]): SDPA's own choice, and flashinfer's FA3 ragged prefill when ``fi`` (the
    flashinfer module) is given; a failure of flashinfer is reported and its entry left out."""
    import torch.nn.functional as F
    n, h, d = q.shape
    qd, kd, vd = (t.view(batch, length, -1, d).transpose(1, 2) for t in (q, k, v))
    out = {"SDPA": bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                                enable_gqa=True))}
    if fi is not None:
        try:
            indptr = torch.arange(0, n + 1, length, dtype=torch.int32, device=q.device)
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
            w.plan(indptr, indptr, h, k.shape[1], d, causal=True, sm_scale=scale, q_data_type=q.dtype)
            out["FA3"] = bench(lambda: w.run(q, k, v))
        except Exception as e:  # noqa: BLE001 - report and go on
            emit(f"flashinfer FA3 failed: {type(e).__name__}: {e}")
    return out
