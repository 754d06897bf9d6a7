"""``MegatronTrainer``: the GRPO train step of :class:`rlrepro.trainer.Trainer` on a tensor-parallel model.

Same interface and metric keys as ``Trainer``: ``train_step(samples)``, ``named_weights()`` (full, unsharded
tensors in name order), ``save_checkpoint`` / ``load_checkpoint``, ``step``. ``train_step`` is ``Trainer``'s own;
what changes is where gradients go between the backward passes and the optimizer step (its hooks
``_reduce_grads`` and ``_grad_norm``):

1. q_norm/k_norm grads (replicated weights applied per head, so each TP rank's grad covers only its heads) are
   summed over the TP group in rank order;
2. data parallel (``groups.dp_size > 1``): every grad is summed over the DP group in rank order
   (:class:`rlrepro.trainer.DataParallel` on the DP group);
3. the global grad norm is computed on the **full** gradients, gathered one parameter at a time in name order,
   with :func:`rlrepro.trainer.optim.grad_norm`'s formula, so it is the number a single-process trainer computes
   from the same gradients; every rank scales its shards by the same coefficient.

The optimizer is rlrepro's :class:`MasterWeightAdamW` over this rank's shards (elementwise, so sharding changes no
bits of the update). This order-fixed path (``grad_sync="ordered"``, the default) runs on CPU (gloo) and CUDA
(NCCL). ``grad_sync="megatron"`` replaces steps 2-3 and the optimizer with megatron-core's
``DistributedDataParallel`` and optimizer (:mod:`.mcore`): the DP sum in NCCL's order, megatron-core's grad norm,
rlrepro's clipping rule; both checkpoint formats (the optimizer state in rlrepro's layout).

Checkpoints, two formats (``checkpoint_format``), both TP-agnostic:

- ``"full"`` (default): the shards are gathered into the full model and full optimizer state and written by one
  rank (TP rank 0 of replica 0) in rlrepro's checkpoint format (``rlrepro.trainer.checkpoint``), with the RNG
  states and ``extra_state`` (data cursor) as ``Trainer`` writes them. A checkpoint saved at TP=2 loads into a
  ``Trainer`` or a ``MegatronTrainer`` at any TP, and vice versa.
- ``"dist"``: every rank writes only its shards through megatron-core's ``dist_checkpointing``, in the same atomic
  layout with a manifest, every rank's RNG states and ``extra_state`` (:mod:`.dist_checkpoint`); it loads into a
  ``MegatronTrainer`` at any TP, and ``dist_to_full`` / ``dist_to_hf`` convert it for a plain ``Trainer`` / HF.

``load_checkpoint`` reads either format (the manifest says which). Every rank must call the collective methods
(``train_step``, ``named_weights``, ``save_checkpoint``, ``load_checkpoint``, ``export_hf``) together.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import (capture_rng_state, checkpoint_dir_name, load_checkpoint, save_checkpoint,
                          write_on_one_rank)
from .dist_format import is_dist_checkpoint, load_dist_checkpoint, save_dist_checkpoint
from .mcore import GRAD_SYNCS, MegatronCoreOptimizer
from ..data_parallel import DataParallel
from rlrepro.kernels.tp import ordered_sum
from ..optim import check_layout, grad_norm
from ..train import Trainer, TrainConfig
from .model import TPQwen3ForCausalLM, gather_param, shard_spec, shard_tensor

__all__ = ["MegatronTrainer", "CHECKPOINT_FORMATS"]

CHECKPOINT_FORMATS = ("full", "dist")


def _check_format(checkpoint_format: str) -> str:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not one of {CHECKPOINT_FORMATS}: 'full' "
                         "(gathered, one writer, rlrepro's format) or 'dist' (every rank its shards, megatron-core)")
    return checkpoint_format


class _FullModelView:
    """What ``save_checkpoint`` / ``load_checkpoint`` need of a model, in full (unsharded) tensors."""

    def __init__(self, model: TPQwen3ForCausalLM, state: dict | None = None) -> None:
        self.model, self.state = model, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.state is not None:
            return self.state
        tp = self.model.groups.tp_size
        out = {}
        for name, p in self.model.named_parameters():
            dim, _ = shard_spec(name)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            out[name] = torch.empty(shape, dtype=p.dtype, device="meta")
        return out

    def load_state_dict(self, state, strict: bool = True) -> None:
        self.model.load_full_state_dict(dict(state))


class _ShardPrepared:
    """This rank's shard of a full optimizer state, checked and prepared by the optimizer (``.state``)."""

    def __init__(self, state) -> None:
        self.state = state


