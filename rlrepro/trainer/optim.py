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

Optimizer-state sharding (ZeRO-1, :class:`ShardedMasterWeightAdamW`): over data-parallel ranks, each parameter's
master and AdamW moments live only on its owner rank (``data_parallel.assign_owners``); every rank still holds the
full float32 gradients, reduces and clips them as above, the owner alone runs AdamW on its masters, and every
weight is then broadcast from its owner. AdamW is elementwise per tensor, so the update is the same bits as the
unsharded optimizer's.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from .data_parallel import DataParallel, assign_owners

__all__ = ["MasterWeightAdamW", "ShardedMasterWeightAdamW", "WarmupCosineLR", "lr_at", "clip_grad_norm_",
           "grad_norm"]


# AdamW's settings a saved state carries into the run it resumes (torch's load_state_dict takes the saved group's);
# every other key of the group says how the update is computed (foreach, fused, amsgrad, ...) and must be the live one
_HYPER = ("lr", "betas", "eps", "weight_decay")
_REBUILD = "load it into a trainer built with the same model, param_dtype and optimizer as the saving run"


def check_layout(state) -> None:  # a KeyError deep in a load would say less
    if not isinstance(state, Mapping) or not {"names", "adamw", "master_weights"} <= set(state):
        raise ValueError("optimizer state is not an rlrepro MasterWeightAdamW state (it needs 'names', 'adamw' and "
                         "'master_weights'); resume from a checkpoint rlrepro wrote")


def check_masters(masters, names: list[str], shapes: list[tuple], need: Iterable[int], mine: Iterable[int]) -> None:
    """Masters ``need`` named in ``masters``, those ``mine`` tensors of their parameter's shape (others may be None)."""
    masters = masters if isinstance(masters, Mapping) else {}
    for i in need:
        if names[i] not in masters:
            raise ValueError(f"optimizer state lacks the float32 master weight {names[i]!r}: it was saved by a "
                             "trainer without master copies; use the same param_dtype as the saving run")
    for i in mine:
        t = masters[names[i]]
        if not torch.is_tensor(t) or not t.is_floating_point() or tuple(t.shape) != shapes[i]:
            what = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"optimizer state's master weight {names[i]!r} is {what}, the parameter is "
                             f"{shapes[i]}; {_REBUILD}")


def check_adamw(adamw, live: Mapping, names: list[str], shapes: list[tuple], complete: Iterable[int]) -> None:
    """What torch's AdamW load would refuse, or take without a word and fail on (or compute otherwise with) later:
    one group over parameters ``0..n-1``, AdamW's settings present and every other one the ``live`` group's, state
    only for those indices with tensors of their parameter's shape, complete for the indices this rank loads."""
    n = len(names)
    groups = adamw.get("param_groups") if isinstance(adamw, Mapping) else None
    if not isinstance(groups, list | tuple) or not isinstance(adamw.get("state"), Mapping):
        raise ValueError("optimizer state's 'adamw' is not a torch.optim.AdamW state_dict (with 'state' and "
                         "'param_groups'); resume from a checkpoint rlrepro wrote")
    if len(groups) != 1 or not isinstance(groups[0], Mapping) or list(groups[0].get("params", ())) != list(range(n)):
        sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else None for g in groups]
        raise ValueError(f"optimizer state has {len(groups)} parameter groups with {sizes} parameters; expected one "
                         f"group of {n} (an rlrepro MasterWeightAdamW state); {_REBUILD}")
    group = groups[0]
    missing = [k for k in _HYPER if k not in group]
    if missing:
        raise ValueError(f"optimizer state's parameter group lacks AdamW's {missing}: it is another optimizer's "
                         f"state; {_REBUILD}")
    for key, value in group.items():
        if key not in ("params", "param_names", *_HYPER) and key in live and value != live[key]:
            raise ValueError(f"optimizer state was saved with AdamW {key}={value!r}, this trainer's AdamW has "
                             f"{key}={live[key]!r}; {_REBUILD}")
    for i, entry in adamw["state"].items():
        if not isinstance(i, int) or not 0 <= i < n or not isinstance(entry, Mapping):
            raise ValueError(f"optimizer state holds AdamW state under {i!r}, not for one of the {n} parameters; "
                             f"{_REBUILD}")
        for key, t in entry.items():
            if key != "step" and torch.is_tensor(t) and tuple(t.shape) != shapes[i]:
                raise ValueError(f"optimizer state's AdamW {key} of {names[i]!r} has shape {tuple(t.shape)}, the "
                                 f"parameter {shapes[i]}; {_REBUILD}")
        need = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        lacking = [k for k in need if k not in entry] if i in complete else []
        if lacking:
            raise ValueError(f"optimizer state's AdamW state of {names[i]!r} lacks {lacking}; the optimizer.pt is "
                             "damaged or not rlrepro's: resume from another checkpoint")


