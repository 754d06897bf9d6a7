"""Session 30 review: CPU kernels and attention metadata (layout independence, validation with clear errors)."""
import math

import pytest
import torch

from rlrepro import kernels
from rlrepro.kernels import AttentionMetadata, cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,n", [(17, 31), (64, 131), (1024, 60)])
def test_linear_bits_do_not_depend_on_the_weights_memory_layout(dtype, k, n):
    # a weight held as a transposed view (same values) took another GEMM route and gave other bits
    torch.manual_seed(0)
    w = torch.randn(n, k).to(dtype)
    w_view = w.t().contiguous().t()
    assert not w_view.is_contiguous() and torch.equal(w_view, w)
    x = torch.randn(5, k).to(dtype)
    assert torch.equal(kernels.linear(x, w_view), kernels.linear(x, w))
    assert torch.equal(kernels.linear(x[:1], w_view), kernels.linear(x, w)[:1])


def test_linear_with_a_transposed_weight_still_trains():
    torch.manual_seed(0)
    w = torch.randn(31, 17).t().contiguous().t().requires_grad_()
    x = torch.randn(4, 17, requires_grad=True)
    kernels.linear(x, w).sum().backward()
    ref_w = w.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(ref_x.double(), ref_w.double()).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)


def test_linear_names_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(3, 4\).*\[out_features, in_features\]"):
        kernels.linear(torch.randn(2, 5), torch.randn(3, 4))
    with pytest.raises(ValueError, match="x is torch.float32 but the weight is torch.bfloat16; cast"):
        kernels.linear(torch.randn(2, 4), torch.randn(3, 4).bfloat16())


def test_embedding_refuses_negative_and_non_integer_ids_on_cpu():
    w = torch.randn(5, 3)
    assert torch.equal(kernels.embedding(torch.tensor([4, 0]), w), w[[4, 0]])
    with pytest.raises(ValueError, match=r"\[0, 5\); got min -1"):  # used to return the last row silently
        kernels.embedding(torch.tensor([2, -1]), w)
    with pytest.raises(ValueError, match=r"\[0, 5\); got min 0, max 5"):
        kernels.embedding(torch.tensor([0, 5]), w)
    with pytest.raises(ValueError, match="integer tensor.*torch.float32"):
        kernels.embedding(torch.tensor([1.0]), w)
    with pytest.raises(ValueError, match="integer tensor.*torch.bool"):
        kernels.embedding(torch.tensor([True, False, True, False, True]), w)
    with kernels.mode("fast"):  # the fast mode shares this gather
        with pytest.raises(ValueError, match="got min -1"):
            kernels.embedding(torch.tensor([-1]), w)


def test_silu_and_mul_names_an_odd_last_dim():
    with pytest.raises(ValueError, match=r"\(2, 5\).*must be even"):
        kernels.silu_and_mul(torch.randn(2, 5))


def test_nan_temperature_is_refused_not_taken_as_greedy():
    logits, ids = torch.randn(2, 7), torch.tensor([1, 3])
    with pytest.raises(ValueError, match="temperature=nan"):
        kernels.token_logprob(logits, ids, float("nan"))
    with pytest.raises(ValueError, match="temperature=nan"):
        kernels.scale_logits(logits, math.nan)
    # the documented conventions stay: <= 0 reports the untempered distribution, 1 skips the division
    assert torch.equal(kernels.token_logprob(logits, ids, 0.0), kernels.token_logprob(logits, ids, 1.0))
    assert torch.equal(kernels.token_logprob(logits, ids, -1.0), kernels.token_logprob(logits, ids, 1.0))


def _qkv(n, h, hkv, d):
    torch.manual_seed(1)
    return torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)


def test_attention_names_bad_head_layouts_and_token_counts():
    q, k, v = _qkv(3, 3, 2, 8)
    with pytest.raises(ValueError, match=r"Hkv \(2\) dividing H \(3\)"):
        kernels.attention(q, k, v, AttentionMetadata.packed([3]), 1.0)
    q, k, v = _qkv(3, 2, 2, 8)
    with pytest.raises(ValueError, match=r"same N and D"):
        kernels.attention(q, k[..., :6], v[..., :6], AttentionMetadata.packed([3]), 1.0)
    with pytest.raises(ValueError, match="3 query tokens but the metadata describes 4"):
        kernels.attention(q, k, v, AttentionMetadata.packed([4]), 1.0)
    cache = (torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))
    with pytest.raises(ValueError, match="needs paged metadata"):
        kernels.attention(q, k, v, AttentionMetadata.packed([3]), 1.0, cache)
    with pytest.raises(ValueError, match=r"key cache has shape \(4, 4, 1, 8\)"):
        kernels.attention(q, k, v, AttentionMetadata.paged([3], [3], [[0]], 4), 1.0,
                          (torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)))


