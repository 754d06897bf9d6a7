"""The trainer's fused token logprob, entropy and logprob gradient (``rlrepro.kernels.triton_logprob``) against the
torch ops it replaces (``rlrepro.trainer.logprobs._token_logprob_rows`` and its autograd backward).

* CPU: the kernels' logic through Triton's interpreter (``TRITON_INTERPRET=1``, float32), in one subprocess;
  ``TRITON_INTERPRET=1 python tests/test_token_logprob_fused.py --interpret [NAME ...]`` runs them directly. The
  interpreter's numpy ``exp`` and true division are not CUDA's, so the gradient is compared to rounding there; the
  logprob, which shares the log-softmax's own code, bit for bit.
* GPU (``-m gpu``): logprobs and gradients ``torch.equal`` to the torch path's, bf16 and float32, at T = 1 and 0.7,
  chunked and not; the entropy close to the torch path's and a row's entropy the same alone or in a batch.
"""
from __future__ import annotations

import pytest
import torch

from _triton_helpers import fresh_seed, gpu, interpreter_test_items, main, needs_cuda  # noqa: E402

INTERP_CHECKS: dict = {}


def interp_check(fn):
    INTERP_CHECKS[fn.__name__] = fn
    return fn


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float, weight: torch.Tensor):
    """The torch path: logprobs, entropies and the logits' gradient of ``sum(weight * logprob)``."""
    from rlrepro.trainer.logprobs import _token_logprob_rows, entropy
    x = logits.clone().requires_grad_(True)
    lp, lsm = _token_logprob_rows(x, targets, temperature)
    ent = entropy(lsm.detach())
    (lp * weight).sum().backward()
    return lp.detach(), ent, x.grad


def _fused(logits: torch.Tensor, targets: torch.Tensor, temperature: float, weight: torch.Tensor, chunk: int = 0):
    from rlrepro.trainer.logprobs import _FusedTokenLogprob
    x = logits.clone().requires_grad_(True)
    lp, ent = _FusedTokenLogprob.apply(x, targets, float(temperature), chunk)
    assert not ent.requires_grad
    (lp * weight).sum().backward()
    return lp.detach(), ent, x.grad


def _inputs(m: int, v: int, dtype: torch.dtype, device: str):
    logits = (torch.randn(m, v, device=device) * 4).to(dtype)
    logits[1, :] = float("-inf")  # a row where all but one column are impossible: p == 0 counts 0 in the entropy
    logits[1, 3] = 2.0
    targets = torch.randint(0, v, (m,), device=device)
    targets[1] = 3
    targets[2] = v - 1  # the last column (the last, partial range)
    logits[3, :] = -95.0  # exp(log p) subnormal in float32 at T = 1 (-95), and at T = 0.7 in row 6 (-64 / 0.7)
    logits[3, 0] = 0.0
    logits[6, :] = -64.0
    logits[6, 0] = 0.0
    weight = torch.randn(m, device=device)
    weight[4] = 0.0
    weight[5] = -0.0  # a zero of either sign: torch's one-hot adds it into +0
    return logits, targets, weight


# ============================================================================================ CPU: interpreter
@interp_check
def check_fused_forward_fp32():
    from rlrepro.kernels import triton_logprob as tlp
    from rlrepro.kernels import triton_rowwise as rw
    from rlrepro.trainer.logprobs import entropy
    fresh_seed()
    m, v = 9, rw.LSM_BLOCK * 2 + 77  # three ranges, the last partial
    x, targets, _ = _inputs(m, v, torch.float32, "cpu")
    lp, ent, lse = (torch.empty(m) for _ in range(3))
    tlp.token_logprob_entropy(x, targets, lp, ent, lse)
    lsm = rw.log_softmax_fwd(x)  # the log-softmax kernel the engine's token_logprob runs
    assert torch.equal(lp, lsm.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, entropy(lsm), rtol=1e-5, atol=1e-6)
    assert ent[1].item() == 0.0  # one possible token: no uncertainty, and no NaN from 0 * -inf