class _FullOptimizerView:
    """What ``save_checkpoint`` / ``load_checkpoint`` need of an optimizer, in the full (unsharded) layout. A load
    is all or nothing: ``prepare_state_dict`` (run by ``load_checkpoint`` before the weights change) cuts this rank's
    shards and has the optimizer check and prepare them; ``load_state_dict`` then only sets them."""

    def __init__(self, trainer: "MegatronTrainer", state: dict | None = None) -> None:
        self.trainer, self.state = trainer, state

    def state_dict(self) -> dict:
        return self.state

    def prepare_state_dict(self, state: Mapping) -> _ShardPrepared:
        return _ShardPrepared(self.trainer._prepare_full_optimizer_state(state))

    def load_state_dict(self, state) -> None:
        if isinstance(state, _ShardPrepared):
            self.trainer.optimizer.load_state_dict(state.state)
        else:
            self.trainer._load_full_optimizer_state(state)


class MegatronTrainer(Trainer):
    """``Trainer`` over a :class:`TPQwen3ForCausalLM` (this rank's shard; its ``groups`` give TP and DP).

    ``ref_model``: a frozen ``TPQwen3ForCausalLM`` of the initial policy (same groups), when ``kl_coef > 0``.
    ``checkpoint_format``: what :meth:`save_checkpoint` writes by default, ``"full"`` or ``"dist"`` (module doc).
    Determinism: :func:`rlrepro.trainer.enable_determinism` first, and the same CPU thread count on every rank.
    """

    def __init__(self, model: TPQwen3ForCausalLM, config: TrainConfig, ref_model=None, *,
                 param_dtype: torch.dtype | None = None, checkpoint_format: str = "full",
                 distributed_optimizer: bool | None = None, grad_sync: str | None = None,
                 temperature: float = 1.0, max_response_length: int | None = None) -> None:
        # distributed_optimizer / grad_sync: None = the config's (train.distributed_optimizer, train.grad_sync)
        if grad_sync is None:
            grad_sync = config.grad_sync
        if distributed_optimizer is None:
            distributed_optimizer = config.distributed_optimizer
        if not isinstance(model, TPQwen3ForCausalLM):
            raise TypeError(f"MegatronTrainer takes a TPQwen3ForCausalLM (rlrepro.trainer.megatron), got "
                            f"{type(model).__name__}; build it with TPQwen3ForCausalLM.from_pretrained(path, groups)")
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"train.grad_sync={grad_sync!r} is not one of {GRAD_SYNCS}: 'ordered' (rlrepro's "
                             "rank-order gradient sum and AdamW) or 'megatron' (megatron-core's "
                             "DistributedDataParallel and optimizer)")
        if grad_sync == "megatron" and config.layout_invariant:
            raise ValueError("train.layout_invariant=true needs train.grad_sync=ordered: megatron-core's gradient "
                             "sum runs in NCCL's order, which depends on the layout")
        tp = model.groups.tp_size
        if config.layout_invariant and config.tp_partials % tp:
            # (the pieces that sum the q_norm/k_norm grads over TP would not be installed: replicas would drift)
            raise ValueError(f"train.tp_partials={config.tp_partials} is not a multiple of train.tensor_parallel={tp}"
                             ": with train.layout_invariant=true every TP rank computes tp_partials / TP of the fixed "
                             f"pieces; set train.tp_partials to a multiple of every TP size the run uses (e.g. "
                             f"{max(8, tp)}), or train.layout_invariant=false")
        self.grad_sync = grad_sync
        self.groups = model.groups
        self.checkpoint_format = _check_format(checkpoint_format)
        dp = DataParallel(group=self.groups.dp_group) if self.groups.dp_size > 1 else None
        super().__init__(model, config, ref_model, temperature=temperature, max_response_length=max_response_length,
                         param_dtype=param_dtype, data_parallel=dp, distributed_optimizer=distributed_optimizer)
        self._specs = [shard_spec(n) for n in self.optimizer.names]

    def _set_layout_partials(self, partials: int) -> None:
        for model in (self.model, self.ref_model):
            if model is not None:
                model.set_layout_partials(partials)

    def _make_optimizer(self, model, *, master_init=None, **optim_kwargs):
        if self.grad_sync == "megatron":
            return MegatronCoreOptimizer(model, distributed_optimizer=self.distributed_optimizer,
                                         master_init=master_init, **optim_kwargs)
        return super()._make_optimizer(model, master_init=master_init, **optim_kwargs)

    # --- gradients: the hooks of Trainer.train_step --------------------------------------------------------------
    @torch.no_grad()
    def _reduce_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """q_norm/k_norm grads (each TP rank's covers its heads only) summed over TP in rank order, then the sum
        over the DP replicas: ``Trainer``'s order-fixed one, or (``grad_sync='megatron'``) megatron-core's DDP,
        after which the grads to clip are the optimizer's float32 main grads."""
        g = self.groups
        if g.tp_size > 1 and not self.model.layout_pieces:  # train.tp_partials' pieces: summed in the norms' backward
            for grad, (_, partial) in zip(grads, self._specs):
                if partial:
                    grad.copy_(ordered_sum(grad, g.tp_group))
        if self.grad_sync == "megatron":
            return self.optimizer.finish_grad_sync()
        return super()._reduce_grads(grads)

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Global norm of the **full** grads: each sharded grad gathered in turn (name order), then
        :func:`rlrepro.trainer.optim.grad_norm`'s formula; ``Trainer`` clips every shard by it. With
        ``grad_sync='megatron'``: megatron-core's norm of its main grads."""
        if self.grad_sync == "megatron":
            return self.optimizer.grad_norm()
        return grad_norm(gather_param(name, grad, self.groups) for name, grad in zip(self.optimizer.names, grads))

    # --- weights --------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) in name order, compute dtype; a collective over the TP group (every TP rank must
        consume the whole iterator)."""
        yield from self.model.named_full_parameters()

    # --- checkpoints ----------------------------------------------------------------------------------------
    def _full_optimizer_state(self, keep: bool | None = None) -> dict | None:
        """The optimizer state a single-process Trainer of the full model would hold, in CPU memory; a collective.
        With the optimizer sharded over the DP replicas, replica 0 first gathers its TP shard's full state from the DP
        owners, then its TP group gathers the shards; the other replicas return None. Each full tensor is gathered
        in turn and moved to the CPU on a rank that ``keep``s it, dropped on the others: ``keep=None`` (a checkpoint
        save) keeps it on the writer only (TP rank 0 of replica 0; the other replicas, whose TP groups hold the same
        state, return None without gathering), ``keep=True`` on every TP rank (of replica 0 with the distributed
        optimizer, else of every replica)."""
        g = self.groups
        writer_only = keep is None
        keep = g.is_writer if writer_only else bool(keep)
        if self.distributed_optimizer:  # both gather onto DP rank 0 (CPU tensors); a collective over DP
            local = (self.optimizer.gather_state_dict(dst=0) if self.grad_sync == "ordered"
                     else self.optimizer.state_dict())
            if local is None:
                return None
        elif writer_only and g.dp_rank != 0:
            return None
        elif self.grad_sync == "ordered":  # MasterWeightAdamW.state_dict() without its device copies of the masters
            opt = self.optimizer
            local = {"names": opt.names, "adamw": opt.inner.state_dict(),
                     "master_weights": {n: m.detach() for n, m, p in zip(opt.names, opt.masters, opt.params)
                                        if m is not p}}
        else:
            local = self.optimizer.state_dict()  # live tensors

        def full(name: str, t: torch.Tensor, copy: bool = False) -> torch.Tensor | None:
            whole = gather_param(name, t, g)  # a collective over TP: every TP rank calls it, in the same order
            return whole.to("cpu", copy=copy) if keep else None

        names = local["names"]
        adamw = local["adamw"]
        state = {}
        for i, per_param in sorted(adamw["state"].items()):
            name = names[i]
            state[i] = {k: (full(name, v) if torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in sorted(per_param.items())}
        # masters: copies, never the optimizer's live tensors (as MasterWeightAdamW.state_dict() gives them)
        masters = {n: full(n, t, copy=True) for n, t in sorted(local["master_weights"].items())}
        if not keep:
            return None
        return {"names": list(names), "adamw": {"state": state, "param_groups": adamw["param_groups"]},
                "master_weights": masters}

    def _full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The full weights (name order) in CPU memory on the writer, None on the other ranks; each gathered in turn
        (a collective over the TP group of replica 0; the other replicas hold the same weights and skip it)."""
        if self.groups.dp_rank != 0:
            return None
        keep = self.groups.is_writer
        out = {}
        for name, t in self.model.named_full_parameters():
            if keep:
                out[name] = t.to("cpu")
        return out if keep else None

    def _shard_full_optimizer_state(self, full: Mapping) -> dict:
        """This rank's TP shards of a full optimizer state (copies), changing nothing live. A tensor whose shape is
        not its parameter's full shape (or under a name the model lacks) is passed on uncut: the optimizer's check
        then refuses it, naming the parameter."""
        check_layout(full)
        g = self.groups
        shapes = {n: tuple(t.shape) for n, t in _FullModelView(self.model).state_dict().items()}

        def shard(name, t):
            if torch.is_tensor(t) and t.dim() > 0 and shapes.get(name) == tuple(t.shape):
                return shard_tensor(name, t, g.tp_rank, g.tp_size).clone()
            return t

        names = list(full["names"]) if isinstance(full["names"], list | tuple) else []
        adamw, masters = full["adamw"], full["master_weights"]
        if not isinstance(adamw, Mapping) or not isinstance(adamw.get("state"), Mapping) or \
                not isinstance(masters, Mapping):
            return dict(full)  # the optimizer's check names what is missing
        state = {i: ({k: shard(names[i] if isinstance(i, int) and 0 <= i < len(names) else None, v)
                      for k, v in per.items()} if isinstance(per, Mapping) else per)
                 for i, per in adamw["state"].items()}
        return {"names": names, "adamw": {**adamw, "state": state},
                "master_weights": {n: shard(n, t) for n, t in masters.items()}}

    def _prepare_full_optimizer_state(self, full: Mapping):
        """This rank's shards of ``full``, checked and prepared by the optimizer (all its checks run: nothing live
        changes); what its ``load_state_dict`` then takes."""
        local = self._shard_full_optimizer_state(full)
        if hasattr(self.optimizer, "prepare_state_dict"):
            return self.optimizer.prepare_state_dict(local)
        return local

    def _load_full_optimizer_state(self, full: Mapping) -> None:
        self.optimizer.load_state_dict(self._prepare_full_optimizer_state(full))

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def save_checkpoint(self, ckpt_root, step: int, *, extra_state: Mapping | None = None,
                        keep_last: int | None = None, generators: Mapping | None = None,
                        checkpoint_format: str | None = None) -> Path:
        """``checkpoint_format`` (default: the trainer's) ``"full"``: gather the full model and optimizer state and
        write them (one writer rank) in rlrepro's checkpoint format, with the writer's RNG states and
        ``extra_state``; ``"dist"``: every rank writes its shards and its RNG states through megatron-core's
        ``dist_checkpointing`` (:func:`.dist_checkpoint.save_dist_checkpoint`). Every rank calls it; all get the
        path."""
        fmt = _check_format(checkpoint_format or self.checkpoint_format)
        if fmt == "dist":
            return save_dist_checkpoint(self, ckpt_root, step, extra_state=extra_state, keep_last=keep_last,
                                        generators=generators)
        # gathered one tensor at a time; the writer keeps each in CPU memory, every other rank drops it
        model_state = self._full_model_state()
        optim_state = self._full_optimizer_state()
        write_on_one_rank(self.groups.is_writer, lambda: save_checkpoint(
            ckpt_root, step, model=_FullModelView(self.model, model_state),
            optimizer=_FullOptimizerView(self, optim_state), scheduler=self.scheduler, extra_state=extra_state,
            rng_state=capture_rng_state(generators), keep_last=keep_last), self._barrier)
        return Path(ckpt_root) / checkpoint_dir_name(step)

    def load_checkpoint(self, path, *, generators: Mapping | None = None, restore_rng: bool = True) -> dict:
        """Verify and load a checkpoint (from this class or from a plain ``Trainer``, at any TP): a full one is read
        by every rank, which keeps its shards (RNG states are the writer's); a dist one is read shard by shard
        (:func:`.dist_checkpoint.load_dist_checkpoint`). Returns ``extra_state``."""
        if is_dist_checkpoint(path):
            return load_dist_checkpoint(self, path, generators=generators, restore_rng=restore_rng)
        loaded = load_checkpoint(path, model=_FullModelView(self.model), optimizer=_FullOptimizerView(self),
                                 scheduler=self.scheduler, restore_rng=restore_rng, generators=generators)
        self._barrier()
        return loaded.extra_state

    def export_hf(self, path, **kwargs) -> Path:
        """Write the full policy as an HF directory (config.json + safetensors) from the writer rank; a collective."""
        from rlrepro.model import save_pretrained

        full = self.model.to_full_model()
        write_on_one_rank(self.groups.is_writer, lambda: save_pretrained(full, path, **kwargs), self._barrier)
        return Path(path)