def test_attention_good_calls_unchanged_and_batch_invariant():
    lens = [5, 1, 33]
    n = sum(lens)
    q, k, v = _qkv(n, 4, 2, 24)  # head size not a power of two
    full = kernels.attention(q, k, v, AttentionMetadata.packed(lens), 24 ** -0.5)
    assert torch.equal(kernels.attention(q[6:], k[6:], v[6:], AttentionMetadata.packed([33]), 24 ** -0.5), full[6:])
    assert torch.equal(kernels.attention(q[5:6], k[5:6], v[5:6], AttentionMetadata.packed([1]), 24 ** -0.5),
                       full[5:6])


def test_paged_metadata_refuses_an_empty_step_with_a_clear_message():
    with pytest.raises(ValueError, match="at least one sequence"):  # was "max() arg is an empty sequence"
        AttentionMetadata.paged([], [], [], 16)


@pytest.mark.parametrize("bs", [0, -4])
def test_paged_metadata_refuses_a_non_positive_block_size(bs):
    with pytest.raises(ValueError, match=f"block_size must be a positive integer, got {bs}"):
        AttentionMetadata.paged([1], [1], [[0]], bs)


def test_paged_metadata_refuses_negative_block_ids():
    # a negative id in a prefix block was read as a block from the end of the cache, silently
    with pytest.raises(ValueError, match=r"block ids must be >= 0.*\[\[-1, 2\]\]"):
        AttentionMetadata.paged([1], [6], [[-1, 2]], 4)


def test_paged_metadata_names_a_short_block_table_and_its_need():
    with pytest.raises(ValueError, match="1 blocks of 4 for 6 tokens; its block table needs at least 2 blocks"):
        AttentionMetadata.paged([1], [6], [[3]], 4)
    with pytest.raises(ValueError, match="1 <= query_len <= seq_len"):
        AttentionMetadata.paged([7], [6], [[3, 1]], 4)


@pytest.mark.parametrize("lens", [[2.5], [True, 2], ["3"]])
def test_packed_metadata_refuses_non_integer_lengths(lens):
    # [2.5] was truncated to a 2-token sequence with max_seq_len 2.5; True was a 1-token sequence
    with pytest.raises(ValueError, match="seq_lens must hold integers"):
        AttentionMetadata.packed(lens)


def test_paged_metadata_refuses_non_integer_lengths_and_takes_integer_scalars():
    with pytest.raises(ValueError, match="query_lens must hold integers, got 1.5"):
        AttentionMetadata.paged([1.5], [2], [[0]], 4)
    np = pytest.importorskip("numpy")
    a = AttentionMetadata.paged([np.int64(2)], [torch.tensor(5)], [[1, 3]], np.int64(4))
    b = AttentionMetadata.paged([2], [5], [[1, 3]], 4)
    assert a.max_seq_len == b.max_seq_len == 5 and type(a.max_seq_len) is int and a.block_size == 4
    assert torch.equal(a.slot_mapping, b.slot_mapping) and torch.equal(a.positions, b.positions)
    p = AttentionMetadata.packed([np.int64(3), 2])
    assert type(p.max_seq_len) is int and p.max_seq_len == 3


def test_mode_nesting_threads_and_errors():
    import threading

    seen = {}
    with kernels.mode("fast"):
        with kernels.mode("deterministic"):
            assert kernels.current_mode() == "deterministic"
            with pytest.raises(RuntimeError):
                with kernels.mode("fast"):
                    raise RuntimeError("boom")
            assert kernels.current_mode() == "deterministic"
        assert kernels.current_mode() == "fast"
        t = threading.Thread(target=lambda: seen.setdefault("other", kernels.current_mode()))
        t.start()
        t.join()
    assert kernels.current_mode() == "deterministic"
    assert seen["other"] == "deterministic"  # per thread: another thread does not see this one's mode
    with pytest.raises(ValueError, match="unknown kernel mode 'Fast'"):
        with kernels.mode("Fast"):
            pass
    assert kernels.current_mode() == "deterministic"
