"""The warp-specialised Gluon forward as the "long" tile's kernel on sm_90 (issue #27): where ``use_gluon`` takes a
packed call, the output and the log-sum-exp are the Triton kernel's bits (``torch.equal``), at every GQA group the
dispatch admits, head sizes 64 and 128, ragged lengths around the 64-position KV tiles and the query tiles, and a
sequence alone, in both reduction orders (``RLREPRO_ATTENTION_ORDER``); ``RLREPRO_ATTENTION_GLUON=0`` and a forced
config keep the Triton kernel; so do the variants (Q by TMA, persistent, ping-pong). The CPU tests check the layout
rule and the switches, and (Triton interpreter) the persistent variant's slot order.
"""
from __future__ import annotations

import pytest
import torch

from _triton_helpers import attention_data, fresh_seed, interpreter_test_items, main
from rlrepro.kernels import triton_attention_fwd as A
from rlrepro.kernels.metadata import AttentionMetadata

LENS = [300, 129, 1, 77, 2000, 64, 65, 128, 127, 33, 513]


def _hopper_with_gluon() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    import triton

    from rlrepro.kernels import gluon_attention_fwd as G
    return G.HAVE_GLUON and triton.__version__.startswith("3.6.")


def test_gluon_layout_rule():
    """What the Gluon kernel's TMA descriptors can read: bf16 heads of 64 or 128, K/V heads contiguous (a view of a
    fused projection is), rows and base 16-byte aligned, groups up to the proven size; the switches refuse all."""
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    fused = torch.zeros(4, 3 * 2 * 128, dtype=torch.bfloat16)
    k, v = fused[:, 256:512].view(4, 2, 128), fused[:, 512:].view(4, 2, 128)
    assert A.gluon_layout_ok(q, k, v, 4)
    assert A.gluon_layout_ok(torch.zeros(4, 8, 64, dtype=torch.bfloat16), k[..., :64].contiguous(),
                             v[..., :64].contiguous(), 4)
    assert not A.gluon_layout_ok(q.float(), k.float(), v.float(), 4)
    assert not A.gluon_layout_ok(torch.zeros(4, 8, 96, dtype=torch.bfloat16), k[..., :96], v[..., :96], 4)
    assert not A.gluon_layout_ok(q, k, v, A.GLUON_MAX_GROUP + 1)
    assert not A.gluon_layout_ok(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, 4)  # heads not rows
    odd = torch.zeros(4 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 2, 128)  # 2-byte aligned base
    assert not A.gluon_layout_ok(q, odd, v, 4)
    assert not A.use_gluon(q, k, v, 4)  # not on a GPU


def test_use_gluon_switches(monkeypatch):
    """``RLREPRO_ATTENTION_GLUON=0`` and a forced ``RLREPRO_ATTENTION_CONFIG`` keep the Triton kernel (checked before
    anything else, so they hold on any machine)."""
    calls = []
    monkeypatch.setattr(A, "gluon_layout_ok", lambda *a: calls.append(1) or True)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("RLREPRO_ATTENTION_GLUON", "0")
    assert not A.use_gluon(q, q, q, 4) and not calls
    monkeypatch.delenv("RLREPRO_ATTENTION_GLUON")
    monkeypatch.setenv("RLREPRO_ATTENTION_CONFIG", "long")
    assert not A.use_gluon(q, q, q, 4) and not calls
    monkeypatch.delenv("RLREPRO_ATTENTION_CONFIG")
    A.use_gluon(q, q, q, 4)
    assert calls


def test_q_tma_rule(monkeypatch):
    """``GLW_QTMA=1`` (off by default in the 64-position order) has the producer load Q by TMA where its boxes
    can: 16-byte aligned rows of whole heads (a view of the fused q|k|v row is) and an unpadded GQA group; elsewhere
    the consumers load Q."""
    from rlrepro.kernels import gluon_attention_fwd as G
    q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("GLW_QTMA", raising=False)
    assert not G.q_tma(q, 4, 4, 32)
    monkeypatch.setenv("GLW_QTMA", "1")
    assert G.q_tma(q, 4, 4, 32) and G.q_tma(q, 1, 1, 128) and G.q_tma(q, 8, 8, 16)
    fused = torch.zeros(64, 48 * 128, dtype=torch.bfloat16)
    assert G.q_tma(fused[:, :32 * 128].view(64, 32, 128), 4, 4, 32)
    assert not G.q_tma(q, 3, 4, 32)  # a padded group: its padding rows are no head of Q
    odd = torch.zeros(64 * 32 * 128 + 1, dtype=torch.bfloat16)[1:].view(64, 32, 128)
    assert not G.q_tma(odd, 4, 4, 32)  # a 2-byte aligned base
    assert not G.q_tma(torch.zeros(64, 128, 32, dtype=torch.bfloat16).transpose(1, 2), 4, 4, 32)


