"""Dense Qwen3 built on rlrepro.kernels.

Module and parameter names follow transformers' ``Qwen3ForCausalLM`` so that state dicts load both ways.
Every op goes through :mod:`rlrepro.kernels`, so the trainer's full-sequence forward and the engine's chunked,
cached forward compute each token identically in deterministic mode.

Entry points:

* ``model(input_ids)``: [B, T] -> logits [B, T, vocab]; each row is one whole sequence (no padding, no cache).
* ``model.forward_tokens(ids, meta, kv_caches=None)``: a flat batch of N tokens described by an
  :class:`~rlrepro.kernels.AttentionMetadata` -> final hidden states [N, hidden] (after the last norm).
* ``model.compute_logits(hidden)``: hidden -> logits with the (possibly tied) LM head.
"""
from __future__ import annotations

import torch
from torch import nn

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata

from .config import Qwen3Config


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class Linear(nn.Module):
    # Tensor-parallel emulation (see Qwen3ForCausalLM.set_tensor_parallel_emulation): None = one plain product;
    # ("column" | "row", tp) = what a column-/row-parallel linear over tp ranks computes (rlrepro.kernels.tp).
    tp_split: tuple[str, int] | None = None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_split is None:
            return kernels.linear(x, self.weight)
        return _tp_linear(x, self.weight, self.tp_split)


def _tp_linear(x: torch.Tensor, weight: torch.Tensor, split: tuple[str, int]) -> torch.Tensor:
    from rlrepro.kernels import tp

    kind, parts = split
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        # training (train.layout_invariant): the same forward bits, and a backward fixed piece by piece
        return (tp.row_pieces_linear if kind == "row" else tp.column_pieces_linear)(x, weight, parts)
    return (tp.linear_row_split if kind == "row" else tp.linear_column_split)(x, weight, parts)


class FusedWeight:
    """Several linears' weights stored as the row blocks of one tensor, so one product computes them all.

    The linears keep their ``Parameter`` objects (names, identities, optimizer references); only their storage is
    moved into ``weight``, so in-place updates (``copy_``, ``load_weights``, a broadcast into ``.data``) reach the
    fused tensor. ``usable()`` is False, and callers fall back to one product per linear, whenever that no longer
    holds (a ``.to()`` moved a weight, a weight was re-assigned, tensor-parallel emulation is on off CUDA's
    deterministic kernels) or gradients are wanted (autograd would not reach the separate parameters through the
    fused tensor).

    Bits: on CUDA the batch-invariant matmul computes every output element as one fixed chain over K whatever N
    and the tile config are (rlrepro.kernels.triton_matmul), so the fused columns equal the separate products bit
    for bit (tests/test_fused_projections.py; on the GPU, tests/test_triton_kernels.py). The CPU kernels give no
    such guarantee, which is why the engine fuses on CUDA only.
    """

    def __init__(self, linears: list["Linear"]) -> None:
        self.linears = linears
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in linears])
            row = 0
            for lin in linears:
                rows = lin.weight.shape[0]
                lin.weight.data = self.weight[row:row + rows]
                row += rows
        self.sizes = [lin.weight.shape[0] for lin in linears]

    def usable(self, x: torch.Tensor | None = None) -> bool:
        """Whether a forward on ``x`` may use the fused product now: the layout holds, no gradient is wanted, and
        under tensor-parallel emulation (column splits) the split product is the one whole product on ``x``'s
        device (CUDA's deterministic kernels, :func:`rlrepro.kernels.tp.column_split_is_one_product`)."""
        if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in self.linears):
            return False
        if not self.intact():
            return False
        splits = [lin.tp_split for lin in self.linears]
        if all(s is None for s in splits):
            return True
        from rlrepro.kernels import tp

        return (x is not None and all(s is not None and s[0] == "column" for s in splits)
                and tp.column_split_is_one_product(x, self.weight))

    def intact(self) -> bool:
        """Whether every linear's weight is still its slice of ``weight`` (whatever the grad mode and emulation)."""
        w = self.weight
        step = w.shape[1] * w.element_size()
        ptr = w.data_ptr()
        for lin, rows in zip(self.linears, self.sizes):
            t = lin.weight
            if (t.data_ptr() != ptr or t.dtype != w.dtype or t.device != w.device
                    or tuple(t.shape) != (rows, w.shape[1])):
                return False
            ptr += rows * step
        return True


