"""megatron-core's ``DistributedDataParallel`` and optimizer behind the optimizer interface ``Trainer`` uses.

``MegatronTrainer(..., grad_sync="megatron")`` trains with this instead of rlrepro's order-fixed data-parallel sum
and ``MasterWeightAdamW``:

- **gradients**: ``megatron.core.distributed.DistributedDataParallel`` wraps the TP model. Its backward hooks add
  each parameter's grad into a contiguous float32 buffer (``param.main_grad``; ``grad_reduce_in_fp32``), and
  ``finish_grad_sync()`` sums the buffer over the data-parallel group: an all-reduce, or with the distributed
  optimizer a reduce-scatter (each DP rank keeps the reduced grads of the parameter range it owns). The loss is
  already scaled by the whole batch's token count, so the grads are **summed**, not averaged
  (``TransformerConfig.calculate_per_token_loss=True``).
- **optimizer**: ``get_megatron_optimizer`` (Adam with decoupled weight decay on float32 main parameters; with
  ``distributed_optimizer`` megatron-core's ``DistributedOptimizer``, ZeRO-1: each DP rank holds the float32 masters
  and Adam moments of its range, updates them, and the bf16 parameters are all-gathered after the step). Weight
  decay applies to every parameter, as in rlrepro's optimizer (``config_overrides={}``); gradient clipping is
  rlrepro's (the trainer scales the main grads by ``min(1, max_norm / (norm + 1e-6))``) with the norm computed by
  megatron-core (``get_grad_norm``: TP-duplicate parameters counted once, reduced over the model- and
  data-parallel ranks).

What this changes against the order-fixed path: the DP sum is NCCL's (its summation order is fixed for a fixed
NCCL version, topology and settings, so two runs on the same machine agree, but nothing else reproduces it), and
megatron-core's Adam is ``torch.optim.AdamW`` with torch's default (foreach) implementation, or Transformer
Engine's / Apex's fused Adam when installed. The forward pass, hence the on-policy guarantee (trainer logprobs ==
engine logprobs), is untouched. Checkpoints, both formats, hold the optimizer state in rlrepro's unsharded
layout (``"full"``: gathered onto DP rank 0; ``"dist"``: each parameter's tensors gathered onto an owner DP rank,
:meth:`MegatronCoreOptimizer.owned_tensors`), so a checkpoint moves between this path, the order-fixed path and a
plain ``Trainer``. They carry ``torch.optim.AdamW``'s state: with Transformer Engine's or Apex's fused Adam they
refuse.

megatron-core allocates and checks CUDA tensors by name in these classes. For a model on the CPU (the CPU tests, or
``run.device=cpu`` on a machine with CUDA) every call into it runs under :func:`cpu_stand_in`, which redirects those
allocations to the CPU; nothing else in megatron-core's code is changed.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from .model import TPQwen3ForCausalLM, shard_spec

__all__ = ["GRAD_SYNCS", "MegatronCoreOptimizer", "cpu_stand_in", "cuda_calls_on_cpu", "merged_over"]

from ..config import GRAD_SYNCS  # noqa: E402 - the registry lives with TrainConfig


class _CudaToCpu(TorchFunctionMode):
    """Tensor factories asked for ``device='cuda'`` get the CPU; ``Tensor.cuda()`` returns the tensor; ``x.type()``
    names the CUDA type (megatron-core's optimizers accept only ``torch.cuda.*Tensor`` parameters)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # type checks name torch.cuda.*Tensor
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _on_cpu(device) -> bool:
    """Whether megatron-core's tensors must stay on the CPU: ``device`` (where the model lives) is not a CUDA
    device. Keyed on the model, not on ``torch.cuda.is_available()``: a CPU run on a machine with CUDA is a CPU run."""
    return torch.device(device).type != "cuda"


@contextlib.contextmanager
def cuda_calls_on_cpu(device):
    """For a model on the CPU (``device``: where its tensors live): ``torch.cuda.current_device()`` is ``'cpu'`` and
    ``torch.cuda.synchronize()`` does nothing while the body runs (megatron-core calls both where every tensor is on
    the CPU, e.g. its torch_dist checkpoint save after copying to the CPU). A no-op for a model on CUDA."""
    if not _on_cpu(device):
        yield
        return
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = sync, current


@contextlib.contextmanager
def cpu_stand_in(device):
    """Run megatron-core's DDP / optimizer code on a model on the CPU (``device``: where its tensors live), with or
    without CUDA on the machine: :func:`cuda_calls_on_cpu`, and tensors it creates on ``'cuda'`` are created on the
    CPU and ``Tensor.type()`` answers with the CUDA type name. A no-op for a model on CUDA (the real path)."""
    if not _on_cpu(device):
        yield
        return
    with cuda_calls_on_cpu(device), _CudaToCpu(), warnings.catch_warnings():
        # the mode sees megatron-core read .grad of its flat shard views (None there, as on CUDA)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        yield


def merged_over(group, size: int, part: dict) -> dict:
    """The union of every rank's ``part`` over ``group`` (``size`` ranks; a collective), or ``part`` alone."""
    if size == 1:
        return dict(part)
    parts = [None] * size
    dist.all_gather_object(parts, part, group=group)
    return {k: v for one in parts for k, v in one.items()}


class _PreparedLoad:
    """A checked optimizer state, ready to set (:meth:`MegatronCoreOptimizer.prepare_state_dict`): per parameter
    range ``(sub-optimizer, main param, param, start, end, master source or None, AdamW state or None)``, and lr."""

    def __init__(self, plan: list, lr) -> None:
        self.plan, self.lr = plan, lr


def _sub_optimizers(mopt) -> list:
    return [o for o in getattr(mopt, "chained_optimizers", [mopt]) if getattr(o, "optimizer", None) is not None]


def _require_torch_adam(mopt) -> None:
    """Checkpoints read and write the per-parameter state of ``torch.optim.Adam(W)`` (``step``, ``exp_avg``,
    ``exp_avg_sq``), the optimizer megatron-core uses without Transformer Engine or Apex. Their fused Adams keep the
    step count elsewhere, which this layout does not carry: refuse rather than resume with a wrong step."""
    for sub in _sub_optimizers(mopt):
        if not isinstance(sub.optimizer, torch.optim.Adam):
            raise NotImplementedError(
                f"grad_sync='megatron' checkpoints need megatron-core's torch.optim.AdamW, but it uses "
                f"{type(sub.optimizer).__module__}.{type(sub.optimizer).__name__} (Transformer Engine or Apex is "
                "installed); uninstall them for this run, or use train.grad_sync=ordered")


class MegatronCoreOptimizer:
    """megatron-core's ``DistributedDataParallel`` + optimizer for a :class:`TPQwen3ForCausalLM`, with the methods
    ``Trainer`` calls on its optimizer (``names``, ``param_groups``, ``zero_grad``, ``accumulate_grads``, ``grads``,
    ``step``, state dicts). Every DP and TP rank builds it together (a collective).

    ``state_dict()`` is rlrepro's unsharded layout for this rank's TP shard (``names``, ``adamw`` =
    ``torch.optim.AdamW.state_dict()`` of one tensor per name, ``master_weights``): with the distributed optimizer
    it gathers the DP owners' ranges onto DP rank 0 (CPU memory; the other ranks get None), a collective over the
    DP group. Parameters must be float32 or bfloat16 (megatron-core's fp16 path needs a loss scaler).
    """

    def __init__(self, model: TPQwen3ForCausalLM, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, distributed_optimizer: bool = False,
                 master_init: Mapping[str, torch.Tensor] | None = None) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        g = model.groups
        if not g.megatron:
            raise ValueError("grad_sync='megatron' needs megatron-core's parallel_state: build the groups with "
                             "init_parallel(tp, use_megatron=True) (build_megatron_trainer's default when "
                             "megatron-core is installed)")
        cfg = model.config
        dtype = model.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"grad_sync='megatron' trains float32 or bfloat16 parameters, got {dtype}; use "
                             "model.dtype=bfloat16 (or float32), or grad_sync='ordered'")
        pairs = sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda kv: kv[0])
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        for name, p in pairs:  # megatron-core's TP attributes (grad norm: TP-replicated params count once)
            dim, _ = shard_spec(name)
            p.tensor_model_parallel = dim is not None and g.tp_size > 1
            p.partition_dim = -1 if dim is None else dim
            p.partition_stride = 1
        self.distributed = bool(distributed_optimizer)
        self.dp_group, self.dp_size = g.dp_group, g.dp_size
        self.device = model.device  # cpu_stand_in's key: a model on the CPU runs megatron-core on the CPU
        with cpu_stand_in(self.device):
            tconfig = TransformerConfig(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                                        num_attention_heads=cfg.num_attention_heads,
                                        tensor_model_parallel_size=g.tp_size, params_dtype=dtype,
                                        bf16=dtype == torch.bfloat16, calculate_per_token_loss=True)
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       overlap_param_gather=False,
                                                       use_distributed_optimizer=self.distributed)
            self.ddp = DistributedDataParallel(tconfig, ddp_config, model)
            oconfig = OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=weight_decay,
                                      adam_beta1=float(betas[0]), adam_beta2=float(betas[1]), adam_eps=eps,
                                      bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
                                      use_distributed_optimizer=self.distributed, clip_grad=0.0)
            self.mopt = get_megatron_optimizer(oconfig, [self.ddp], config_overrides={})
        # model param -> (sub-optimizer, main param, [start, end) of the flattened param this rank updates)
        self._main = {}
        for sub in _sub_optimizers(self.mopt):
            if hasattr(sub, "model_param_group_index_map"):  # DistributedOptimizer: this rank's ranges
                for p in self.params:
                    if p not in sub.model_param_group_index_map:
                        continue
                    gi, go = sub.model_param_group_index_map[p]
                    groups = (sub.shard_fp32_from_float16_groups if p.dtype in (torch.bfloat16, torch.float16)
                              else sub.shard_fp32_groups)
                    r = sub._get_model_param_range_map(p)["param"]
                    self._main[p] = (sub, groups[gi][go], r.start, r.end)
            elif hasattr(sub, "float16_groups"):  # Float16OptimizerWithFloat16Params: whole tensors
                for mg, fg in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                    for p, m in zip(mg, fg):
                        self._main[p] = (sub, m, 0, p.numel())
                for group in sub.fp32_from_fp32_groups:
                    for p in group:
                        self._main[p] = (sub, p, 0, p.numel())
            else:  # FP32Optimizer: the parameters are their own masters
                for group in sub.optimizer.param_groups:
                    for p in group["params"]:
                        self._main[p] = (sub, p, 0, p.numel())
        if not self.distributed:
            missing = [n for n, p in zip(self.names, self.params) if p not in self._main]
            if missing:
                raise RuntimeError(f"megatron-core's optimizer does not hold {missing[:3]}")
        # float32 masters from the weights before the cast to the compute dtype, as MasterWeightAdamW's
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                if master_init is not None and name in master_init and p in self._main:
                    _, m, a, b = self._main[p]
                    if m is not p:
                        m.copy_(master_init[name].reshape(-1)[a:b].view_as(m).to(device=m.device, dtype=m.dtype))
        self._adamw_group = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=tuple(betas), eps=eps,
                                              weight_decay=weight_decay, foreach=False,
                                              fused=False).state_dict()["param_groups"][0]

    # --- the interface Trainer uses ------------------------------------------------------------------------
    @property
    def has_master_copies(self) -> bool:
        return any(p.dtype != torch.float32 for p in self.params)

    @property
    def param_groups(self) -> list[dict]:
        return self.mopt.param_groups

    def zero_grad(self) -> None:
        with cpu_stand_in(self.device):
            self.ddp.zero_grad_buffer()
            self.mopt.zero_grad()

    def accumulate_grads(self) -> None:
        """Nothing to do: DDP's backward hooks add every grad into ``param.main_grad`` (float32)."""

    def grads(self) -> list[torch.Tensor]:
        """The float32 grad buffers (``main_grad``) of this rank's parameters, name order, before the DP sum."""
        return [p.main_grad for p in self.params]

    def finish_grad_sync(self) -> list[torch.Tensor]:
        """Sum the grad buffers over the DP group (megatron-core), hand them to the main parameters, and return
        the float32 grads the optimizer steps with: one per main parameter (with the distributed optimizer, this
        rank's ranges only). Scaling them in place is clipping."""
        with cpu_stand_in(self.device):
            self.ddp.finish_grad_sync()
            for sub in _sub_optimizers(self.mopt):
                if sub.prepare_grads():
                    raise RuntimeError("megatron-core's optimizer found inf/nan with a loss scaler, which rlrepro "
                                       "does not configure")
        out = []
        for sub in _sub_optimizers(self.mopt):
            for group in sub.optimizer.param_groups:
                out.extend(m.grad for m in group["params"] if m.grad is not None)
        return out

    def grad_norm(self) -> torch.Tensor:
        """megatron-core's global grad norm over every TP and DP rank (float64 0-d tensor)."""
        with cpu_stand_in(self.device):
            norm = self.mopt.get_grad_norm()
        return torch.tensor(float(norm), dtype=torch.float64)

    def step(self) -> None:
        """Adam on the main parameters, cast back into the model's; with the distributed optimizer the updated
        ranges are all-gathered into every DP rank's parameters."""
        with cpu_stand_in(self.device):
            for sub in _sub_optimizers(self.mopt):
                sub.step_with_ready_grads()

    # --- state -----------------------------------------------------------------------------------------------
    def _local_entries(self, p) -> dict:
        """This rank's float32 tensors of ``p`` (its range with the distributed optimizer): moments and master."""
        if p not in self._main:
            return {}
        sub, m, _, _ = self._main[p]
        own = sub.optimizer.state.get(m, {})
        out = {k: own[k] for k in ("exp_avg", "exp_avg_sq") if k in own}
        if p.dtype != torch.float32:  # float32 parameters are their own masters (saved with the model)
            out["master"] = m
        if "step" in own:
            out["step"] = float(own["step"])
        return out

    def _dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if self.distributed else 0

    @torch.no_grad()
    def _gathered(self, dst_of) -> Iterator[tuple[int, dict]]:
        """For each parameter ``i`` (name order): ``(i, {key: tensor})`` of its whole (this TP shard's) float32
        ``exp_avg`` / ``exp_avg_sq`` / ``master`` (bf16 parameters) and its ``step`` (a float). Without the distributed
        optimizer: this rank's live tensors, on every rank. With it, a collective over the DP group: each range
        travels once from its holder (a broadcast of that slice alone) and DP rank ``dst_of(i)`` assembles CPU
        tensors; the other ranks get ``{}``."""
        if not self.distributed:
            for i, p in enumerate(self.params):
                local = self._local_entries(p)
                yield i, {k: (v if k == "step" else v.view_as(p)) for k, v in local.items()}
            return
        mine = {i: (self._main[p][2], self._main[p][3], sorted(k for k in self._local_entries(p) if k != "step"),
                    self._local_entries(p).get("step"))
                for i, p in enumerate(self.params) if p in self._main}
        metas = [None] * self.dp_size
        dist.all_gather_object(metas, mine, group=self.dp_group)  # who holds which range and which entries
        me = self._dp_rank()
        for i, p in enumerate(self.params):
            here = dst_of(i) == me
            local = self._local_entries(p)
            holders = [(r, meta[i]) for r, meta in enumerate(metas) if i in meta and meta[i][1] > meta[i][0]]
            full = {}
            steps = [st for _, (_, _, _, st) in holders if st is not None]
            if steps:
                full["step"] = steps[0]
            for key in sorted({k for _, (_, _, ks, _) in holders for k in ks}):
                out = torch.empty(p.numel(), dtype=torch.float32) if here else None
                for r, (a, b, _, _) in holders:
                    if me == r:
                        buf = local[key].detach().reshape(-1).float().contiguous()
                    else:
                        buf = torch.empty(b - a, dtype=torch.float32, device=p.device)
                    dist.broadcast(buf, src=dist.get_global_rank(self.dp_group, r), group=self.dp_group)
                    if here:
                        out[a:b] = buf.cpu()
                if here:
                    full[key] = out.view(p.shape)
            yield i, (full if here else {})

    def names_with_ranges(self) -> list[str]:
        """The parameters this rank updates (all without the distributed optimizer; with it, those of which it holds
        a non-empty range)."""
        return [n for n, p in zip(self.names, self.params) if p in self._main and self._main[p][3] > self._main[p][2]]

    def adamw_param_groups(self) -> list[dict]:
        """The param_groups of the unsharded ``torch.optim.AdamW`` state (one group over every name)."""
        return [{**self._adamw_group, "lr": self.param_groups[0]["lr"], "params": list(range(len(self.names)))}]

    def dist_owners(self) -> dict[str, int]:
        """The DP rank that writes each parameter's optimizer tensors into a dist checkpoint (whole tensors of this
        TP shard, gathered from the ranges: :meth:`owned_tensors`); ``assign_owners`` over names and sizes."""
        from ..data_parallel import assign_owners

        size = self.dp_size if self.distributed else 1
        return assign_owners([(n, p.numel()) for n, p in zip(self.names, self.params)], size)

    def owned_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(name, key, tensor)`` for the dist checkpoint: this rank's owned parameters' whole float32 master
        (``"master"``), ``"exp_avg"`` and ``"exp_avg_sq"`` (a collective over DP with the distributed optimizer)."""
        _require_torch_adam(self.mopt)
        owner = self.dist_owners()
        out = []
        for i, full in self._gathered(lambda i: owner[self.names[i]]):
            out += [(self.names[i], k, v) for k, v in sorted(full.items()) if k != "step"]
        return out

    def step_counts(self) -> dict[str, dict]:
        """name -> ``{"step": tensor}`` (AdamW's per-parameter step count) of every parameter that has one; a
        collective over DP with the distributed optimizer."""
        entries = {n: self._local_entries(p) for n, p in zip(self.names, self.params)}
        known = {n: e["step"] for n, e in entries.items() if "step" in e}
        if self.distributed:
            known = merged_over(self.dp_group, self.dp_size, known)
        return {n: {"step": torch.tensor(v)} for n, v in sorted(known.items())}

    @torch.no_grad()
    def state_dict(self) -> dict | None:
        """rlrepro's unsharded optimizer layout for this TP shard: ``names``, ``adamw`` (AdamW's ``state_dict`` with
        one entry per name, name order) and ``master_weights`` (float32). Without the distributed optimizer every
        rank returns it (live tensors, as ``MasterWeightAdamW.state_dict``). With it, a collective over the DP group
        (:meth:`_gathered` onto DP rank 0: CPU tensors), and the other ranks return None."""
        _require_torch_adam(self.mopt)
        state, masters, steps = {}, {}, []
        for i, full in self._gathered(lambda i: 0):
            full = dict(full)
            if "step" in full:
                steps.append(full.pop("step"))
            if "master" in full:
                masters[self.names[i]] = full.pop("master")
            if full:
                state[i] = full
        if self._dp_rank() != 0:
            return None
        step = torch.tensor(steps[0] if steps else 0.0)
        for entry in state.values():
            entry["step"] = step.clone()
        return {"names": list(self.names), "adamw": {"state": state, "param_groups": self.adamw_param_groups()},
                "master_weights": masters}

    def check_state_dict(self, state: Mapping) -> None:
        """Raise (ValueError: the mismatch and the fix) what :meth:`load_state_dict` would refuse or fail on midway
        (other names, groups or AdamW settings, a master or moment of another shape, a moment entry missing a key),
        changing nothing. Masters may be absent (a float32 run's state: the loaded weights are taken); every rank
        checks every name and shape (the same error everywhere), moments complete for those it holds a range of."""
        from ..optim import check_adamw, check_layout, check_masters

        _require_torch_adam(self.mopt)
        check_layout(state)
        names = list(state["names"]) if isinstance(state["names"], list | tuple) else []
        if names != self.names:
            missing = sorted(set(self.names) - set(names))
            extra = sorted(set(names) - set(self.names))
            raise ValueError(f"optimizer state is for other parameters (missing {missing[:5]}, extra {extra[:5]}); "
                             "load it into a trainer built for the same model")
        masters = state["master_weights"]
        shapes = [tuple(p.shape) for p in self.params]
        given = [i for i, (n, p) in enumerate(zip(self.names, self.params))
                 if p.dtype != torch.float32 and isinstance(masters, Mapping) and n in masters]
        check_masters(masters, self.names, shapes, [], given)
        held = set(self.names_with_ranges())
        check_adamw(state["adamw"], self._adamw_group, self.names, shapes,
                     [i for i, n in enumerate(self.names) if n in held])

    def prepare_state_dict(self, state: Mapping) -> "_PreparedLoad":
        """``state`` checked (:meth:`check_state_dict`) and turned into what :meth:`load_state_dict` sets: each range's
        moments already cut and placed on its device, so the load allocates nothing and cannot fail on the state."""
        self.check_state_dict(state)
        masters, per_param = state["master_weights"], state["adamw"]["state"]
        plan = []
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            if p not in self._main:
                continue
            sub, m, a, b = self._main[p]
            src = masters[name].reshape(-1)[a:b].view_as(m) if m is not p and name in masters else None
            saved, inner = per_param.get(i), None
            if saved and "exp_avg" in saved:
                try:
                    step = torch.tensor(float(saved["step"]))
                except (TypeError, ValueError, RuntimeError) as e:
                    raise ValueError(f"optimizer state's AdamW step of {name!r} is not a number ({e}); the optimizer"
                                     ".pt is damaged or not rlrepro's: resume from another checkpoint") from None
                inner = {"step": step, **{k: saved[k].reshape(-1)[a:b].view_as(m).to(device=m.device, dtype=m.dtype,
                                                                                      copy=True)
                                          for k in ("exp_avg", "exp_avg_sq")}}
            plan.append((sub, m, p, a, b, src, inner))
        return _PreparedLoad(plan, state["adamw"]["param_groups"][0]["lr"])

    @torch.no_grad()
    def load_state_dict(self, state) -> None:
        """Load rlrepro's unsharded layout (from this path, the order-fixed path or a plain ``Trainer``), or what
        :meth:`prepare_state_dict` made of it: each rank keeps its ranges of the masters and moments. All or nothing:
        everything is checked and prepared before the first master is written."""
        prepared = state if isinstance(state, _PreparedLoad) else self.prepare_state_dict(state)
        for sub, m, p, a, b, src, inner in prepared.plan:
            if m is not p:  # saved without masters (float32 run): start from the loaded weights
                m.copy_(src if src is not None else p.detach().reshape(-1)[a:b].view_as(m))
            if inner is not None:
                sub.optimizer.state[m] = inner
            else:
                sub.optimizer.state.pop(m, None)
        for group in self.param_groups:
            group["lr"] = prepared.lr

    def local_state_dict(self) -> dict:
        """This rank's masters and Adam state, copied (a snapshot within a train step; no collective)."""
        out = []
        for sub in _sub_optimizers(self.mopt):
            mains = [m for group in sub.optimizer.param_groups for m in group["params"]]
            out.append(([m.detach().clone() for m in mains],
                        {id(m): copy.deepcopy(sub.optimizer.state[m]) for m in mains if m in sub.optimizer.state}))
        return {"subs": out}

    @torch.no_grad()
    def load_local_state_dict(self, state: Mapping) -> None:
        for sub, (values, inner) in zip(_sub_optimizers(self.mopt), state["subs"]):
            mains = [m for group in sub.optimizer.param_groups for m in group["params"]]
            for m, v in zip(mains, values):
                m.copy_(v)
                if id(m) in inner:
                    sub.optimizer.state[m] = copy.deepcopy(inner[id(m)])
                else:
                    sub.optimizer.state.pop(m, None)
