"""The CUDA fast path of the layout-invariant pieces (``train.tp_partials``, rlrepro/kernels/tp.py): its forward
against the per-piece path it replaces, bit for bit (``torch.equal``; the no-grad emulation ``linear_row_split`` /
``linear_column_split`` too); its own backward (one Triton product per gradient) the same bits at every TP dividing
``P`` (each rank's shard through the pieces functions == the slice of the TP=1 gradient), close to float64 and the
same run to run; and the kernels under it (``triton_pieces.matmul_k_pieces``, ``triton_pieces.ordered_sum``).

Two tiers, as tests/test_triton_kernels.py:

* CPU: the same comparisons through Triton's interpreter (``TRITON_INTERPRET=1``, float32 only: the interpreter
  computes bf16 wrongly), the fast path forced onto CPU tensors and both paths' ``kernels.linear`` set to the
  Triton one (``triton_ops.linear``), so what differs between them is only what the fast path changes.
  ``TRITON_INTERPRET=1 python tests/test_tp_pieces_fast.py --interpret [NAME ...]`` runs them directly.
* GPU (``-m gpu``): the compiled kernels, bf16 and float32, through the real dispatch (CUDA, deterministic mode).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from _triton_helpers import fresh_seed, gpu, interpreter_test_items, main, needs_cuda, rel_err  # noqa: E402,F401


# ============================================================================================ shared comparisons
def _assert_equal(got: torch.Tensor, expect: torch.Tensor, what: str) -> None:
    assert got.shape == expect.shape and got.dtype == expect.dtype, (what, got.shape, expect.shape, got.dtype)
    assert torch.equal(got, expect), f"{what}: max |diff| {(got.double() - expect.double()).abs().max().item()}"


def _run_with_grad(fn, x, w, g, parts, need_x=True):
    xx = x.clone().requires_grad_(need_x)
    ww = w.clone().requires_grad_(True)
    y = fn(xx, ww, parts)
    y.backward(g)
    return y.detach(), (xx.grad if need_x else None), ww.grad


def compare_pieces(kind: str, device, dtype, m: int, k: int, n: int, parts: int, lead=(), seed_note="",
                   tps=(1, 2, 4)) -> None:
    """``row_pieces_linear`` / ``column_pieces_linear`` (the fast path where it applies): the forward == the
    per-piece graphs' (with and without an input gradient), the no-grad forms == the per-piece ones; the gradients
    (the fast path's own backward) the same bits at every TP in ``tps`` dividing ``parts`` (:func:`compare_shards`),
    close to float64, and the same in a second run."""
    from rlrepro.kernels import tp

    x = torch.randn(*lead, m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    g = torch.randn(*lead, m, n, device=device).to(dtype)
    fast, ref = ((tp.row_pieces_linear, tp._row_pieces_per_piece) if kind == "row" else
                 (tp.column_pieces_linear, tp._column_pieces_per_piece))
    split, split_ref = ((tp.linear_row_split, tp._linear_row_split_per_piece) if kind == "row" else
                        (tp.linear_column_split, tp._linear_column_split_per_piece))
    what = f"{kind} {dtype} m={m} k={k} n={n} P={parts} lead={lead} {seed_note}"
    for need_x in (True, False):
        got, expect = _run_with_grad(fast, x, w, g, parts, need_x), _run_with_grad(ref, x, w, g, parts, need_x)
        _assert_equal(got[0], expect[0], f"{what} need_x={need_x}: forward")
    whole = _run_with_grad(fast, x, w, g, parts)
    _assert_equal(whole[2], got[2], f"{what}: weight grad with and without the input grad")
    for name, a, b in zip(("forward", "input grad", "weight grad"), _run_with_grad(fast, x, w, g, parts), whole):
        _assert_equal(a, b, f"{what}: run to run, {name}")
    x64, w64, g64 = x.double().reshape(-1, k), w.double(), g.double().reshape(-1, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, got_grad, expect_grad in (("input grad", whole[1].reshape(-1, k), g64 @ w64),
                                        ("weight grad", whole[2], g64.t() @ x64)):
        e = rel_err(got_grad, expect_grad)
        assert e < tol, f"{what}: {name} rel err {e} vs float64"
    for t in tps:
        if parts % t == 0:
            compare_shards(kind, x, w, g, parts, t, whole, what)
    with torch.no_grad():
        _assert_equal(fast(x, w, parts), expect[0], f"{what}: no-grad pieces")
        _assert_equal(split(x, w, parts), expect[0], f"{what}: no-grad split")
        _assert_equal(split_ref(x, w, parts), expect[0], f"{what}: per-piece split")


def compare_shards(kind: str, x, w, g, parts: int, t: int, whole, what: str) -> None:
    """TP=``t`` emulated rank by rank, each rank's shard through the calls the megatron model makes (the pieces
    functions on the shard, ``parts / t`` local pieces): its forward and gradients == the matching slices of the
    TP=1 ones (``whole``: forward, input grad, weight grad), bit for bit. The column-parallel input gradient, which
    real TP gathers, is the ranks' stacked partials (``tp_fused.column_grad_input_partials``, what a rank
    gathers) added in piece order by ``tp_fused.ordered_sum_cuda``; the row-parallel forward's stacked partials are compared too."""
    from rlrepro.kernels import tp, tp_fused

    local = parts // t
    k, n = x.shape[-1], w.shape[0]
    y, gx, gw = whole
    partials, row_stack = [], tp_fused.row_fused(x, w, parts, stack=True) if kind == "row" else None
    for r in range(t):
        note = f"{what} TP={t} rank {r}"
        if kind == "row":
            a, b = tp.shard_range(k, t, r)
            xs, ws = x[..., a:b].contiguous(), w[:, a:b].contiguous()
            _, gxs, gws = _run_with_grad(tp.row_pieces_linear, xs, ws, g, local)
            _assert_equal(gxs, gx[..., a:b], f"{note}: input grad")
            _assert_equal(gws, gw[:, a:b], f"{note}: weight grad")
            _assert_equal(tp_fused.row_fused(xs, ws, local, stack=True), row_stack[r * local:(r + 1) * local],
                          f"{note}: forward partials")
        else:
            a, b = tp.shard_range(n, t, r)
            ws, gs = w[a:b].contiguous(), g[..., a:b].contiguous()
            ys, _, gws = _run_with_grad(tp.column_pieces_linear, x, ws, gs, local, need_x=False)
            _assert_equal(ys, y[..., a:b], f"{note}: forward")
            _assert_equal(gws, gw[a:b], f"{note}: weight grad")
            partials.extend(tp_fused.column_grad_input_partials(gs.reshape(-1, b - a), ws, local).unbind(0))
    if kind == "column":
        _assert_equal(tp_fused.ordered_sum_cuda(partials).reshape(x.shape), gx, f"{what} TP={t}: input grad")