def _placed(state: Mapping, where: Mapping[int, torch.Tensor]) -> dict:
    """``state`` with the AdamW tensors of the indices in ``where`` moved to the device and floating dtype of
    ``where[i]`` (torch's own cast in ``load_state_dict``, done ahead: it then allocates nothing); ``step`` stays."""
    adamw = state["adamw"]
    per = {i: {k: t if k == "step" or not torch.is_tensor(t) else
               t.to(device=where[i].device, dtype=where[i].dtype if t.is_floating_point() else t.dtype)
               for k, t in e.items()} if i in where else e for i, e in adamw["state"].items()}
    return {**state, "adamw": {**adamw, "state": per}}


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

    @torch.no_grad()
    def take_grads(self) -> list[torch.Tensor | None]:
        """The model's grads of the last backward in name order, as autograd left them (the compute dtype; None: no
        grad), cleared from the parameters: one micro-batch's gradient, a leaf of the layout-invariant fold over
        data-parallel ranks (``train.layout_invariant``; :mod:`rlrepro.trainer.grad_fold`, which adds them into its
        float32 accumulator: the same exact widening as :meth:`accumulate_grads`). Use it instead of
        :meth:`accumulate_grads`, with :meth:`set_grads`."""
        out = []
        for p in self.params:
            out.append(p.grad)
            p.grad = None
        return out

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        """Make ``grads`` (float32, name order, one per parameter) the step's gradients (what :meth:`grads` returns)."""
        for p, m, g in zip(self.params, self.masters, grads):
            p.grad = None
            m.grad = g

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

    def _check_names(self, state: Mapping) -> None:
        if list(state["names"]) != self.names:
            missing = sorted(set(self.names) - set(state["names"]))
            extra = sorted(set(state["names"]) - set(self.names))
            raise ValueError(f"optimizer state is for other parameters (missing {missing[:5]}, extra {extra[:5]}); "
                             "load it into a trainer built for the same model")

    def _shapes(self) -> list[tuple]:
        return [tuple(p.shape) for p in self.params]

    def check_state_dict(self, state: Mapping) -> None:
        """Raise (ValueError: the mismatch and the fix) what :meth:`load_state_dict` would refuse or load wrongly (other
        names, shapes, groups, AdamW settings, a missing master or moment), changing nothing: a load checks first."""
        check_layout(state)
        self._check_names(state)
        copies, shapes = [i for i, (m, p) in enumerate(zip(self.masters, self.params)) if m is not p], self._shapes()
        check_masters(state["master_weights"], self.names, shapes, copies, copies)
        check_adamw(state["adamw"], self.inner.param_groups[0], self.names, shapes, range(len(self.names)))

    def prepare_state_dict(self, state: Mapping) -> dict:
        """``state`` checked, its AdamW tensors already where (and in the dtype) this optimizer keeps them: loading it
        allocates nothing, so what may run out of memory in a checkpoint load happens before the model changes."""
        self.check_state_dict(state)
        return _placed(state, dict(enumerate(self.masters)))

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        """All or nothing: checked first; torch's AdamW load builds the new state before it swaps it in, and the
        masters (of checked shapes) are then copied in place."""
        self.check_state_dict(state)
        masters = state["master_weights"]
        self.inner.load_state_dict(state["adamw"])
        for n, m, p in zip(self.names, self.masters, self.params):
            if m is not p:
                m.copy_(masters[n])
        self._copy_masters_to_params()

    # this rank's state, for snapshots within a train step (the same as state_dict() here; a sharded optimizer
    # returns only its share, without a collective)
    def local_state_dict(self) -> dict:
        return self.state_dict()

    def load_local_state_dict(self, state: Mapping) -> None:
        self.load_state_dict(state)


