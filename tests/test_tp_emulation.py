"""Order-fixed tensor parallelism (rlrepro.kernels.tp): real TP=2 over 2 gloo processes == the single-process
emulation, bit for bit (torch.equal), for the primitives and for the whole Qwen3; TP=1 == the plain model."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlrepro import kernels
from rlrepro.kernels import tp
from rlrepro.model import tiny_model
from rlrepro.trainer import enable_determinism, token_logprobs

PROMPTS = [[5, 9, 14], [7], [30, 31, 32, 33, 34, 35], [3, 3]]
COMPLETIONS = [[11, 12, 40, 41], [50, 2], [8], [20, 21, 22, 23, 24, 25, 26]]


def _data():
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(5, 48, generator=g), w=torch.randn(24, 48, generator=g),
                logits=torch.randn(7, 60, generator=g) * 3, tokens=torch.randint(60, (7,), generator=g))


# ------------------------------------------------------------------------------------------ single process

def test_sum_in_rank_order_is_left_to_right_in_float32():
    a = torch.tensor([1.0, 2.0 ** -8], dtype=torch.bfloat16)
    b = torch.tensor([2.0 ** -8, 1.0], dtype=torch.bfloat16)
    c = torch.tensor([2.0 ** -8, 2.0 ** -8], dtype=torch.bfloat16)
    out = tp.sum_in_rank_order([a, b, c])
    assert out.dtype == torch.bfloat16
    expected = ((a.float() + b.float()) + c.float()).bfloat16()
    assert torch.equal(out, expected)
    # the bf16 running sum would round after each add: 1 + 2^-8 ties to 1, twice; float32 keeps 1 + 2^-7
    assert not torch.equal(out, (a + b) + c)


def test_shard_range_and_errors():
    assert [tp.shard_range(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="size 10 into 4"):
        tp.shard_range(10, 4, 0, "vocab")
    with pytest.raises(ValueError, match="outside"):
        tp.shard_range(10, 2, 2)


def test_one_part_is_the_plain_kernel_and_column_split_is_a_concatenation():
    d = _data()
    assert torch.equal(tp.linear_row_split(d["x"], d["w"], 1), kernels.linear(d["x"], d["w"]))
    assert torch.equal(tp.linear_column_split(d["x"], d["w"], 1), kernels.linear(d["x"], d["w"]))
    col = tp.linear_column_split(d["x"], d["w"], 2)
    assert torch.equal(col[:, 12:], kernels.linear(d["x"], d["w"][12:].contiguous()))
    row = tp.linear_row_split(d["x"], d["w"], 2)
    torch.testing.assert_close(row, kernels.linear(d["x"], d["w"]))  # the same math, another summation order


def test_emulated_vocab_parallel_log_softmax_is_a_log_softmax():
    d = _data()
    lp = tp.emulated_log_softmax(d["logits"], 3, temperature=0.7)
    torch.testing.assert_close(lp, torch.log_softmax(d["logits"] / 0.7, -1))
    tok = tp.emulated_token_logprob(d["logits"], d["tokens"], 3, temperature=0.7)
    assert torch.equal(tok, lp.gather(-1, d["tokens"].unsqueeze(-1)).squeeze(-1))
    assert torch.equal(tp.emulated_token_logprob(d["logits"], d["tokens"], 1, 0.0),
                       tp.emulated_log_softmax(d["logits"], 1).gather(-1, d["tokens"][:, None]).squeeze(-1))


def test_tp1_emulation_is_the_plain_model_and_tp2_changes_bits_not_weights(one_thread):
    model = tiny_model(seed=3)
    ids = torch.tensor([PROMPTS[2] + COMPLETIONS[0]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = model(ids)
    assert torch.equal(model.set_tensor_parallel_emulation(1)(ids), plain)
    emulated = model.set_tensor_parallel_emulation(2)(ids)
    torch.testing.assert_close(emulated, plain, rtol=1e-4, atol=1e-5)
    assert not torch.equal(emulated, plain)  # the K-split really changes the rounding: the emulation is needed
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.set_tensor_parallel_emulation(1)(ids), plain)  # and switching back restores it


def test_emulation_rejects_sizes_that_do_not_divide_the_model():
    model = tiny_model(seed=0)
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        model.set_tensor_parallel_emulation(3)
    with pytest.raises(ValueError, match="positive int"):
        model.set_tensor_parallel_emulation(0)


# ---------------------------------------------------------------------------------------------- 2 processes

def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    enable_determinism()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from rlrepro.trainer.megatron import TPQwen3ForCausalLM, init_parallel

        d, res = _data(), {}
        a, b = tp.shard_range(48, world, rank)
        res["row"] = tp.row_parallel_sum(kernels.linear(d["x"][:, a:b].contiguous(), d["w"][:, a:b].contiguous()))
        xb, wb = d["x"].bfloat16(), d["w"].bfloat16()
        res["row_bf16"] = tp.row_parallel_sum(kernels.linear(xb[:, a:b].contiguous(), wb[:, a:b].contiguous()))
        c, e = tp.shard_range(24, world, rank)
        res["col"] = tp.gather_last_dim(kernels.linear(d["x"], d["w"][c:e].contiguous()))
        va, vb = tp.shard_range(60, world, rank)
        shard = d["logits"][:, va:vb].contiguous().requires_grad_(True)
        res["lsm"] = tp.vocab_parallel_log_softmax(shard, temperature=0.7).detach()
        tok = tp.vocab_parallel_token_logprob(shard, d["tokens"], temperature=0.7)
        tok.sum().backward()
        res["tok"], res["tok_grad_shard"] = tok.detach(), shard.grad
        # row-parallel backward is the identity, copy_to_tp's is the rank-order sum of the ranks' grads
        x = d["x"].clone().requires_grad_(True)
        y = tp.row_parallel_sum(tp.copy_to_tp(x) * (rank + 1.5))
        (y * d["x"]).sum().backward()
        res["copy_grad"] = x.grad

        if world != 2:  # the model part needs a TP size dividing the tiny model's heads
            torch.save(res, f"{out}.rank{rank}")
            return
        groups = init_parallel(world)
        model = TPQwen3ForCausalLM.from_full(tiny_model(seed=3), groups)
        res["logits"] = model(torch.tensor([PROMPTS[2] + COMPLETIONS[0]])).detach()
        with torch.no_grad():
            res["lps"] = token_logprobs(model, PROMPTS, COMPLETIONS, temperature=0.9)
        lps = token_logprobs(model, PROMPTS, COMPLETIONS, temperature=0.9)
        torch.cat(lps).sum().backward()
        res["grads"] = {n: g.clone() for n, g in
                        ((n, _gather_grad(model, n, p)) for n, p in sorted(model.named_parameters()))}
        res["full"] = model.full_state_dict()
        untied = TPQwen3ForCausalLM.from_full(tiny_model(seed=4, tie_word_embeddings=False), groups)
        with torch.no_grad():
            res["untied_lps"] = token_logprobs(untied, PROMPTS, COMPLETIONS, temperature=0.9)
        torch.save(res, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _gather_grad(model, name, p):
    from rlrepro.kernels.tp import ordered_sum
    from rlrepro.trainer.megatron import gather_param, shard_spec

    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    if shard_spec(name)[1]:
        grad = ordered_sum(grad, model.groups.tp_group)
    return gather_param(name, grad, model.groups)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path_factory, world: int) -> list[dict]:
    out = str(tmp_path_factory.mktemp(f"tp{world}") / "res")
    mp.start_processes(_worker, args=(world, _free_port(), out), nprocs=world, start_method="spawn", join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.mark.slow
def test_real_tp3_row_parallel_sum_is_the_rank_order_sum(tmp_path_factory, one_thread):
    """With 3 ranks the order of the adds matters (with 2, a + b == b + a): the ranks' sum is the emulation's."""
    d = _data()
    results = _launch(tmp_path_factory, 3)
    xb, wb = d["x"].bfloat16(), d["w"].bfloat16()
    for res in results:
        assert torch.equal(res["row"], tp.linear_row_split(d["x"], d["w"], 3))
        assert torch.equal(res["row_bf16"], tp.linear_row_split(xb, wb, 3))
        assert torch.equal(res["col"], tp.linear_column_split(d["x"], d["w"], 3))
        assert torch.equal(res["tok"], tp.emulated_token_logprob(d["logits"], d["tokens"], 3, temperature=0.7))
    partials = [kernels.linear(d["x"][:, 16 * r:16 * (r + 1)].contiguous(), d["w"][:, 16 * r:16 * (r + 1)].contiguous())
                for r in range(3)]
    assert not torch.equal(results[0]["row"], (partials[2] + partials[1]) + partials[0])  # another order, other bits


def test_real_tp2_primitives_equal_the_emulation(tp2_results, one_thread):
    d = _data()
    for res in tp2_results:  # every rank holds the same bits
        assert torch.equal(res["row"], tp.linear_row_split(d["x"], d["w"], 2))
        assert torch.equal(res["row_bf16"], tp.linear_row_split(d["x"].bfloat16(), d["w"].bfloat16(), 2))
        assert torch.equal(res["col"], tp.linear_column_split(d["x"], d["w"], 2))
        assert torch.equal(res["tok"], tp.emulated_token_logprob(d["logits"], d["tokens"], 2, temperature=0.7))
        assert torch.equal(res["copy_grad"], tp.sum_in_rank_order([d["x"] * 1.5, d["x"] * 2.5]))
    lsm = tp.emulated_log_softmax(d["logits"], 2, temperature=0.7)
    assert torch.equal(tp2_results[0]["lsm"], lsm[:, :30]) and torch.equal(tp2_results[1]["lsm"], lsm[:, 30:])
    # the vocab-parallel backward is the log-softmax gradient (math; tolerance) split by shard
    full = d["logits"].clone().requires_grad_(True)
    tp.emulated_token_logprob(full, d["tokens"], 2, temperature=0.7).sum().backward()
    got = torch.cat([tp2_results[0]["tok_grad_shard"], tp2_results[1]["tok_grad_shard"]], dim=-1)
    torch.testing.assert_close(got, full.grad)


def test_real_tp2_model_equals_the_emulated_model_bitwise(tp2_results, one_thread):
    plain = tiny_model(seed=3)
    emulated = tiny_model(seed=3).set_tensor_parallel_emulation(2)
    ids = torch.tensor([PROMPTS[2] + COMPLETIONS[0]])
    with torch.no_grad():
        want_logits = emulated(ids)
        want = token_logprobs(emulated, PROMPTS, COMPLETIONS, temperature=0.9)
        plain_lps = token_logprobs(plain, PROMPTS, COMPLETIONS, temperature=0.9)
    for res in tp2_results:
        assert torch.equal(res["logits"], want_logits)
        assert all(torch.equal(a, b) for a, b in zip(res["lps"], want))
        for name, w in plain.state_dict().items():  # gathering the shards gives back the full weights
            assert torch.equal(res["full"][name], w), name
    assert not all(torch.equal(a, b) for a, b in zip(want, plain_lps))  # TP=2 is not the TP=1 rounding
    untied = tiny_model(seed=4, tie_word_embeddings=False).set_tensor_parallel_emulation(2)  # a separate lm_head
    with torch.no_grad():
        want_untied = token_logprobs(untied, PROMPTS, COMPLETIONS, temperature=0.9)
    for res in tp2_results:
        assert all(torch.equal(a, b) for a, b in zip(res["untied_lps"], want_untied))
    # gradients through the TP model: the same on both ranks, and the plain model's gradient up to rounding
    (g0, g1) = (tp2_results[0]["grads"], tp2_results[1]["grads"])
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    torch.cat(token_logprobs(plain, PROMPTS, COMPLETIONS, temperature=0.9)).sum().backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(g0[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