def compare_k_pieces(device, dtype, m: int, k: int, n: int, parts: int, configs=(None,), note="") -> int:
    """``matmul_k_pieces`` == the per-piece products (``matmul`` on contiguous slices), summed by
    ``sum_in_rank_order`` and stacked, for each config and each kernel (TMA where it may run, pointers)."""
    from rlrepro.kernels import tp
    from rlrepro.kernels import triton_matmul as mm
    from rlrepro.kernels import triton_pieces as pk

    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    pieces = [mm.matmul(x[:, a:b].contiguous(), w[:, a:b].contiguous())
              for a, b in (tp.shard_range(k, parts, r) for r in range(parts))]
    expect, expect_stack = tp.sum_in_rank_order(pieces), torch.stack(pieces)
    checked = 0
    for cfg in configs:
        # TMA: pieces of whole K tiles, or (forced) any pieces, the last partial tile through pointers (TAIL)
        aligned_pieces = ((k // parts) * x.element_size()) % 16 == 0 or parts == 1
        for tma in (None, False) + ((True,) if mm.tma_usable(w, n, k) and aligned_pieces else ()):
            what = f"{dtype} m={m} k={k} n={n} P={parts} config={cfg and cfg.name} tma={tma} {note}"
            _assert_equal(pk.matmul_k_pieces(x, w, parts, config=cfg, use_tma=tma), expect, what)
            _assert_equal(pk.matmul_k_pieces(x, w, parts, stack=True, config=cfg, use_tma=tma), expect_stack,
                          what + " stack")
            checked += 1
    return checked


def compare_grad_products(device, dtype, m: int, k: int, n: int, parts: int, configs=(None,), note="") -> int:
    """The backward's products read their operands as stored (no transposed copies): ``linear_grad_input``,
    ``linear_grad_weight`` and ``linear_grad_input_n_pieces`` == the same products on transposed contiguous copies
    (``matmul`` / ``matmul_k_pieces``), for each config and kernel (TMA where it may run, pointers)."""
    from rlrepro.kernels import triton_matmul as mm
    from rlrepro.kernels import triton_pieces as pk

    x = torch.randn(m, k, device=device).to(dtype)  # y = x @ w^T: x [M, K], w [N, K], g [M, N]
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    g = torch.randn(m, n, device=device).to(dtype)
    expect = {"input": mm.matmul(g, w.t().contiguous()), "weight": mm.matmul(g.t().contiguous(), x.t().contiguous()),
              "n_pieces": pk.matmul_k_pieces(g, w.t().contiguous(), parts),
              "n_pieces stack": pk.matmul_k_pieces(g, w.t().contiguous(), parts, stack=True)}
    assert torch.equal(pk.linear_grad_input(g, w), expect["input"]), f"{dtype} m={m} k={k} n={n}: input grad"
    assert torch.equal(pk.linear_grad_weight(g, x), expect["weight"]), f"{dtype} m={m} k={k} n={n}: weight grad"
    assert torch.equal(pk.linear_grad_input_n_pieces(g, w, parts), expect["n_pieces"])
    checked = 0
    for cfg in configs:
        for tma in (False, True):
            calls = {"input": (g, w, m, k, n, 1, False, False, True, True),
                     "weight": (g, x, n, k, m, 1, False, True, True, True),
                     "n_pieces": (g, w, m, k, n, parts, False, False, True, False),
                     "n_pieces stack": (g, w, m, k, n, parts, True, False, True, False)}
            for name, args in calls.items():
                a, b, mm_, nn_, kk, pieces = args[:6]
                es = a.element_size()
                aligned = all((s * es) % 16 == 0 for s in (mm_ if args[7] else kk, nn_ if args[8] else kk, nn_))
                aligned = aligned and (pieces == 1 or ((kk // pieces) * es) % 16 == 0 or (args[7] and args[8]))
                if tma and not aligned:
                    continue
                what = f"{name} {dtype} m={m} k={k} n={n} P={parts} config={cfg and cfg.name} tma={tma} {note}"
                _assert_equal(pk._pieces_product(*args, config=cfg, use_tma=tma), expect[name], what)
                checked += 1
    return checked


def compare_ordered_sum(device, dtype, shape, counts=(1, 2, 3, 8, 9, 17)) -> None:
    from rlrepro.kernels import tp
    from rlrepro.kernels import triton_pieces as pk

    for count in counts:
        parts = [(torch.randn(*shape, device=device) * 10 ** (i % 5 - 2)).to(dtype) for i in range(count)]
        parts[0].view(-1)[:3] = -0.0  # a -0.0 partial stays -0.0 where nothing else is added
        for p in parts[1:]:
            p.view(-1)[:2] = -0.0
        _assert_equal(pk.ordered_sum(parts), tp.sum_in_rank_order(parts), f"ordered_sum {dtype} x{count}")
        got, expect = pk.ordered_sum(parts), tp.sum_in_rank_order(parts)
        assert torch.equal(torch.signbit(got), torch.signbit(expect)), "sign of zero"


# ============================================================================================ CPU: interpreter
INTERP_CHECKS: dict = {}


def interp_check(fn):
    INTERP_CHECKS[fn.__name__] = fn
    return fn


@contextlib.contextmanager
def _fast_path_on_cpu():
    """The interpreter run's stand-in for CUDA: the fast path takes float32 CPU tensors, and ``kernels.linear`` of
    both paths is the Triton one (the per-piece graphs then make the same ``triton_ops`` calls as on a GPU)."""
    from rlrepro.kernels import tp, triton_ops

    saved = tp._fused_usable, tp._kernel_linear
    tp._fused_usable = lambda x, w: x.dtype == w.dtype == torch.float32
    tp._kernel_linear = lambda: triton_ops.linear
    try:
        yield
    finally:
        tp._fused_usable, tp._kernel_linear = saved


@interp_check
def check_k_pieces_fp32():
    from dataclasses import replace
    from rlrepro.kernels import triton_matmul as mm
    from rlrepro.kernels import triton_pieces as pk
    fresh_seed()
    # K pieces of 40 (a K tile of 32 plus a masked tail: the pointer kernel) and of 64 (whole tiles: TMA)
    for m, k, n, parts in ((1, 80, 24, 2), (7, 160, 40, 4), (70, 128, 24, 2), (3, 256, 8, 4), (5, 64, 16, 1)):
        assert compare_k_pieces("cpu", torch.float32, m, k, n, parts, note="interpreter")
    # the 16-bit tile geometries (persistent loop, grouped order) compute the sum: closeness (other numpy tile
    # shapes than the per-piece calls' float32 config, so not bit for bit here)
    x, w = torch.randn(150, 256), torch.randn(300, 256)
    expect = sum((x[:, a:a + 64] @ w[:, a:a + 64].t()).double() for a in range(0, 256, 64))
    for name in (*pk.PIECES_SMALL_M, *(c for c, _ in pk.PIECES_LARGE_M_CANDIDATES)):
        cfg = replace(mm.CONFIGS_16BIT[name], ctas_per_sm=1)
        for tma in (True, False):
            e = rel_err(pk.matmul_k_pieces(x, w, 4, config=cfg, use_tma=tma), expect)
            assert e < 1e-6, (name, tma, e)


@interp_check
def check_grad_products_fp32():
    fresh_seed()
    # reductions of 40 (a masked tail), of 64 and 128 (whole tiles); rows and columns not multiples of the tiles
    for m, k, n, parts in ((5, 24, 80, 2), (70, 40, 128, 2), (3, 16, 256, 4), (9, 8, 64, 1)):
        assert compare_grad_products("cpu", torch.float32, m, k, n, parts, note="interpreter")


@interp_check
def check_k_pieces_flattened_fp32():
    """``RLREPRO_PIECES_FLATTEN`` 1 (the pieces' K loops as one fused loop) and 0 (a loop a piece; ``auto`` picks
    per piece length): each the same per-piece products' sum."""
    import os

    fresh_seed()
    try:
        for value in ("1", "0"):
            os.environ["RLREPRO_PIECES_FLATTEN"] = value
            for m, k, n, parts in ((7, 256, 40, 4), (70, 128, 24, 2), (5, 160, 16, 4)):
                assert compare_k_pieces("cpu", torch.float32, m, k, n, parts, note=f"interpreter, flatten={value}")
    finally:
        os.environ.pop("RLREPRO_PIECES_FLATTEN")


@interp_check
def check_ordered_sum_fp32():
    fresh_seed()
    compare_ordered_sum("cpu", torch.float32, (5, 333))


@interp_check
def check_pieces_fast_path_fp32():
    from rlrepro.kernels import triton_pieces as pk

    seed = fresh_seed()
    calls = {"matmul_k_pieces": 0, "ordered_sum": 0}
    saved = pk.matmul_k_pieces, pk.ordered_sum

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    pk.matmul_k_pieces, pk.ordered_sum = counted("matmul_k_pieces", saved[0]), counted("ordered_sum", saved[1])
    try:
        _pieces_cases(seed)
    finally:
        pk.matmul_k_pieces, pk.ordered_sum = saved
    assert calls["matmul_k_pieces"] and calls["ordered_sum"], calls  # the fast path ran


def _pieces_cases(seed):
    with _fast_path_on_cpu():
        for kind in ("row", "column"):
            for m, k, n, parts, lead in ((1, 80, 24, 2, ()), (7, 160, 40, 4, ()), (70, 128, 24, 2, ()),
                                         (3, 64, 16, 1, ()), (4, 96, 48, 2, (2,))):
                compare_pieces(kind, "cpu", torch.float32, m, k, n, parts, lead, seed_note=f"seed {seed}")


@interp_check
def check_fast_path_not_used_off_cuda():
    """Without the stand-in, CPU tensors take the per-piece path (today's CPU bits): no Triton call at all."""
    from rlrepro.kernels import tp, triton_pieces as pk
    calls = []
    saved = pk.matmul_k_pieces, pk.ordered_sum
    pk.matmul_k_pieces = pk.ordered_sum = lambda *a, **k: calls.append(a)
    try:
        x, w = torch.randn(3, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        tp.row_pieces_linear(x, w, 2).sum().backward()
        tp.column_pieces_linear(x, w, 2).sum().backward()
        with torch.no_grad():
            tp.linear_row_split(x, w, 2), tp.linear_column_split(x, w, 2), tp.row_pieces_linear(x, w, 2)
    finally:
        pk.matmul_k_pieces, pk.ordered_sum = saved
    assert not calls and not tp._fused_usable(x, w)


def _group_worker(rank: int, world: int, port: int, out: str) -> None:
    """A TP rank of :func:`check_pieces_fast_path_tp_group_fp32`: its shard's pieces through both paths, with the
    gathers of a real (gloo) group."""
    import torch.distributed as dist
    from _dist import gloo_process_group
    from rlrepro.kernels import tp

    with gloo_process_group(rank, world, port), _fast_path_on_cpu():
        x, w, g = _group_inputs()
        group, local = dist.group.WORLD, GROUP_PARTS // world
        res = {}
        ka, kb = tp.shard_range(x.shape[-1], world, rank)
        na, nb = tp.shard_range(w.shape[0], world, rank)
        for name, fn in (("fast", tp.row_pieces_linear), ("ref", tp._row_pieces_per_piece)):
            res["row", name] = _run_with_grad(lambda xx, ww, p, fn=fn: fn(xx, ww, p, group), x[:, ka:kb].contiguous(),
                                              w[:, ka:kb].contiguous(), g, local)
        for name, fn in (("fast", tp.column_pieces_linear), ("ref", tp._column_pieces_per_piece)):
            res["column", name] = _run_with_grad(lambda xx, ww, p, fn=fn: fn(xx, ww, p, group), x,
                                                 w[na:nb].contiguous(), g[:, na:nb].contiguous(), local)
        with torch.no_grad():
            res["row", "no-grad"] = tp.row_pieces_linear(x[:, ka:kb].contiguous(), w[:, ka:kb].contiguous(), local,
                                                         group)
        torch.save(res, f"{out}.rank{rank}")


GROUP_PARTS = 4


def _group_inputs():
    gen = torch.Generator().manual_seed(5)
    m, k, n = 6, 4 * 40, 24  # pieces of 40: the pointer kernel with a masked K tail
    return (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / 8, torch.randn(m, n, generator=gen))


@interp_check
def check_pieces_fast_path_tp_group_fp32():
    """Real TP (gloo, 2 ranks holding 2 of the 4 pieces each): the fast path's forward with its gathers == the
    per-piece path's on every rank, and its forward and gradients == one process computing all 4 pieces (the layout
    invariance itself)."""
    import tempfile

    from _dist import spawn_ranks
    from rlrepro.kernels import tp

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        ranks = spawn_ranks(_group_worker, world, out=f"{tmp}/res", weights_only=False)
    x, w, g = _group_inputs()
    with _fast_path_on_cpu():
        whole = {"row": _run_with_grad(tp.row_pieces_linear, x, w, g, GROUP_PARTS),
                 "column": _run_with_grad(tp.column_pieces_linear, x, w, g, GROUP_PARTS)}
    for rank, res in enumerate(ranks):
        ka, kb = tp.shard_range(x.shape[-1], world, rank)
        na, nb = tp.shard_range(w.shape[0], world, rank)
        for kind in ("row", "column"):  # the fast path's backward is its own (the same at any TP, below)
            _assert_equal(res[kind, "fast"][0], res[kind, "ref"][0], f"rank {rank} {kind} forward: fast vs per-piece")
        y, gx, gw = res["row", "fast"]
        _assert_equal(y, whole["row"][0], "row forward vs one process")
        _assert_equal(res["row", "no-grad"], whole["row"][0], "row no-grad forward vs one process")
        _assert_equal(gx, whole["row"][1][:, ka:kb], "row input grad vs one process")
        _assert_equal(gw, whole["row"][2][:, ka:kb], "row weight grad vs one process")
        y, gx, gw = res["column", "fast"]
        _assert_equal(y, whole["column"][0][:, na:nb], "column forward vs one process")
        _assert_equal(gx, whole["column"][1], "column input grad vs one process")
        _assert_equal(gw, whole["column"][2][na:nb], "column weight grad vs one process")


interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)


# ============================================================================================ CPU (no Triton)
def test_no_grad_pieces_build_no_graph_and_keep_the_bits():
    """Without autograd the per-piece path makes the same kernel calls without per-piece graphs: the same bits as
    with the graphs (CPU, where the fast path never runs)."""
    from rlrepro.kernels import tp

    torch.manual_seed(0)
    x, w = torch.randn(5, 12), torch.randn(8, 12)
    for parts in (1, 2, 4):
        for fast, ref in ((tp.row_pieces_linear, tp._row_pieces_per_piece),
                          (tp.column_pieces_linear, tp._column_pieces_per_piece)):
            with_graph = ref(x.clone().requires_grad_(True), w.clone().requires_grad_(True), parts)
            with torch.no_grad():
                out = fast(x, w, parts)
            assert not out.requires_grad and out.grad_fn is None
            assert torch.equal(out, with_graph.detach())
            out2 = fast(x, w, parts)  # grad mode on, but nothing requires grad
            assert out2.grad_fn is None and torch.equal(out2, out)


def test_flatten_rule_follows_the_piece_length_and_the_variable(monkeypatch):
    """``RLREPRO_PIECES_FLATTEN``: auto flattens pieces of at most FLATTEN_MAX_TILES K tiles; 0/1 force; a bad value
    names itself and the choices."""
    from rlrepro.kernels import triton_pieces as pk

    monkeypatch.delenv("RLREPRO_PIECES_FLATTEN", raising=False)
    assert pk._flatten_pieces(pk.FLATTEN_MAX_TILES) and not pk._flatten_pieces(pk.FLATTEN_MAX_TILES + 1)
    monkeypatch.setenv("RLREPRO_PIECES_FLATTEN", "0")
    assert not pk._flatten_pieces(1)
    monkeypatch.setenv("RLREPRO_PIECES_FLATTEN", "1")
    assert pk._flatten_pieces(1000)
    monkeypatch.setenv("RLREPRO_PIECES_FLATTEN", "yes")
    with pytest.raises(ValueError, match="'yes'.*auto, 0 or 1|auto, 0 or 1.*'yes'"):
        pk._flatten_pieces(1)


# ============================================================================================ GPU
GPU_MS = (1, 7, 300)
GPU_PARTS = (1, 2, 4, 8)
GPU_KS = (2048 + 64 * 3, 2048)  # pieces of 280 (a masked K tail: pointer kernel) and of 256 (whole tiles: TMA)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["row", "column"])
@pytest.mark.parametrize("k", GPU_KS)
def test_gpu_pieces_fast_path(dtype, kind, k):
    """Forward == per-piece; gradients at TP 1, 2, 4 (dividing P) == TP=1, close to float64, run to run equal."""
    from rlrepro import kernels
    from rlrepro.kernels import tp

    seed = fresh_seed()
    x = torch.randn(3, 64, device="cuda").to(dtype)
    assert tp._fused_usable(x, x) and kernels.current_mode() == "deterministic"
    n = 1000  # not a multiple of 64; its eighth (125) is not 16-byte aligned in bf16 (pieces: pointer kernel)
    for m in GPU_MS:
        for parts in GPU_PARTS:
            compare_pieces(kind, "cuda", dtype, m, k, n, parts, seed_note=f"seed {seed}")
    compare_pieces(kind, "cuda", dtype, 33, k, n, 4, lead=(3,), seed_note=f"seed {seed}")  # [B, T, K] inputs
    # N = 1216: column pieces of 152 (not whole K tiles of the input gradient, but 16-byte aligned starts): the TMA
    # kernel with its last partial tile through pointers (TAIL), as the LM head's 18,992-row vocab pieces at P=8
    compare_pieces(kind, "cuda", dtype, 300, k, 1216, 8, seed_note=f"seed {seed}")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_k_pieces_kernel_all_configs(dtype):
    from rlrepro.kernels import triton_matmul as mm
    from rlrepro.kernels import triton_pieces as pk

    seed = fresh_seed()
    configs = (None,) if dtype == torch.float32 else \
        (None, *(mm.CONFIGS_16BIT[c] for c in (*pk.PIECES_SMALL_M, *(c for c, _ in pk.PIECES_LARGE_M_CANDIDATES))))
    checked = 0
    for m in (1, 7, 64, 65, 300, 1500):
        for k, n, parts in ((2240, 1000, 8), (2048, 1003, 8), (4096, 2048, 2), (192, 64, 3), (12288, 512, 8)):
            checked += compare_k_pieces("cuda", dtype, m, k, n, parts, configs, note=f"seed {seed}")
    assert checked


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grad_products_read_operands_as_stored(dtype):
    """The backward's products without transposed copies == on the copies, bit for bit, every config and kernel."""
    from rlrepro.kernels import triton_matmul as mm

    seed = fresh_seed()
    configs = (None,) if dtype == torch.float32 else \
        (None, *(mm.CONFIGS_16BIT[c] for c in ("64x64x64w4s10c1", "128x128x64w8s4c1", "128x256x64w8s3c1s")))
    checked = 0
    for m in (1, 7, 300, 1500):
        for k, n, parts in ((2240, 1000, 8), (1024, 2048, 8), (192, 512, 2), (4096, 1216, 8)):
            checked += compare_grad_products("cuda", dtype, m, k, n, parts, configs, note=f"seed {seed}")
    assert checked


@gpu
@needs_cuda
@pytest.mark.parametrize("flatten", ["1", "0"])
def test_gpu_k_pieces_flattened_keeps_the_bits(monkeypatch, flatten):
    """``RLREPRO_PIECES_FLATTEN`` 1 (one K loop over the pieces) and 0 (a loop a piece), which ``auto`` (the default)
    picks between by the piece length: each == the per-piece products."""
    from rlrepro.kernels import triton_matmul as mm
    from rlrepro.kernels import triton_pieces as pk

    monkeypatch.setenv("RLREPRO_PIECES_FLATTEN", flatten)
    seed = fresh_seed()
    configs = (None, *(mm.CONFIGS_16BIT[c] for c in (*pk.PIECES_SMALL_M, "128x128x64w8s4c1")))
    for m in (1, 64, 300):
        for k, n, parts in ((4096, 4096, 8), (12288, 512, 8), (2240, 1000, 8)):
            assert compare_k_pieces("cuda", torch.bfloat16, m, k, n, parts, configs,
                                    note=f"flatten={flatten}, seed {seed}")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_head_group_norm_backward_without_graphs_keeps_the_bits(monkeypatch, dtype):
    """``tp.head_group_rms_norm``'s backward calling the Triton norm's backward directly == the autograd a head group
    it replaced (``tp._direct_norm_grads`` giving none), and run to run equal."""
    from rlrepro.kernels import tp

    seed = fresh_seed()

    def grads():
        x = torch.randn(300, 32, 128, device="cuda").to(dtype).requires_grad_(True)
        w = (1 + 0.1 * torch.randn(128, device="cuda")).to(dtype).requires_grad_(True)
        y = tp.head_group_rms_norm(x, w, 1e-6, 8)
        return (y, *torch.autograd.grad(y, (x, w), torch.randn_like(y)))

    def with_seed(fn):
        torch.manual_seed(seed)
        return fn()

    direct, again = with_seed(grads), with_seed(grads)
    assert tp._direct_norm_grads(direct[0]) is not None
    monkeypatch.setattr(tp, "_direct_norm_grads", lambda x: None)
    autograd = with_seed(grads)
    for a, b, c in zip(direct, again, autograd):
        assert torch.equal(a, b) and torch.equal(a, c), f"seed {seed}"


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_ordered_sum(dtype):
    fresh_seed()
    compare_ordered_sum("cuda", dtype, (300, 2049))


@gpu
@needs_cuda
def test_gpu_pieces_fast_path_in_fast_mode_is_not_used():
    """``kernels.mode("fast")``: the pieces run one by one through the stock kernels, as before."""
    from rlrepro import kernels
    from rlrepro.kernels import tp

    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    with kernels.mode("fast"):
        assert not tp._fused_usable(x, x)


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
