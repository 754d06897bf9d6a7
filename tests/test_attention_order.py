"""The attention forward's reduction orders (issue #27, ``RLREPRO_ATTENTION_ORDER``): ``64`` (the default:
64-position softmax steps, ``s = qk * scale`` then ``s - m``) and ``128f`` (128-position steps, the scale folded
into one multiply-add, as FlashAttention-3 computes). Within one order every promise holds bit for bit: packed ==
each sequence alone == reordered == paged (one step, chunked prefill, decode), every tile config, and the Gluon
kernel == the Triton kernel; the two orders differ in bits, and the variable is recorded as one that changes bits.

CPU: the variable's parsing and errors, the auto tile per order, the record; Triton's interpreter runs the
invariance battery in ``128f`` around the 128-position tiles. GPU (``-m gpu``): the battery, every tile config,
the Gluon kernel's bits and engine == trainer at an 8k-token context, all in ``128f``.
"""
from __future__ import annotations

import os

import pytest
import torch

from _triton_helpers import fresh_seed, interpreter_test_items, main, rel_err
from rlrepro.kernels import reference as ref
from rlrepro.kernels import triton_attention_fwd as A
from rlrepro.kernels.metadata import AttentionMetadata


def test_order_variable_parsed_and_refused(monkeypatch):
    monkeypatch.delenv("RLREPRO_ATTENTION_ORDER", raising=False)
    assert A.attention_order() == A.ATTENTION_ORDERS[A.DEFAULT_ORDER] == (64, False)
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128f")
    assert A.attention_order() == (128, True)
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", " 64 ")
    assert A.attention_order() == (64, False)
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128")
    with pytest.raises(ValueError, match=r"RLREPRO_ATTENTION_ORDER='128' is not one of \['128f', '64'\].*unset"):
        A.attention_order()


def test_fa3_mode_refuses_an_order(monkeypatch):
    """``RLREPRO_ATTENTION=fa3`` computes in FA3's own order: an order set beside it is refused, not ignored."""
    from rlrepro.kernels import fa3_attention
    monkeypatch.setenv("RLREPRO_ATTENTION", "fa3")
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128f")
    with pytest.raises(ValueError, match="RLREPRO_ATTENTION=fa3 computes in FA3's own order.*unset one of the two"):
        fa3_attention.requested()
    monkeypatch.delenv("RLREPRO_ATTENTION_ORDER")
    assert fa3_attention.requested()
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128f")
    monkeypatch.setenv("RLREPRO_ATTENTION", "triton")
    assert not fa3_attention.requested()


def test_auto_tile_per_order():
    """64: the pick stands. 128f: "large" for the 128- and 256-row picks (16-bit, heads up to 128), "small1"
    otherwise; K and V tiles that cannot fit shared memory are refused with the fix."""
    cfgs = A.ATTENTION_CONFIGS
    for name, cfg in cfgs.items():
        assert A.config_for_order(cfg, 64) is cfg, name
    assert A.config_for_order(cfgs["long"], 128) == cfgs["large"]
    assert A.config_for_order(cfgs["large"], 128) == cfgs["large"]
    for name in ("decode", "small"):
        assert A.config_for_order(cfgs[name], 128) == cfgs["small1"] == A.AttentionConfig(64, 4, 1)
    assert A.config_for_order(cfgs["large"], 128, element_size=4) == cfgs["small1"]
    assert A.config_for_order(cfgs["long"], 128, head_dim=256) == cfgs["small1"]
    with pytest.raises(ValueError, match="32-bit heads of 256.*unset RLREPRO_ATTENTION_ORDER"):
        A.config_for_order(cfgs["small"], 128, element_size=4, head_dim=256)


def test_order_variable_is_recorded_as_changing_bits():
    from rlrepro.repro import inputs
    bits, info = inputs._env({"RLREPRO_ATTENTION_ORDER": "128f", "HOME": "/x"})
    assert bits == {"RLREPRO_ATTENTION_ORDER": "128f"} and "RLREPRO_ATTENTION_ORDER" not in info


# ============================================================================================ CPU: interpreter
INTERP_CHECKS: dict = {}


def _with_order(order: str):
    def wrap(fn):
        def run():
            old = os.environ.get("RLREPRO_ATTENTION_ORDER")
            os.environ["RLREPRO_ATTENTION_ORDER"] = order
            try:
                fn()
            finally:
                if old is None:
                    del os.environ["RLREPRO_ATTENTION_ORDER"]
                else:
                    os.environ["RLREPRO_ATTENTION_ORDER"] = old
        INTERP_CHECKS[fn.__name__] = run
        return fn
    return wrap


