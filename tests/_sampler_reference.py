"""The top-k / top-p rule of ``rlrepro.rollout.sampler`` written out for one row with Python integers, for tests
(CPU and CUDA). Imported as ``from _sampler_reference import ...`` (``tests/`` is on ``sys.path`` under pytest)."""
import math

import torch


def one_row_reference_mask(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition written out for one row with Python integers, independently of ``keep_masks``."""
    v = row.shape[-1]
    vals, order = torch.sort(row.reshape(1, v), dim=-1, descending=True, stable=True)
    k = top_k if 0 < top_k < v else v
    keep = [j < k for j in range(v)]
    if top_p < 1.0:
        weights = torch.exp(vals - vals[:, :1])[0].tolist()  # float32 values, as Python floats (exact)
        masses = [math.floor(w * 2.0 ** 32) if keep[j] else 0 for j, w in enumerate(weights)]
        total, before = sum(masses), 0
        for j in range(v):
            keep[j] = keep[j] and (j == 0 or before / total < top_p)  # int / int: correctly rounded float
            before += masses[j]
    keep_t = torch.tensor([keep])
    return torch.empty_like(keep_t).scatter_(1, order.cpu(), keep_t).reshape(v)  # on the CPU