def _case(lens, h, hkv, d, gen):
    n = sum(lens)
    q = torch.randn(n, h, d, device="cuda", generator=gen).mul_(2.0).to(torch.bfloat16)
    # K and V as views of one fused projection (the trainer's layout): heads contiguous, rows strided
    kv = torch.randn(n, 2 * hkv * d, device="cuda", generator=gen).to(torch.bfloat16)
    k = kv[:, :hkv * d].view(n, hkv, d)
    v = kv[:, hkv * d:].view(n, hkv, d)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("h,hkv", [(32, 8), (16, 8), (40, 8), (64, 8), (16, 16)],
                         ids=["gqa4", "gqa2", "gqa5", "gqa8", "mha"])
def test_gpu_gluon_forward_gives_the_triton_bits(h, hkv, d, order, monkeypatch):
    """In each reduction order (``RLREPRO_ATTENTION_ORDER``) the Gluon kernel gives that order's Triton bits."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = _case(LENS, h, hkv, d, gen)
    meta = AttentionMetadata.packed(LENS, device="cuda")
    assert A.pick_attention_config(q.shape[0], len(LENS), h // hkv, q.dtype, d) == A.ATTENTION_CONFIGS["long"]
    assert A.use_gluon(q, k, v, h // hkv)
    calls = []
    real = G.attention_fwd_gluon
    monkeypatch.setattr(G, "attention_fwd_gluon", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    og, lg = A.attention_fwd(q, k, v, meta, d ** -0.5, return_lse=True)
    assert calls, "the auto-picked long tile did not run the Gluon kernel"
    for name in ("long", "large"):
        ot, lt = A.attention_fwd(q, k, v, meta, d ** -0.5, config=A.ATTENTION_CONFIGS[name], return_lse=True)
        assert torch.equal(og, ot), f"out differs from the Triton {name!r} tile ({h}/{hkv}/{d}, seed {seed})"
        assert torch.equal(lg, lt), f"lse differs from the Triton {name!r} tile ({h}/{hkv}/{d}, seed {seed})"
    n_calls = len(calls)
    monkeypatch.setenv("RLREPRO_ATTENTION_GLUON", "0")
    off = A.attention_fwd(q, k, v, meta, d ** -0.5)
    assert len(calls) == n_calls and torch.equal(off, og)
    monkeypatch.delenv("RLREPRO_ATTENTION_GLUON")
    # the 2000-token sequence alone: the same rows as in the batch
    i = LENS.index(2000)
    sl = slice(sum(LENS[:i]), sum(LENS[:i + 1]))
    alone = A.attention_fwd(q[sl], k[sl], v[sl], AttentionMetadata.packed([2000], device="cuda"), d ** -0.5)
    assert len(calls) > n_calls and torch.equal(alone, og[sl]), f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
def test_gpu_gluon_forward_ignores_a_nonfinite_neighbour(order, monkeypatch):
    """A sequence does not see its packed neighbours' K/V, even where a last KV tile loads their rows: with two
    sequences' K all inf and V all NaN, the others give, through the Gluon kernel, finite rows equal to their bits
    alone (the Triton tiles' masked loads never read those rows; the Gluon kernel zeroes them in shared memory)."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = [300, 37, 2000, 100, 129]
    q, k, v = _case(lens, 32, 8, 128, gen)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    for bad in (1, 3):
        k[cu[bad]:cu[bad + 1]] = float("inf")
        v[cu[bad]:cu[bad + 1]] = float("nan")
    calls = []
    real = G.attention_fwd_gluon
    monkeypatch.setattr(G, "attention_fwd_gluon", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    out = A.attention_fwd(q, k, v, AttentionMetadata.packed(lens, device="cuda"), 0.09)
    assert calls, "the packed call did not run the Gluon kernel"
    for i in (0, 2, 4):
        sl = slice(cu[i], cu[i + 1])
        alone = A.attention_fwd(q[sl], k[sl], v[sl], AttentionMetadata.packed([lens[i]], device="cuda"), 0.09)
        assert torch.isfinite(out[sl]).all(), f"sequence {i} took a neighbour's non-finite values (seed {seed})"
        assert torch.equal(out[sl], alone), f"sequence {i} differs from its bits alone (seed {seed})"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
@pytest.mark.parametrize("qtma,persist,pp,meta,osm", [(1, 0, 0, 0, 1), (0, 0, 0, 0, 1), (1, 1, 0, 0, 1),
                                                      (1, 1, 1, 0, 0), (0, 1, 1, 0, 1), (1, 1, 1, 1, 1),
                                                      (1, 1, 0, 1, 0), (1, 0, 0, 1, 1)],
                         ids=["qtma", "qregs", "qtma-persist", "qtma-persist-pp-o4", "qregs-persist-pp",
                              "qtma-persist-pp-meta", "qtma-persist-meta-o4", "qtma-meta"])
def test_gpu_gluon_forward_q_loads_and_schedules_keep_the_bits(order, qtma, persist, pp, meta, osm, monkeypatch):
    """Q loaded by the producer's TMA (head-major rows, ``GLW_QTMA=1``) or by the consumers (``GLW_QTMA=0``), one
    program a work or persistent (``GLW_PERSIST``), with or without ping-pong (``GLW_PP``), the slot rows handed over
    by the producer (``GLW_META``), O through the Q buffer or not (``GLW_OSM``): the Triton bits, for Q
    as a strided view of the fused q|k|v projection (the trainer's layout) and for short sequences (16 x 1024
    and ragged ones around the 32-query boxes), in each reduction order."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    monkeypatch.setenv("GLW_QTMA", str(qtma))
    monkeypatch.setenv("GLW_PERSIST", str(persist))
    monkeypatch.setenv("GLW_PP", str(pp))
    monkeypatch.setenv("GLW_META", str(meta))  # the producer hands each work's slot row to the consumers
    monkeypatch.setenv("GLW_OSM", str(osm))  # O through the Q buffer (released after the epilogue) or not
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, hkv, d = 32, 8, 128
    calls = []
    real = G.attention_fwd_gluon
    monkeypatch.setattr(G, "attention_fwd_gluon", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    for lens in ([1024] * 16, [31, 33, 1, 64, 95, 2000, 97, 4100, 32]):
        n = sum(lens)
        qkv = torch.randn(n, (h + 2 * hkv) * d, device="cuda", generator=gen).to(torch.bfloat16)
        q = qkv[:, :h * d].view(n, h, d)
        k = qkv[:, h * d:(h + hkv) * d].view(n, hkv, d)
        v = qkv[:, (h + hkv) * d:].view(n, hkv, d)
        meta = AttentionMetadata.packed(lens, device="cuda")
        assert G.q_tma(q, 4, 4, 32) == bool(qtma)
        calls.clear()
        og, lg = A.attention_fwd(q, k, v, meta, d ** -0.5, return_lse=True)
        assert calls, f"{lens[:3]}...: the packed call did not run the Gluon kernel"
        ot, lt = A.attention_fwd(q, k, v, meta, d ** -0.5, config=A.ATTENTION_CONFIGS["large"], return_lse=True)
        assert torch.equal(og, ot), f"out differs from the Triton 'large' tile ({lens[:3]}..., seed {seed})"
        assert torch.equal(lg, lt), f"lse differs from the Triton 'large' tile ({lens[:3]}..., seed {seed})"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
@pytest.mark.parametrize("half,tmax,pp", [(1, 0, 0), (0, 1, 0), (1, 1, 1), (1, 1, 0)],
                         ids=["half", "tree-max", "half-tree-pp", "half-tree"])
def test_gpu_gluon_forward_half_tile_and_tree_max_keep_the_bits(order, half, tmax, pp, monkeypatch):
    """A work's last KV tile on its lower half alone where the upper half is past every query (``GLW_HALF``) and
    the row max as a tree (``GLW_TMAX``): the Triton bits (out and lse), for ragged lengths whose last tiles end in
    either half, 1-token and tile-sized sequences, and with two neighbours' K all inf and V all NaN (a sequence
    that ends inside a half tile zeroes the rows past it there)."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    for name, val in (("GLW_HALF", half), ("GLW_TMAX", tmax), ("GLW_PP", pp), ("GLW_PERSIST", 0), ("GLW_QTMA", 0),
                      ("GLW_META", 0), ("GLW_KVS", 0)):  # one program a work, Q by the consumers: HALF runs
        monkeypatch.setenv(name, str(val))
    assert G.half_tile(False) == half
    _ragged_and_nonfinite_equal_large(G, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("pp,persist,qtma_meta", [(1, 0, 0), (0, 0, 0), (1, 1, 1), (0, 1, 1)],
                         ids=["pp", "plain", "pp-persist-qtma-meta", "persist-qtma-meta"])
def test_gpu_gluon_forward_split_kv_release_keeps_the_bits(order, stages, pp, persist, qtma_meta, monkeypatch):
    """A ring stage's K buffer freed after its ``Q @ K^T`` and its V buffer after ``P @ V`` (``GLW_KVS``), with
    two or three stages (two give the persistent Q-by-TMA kernel a second Q buffer): the Triton bits (out and lse),
    for ragged lengths, tile-sized and 1-token sequences, and two neighbours' K all inf and V all NaN."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    for name, val in (("GLW_KVS", 1), ("GLW_PP", pp), ("GLW_PERSIST", persist), ("GLW_QTMA", qtma_meta),
                      ("GLW_META", qtma_meta)):
        monkeypatch.setenv(name, str(val))
    monkeypatch.setattr(G, "STAGES", stages)
    _ragged_and_nonfinite_equal_large(G, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
@pytest.mark.parametrize("qtma_meta,kvs", [(1, 1), (0, 0)], ids=["qtma-meta-kvs", "consumers-load"])
def test_gpu_gluon_forward_work_table_keeps_the_bits(order, qtma_meta, kvs, monkeypatch):
    """The persistent kernel reading each work's slot row from ``persistent_order``'s table (``GLW_TAB``: the
    producer, and the consumers where no META row is handed to them): the Triton bits (out and lse), for ragged
    lengths, tile-sized and 1-token sequences, and two neighbours' K all inf and V all NaN."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    for name, val in (("GLW_TAB", 1), ("GLW_PERSIST", 1), ("GLW_PP", 0), ("GLW_QTMA", qtma_meta),
                      ("GLW_META", qtma_meta), ("GLW_KVS", kvs)):
        monkeypatch.setenv(name, str(val))
    _ragged_and_nonfinite_equal_large(G, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("order", ["64", "128f"])
@pytest.mark.parametrize("data", ["random", "sink", "rising"])
def test_gpu_gluon_forward_skipped_rescale_keeps_the_bits(order, data, monkeypatch):
    """``GLW_SKIP=1``: a warp whose rows' max did not grow on a tile skips the accumulator's rescale. The Triton
    bits (out and lse, ``torch.equal``) on the default variants where the skip is sometimes taken (``random``),
    taken on every tile after the first (``sink``: every query's largest score is on its sequence's first key) and
    never (``rising``: the scores grow with the key's position, so every tile raises every row's max); and the
    ragged / non-finite battery."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
    monkeypatch.setenv("GLW_SKIP", "1")
    for name in ("GLW_PERSIST", "GLW_QTMA", "GLW_META", "GLW_KVS", "GLW_TAB", "GLW_PP"):
        monkeypatch.delenv(name, raising=False)  # the defaults (FAST for these lengths)
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = [2048, 31, 1, 513, 4100, 64, 65, 300]
    q, k, v = _case(lens, 32, 8, 128, gen)
    attention_data(data, q, k, lens)
    meta = AttentionMetadata.packed(lens, device="cuda")
    og, lg = A.attention_fwd(q, k, v, meta, 128 ** -0.5, return_lse=True)
    ot, lt = A.attention_fwd(q, k, v, meta, 128 ** -0.5, config=A.ATTENTION_CONFIGS["large"], return_lse=True)
    assert torch.equal(og, ot), f"out differs from the Triton 'large' tile ({data}, {order}, seed {seed})"
    assert torch.equal(lg, lt), f"lse differs from the Triton 'large' tile ({data}, {order}, seed {seed})"
    if data == "random":
        _ragged_and_nonfinite_equal_large(G, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_gluon(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
@pytest.mark.parametrize("data", ["random", "sink", "rising"])
@pytest.mark.parametrize("d,kvs,h", [(128, 1, 32), (64, 1, 32), (128, 0, 64), (128, 1, 16)],
                         ids=["d128-kvs-gqa4", "d64-kvs-gqa4", "d128-gqa8", "d128-kvs-mha"])
def test_gpu_gluon_forward_paired_tiles_keep_the_bits(data, d, kvs, h, monkeypatch):
    """``GLW_QK2=1`` (the 64-position order): two KV tiles a ring stage, their ``Q @ K^T`` issued together, the two
    softmax steps and ``P @ V`` products one after the other. The Triton bits (out and lse, ``torch.equal``) for
    works of odd and even tile counts, sequences ending in a pair's first or second tile, with the rescale skipped
    often, always or never (``data``), K and V freed apart or together; and the ragged / non-finite battery."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "64")
    monkeypatch.setenv("GLW_QK2", "1")
    monkeypatch.setenv("GLW_KVS", str(kvs))
    for name in ("GLW_PERSIST", "GLW_QTMA", "GLW_META", "GLW_TAB", "GLW_PP", "GLW_SKIP", "GLW_HOLD"):
        monkeypatch.delenv(name, raising=False)  # the defaults (FAST and FAST_64 for these lengths)
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens = [2048, 31, 1, 513, 4100, 64, 65, 128, 129, 191, 192, 300]
    q, k, v = _case(lens, h, 16 if h == 16 else 8, d, gen)
    attention_data(data, q, k, lens)
    meta = AttentionMetadata.packed(lens, device="cuda")
    assert G.pair_tiles(64, True) == 1 and A.use_gluon(q, k, v, h // k.shape[1])
    calls = []
    real = G.attention_fwd_gluon
    monkeypatch.setattr(G, "attention_fwd_gluon",
                        lambda *a, **kw: (calls.append(kw.get("block_kv")), real(*a, **kw))[1])
    og, lg = A.attention_fwd(q, k, v, meta, d ** -0.5, return_lse=True)
    assert calls == [64], f"the auto-picked tile did not run the Gluon kernel in the 64-position order: {calls}"
    monkeypatch.setattr(G, "attention_fwd_gluon", real)
    ot, lt = A.attention_fwd(q, k, v, meta, d ** -0.5, config=A.ATTENTION_CONFIGS["large"], return_lse=True)
    assert torch.equal(og, ot), f"out differs from the Triton 'large' tile ({data}, d {d}, seed {seed})"
    assert torch.equal(lg, lt), f"lse differs from the Triton 'large' tile ({data}, d {d}, seed {seed})"
    if data == "random" and d == 128:
        _ragged_and_nonfinite_equal_large(G, monkeypatch)


def test_attention_data_kinds_set_the_row_max_where_meant():
    """The inputs of the skip test: with ``sink`` every query's largest causal score is its sequence's first key
    (the skip is taken on every later tile), with ``rising`` every 64-position tile raises every row's max (never
    taken); on the CPU, with the GPU test's scale and head layout."""
    lens = [200, 1, 130]
    gen = torch.Generator().manual_seed(3)
    for kind in ("sink", "rising"):
        q = (torch.randn(sum(lens), 4, 128, generator=gen) * 2.0).to(torch.bfloat16)
        k = torch.randn(sum(lens), 1, 128, generator=gen).to(torch.bfloat16)
        attention_data(kind, q, k, lens)
        start = 0
        for n in lens:
            s = torch.einsum("qhd,kd->hqk", q[start:start + n].float(), k[start:start + n, 0].float()) * 128 ** -0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            if kind == "sink":
                assert (s.argmax(-1) == 0).all(), f"sink: a row's max is not on its first key (len {n})"
            else:
                tiles = s.split(64, dim=-1)
                for t in range(1, len(tiles)):
                    rows = torch.arange(t * 64, n)  # the rows that see tile t
                    before = torch.cat(tiles[:t], -1)[:, rows].amax(-1)
                    assert (tiles[t][:, rows].amax(-1) > before).all(), f"rising: tile {t} kept a max (len {n})"
            start += n
    with pytest.raises(ValueError, match="random, sink or rising"):
        attention_data("flat", q, k, lens)


def test_skipped_rescale_and_hold_asm():
    """The PTX behind ``GLW_SKIP``: each of a thread's ``pack`` outputs is its own input (tied) times its alpha
    operand, under one warp-uniform branch on the vote operand; the vote ORs the thread's two rows across the warp.
    Behind ``GLW_HOLD``: the row sums unchanged, after a one-pass loop (a block boundary for ptxas)."""
    from rlrepro.kernels import gluon_attention_parts as P
    for pack in (32, 64):
        asm, cons = P._rescale_asm(pack)
        parts = cons.split(",")
        assert parts == ["=f"] * pack + [str(i) for i in range(pack)] + ["f"] * pack + ["r"] * pack
        muls = [line for line in asm.splitlines() if line.startswith("mul.rn.f32")]
        assert muls == [f"mul.rn.f32 ${i}, ${i}, ${2 * pack + i};" for i in range(pack)]
        assert f"setp.eq.s32 keep, ${3 * pack}, 0;" in asm and "@keep bra.uni done;" in asm
        assert asm.index("bra.uni done") < asm.index("mul.rn") < asm.index("done:")
    vote = P._ANY_ROW_RESCALED_S
    assert "setp.neu.f32 a, $2, 0f3F800000;" in vote and "setp.neu.f32 b, $3, 0f3F800000;" in vote
    assert "or.pred a, a, b;" in vote and "vote.sync.any.pred a, a, 0xffffffff;" in vote
    # GLW_HOLD: the two values pass through unchanged behind a loop on the clock that runs once
    lines = [line.strip() for line in P._HOLD_S.splitlines()]
    assert lines[lines.index("again:") + 1:lines.index("again:") + 4] == [
        "mov.u32 c, %clock;", "setp.eq.u32 q, c, 0xffffffff;", "@q bra again;"]
    assert "mov.b32 $0, $2;" in lines and "mov.b32 $1, $3;" in lines


def _ragged_and_nonfinite_equal_large(G, monkeypatch):
    """The Gluon kernel (as the environment sets it) against the Triton "large" tile, ``torch.equal`` on out and
    lse, on ragged lengths and on a batch whose sequences 1 and 3 have K all inf and V all NaN."""
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    calls = []
    real = G.attention_fwd_gluon
    monkeypatch.setattr(G, "attention_fwd_gluon", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    for lens, bad in (([1024] * 4 + [31, 33, 1, 64, 95, 2000, 97, 4100, 32, 129, 191, 300], ()),
                      ([300, 37, 2000, 100, 129, 45], (1, 3))):
        q, k, v = _case(lens, 32, 8, 128, gen)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        for i in bad:
            k[cu[i]:cu[i + 1]] = float("inf")
            v[cu[i]:cu[i + 1]] = float("nan")
        meta = AttentionMetadata.packed(lens, device="cuda")
        calls.clear()
        og, lg = A.attention_fwd(q, k, v, meta, 128 ** -0.5, return_lse=True)
        assert calls, f"{lens[:3]}...: the packed call did not run the Gluon kernel"
        ot, lt = A.attention_fwd(q, k, v, meta, 128 ** -0.5, config=A.ATTENTION_CONFIGS["large"], return_lse=True)
        good = torch.ones(sum(lens), dtype=torch.bool, device="cuda")
        for i in bad:
            good[cu[i]:cu[i + 1]] = False
        assert torch.isfinite(og[good]).all(), f"a neighbour's non-finite values leaked in (seed {seed})"
        assert torch.equal(og[good], ot[good]), f"out differs from the Triton 'large' tile ({lens[:3]}..., seed {seed})"
        assert torch.equal(lg[good], lt[good]), f"lse differs from the Triton 'large' tile ({lens[:3]}..., seed {seed})"


def test_variant_defaults_by_order(monkeypatch):
    """Both orders run persistent, Q by TMA, META, K freed apart from V and the work table by default where the
    sequences average under ``LONG_MEAN`` tokens (the 64-position order since session 39, with the skipped rescale
    and the held wait since session 40), on the deepest ring that
    leaves room for two Q buffers: two stages of 128-position tiles, three of 64-position ones; longer sequences none
    of them, on three; each switch follows the environment where it is set."""
    from rlrepro.kernels import gluon_attention_fwd as G
    for name in ("GLW_PERSIST", "GLW_QTMA", "GLW_META", "GLW_KVS", "GLW_TAB", "GLW_PP", "GLW_KV2"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(G, "STAGES", None)
    long = G.LONG_MEAN
    assert G.fast_defaults(4 * 2048, 4) and G.fast_defaults(16 * 1024, 16) and G.fast_defaults(8192, None)
    assert G.fast_defaults(2 * long - 1, 2) and not G.fast_defaults(2 * long, 2) and not G.fast_defaults(16384, 1)
    names = ("GLW_PERSIST", "GLW_QTMA", "GLW_META", "GLW_KVS", "GLW_TAB", "GLW_PP")
    assert [G.flag(k, True) for k in names] == [1, 1, 1, 1, 1, 0]
    assert [G.flag(k, False) for k in names] == [0, 0, 0, 0, 0, 0]
    # the 64-position order adds the skipped rescale and the held wait; 128f and long sequences do not
    for name in ("GLW_SKIP", "GLW_HOLD"):
        monkeypatch.delenv(name, raising=False)
        assert (G.flag(name, True, 64), G.flag(name, True, 128), G.flag(name, False, 64)) == (1, 0, 0)
        monkeypatch.setenv(name, "0")
        assert G.flag(name, True, 64) == 0
        monkeypatch.delenv(name)
    assert (G.ring_stages(True, 128), G.ring_stages(True, 64), G.ring_stages(False, 128)) == (2, 3, 3)
    assert G.ring_stages(True, 128, 64) == 3  # D = 64: three 128-position stages leave room for two Q buffers
    for block_kv, d in ((128, 128), (64, 128), (128, 64), (64, 64)):  # the kernel's rule for two Q buffers agrees
        ring = G.ring_stages(True, block_kv, d) * 2 * block_kv * d * 2
        assert ring + 4 * G.ROWS * d * 2 <= G.Q_ROOM, (block_kv, d)
    q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)
    assert G.q_tma(q, 4, 4, 32, True) and not G.q_tma(q, 4, 4, 32, False)
    monkeypatch.setenv("GLW_KVS", "0")  # K and V freed together: two stages would stall every tile
    assert G.flag("GLW_KVS", True) == 0 and G.ring_stages(True, 128) == 3
    monkeypatch.setenv("GLW_KVS", "1")
    monkeypatch.setenv("GLW_PERSIST", "0")
    assert G.ring_stages(False, 128) == 2 and G.flag("GLW_PERSIST", True) == 0
    monkeypatch.setattr(G, "STAGES", 4)
    assert G.ring_stages(True, 64) == 4


def test_paired_tiles_switch(monkeypatch):
    """``GLW_QK2`` (two 64-position tiles a ring stage, one ``Q @ K^T`` issue for both) is off unless set, and only
    ever on in the 64-position order; its ring is sized for pairs: two stages of two tiles where K and V are freed
    apart, with room left for two Q buffers at D = 128."""
    from rlrepro.kernels import gluon_attention_fwd as G
    monkeypatch.delenv("GLW_QK2", raising=False)
    monkeypatch.setattr(G, "STAGES", None)
    assert (G.pair_tiles(64, True), G.pair_tiles(64, False), G.pair_tiles(128, True)) == (0, 0, 0)
    monkeypatch.setenv("GLW_QK2", "1")
    assert (G.pair_tiles(64, True), G.pair_tiles(64, False), G.pair_tiles(128, True)) == (1, 1, 0)
    monkeypatch.setenv("GLW_KVS", "1")
    monkeypatch.delenv("GLW_KV2", raising=False)
    assert G.ring_stages(True, 2 * 64) == 2
    assert G.ring_stages(True, 2 * 64) * 2 * 128 * 128 * 2 + 4 * G.ROWS * 128 * 2 <= G.Q_ROOM
    monkeypatch.setenv("GLW_PP", "1")
    q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="GLW_QK2=1 .* does not ping-pong; unset GLW_PP"):
        G.attention_fwd_gluon(q, q[:, :8], q[:, :8], torch.tensor([0, 64], dtype=torch.int32),
                              torch.tensor([64], dtype=torch.int32), (1, None, None), 0.1, 4, 4, 32, q, None)


def test_dispatch_passes_the_sequence_count(monkeypatch):
    """``attention_fwd`` hands the Gluon forward the call's sequence count (``n_seqs``), which picks the 128-position
    defaults (:func:`fast_defaults`): four 2k sequences get ``FAST`` in either order, one 16k sequence does not; the
    order's tile and FMA pass on too."""
    from rlrepro.kernels import gluon_attention_fwd as G
    got = []
    monkeypatch.setattr(A, "use_gluon", lambda *a: True)
    monkeypatch.setattr(A, "_device_schedule", lambda *a, **kw: (1, None, None))
    monkeypatch.setattr(G, "attention_fwd_gluon", lambda q, *a, **kw: got.append((q.shape[0], kw)))
    monkeypatch.delenv("RLREPRO_ATTENTION_CONFIG", raising=False)
    for order, lens, fast in (("128f", [2048] * 4, True), ("128f", [16384], False), ("64", [2048] * 4, True),
                              ("64", [16384], False)):
        monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", order)
        q = torch.zeros(sum(lens), 8, 128, dtype=torch.bfloat16)
        kv = torch.zeros(sum(lens), 2, 128, dtype=torch.bfloat16)
        A.attention_fwd(q, kv, kv, AttentionMetadata.packed(lens), 0.1)
        n, kw = got.pop()
        assert kw["n_seqs"] == len(lens) and (kw["block_kv"], kw["fma"]) == A.attention_order()
        assert G.fast_defaults(n, kw["n_seqs"]) == fast, (order, lens)


def test_half_tile_rule(monkeypatch):
    """``GLW_HALF=1`` turns the half-width last tile on, except with two tiles a ring stage, with Q loaded by TMA
    and released before the last tile (``GLW_OSM=0``) or into two Q buffers."""
    from rlrepro.kernels import gluon_attention_fwd as G
    if not G.HAVE_GLUON:
        pytest.skip("Triton without Gluon")
    monkeypatch.delenv("GLW_HALF", raising=False)
    monkeypatch.delenv("GLW_KV2", raising=False)
    monkeypatch.delenv("GLW_OSM", raising=False)
    assert G.half_tile(False) == 0
    monkeypatch.setenv("GLW_HALF", "1")
    assert G.half_tile(False) == 1 and G.half_tile(True) == 1  # Q by TMA, released after O went through it
    assert G.half_tile(True, 2) == 0  # two Q buffers (D = 64): differed on an H100 (BENCHMARKS, 35th session)
    monkeypatch.setenv("GLW_OSM", "0")
    assert G.half_tile(False) == 1 and G.half_tile(True) == 0  # Q by TMA released after the last whole tile
    monkeypatch.setenv("GLW_KV2", "1")
    assert G.half_tile(False) == 0


INTERP_CHECKS: dict = {}


def check_persistent_order():
    """``persistent_order`` (``GLW_PERSIST=1``): every slot of the schedule once, by KV tiles most first, ties by slot,
    empty slots last, for ragged batches with more slots than one program's chunk (128)."""
    from rlrepro.kernels import gluon_attention_fwd as G
    fresh_seed()
    for lens, block_q in (([300, 129, 1, 77, 2000, 64, 65], 32), ([17] * 150 + [4096], 16), ([1], 64)):
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        sched = A._device_schedule(cu, len(lens), sum(lens), block_q)
        order = G.persistent_order(sched, cu, seq_lens, block_q).tolist()
        g_slots, prog_seq, prog_q0 = sched
        tiles = []
        for seq, q0 in zip(prog_seq.tolist(), prog_q0.tolist()):
            tiles.append(0 if seq < 0 else (min(q0 + block_q, lens[seq]) - 1) // G.BLOCK_KV + 1)
        assert order == sorted(range(g_slots), key=lambda i: (-tiles[i], i)), (lens, block_q)
        # GLW_TAB's table: row k is the k-th slot's (seq, q0, cu0, q_len, first_pos, n_tiles, n_full, 0)
        for block_kv in (G.BLOCK_KV, 128):
            order = G.persistent_order(sched, cu, seq_lens, block_q, block_kv).tolist()
            table = G.persistent_order(sched, cu, seq_lens, block_q, block_kv, table=True)
            assert table.shape == (g_slots, 8) and table.dtype == torch.int32
            for k, slot in enumerate(order):
                seq, q0 = prog_seq[slot].item(), prog_q0[slot].item()
                if seq < 0:
                    want = [-1, q0, 0, lens[0], 0, 0, 0, 0]  # sequence 0's values, no tiles
                else:
                    last = min(q0 + block_q, lens[seq]) - 1
                    n_tiles = last // block_kv + 1
                    want = [seq, q0, sum(lens[:seq]), lens[seq], 0, n_tiles, min((q0 + 1) // block_kv, n_tiles), 0]
                assert table[k].tolist() == want, (lens, block_q, block_kv, k, slot)


INTERP_CHECKS[check_persistent_order.__name__] = check_persistent_order
interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)

if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