@_with_order("128f")
def check_invariance_128f():
    """The battery around the 128-position KV tiles (127/128/129, 255-257 tokens), GQA 3 padded to 4, a head of 24
    padded to 32: packed == alone == reordered == paged in blocks of 4 and 16 (one step, chunked, decode), and
    close to the float64 reference."""
    from test_triton_kernels import check_attention_invariance

    from rlrepro.kernels import triton_ops as T
    check_attention_invariance(T.attention, [129, 5, 1, 128, 257, 127], h=6, hkv=2, d=24, dtype=torch.float32,
                               device="cpu", block_sizes=(4, 16), tol=1e-5)


@_with_order("128f")
def check_every_tile_128f():
    """Every tile config, forced, gives the auto tile's bits in 128f; the 256-row one at its query blocks' edges."""
    from test_triton_kernels import make_paged_case
    fresh_seed()
    lens = [300, 129, 1, 77]
    q, k, v = make_paged_case(lens, 8, 2, 16, torch.float32, "cpu")
    meta = AttentionMetadata.packed(lens)
    auto = A.attention_fwd(q, k, v, meta, 0.3)
    for name, cfg in A.ATTENTION_CONFIGS.items():
        assert torch.equal(A.attention_fwd(q, k, v, meta, 0.3, config=cfg), auto), name
    assert rel_err(auto, ref.attention_packed(q, k, v, meta, 0.3)) < 1e-5


def check_orders_differ_in_bits():
    """The two orders give other bits (both close to the reference): a run's order is part of its inputs."""
    from test_triton_kernels import make_paged_case
    fresh_seed()
    lens = [300, 40]
    q, k, v = make_paged_case(lens, 4, 2, 16, torch.float32, "cpu")
    meta = AttentionMetadata.packed(lens)
    outs = {}
    for order in ("64", "128f"):
        os.environ["RLREPRO_ATTENTION_ORDER"] = order
        try:
            outs[order] = A.attention_fwd(q, k, v, meta, 0.3)
        finally:
            del os.environ["RLREPRO_ATTENTION_ORDER"]
        assert rel_err(outs[order], ref.attention_packed(q, k, v, meta, 0.3)) < 1e-5, order
    assert not torch.equal(outs["64"], outs["128f"])


INTERP_CHECKS[check_orders_differ_in_bits.__name__] = check_orders_differ_in_bits
interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)


# ============================================================================================ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
def test_gpu_128f_battery_and_tiles(h, hkv, monkeypatch):
    """128f on CUDA: every tile config the same bits (the 16-row one-warp tile, the 256-row one at two stages, the
    Gluon kernel through the auto pick of packed calls on Hopper); the battery at the tile boundaries with the
    128- and 256-row picks switched in at 64 tokens."""
    from test_attention_gpu_long import BOUNDARY_LENS
    from test_triton_kernels import check_attention_invariance, make_paged_case

    from rlrepro.kernels import triton_ops as T
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128f")
    seed = fresh_seed()
    lens = [300, 129, 1, 77, 2000, 255, 256, 257]
    q, k, v = make_paged_case(lens, h, hkv, 128, torch.bfloat16, "cuda")
    meta = AttentionMetadata.packed(lens, device="cuda")
    auto, auto_lse = A.attention_fwd(q, k, v, meta, 0.09, return_lse=True)
    for name, cfg in A.ATTENTION_CONFIGS.items():
        out, lse = A.attention_fwd(q, k, v, meta, 0.09, config=cfg, return_lse=True)
        assert torch.equal(out, auto) and torch.equal(lse, auto_lse), f"{name} differs (seed {seed})"
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "64")
    assert not torch.equal(A.attention_fwd(q, k, v, meta, 0.09), auto)
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128f")
    monkeypatch.setattr(A, "LARGE_MIN_TOKENS", 64)
    monkeypatch.setattr(A, "LONG_MIN_QUERIES", 16)
    check_attention_invariance(T.attention, BOUNDARY_LENS, h=h, hkv=hkv, d=128, dtype=torch.bfloat16,
                               device="cuda", block_sizes=(16, 64), tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_128f_engine_equals_trainer_at_8k_context(monkeypatch):
    from test_attention_gpu_long import test_gpu_engine_equals_trainer_at_8k_context as same_at_8k
    monkeypatch.setenv("RLREPRO_ATTENTION_ORDER", "128f")
    same_at_8k()


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
