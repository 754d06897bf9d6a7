"""Qwen3 sharded over tensor-parallel ranks, Megatron-style, with order-fixed reductions.

The layers are Megatron's (column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj, vocab-parallel
embedding and LM head), written here on :mod:`rlrepro.kernels.tp` rather than taken from
``megatron.core.tensor_parallel``, for two reasons: megatron-core's layers and mappings allocate on
``torch.cuda.current_device()`` (they do not run on CPU/gloo, checked with megatron-core 0.16.1), and their
row-parallel reduction is an ``all_reduce`` whose summation order NCCL chooses. Here the row-parallel output is
the partials all-gathered and added in rank order, which the engine reproduces in one process
(``Qwen3ForCausalLM.set_tensor_parallel_emulation(tp)``), so trainer logprobs equal rollout logprobs exactly.

Parameter names and module layout are those of :class:`rlrepro.model.Qwen3ForCausalLM` (transformers naming);
each parameter holds this rank's shard (:func:`shard_spec`). ``forward_tokens`` / ``compute_logits`` have the
plain model's signatures, and ``compute_logits`` returns the *gathered* full-vocabulary logits, so
``rlrepro.trainer.token_logprobs`` and ``logprobs_and_entropy`` work on this model unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata
from rlrepro.kernels import tp as tpk
from rlrepro.model import Qwen3Config, Qwen3ForCausalLM
from rlrepro.model.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3MLP, RMSNorm

from .parallel import ParallelGroups

__all__ = ["TPQwen3ForCausalLM", "shard_spec", "shard_tensor", "gather_param"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def shard_spec(name: str) -> tuple[int | None, bool]:
    """``(dim, partial_grad)`` of a parameter: the dim split over TP ranks (None: replicated), and whether a
    replicated parameter's grad on one rank covers only that rank's heads (q_norm/k_norm, applied per head after
    the column-parallel projections) and so must be summed over the TP ranks."""
    parts = name.split(".")
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, False
    if len(parts) >= 2 and parts[-2] in _COLUMN:
        return 0, False
    if len(parts) >= 2 and parts[-2] in _ROW:
        return 1, False
    if len(parts) >= 2 and parts[-2] in ("q_norm", "k_norm"):
        return None, True
    return None, False


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    dim, _ = shard_spec(name)
    if dim is None or tp_size == 1:
        return full
    a, b = tpk.shard_range(full.shape[dim], tp_size, tp_rank, f"{name} dim {dim}")
    return full.narrow(dim, a, b - a)


@torch.no_grad()
def gather_param(name: str, local: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter or grad; every TP rank must call it (a collective)."""
    dim, _ = shard_spec(name)
    if dim is None or groups.tp_size == 1:
        return local.detach()
    x = local.detach().contiguous()
    if x.device.type == "cpu" and torch.distributed.get_backend(groups.tp_group) == "nccl":
        x = x.to(torch.cuda.current_device())  # (e.g. optimizer state gathered to the CPU) NCCL moves CUDA tensors
    parts = [torch.empty_like(x) for _ in range(groups.tp_size)]
    torch.distributed.all_gather(parts, x, group=groups.tp_group)
    return torch.cat(parts, dim=dim).to(local.device)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class _TPModule(nn.Module):
    # train.layout_invariant: this rank computes its product as this many fixed pieces (train.tp_partials / TP),
    # combined with the other ranks' in piece order (rlrepro.kernels.tp.column_pieces_linear / row_pieces_linear)
    pieces: int = 0

    def __init__(self, groups: ParallelGroups) -> None:
        super().__init__()
        self._groups = groups  # plain attribute (a dataclass, not a module)

    @property
    def comm(self):
        return self._groups.tp_group if self.tp > 1 else None

    @property
    def tp(self) -> int:
        return self._groups.tp_size

    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else tpk.copy_to_tp(x, self._groups.tp_group)