def _master_init(name: str, p: torch.Tensor, master_init: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    init = p.detach() if master_init is None or name not in master_init else master_init[name]
    if tuple(init.shape) != tuple(p.shape):
        raise ValueError(f"master_init[{name!r}] has shape {tuple(init.shape)}, parameter has {tuple(p.shape)}")
    return init


class ShardedMasterWeightAdamW(MasterWeightAdamW):
    """:class:`MasterWeightAdamW` with the float32 masters and AdamW state sharded over the data-parallel ranks of
    ``data_parallel`` (ZeRO-1), bitwise equal to the unsharded optimizer on every rank.

    * Ownership: :func:`~rlrepro.trainer.data_parallel.assign_owners` over the trainable parameters' names and
      sizes — whole tensors, a pure function of the names, sizes and world size. ``owners[i]`` is parameter
      ``names[i]``'s rank; ``masters[i]`` is None for a parameter this rank does not own.
    * Gradients are not sharded: every rank accumulates float32 grads for every parameter (a float32 grad buffer,
      not a master, for a low-precision parameter it does not own), so the order-fixed data-parallel sum, the
      global norm and the clip are exactly those of the unsharded path.
    * ``step()``: AdamW (single-tensor path) on the owned masters only, each owner casts its masters into the
      model's parameters, then every parameter is broadcast from its owner in name order (byte copies: every rank
      ends with the same weights). A collective: every rank calls it.
    * ``gather_state_dict(dst)`` (a collective) gives rank ``dst`` the unsharded optimizer's ``state_dict()``
      (same format and contents), moved to CPU tensor by tensor; ``load_state_dict`` takes that full format (from
      a sharded or an unsharded run) and keeps what this rank owns. ``state_dict()`` refuses (it would need every
      rank); ``local_state_dict()`` is this rank's share (snapshots).

    Memory per rank: the float32 masters (when separate) and both moments of the owned tensors only, i.e. about
    ``1/world_size`` of the unsharded 12 bytes per parameter (8 for float32 parameters, their own masters).
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], data_parallel: DataParallel, *,
                 lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 master_init: Mapping[str, torch.Tensor] | None = None) -> None:
        pairs = sorted(((n, p) for n, p in named_params if p.requires_grad), key=lambda kv: kv[0])
        if not pairs:
            raise ValueError("ShardedMasterWeightAdamW got no trainable parameters")
        self.data_parallel = dp = data_parallel
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        owner_of = assign_owners([(n, p.numel()) for n, p in pairs], dp.world_size)
        self.owners = [owner_of[n] for n in self.names]
        self.owned = [o == dp.rank for o in self.owners]
        # a separate float32 master (on the owner); else the float32 parameter is its own master
        self.has_copy = [not (p.dtype == torch.float32 and (master_init is None or n not in master_init))
                         for n, p in pairs]
        self.masters: list[torch.Tensor | None] = []
        self._grad_bufs: list[torch.Tensor | None] = [None] * len(pairs)  # float32 grads of non-owned copies
        for i, (name, p) in enumerate(pairs):
            init = _master_init(name, p, master_init) if self.has_copy[i] else None  # checked on every rank
            if not self.owned[i]:
                self.masters.append(None)
            elif not self.has_copy[i]:
                self.masters.append(p)
            else:
                self.masters.append(init.detach().to(device=p.device, dtype=torch.float32).clone()
                                    .requires_grad_(True))
        self._local = [i for i, own in enumerate(self.owned) if own]  # global index of local AdamW param j
        self.inner = torch.optim.AdamW([{"params": [self.masters[i] for i in self._local]}], lr=lr,
                                       betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                       foreach=False, fused=False)
        self._copy_masters_to_params()
        self._broadcast_params()

    @property
    def has_master_copies(self) -> bool:
        return any(self.has_copy)

    def _grad(self, i: int) -> torch.Tensor | None:
        if not self.has_copy[i]:
            return self.params[i].grad
        return self.masters[i].grad if self.owned[i] else self._grad_bufs[i]

    def _set_grad(self, i: int, g: torch.Tensor) -> None:
        if not self.has_copy[i]:
            self.params[i].grad = g
        elif self.owned[i]:
            self.masters[i].grad = g
        else:
            self._grad_bufs[i] = g

    def zero_grad(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = None
            if self.masters[i] is not None:
                self.masters[i].grad = None
            self._grad_bufs[i] = None

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """As :meth:`MasterWeightAdamW.accumulate_grads` (the same operations), into the master's grad for an owned
        parameter and into a float32 grad buffer for one owned by another rank."""
        for i, p in enumerate(self.params):
            if not self.has_copy[i] or p.grad is None:
                continue
            acc = self._grad(i)
            if acc is None:
                g = p.grad.float()
                self._set_grad(i, g.clone() if g.data_ptr() == p.grad.data_ptr() else g)
            else:
                acc.add_(p.grad)
            p.grad = None

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        for i, (p, g) in enumerate(zip(self.params, grads)):
            p.grad = None
            self._set_grad(i, g)

    def grads(self) -> list[torch.Tensor]:
        """The float32 grads of **every** parameter in name order (owned or not); zeros where there is none."""
        self.accumulate_grads()
        out = []
        for i, p in enumerate(self.params):
            g = self._grad(i)
            if g is None:
                g = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                self._set_grad(i, g)
            out.append(g)
        return out

    @torch.no_grad()
    def _copy_masters_to_params(self) -> None:
        for i in self._local:
            if self.has_copy[i]:
                self.params[i].copy_(self.masters[i])

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        if self.data_parallel.world_size == 1:
            return
        for p, owner in zip(self.params, self.owners):
            self.data_parallel.broadcast_(p.detach(), owner)

    def step(self) -> None:
        """AdamW on this rank's masters, cast into their parameters, then every parameter broadcast from its owner
        (a collective)."""
        self.grads()
        self.inner.step()
        self._copy_masters_to_params()
        self._broadcast_params()

    def named_master_weights(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's (owned) masters, in name order."""
        return [(self.names[i], self.masters[i].detach()) for i in self._local]

    def owned_names(self) -> list[str]:
        return [self.names[i] for i in self._local]

    def state_dict(self) -> dict:
        raise RuntimeError("the optimizer state is sharded over the data-parallel ranks (distributed_optimizer): "
                           "call gather_state_dict(dst) on every rank for the full state, or local_state_dict() "
                           "for this rank's share")

    def local_state_dict(self) -> dict:
        """This rank's share: its AdamW state (local indices) and its separate masters; no collective."""
        return {
            "names": list(self.names),
            "owned": self.owned_names(),
            "adamw": self.inner.state_dict(),
            "master_weights": {self.names[i]: self.masters[i].detach().clone() for i in self._local
                               if self.has_copy[i]},
        }

    @torch.no_grad()
    def load_local_state_dict(self, state: Mapping) -> None:
        if list(state["names"]) != self.names or list(state["owned"]) != self.owned_names():
            raise ValueError("local optimizer state is for other parameters or another sharding; load it into the "
                             "trainer (and rank) that took it")
        for i in self._local:
            if self.has_copy[i]:
                self.masters[i].copy_(state["master_weights"][self.names[i]])
        self.inner.load_state_dict(state["adamw"])
        self._copy_masters_to_params()

    @torch.no_grad()
    def gather_state_dict(self, dst: int = 0) -> dict | None:
        """The unsharded optimizer's ``state_dict()`` (same format and values; tensors on CPU) on rank ``dst`` of the
        data-parallel group, None on the others. A collective: every rank calls it. Each tensor another rank owns
        travels alone (a broadcast from its owner), so no rank holds more than one of them in flight; ``dst``
        accumulates the full state (as every rank of an unsharded run holds it)."""
        dp = self.data_parallel
        local = self.inner.state_dict()
        # which state entries each owned parameter has (AdamW creates them at its first step), with shapes/dtypes
        meta = {}
        for j, per in local["state"].items():
            meta[self._local[j]] = [(k, ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", v))
                                    for k, v in per.items()]
        entries: dict[int, list] = {}
        for part in (dp.all_gather_object(meta) if dp.world_size > 1 else [meta]):
            entries.update(part)
        here = dp.rank == dst
        local_index = {i: j for j, i in enumerate(self._local)}

        def fetch(i: int, value: torch.Tensor | None, shape, dtype) -> torch.Tensor | None:
            owner = self.owners[i]
            if owner == dst:
                return value.detach().to("cpu", copy=True) if here else None
            if dp.rank == owner:
                buf = value.detach().to(dp.device).contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=dp.device)
            dp.broadcast_(buf, owner)
            return buf.to("cpu", copy=True) if here else None

        state: dict[int, dict] = {}
        masters: dict[str, torch.Tensor] = {}
        for i, name in enumerate(self.names):
            if i in entries:
                own = local["state"][local_index[i]] if self.owned[i] else None
                per = {}
                for key, (kind, *rest) in entries[i]:
                    per[key] = rest[0] if kind == "value" else fetch(i, own[key] if own is not None else None, *rest)
                if here:
                    state[i] = per
            if self.has_copy[i]:
                t = fetch(i, self.masters[i], tuple(self.params[i].shape), torch.float32)
                if here:
                    masters[name] = t
        if not here:
            return None
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(self.names)))}
                  for g in local["param_groups"]]
        return {"names": list(self.names), "adamw": {"state": state, "param_groups": groups},
                "master_weights": masters}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        """Load the full (unsharded-format) state — from a sharded or an unsharded run — keeping this rank's share.
        No collective: the weights are the model's (loaded from the same checkpoint on every rank). All or nothing,
        as :meth:`MasterWeightAdamW.load_state_dict`."""
        self.check_state_dict(state)
        masters, groups, full = state["master_weights"], state["adamw"]["param_groups"], state["adamw"]["state"]
        self.inner.load_state_dict({
            "state": {j: full[i] for j, i in enumerate(self._local) if i in full},
            "param_groups": [{**{k: v for k, v in groups[0].items() if k != "params"},
                              "params": list(range(len(self._local)))}]})
        for i in self._local:
            if self.has_copy[i]:
                self.masters[i].copy_(masters[self.names[i]])
        self._copy_masters_to_params()

    def check_state_dict(self, state: Mapping) -> None:
        """As :meth:`MasterWeightAdamW.check_state_dict`; every rank checks every name, group and shape (the same error
        everywhere), masters and moments only in its share (a dist checkpoint gives each rank its own)."""
        check_layout(state)
        self._check_names(state)
        copies, shapes = [i for i, c in enumerate(self.has_copy) if c], self._shapes()
        check_masters(state["master_weights"], self.names, shapes, copies, [i for i in copies if self.owned[i]])
        check_adamw(state["adamw"], self.inner.param_groups[0], self.names, shapes, self._local)

    def prepare_state_dict(self, state: Mapping) -> dict:
        """As :meth:`MasterWeightAdamW.prepare_state_dict`: this rank's share placed, the rest left as it is."""
        self.check_state_dict(state)
        return _placed(state, {i: self.masters[i] for i in self._local})


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

    def check_state_dict(self, state: Mapping) -> tuple:
        """The values :meth:`load_state_dict` sets, or the ValueError it raises; changes nothing."""
        try:
            return (int(state["last_step"]), float(state["base_lr"]), int(state["warmup_steps"]),
                    int(state["total_steps"]), float(state["min_lr_ratio"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"scheduler state is not a WarmupCosineLR state ({type(e).__name__}: {e}); resume from "
                             "a checkpoint rlrepro wrote") from None

    def load_state_dict(self, state: Mapping) -> None:
        """All or nothing: every value is read before any is set."""
        self.last_step, self.base_lr, self.warmup_steps, self.total_steps, self.min_lr_ratio = \
            self.check_state_dict(state)
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
