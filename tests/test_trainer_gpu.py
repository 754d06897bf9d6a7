"""The trainer on CUDA: Triton kernels, bf16 compute with float32 master weights, NCCL data parallelism."""
import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlrepro.model import tiny_model
from rlrepro.trainer import DataParallel, TrainConfig, Trainer, enable_determinism, token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = dict(lr=3e-3, steps=5, micro_batch_size=3, ppo_epochs=2, clip_high=0.28, kl_coef=0.05)


def make_batch(model, step: int):
    gen = torch.Generator().manual_seed(700 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + (3 * i) % 7,), generator=gen).tolist() for i in range(8)]
    completions = [torch.randint(vocab, (1 + (5 * i) % 11,), generator=gen).tolist() for i in range(8)]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=(-1.0) ** i)
            for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


def train(device, data_parallel=None, steps=3):
    model = tiny_model(seed=1).to(device)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    trainer = Trainer(model, TrainConfig(**CONFIG), ref_model=ref, param_dtype=torch.bfloat16,
                      data_parallel=data_parallel)
    metrics = [trainer.train_step(make_batch(model, s)) for s in range(steps)]
    return {n: w.to("cpu", copy=True) for n, w in trainer.named_weights()}, metrics


@pytest.fixture(autouse=True)
def determinism():
    enable_determinism()


def test_token_logprobs_packing_invariant_on_cuda():
    model = tiny_model(seed=3, dtype=torch.bfloat16).to("cuda")
    batch = make_batch(model, 0)
    prompts = [s["prompt_token_ids"] for s in batch]
    completions = [s["completion_token_ids"] for s in batch]
    with torch.no_grad():
        together = token_logprobs(model, prompts, completions)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            assert torch.equal(token_logprobs(model, [p], [c])[0], together[i])
            assert torch.equal(token_logprobs(model, prompts[::-1], completions[::-1])[7 - i], together[i])


def test_bf16_master_weight_training_is_bitwise_reproducible_on_cuda():
    a, ma = train("cuda")
    b, mb = train("cuda")
    assert ma == mb
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(w.dtype == torch.bfloat16 for w in a.values())
    assert [m["train/rollout_logprob_abs_diff"] for m in ma] == [0.0, 0.0, 0.0]


def _worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    torch.cuda.set_device(rank)
    enable_determinism()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        weights, metrics = train(f"cuda:{rank}", DataParallel(bucket_numel=5000))
        torch.save({"weights": weights, "metrics": metrics}, f"{out_path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _launch(tmp_path, tag: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / tag)
    mp.start_processes(_worker, args=(2, port, out), nprocs=2, start_method="spawn", join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(2)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_rank_nccl_training_is_bitwise_reproducible(tmp_path):
    first, second = _launch(tmp_path, "a"), _launch(tmp_path, "b")
    for run in (first, second):
        assert run[0]["metrics"] == run[1]["metrics"]
        assert all(torch.equal(run[0]["weights"][n], run[1]["weights"][n]) for n in run[0]["weights"])
    assert first[0]["metrics"] == second[0]["metrics"]
    assert all(torch.equal(first[0]["weights"][n], second[0]["weights"][n]) for n in first[0]["weights"])


def test_chunked_log_softmax_equals_unchunked_on_cuda():
    """``logprobs_and_entropy(chunk_rows=...)``'s chunked function against the unchunked ops on Qwen3-sized logits
    (bf16 [300, 151936]): logprobs and the logits' gradient bit for bit, at chunk sizes that leave a ragged last
    chunk. The entropy metric only to rounding: torch's CUDA row sum picks its reduction by the number of rows."""
    from rlrepro.trainer.logprobs import _ChunkedTokenLogprob, _token_logprob_rows, entropy

    gen = torch.Generator(device="cuda").manual_seed(5)
    m, v = 300, 151936
    logits = (torch.randn(m, v, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, v, (m,), device="cuda", generator=gen)
    weight = torch.randn(m, device="cuda", generator=gen)
    x0 = logits.clone().requires_grad_(True)
    lp0, lsm0 = _token_logprob_rows(x0, targets, 0.7)
    ent0 = entropy(lsm0.detach())
    (lp0 * weight).sum().backward()
    for chunk in (64, 299, 7):
        x1 = logits.clone().requires_grad_(True)
        lp1, ent1 = _ChunkedTokenLogprob.apply(x1, targets, 0.7, chunk, False)
        (lp1 * weight).sum().backward()
        assert torch.equal(lp1.detach(), lp0.detach()), chunk
        torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-6)
        assert torch.equal(x1.grad, x0.grad), chunk