class ColumnParallelLinear(_TPModule):
    """weight ``[out / tp, in]``: this rank's output columns; the input is replicated."""

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups) -> None:
        super().__init__(groups)
        self.weight = _param(out_features // groups.tp_size, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pieces:
            return tpk.column_pieces_linear(x, self.weight, self.pieces, self.comm)
        return kernels.linear(self.copy_in(x), self.weight)


class RowParallelLinear(_TPModule):
    """weight ``[out, in / tp]``: this rank's K-slice; output = partials added in rank order (replicated)."""

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups) -> None:
        super().__init__(groups)
        self.weight = _param(out_features, in_features // groups.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pieces:
            return tpk.row_pieces_linear(x, self.weight, self.pieces, self.comm)
        partial = kernels.linear(x, self.weight)
        return partial if self.tp == 1 else tpk.row_parallel_sum(partial, self._groups.tp_group)


class VocabParallelEmbedding(_TPModule):
    """weight ``[vocab / tp, hidden]``. Each rank looks up the ids it owns; the rows are gathered and each token
    takes its owner's row (a copy, so the result is the plain embedding's bits)."""

    def __init__(self, num: int, dim: int, groups: ParallelGroups) -> None:
        super().__init__(groups)
        self.weight = _param(num // groups.tp_size, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return kernels.embedding(ids, self.weight)
        shard = self.weight.shape[0]
        owner = torch.div(ids, shard, rounding_mode="floor")
        rank = self._groups.tp_rank
        local = torch.where(owner == rank, ids - rank * shard, torch.zeros_like(ids))
        stacked = tpk.gather_stack(kernels.embedding(local, self.weight), self._groups.tp_group)  # [tp, N, H]
        index = owner.reshape(1, -1, 1).expand(1, ids.numel(), stacked.shape[-1])
        return stacked.reshape(self.tp, ids.numel(), -1).gather(0, index).reshape(*ids.shape, -1)


class TPAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config, groups: ParallelGroups) -> None:
        super().__init__()
        tp = groups.tp_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        self.head_dim = cfg.head_dim
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, groups)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, groups)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, groups)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, groups)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    # the plain layer's forward on this rank's heads (kv_cache is always None here)
    forward = Qwen3Attention.forward


class TPMLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, groups: ParallelGroups) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, groups)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, groups)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, groups)

    forward = Qwen3MLP.forward


class TPDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, groups: ParallelGroups) -> None:
        super().__init__()
        self.self_attn = TPAttention(cfg, groups)
        self.mlp = TPMLP(cfg, groups)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    forward = Qwen3DecoderLayer.forward
    forward_pending = Qwen3DecoderLayer.forward_pending


class TPQwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, groups: ParallelGroups) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, groups)
        self.layers = nn.ModuleList(TPDecoderLayer(cfg, groups) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TPQwen3ForCausalLM(nn.Module):
    """This rank's shard of a Qwen3 over ``groups.tp_size`` tensor-parallel ranks. Build it with
    :meth:`from_full` or :meth:`from_pretrained`; every TP rank of a replica runs every forward/backward together."""

    def __init__(self, config: Qwen3Config, groups: ParallelGroups) -> None:
        super().__init__()
        tp = groups.tp_size
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            if getattr(config, name) % tp:
                raise ValueError(f"train.tensor_parallel={tp} does not divide the model's {name}="
                                 f"{getattr(config, name)}; choose a tensor_parallel size that divides it")
        self.config = config
        self.groups = groups
        self.model = TPQwen3Model(config, groups)
        self.lm_head = (None if config.tie_word_embeddings
                        else ColumnParallelLinear(config.hidden_size, config.vocab_size, groups))
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layout_pieces = 0  # set_layout_partials: the LM head's pieces on this rank (0: one product)

    def set_layout_partials(self, partials: int) -> "TPQwen3ForCausalLM":
        """``train.layout_invariant``: compute every row-/column-parallel product (and the q_norm/k_norm weight
        gradients) as ``partials`` fixed pieces over the whole TP group, ``partials / tp`` on this rank, combined
        in piece order: the bits of a ``Qwen3ForCausalLM`` with ``set_tensor_parallel_emulation(partials)``, forward
        and backward, at any TP that divides ``partials`` (docs/MEGATRON.md, "Layout invariance")."""
        tp = self.groups.tp_size
        if not isinstance(partials, int) or isinstance(partials, bool) or partials < 1 or partials % tp:
            raise ValueError(f"train.tp_partials={partials!r} is not a positive multiple of train.tensor_parallel="
                             f"{tp}; set train.tp_partials to a multiple of every TP size the run may use (e.g. 8)")
        cfg = self.config
        for name in ("num_key_value_heads", "num_attention_heads", "intermediate_size", "vocab_size"):
            if getattr(cfg, name) % partials:
                raise ValueError(f"train.tp_partials={partials} does not divide the model's {name}="
                                 f"{getattr(cfg, name)}; choose train.tp_partials that divides it")
        local = partials // tp
        for module in self.modules():
            if isinstance(module, _TPModule) and not isinstance(module, VocabParallelEmbedding):
                module.pieces = local
        for layer in self.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.head_groups = local
                norm.head_group_comm = self.groups.tp_group if tp > 1 else None
        self.layout_pieces = local
        return self

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_full(cls, full: Qwen3ForCausalLM, groups: ParallelGroups, device=None) -> "TPQwen3ForCausalLM":
        """This rank's shard of ``full`` (same dtype; ``device`` defaults to ``full``'s)."""
        device = torch.device(device) if device is not None else full.device
        with torch.device("meta"):
            model = cls(full.config, groups)
        model = model.to_empty(device=device).to(full.dtype)
        own = dict(model.named_parameters())
        src = dict(full.named_parameters())
        if set(own) != set(src):
            raise ValueError(f"parameter names differ from the full model: {sorted(set(own) ^ set(src))[:6]}")
        for name, p in own.items():
            p.copy_(shard_tensor(name, src[name].detach(), groups.tp_rank, groups.tp_size))
        return model

    @classmethod
    @torch.no_grad()
    def from_pretrained(cls, path, groups: ParallelGroups, device="cpu", dtype=None) -> "TPQwen3ForCausalLM":
        """Read this rank's shards of an HF directory (config.json + safetensors, sharded too) straight from the
        files (safetensors slices: a rank reads only its shards), cast to ``dtype`` (None: the checkpoint's) as
        :func:`rlrepro.model.load_pretrained` does, so the shards equal ``from_full(load_pretrained(path))``."""

        from rlrepro.model.checkpoint_io import (iter_checkpoint_tensors, load_dtype, model_dir_config,
                                                 require_all_tensors)

        dtype = load_dtype(dtype)  # refuses a dtype load_pretrained refuses, in its words, before reading a file
        path, config = model_dir_config(path)
        dtype = dtype or config.dtype
        with torch.device("meta"):
            model = cls(config, groups)
        model = model.to_empty(device=device).to(dtype)
        params = dict(model.named_parameters())
        seen: set[str] = set()
        for f, name, handle in iter_checkpoint_tensors(path, config, params):
            piece = handle.get_slice(name)
            shape = list(piece.get_shape())
            dim, _ = shard_spec(name)
            if dim is None or groups.tp_size == 1:
                tensor = piece[:]
            else:
                a, b = tpk.shard_range(shape[dim], groups.tp_size, groups.tp_rank, f"{name} dim {dim}")
                tensor = piece[a:b] if dim == 0 else piece[:, a:b]
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{f}: tensor {name!r} has shape {tuple(shape)}, which does not give this "
                                 f"rank's shard {tuple(params[name].shape)}; config.json does not match")
            params[name].copy_(tensor.to(dtype))
            seen.add(name)
        require_all_tensors(path, params, seen)
        model.source_path = str(path)
        return model

    # --- full tensors -------------------------------------------------------------------------------------------
    def named_full_parameters(self):
        """(name, full tensor) in name order; a collective over the TP group (every TP rank must iterate it)."""
        for name, p in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            yield name, gather_param(name, p, self.groups)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in self.named_full_parameters()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's shard of every full tensor (e.g. a checkpoint's); names and full shapes must match."""
        own = dict(self.named_parameters())
        if set(state) != set(own):
            raise ValueError(f"state dict names differ from the model's: missing {sorted(set(own) - set(state))[:5]},"
                             f" extra {sorted(set(state) - set(own))[:5]}; load a checkpoint of the same architecture")
        for name, p in own.items():
            shard = shard_tensor(name, state[name], self.groups.tp_rank, self.groups.tp_size)
            if tuple(shard.shape) != tuple(p.shape):
                raise ValueError(f"{name!r}: full shape {tuple(state[name].shape)} does not give this rank's shard "
                                 f"shape {tuple(p.shape)}; the checkpoint is of another model shape")
            p.copy_(shard.to(p.dtype))

    def to_full_model(self) -> Qwen3ForCausalLM | None:
        """A plain :class:`Qwen3ForCausalLM` with the gathered weights (on the CPU) on the TP rank 0, None on the
        others; a collective. For HF export."""
        state = self.full_state_dict()
        if self.groups.tp_rank != 0:
            return None
        with torch.device("meta"):
            full = Qwen3ForCausalLM(self.config)
        full = full.to_empty(device="cpu").to(self.dtype)
        full.load_state_dict({k: v.to("cpu") for k, v in state.items()}, strict=True)
        return full

    # --- the plain model's interface ---------------------------------------------------------------------------
    # The attributes they read (config, model.embed_tokens / layers / norm, lm_head, _rope) are laid out as in the
    # plain model, so its code serves here too: the same rope tables, the same layer loop (over this class's
    # layers, without KV caches), forward() through this class's compute_logits.
    device = Qwen3ForCausalLM.device
    dtype = Qwen3ForCausalLM.dtype
    head_weight = Qwen3ForCausalLM.head_weight
    rope = Qwen3ForCausalLM.rope
    forward = Qwen3ForCausalLM.forward

    def forward_tokens(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches=None) -> torch.Tensor:
        if kv_caches is not None:
            raise ValueError("the tensor-parallel trainer model runs full sequences only (no KV cache)")
        return Qwen3ForCausalLM.forward_tokens(self, input_ids, meta)

    def compute_logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits (for vocab-parallel logprobs)."""
        if self.layout_pieces:
            return tpk.column_pieces_linear(hidden, self.head_weight(), self.layout_pieces,
                                            self.groups.tp_group if self.groups.tp_size > 1 else None)
        h = hidden if self.groups.tp_size == 1 else tpk.copy_to_tp(hidden, self.groups.tp_group)
        return kernels.linear(h, self.head_weight())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits: the column shards gathered in rank order (a copy: the emulated model's bits)."""
        shard = self.compute_logits_shard(hidden)
        return shard if self.groups.tp_size == 1 else tpk.gather_last_dim(shard, self.groups.tp_group)
