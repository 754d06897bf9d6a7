"""AdamW over float32 master weights, a warm-up + cosine LR schedule, and gradient clipping in a fixed order.

Determinism measures:

* ``torch.optim.AdamW(foreach=False, fused=False)``: the single-tensor implementation, one parameter at a time,
  elementwise only — no multi-tensor kernels whose grouping could depend on the set of tensors.
* Parameters are kept in **name order** everywhere (optimizer, clipping, data-parallel reduction), so no result
  depends on module registration or dict order.
* The global grad norm is ``sqrt(sum_p ||g_p||^2)`` with each ``||g_p||`` a float32 reduction of one tensor and the
  sum over parameters done in float64 in name order.

Mixed precision: when the model computes in bf16/fp16, the optimizer holds a float32 master copy of every
parameter. Gradients are moved into the masters' float32 ``.grad`` after each micro-batch (so accumulation
happens in float32), AdamW updates the masters, and the masters are cast back into the model's parameters.
Float32 parameters are their own masters (no copy).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

__all__ = ["MasterWeightAdamW", "WarmupCosineLR", "lr_at", "clip_grad_norm_", "grad_norm"]


class MasterWeightAdamW:
    """``torch.optim.AdamW`` (single-tensor path) over float32 masters of ``named_params``, taken in name order.

    ``master_init`` (optional, name -> tensor) seeds the masters with more precise values than the model holds
    (e.g. the float32 weights a bf16 model was cast from). Weight decay applies to every parameter.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 master_init: Mapping[str, torch.Tensor] | None = None) -> None:
        pairs = sorted(((n, p) for n, p in named_params if p.requires_grad), key=lambda kv: kv[0])
        if not pairs:
            raise ValueError("MasterWeightAdamW got no trainable parameters")
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        self.masters: list[torch.Tensor] = []
        for name, p in pairs:
            if p.dtype == torch.float32 and (master_init is None or name not in master_init):
                self.masters.append(p)
                continue
            init = p.detach() if master_init is None or name not in master_init else master_init[name]
            if tuple(init.shape) != tuple(p.shape):
                raise ValueError(f"master_init[{name!r}] has shape {tuple(init.shape)}, parameter has {tuple(p.shape)}")
            self.masters.append(init.detach().to(device=p.device, dtype=torch.float32).clone().requires_grad_(True))
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                       foreach=False, fused=False)
        self._copy_masters_to_params()

    @property
    def has_master_copies(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the model's low-precision grads into the float32 master grads and clear them (call after each
        backward). A no-op for float32 parameters, whose grads autograd accumulates in place."""
        for p, m in zip(self.params, self.masters):
            if m is p or p.grad is None:
                continue
            if m.grad is None:
                g = p.grad.float()
                m.grad = g.clone() if g.data_ptr() == p.grad.data_ptr() else g
            else:
                m.grad.add_(p.grad)  # promotes to float32 elementwise (exact), without a float32 temporary
            p.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The float32 master grads in name order; a parameter without a grad gets zeros (so every rank and every
        step updates the same set of tensors)."""
        self.accumulate_grads()
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        return [m.grad for m in self.masters]

    @torch.no_grad()
    def _copy_masters_to_params(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def step(self) -> None:
        self.grads()
        self.inner.step()
        self._copy_masters_to_params()

    def named_master_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, m.detach()) for n, m in zip(self.names, self.masters)]

    def state_dict(self) -> dict:
        """AdamW's state plus the master weights that are separate copies (float32 params are saved with the model)."""
        return {
            "names": list(self.names),
            "adamw": self.inner.state_dict(),
            "master_weights": {n: m.detach().clone() for n, m, p in zip(self.names, self.masters, self.params)
                               if m is not p},
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        if list(state["names"]) != self.names:
            missing = sorted(set(self.names) - set(state["names"]))
            extra = sorted(set(state["names"]) - set(self.names))
            raise ValueError(f"optimizer state is for other parameters (missing {missing[:5]}, extra {extra[:5]}); "
                             "load it into a trainer built for the same model")
        masters = state["master_weights"]
        for n, m, p in zip(self.names, self.masters, self.params):
            if m is p:
                continue
            if n not in masters:
                raise ValueError(f"optimizer state lacks the float32 master weight {n!r}: it was saved by a trainer "
                                 "without master copies; use the same param_dtype as the saving run")
            m.copy_(masters[n])
        self.inner.load_state_dict(state["adamw"])
        self._copy_masters_to_params()


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr_ratio``.

    ``base_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step already moves), then
    ``base_lr * (r + (1 - r) * (1 + cos(pi * progress)) / 2)`` with ``progress = (step - warmup_steps) /
    (total_steps - warmup_steps)`` clamped to [0, 1] and ``r = min_lr_ratio``; ``base_lr * r`` after ``total_steps``.
    Computed in Python floats, so the value is the same on every machine.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class WarmupCosineLR:
    """Sets ``lr_at(step)`` on every param group; ``step()`` once per train step. State: the step counter."""

    def __init__(self, optimizer, *, base_lr: float, warmup_steps: int, total_steps: int,
                 min_lr_ratio: float = 0.0) -> None:
        self.optimizer = optimizer
        self.base_lr, self.warmup_steps, self.total_steps, self.min_lr_ratio = (
            base_lr, warmup_steps, total_steps, min_lr_ratio)
        self.last_step = 0
        self._apply()

    def get_last_lr(self) -> float:
        """The rate the next optimizer step uses."""
        return lr_at(self.last_step, base_lr=self.base_lr, warmup_steps=self.warmup_steps,
                     total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_last_lr()

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_lr_ratio": self.min_lr_ratio}

    def load_state_dict(self, state: Mapping) -> None:
        self.last_step = int(state["last_step"])
        self.base_lr, self.warmup_steps = float(state["base_lr"]), int(state["warmup_steps"])
        self.total_steps, self.min_lr_ratio = int(state["total_steps"]), float(state["min_lr_ratio"])
        self._apply()


@torch.no_grad()
def grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm as a float64 0-d tensor: float32 norm of each tensor, squares summed in order in float64.
    ``grads`` may be a generator (e.g. gathering one sharded gradient at a time)."""
    total = None
    for g in grads:
        if total is None:
            total = torch.zeros((), dtype=torch.float64, device=g.device)
        total += torch.linalg.vector_norm(g, dtype=torch.float32).double().square()
    return torch.zeros((), dtype=torch.float64) if total is None else total.sqrt()


@torch.no_grad()
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor | None = None) -> float:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``) and
    return the norm before clipping. Pass the grads in a fixed order (name order). ``max_norm <= 0``: no clipping.
    ``norm``: the global norm, when it is not ``grad_norm(grads)`` (e.g. that of the full tensors of sharded grads).
    """
    if norm is None:
        norm = grad_norm(grads)
    value = float(norm)
    if max_norm > 0 and math.isfinite(value):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if float(coef) < 1.0:
            for g in grads:
                g.mul_(coef.to(g.dtype))
    return value
