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