class RMSNorm(nn.Module):
    # q_norm / k_norm under tensor-parallel emulation with gradients (train.layout_invariant): the weight gradient
    # is the sum of this many head-group partials, in head order, over the TP group (rlrepro.kernels.tp)
    head_groups: int = 1
    head_group_comm = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_groups > 1 or self.head_group_comm is not None:
            if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                from rlrepro.kernels import tp

                return tp.head_group_rms_norm(x, self.weight, self.eps, self.head_groups, self.head_group_comm)
        return kernels.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return kernels.embedding(ids, self.weight)


class Qwen3Attention(nn.Module):
    qkv: FusedWeight | None = None  # set by Qwen3ForCausalLM.fuse_projections

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, meta, kv_cache):
        n = x.shape[0]
        fused = getattr(self, "qkv", None)  # (the megatron backend's TP layers borrow this forward, unfused)
        if fused is not None and fused.usable(x):  # one q|k|v product (q_norm and k_norm share the config's eps)
            qkv = kernels.linear(x, fused.weight)
            o = kernels.qk_norm_rope_attention(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                               self.k_norm.weight, self.q_norm.eps, cos, sin, meta, self.scale,
                                               kv_cache)
            return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q = kernels.apply_rope(q, cos, sin)
        k = kernels.apply_rope(k, cos, sin)
        o = kernels.attention(q, k, v, meta, self.scale, kv_cache)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    gate_up: FusedWeight | None = None  # set by Qwen3ForCausalLM.fuse_projections

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        fused = getattr(self, "gate_up", None)
        if fused is not None and fused.usable(x):
            gate_up = kernels.linear(x, fused.weight)
        else:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(kernels.silu_and_mul(gate_up))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_pending(self, x, pending, cos, sin, meta, kv_cache):
        """``forward`` with each residual add done inside the next norm (``kernels.add_rms_norm``): takes the
        previous layer's output as ``x + pending`` unsummed (``pending`` None: ``x`` is the whole input) and
        returns its own output the same way. The sums and norms are those of ``forward``, bit for bit."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = kernels.add_rms_norm(x, pending, self.input_layernorm.weight, self.input_layernorm.eps)
        attn = self.self_attn(h, cos, sin, meta, kv_cache)
        ln = self.post_attention_layernorm
        x, h = kernels.add_rms_norm(x, attn, ln.weight, ln.eps)
        return x, self.mlp(h)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rope_tables(head_dim: int, theta: float, num_positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, head_dim/2] in float32, computed as transformers does (then only gathered)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(num_positions, device=device).float().unsqueeze(1) * inv_freq.unsqueeze(0)
    return freqs.cos(), freqs.sin()


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tensor_parallel_emulation = 1

    def set_tensor_parallel_emulation(self, tp: int) -> "Qwen3ForCausalLM":
        """Compute every linear as a Megatron-style tensor-parallel model over ``tp`` ranks would, in this one
        process: q/k/v, gate/up and the LM head as ``tp`` column shards, o_proj and down_proj as ``tp`` K-split
        partials added in rank order (:mod:`rlrepro.kernels.tp`). The engine runs a model set this way to produce
        the same bits as a trainer sharded with ``train.tensor_parallel=tp`` (docs/MEGATRON.md).
        ``tp=1`` (the default) is the plain model, bit for bit. The weights are not touched."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor-parallel emulation size must be a positive int, got {tp!r}")
        cfg = self.config
        if tp > 1:
            for name, value in (("num_attention_heads", cfg.num_attention_heads),
                                ("num_key_value_heads", cfg.num_key_value_heads),
                                ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
                if value % tp:
                    raise ValueError(f"tensor-parallel size {tp} does not divide {name}={value}; "
                                     f"choose a size that divides it")
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin, kind in ((attn.q_proj, "column"), (attn.k_proj, "column"), (attn.v_proj, "column"),
                              (attn.o_proj, "row"), (mlp.gate_proj, "column"), (mlp.up_proj, "column"),
                              (mlp.down_proj, "row")):
                lin.tp_split = None if tp == 1 else (kind, tp)
            attn.q_norm.head_groups = attn.k_norm.head_groups = tp
        if self.lm_head is not None:
            self.lm_head.tp_split = None if tp == 1 else ("column", tp)
        self.tensor_parallel_emulation = tp
        return self

    def fuse_projections(self) -> "Qwen3ForCausalLM":
        """Store each layer's q/k/v weights as one tensor and its gate/up weights as another, so inference runs
        two products per layer instead of five (decode reads the same bytes in fewer, fuller launches).

        Parameter names, objects and values stay as they were (see :class:`FusedWeight`); the fused product is
        used only without gradients, and under tensor-parallel emulation only where a column split is one product
        (CUDA, the deterministic mode), and it is undone by nothing: a later
        ``.to()`` or re-assigned weight just makes the layers fall back to separate products. The engine calls
        this on CUDA, where it is bitwise neutral; calling it twice is a no-op."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # intact(), not usable(): an engine is built with grad mode on; re-fusing then would move the weights
            # to a new tensor and free the one an earlier engine's CUDA graphs read
            if attn.qkv is None or not attn.qkv.intact():
                attn.qkv = FusedWeight([attn.q_proj, attn.k_proj, attn.v_proj])
            if mlp.gate_up is None or not mlp.gate_up.intact():
                mlp.gate_up = FusedWeight([mlp.gate_proj, mlp.up_proj])
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, positions: torch.Tensor, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions``; the table grows (in whole powers of two) and is only gathered from.

        ``max_len`` (> every position), when known on the host, spares reading ``positions.max()`` back from the
        device. The table's rows do not depend on its size, so how it grew never changes a value."""
        if max_len is not None:
            need = max(int(max_len), 1)
        else:
            need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != positions.device:
            size = max(4096, 1 << (need - 1).bit_length())
            self._rope = rope_tables(self.config.head_dim, self.config.rope_theta, size, positions.device)
        return self._rope[0][positions], self._rope[1][positions]

    def forward_tokens(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None, *,
                       check_ids: bool = True) -> torch.Tensor:
        """Hidden states of a packed or paged token batch. ``check_ids=False`` skips the token-range check, which
        reads the ids back to the host (the engine validates ids itself and must not wait for the device)."""
        vocab = self.config.vocab_size
        if check_ids and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}); got min {int(input_ids.min())}, "
                             f"max {int(input_ids.max())}")
        cos, sin = self.rope(meta.positions, meta.max_seq_len)
        x = self.model.embed_tokens(input_ids)
        if torch.is_grad_enabled():  # training: the plain adds and norms (autograd)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i])
            return self.model.norm(x)
        # inference: every residual add fused into the norm after it (the same bits; 2 fewer passes a layer)
        pending = None
        for i, layer in enumerate(self.model.layers):
            x, pending = layer.forward_pending(x, pending, cos, sin, meta, None if kv_caches is None else kv_caches[i])
        if pending is None:
            return self.model.norm(x)
        return kernels.add_rms_norm(x, pending, self.model.norm.weight, self.model.norm.eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel_emulation > 1:
            return _tp_linear(hidden, self.head_weight(), ("column", self.tensor_parallel_emulation))
        return kernels.linear(hidden, self.head_weight())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"model(input_ids) takes [batch, seq_len] token ids; got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        meta = AttentionMetadata.packed([t] * b, device=input_ids.device)
        hidden = self.forward_tokens(input_ids.reshape(-1), meta)
        return self.compute_logits(hidden).view(b, t, -1)


@torch.no_grad()
def init_random_weights(model: Qwen3ForCausalLM, seed: int) -> Qwen3ForCausalLM:
    """Seeded random weights (normal(0, initializer_range), norms = 1), generated on the CPU in float32 in a fixed
    parameter order and then cast, so the same seed gives the same weights on any device and in any dtype."""
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            values = torch.ones(p.shape)
        else:
            values = torch.randn(p.shape, generator=gen) * std
        p.copy_(values.to(p.dtype))
    return model