@interp_check
def check_fused_grad_fp32():
    fresh_seed()
    m, v = 7, 4096 + 300
    for temperature in (1.0, 0.7):
        x, targets, weight = _inputs(m, v, torch.float32, "cpu")
        lp0, _, g0 = _reference(x, targets, temperature, weight)
        for chunk in (0, 3):
            lp1, _, g1 = _fused(x, targets, temperature, weight, chunk)
            torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
            for row in (4, 5):  # weight 0 and -0: all +0, as torch's one-hot makes it
                assert torch.equal(g1[row], torch.zeros(v)) and not torch.signbit(g1[row]).any()
    # a vocabulary smaller than one range (a tiny model's), and a target outside it: NaN, not stale memory
    x, targets, weight = _inputs(8, 37, torch.float32, "cpu")
    lp0, _, g0 = _reference(x, targets, 0.7, weight)
    lp1, _, g1 = _fused(x, targets, 0.7, weight)
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-6)
    # over 37 columns a target often has p near 1, and its gradient weight * (1 - p) keeps the float32 rounding of
    # the log-sum-exp (|lse| * 6e-8, lse ~ 20) as an absolute error: up to 2.4e-6 in 500 random seeds, so atol 1e-7
    # failed about one run in 80
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-5)
    from rlrepro.trainer.logprobs import _FusedTokenLogprob
    bad = targets.clone()
    bad[0] = 37
    assert torch.isnan(_FusedTokenLogprob.apply(x, bad, 1.0, 0)[0][0])


interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)


def test_fused_path_is_cuda_only(monkeypatch):
    from rlrepro import kernels
    from rlrepro.trainer.logprobs import fused_path
    monkeypatch.delenv("RLREPRO_FUSED_LOGPROB", raising=False)
    x = torch.zeros(3, 5)
    assert not fused_path(x, False)  # CPU: the torch ops
    if torch.cuda.is_available():
        y = x.cuda()
        assert fused_path(y, False) and not fused_path(y, True)  # an entropy bonus: the torch ops
        with kernels.mode("fast"):
            assert fused_path(y, False)
        monkeypatch.setenv("RLREPRO_FUSED_LOGPROB", "0")
        assert not fused_path(y, False)


# ============================================================================================ GPU
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_token_logprob_has_the_torch_bits(dtype):
    """Qwen3's vocabulary, a ragged last chunk: logprobs and gradients ``torch.equal`` to the torch ops'; the
    entropy to rounding, and a row's entropy the same alone as among 300 (fixed order, unlike torch's row sum)."""
    seed = fresh_seed()
    m, v = 300, 151936
    logits, targets, weight = _inputs(m, v, dtype, "cuda")
    for temperature in (1.0, 0.7):
        lp0, ent0, g0 = _reference(logits, targets, temperature, weight)
        for chunk in (0, 64, 7):
            lp1, ent1, g1 = _fused(logits, targets, temperature, weight, chunk)
            where = f"seed {seed}, {dtype}, T={temperature}, chunk {chunk}"
            assert torch.equal(lp1, lp0), where
            assert torch.equal(g1, g0), f"{where}: max diff {(g1.float() - g0.float()).abs().max().item()}"
            torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
        alone = _fused(logits[10:11], targets[10:11], temperature, weight[10:11])
        assert torch.equal(alone[1], ent1[10:11]) and torch.equal(alone[0], lp1[10:11]), seed
        assert torch.equal(alone[2], g1[10:11]), seed


@gpu
@needs_cuda
def test_gpu_logprobs_and_entropy_take_the_fused_path(monkeypatch):
    """Through ``logprobs_and_entropy`` and ``token_logprobs`` on a tiny CUDA model: the fused path's logprobs and
    parameter gradients equal the torch ops' (``RLREPRO_FUSED_LOGPROB=0``), chunked and not."""
    from rlrepro.model.tiny import tiny_model
    from rlrepro.trainer.logprobs import logprobs_and_entropy, token_logprobs
    model = tiny_model(seed=0, dtype=torch.bfloat16).cuda()
    prompts = [[1, 2, 3], [4, 5], [6]]
    completions = [[7, 8, 9, 10], [11], [12, 13]]

    def run(chunk):
        model.zero_grad(set_to_none=True)
        lps, ents = logprobs_and_entropy(model, prompts, completions, 0.8, chunk_rows=chunk)
        torch.cat(lps).mul(torch.linspace(-1, 1, 7, device="cuda")).sum().backward()
        with torch.no_grad():  # token_logprobs (the reference model's logprobs) takes the fused forward too
            ref = torch.cat(token_logprobs(model, prompts, completions, 0.8, chunk_rows=chunk))
        return torch.cat(lps).detach(), ref, [p.grad.clone() for p in model.parameters()]

    for chunk in (0, 3):
        monkeypatch.delenv("RLREPRO_FUSED_LOGPROB", raising=False)
        lp1, ref1, g1 = run(chunk)
        monkeypatch.setenv("RLREPRO_FUSED_LOGPROB", "0")
        lp0, ref0, g0 = run(chunk)
        assert torch.equal(lp1, lp0) and torch.equal(ref1, ref0) and torch.equal(ref1, lp1)
        assert all(torch.equal(a, b) for a, b in zip(g1, g0))


if __name__ == "__main__":
    main(INTERP_CHECKS, __file__)
