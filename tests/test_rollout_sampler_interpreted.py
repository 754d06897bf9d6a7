"""The fused CUDA sampler's logic, run by Triton's CPU interpreter, equals the eager definition bit for bit.

(The compiled kernel is compared on the GPU in test_rollout_cuda.py; the interpreter needs TRITON_INTERPRET=1
before Triton is imported, hence the subprocess.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import warnings
warnings.simplefilter("ignore")
import torch
import triton
import triton.language as tl
from rlrepro.rollout.sampler import exact_log, gumbel_noise
from rlrepro.rollout.sampler_triton import FAST_NOISE_ERROR, _fast_noise, gumbel_argmax
torch.manual_seed(0)
rows, vocab = 8, 4500
scaled = torch.randn(rows, vocab) * 3
scaled[2, 100:200] = float("-inf")
scaled[3, :] = 1.0
seeds = torch.tensor([1, 2**63 - 1, 0, 77, 5, 9, 11, 12])
positions = torch.tensor([0, 5, 40000, 3, 2**31 + 1, 8, 9, 10])
scaled[4, :-10] = float("-inf")  # only the last range has candidates
scaled[5, 1000] = float("nan")  # a NaN logit: its chunk is always evaluated
scaled[6, 3000] = float("inf")
scaled[6, 4000] = float("inf")  # two +inf: the first
scaled[7] = torch.linspace(60.0, -60.0, vocab)  # a wide spread: most chunks are skipped
idx, noise = gumbel_argmax(scaled, seeds, positions, return_noise=True)
want = gumbel_noise(seeds, positions, vocab)
assert torch.equal(noise[0], want), (noise[0] - want).abs().max()
gap = (noise[1] - want).abs().max().item()
assert gap < FAST_NOISE_ERROR, gap  # the fast estimate is within its stated error
expect = torch.argmax(scaled.double() + want, -1)
assert torch.equal(idx[:5], expect[:5]) and torch.equal(idx[6:], expect[6:]), (idx, expect)
assert idx[4] >= vocab - 10 and idx[6] == 3000
# the vocabulary cut into ranges (one program each, merged in order), chunks skipped or not: the same tokens for
# every cut, including uneven ones, more splits than chunks, and a row with no candidate at all (index 0, as
# torch.argmax gives); pruned == unpruned for every row, the NaN row included
scaled[0, :] = float("-inf")
expect = torch.argmax(scaled.double() + want, -1)
assert expect[0] == 0
unpruned = gumbel_argmax(scaled, seeds, positions, prune=False)
assert torch.equal(unpruned[:5], expect[:5]) and torch.equal(unpruned[6:], expect[6:])
for block, splits in ((512, 1), (512, 2), (512, 4), (512, 9), (512, 20), (1024, 3), (2048, 2), (64, 5)):
    for prune in (True, False):
        got, evaluated = gumbel_argmax(scaled, seeds, positions, splits=splits, block=block, prune=prune,
                                       return_evaluated=True)
        assert torch.equal(got, unpruned), (block, splits, prune, got, unpruned)
        chunks = [len(range(s, min(s + span, vocab), block)) for span in [-(-(-(-vocab // block)) // min(splits,
                  -(-vocab // block))) * block] for s in range(0, vocab, span)]
        if not prune:
            assert evaluated.tolist() == [chunks] * rows, (evaluated, chunks)
            continue
        # two passes: the whole range's floor first, so a subset of the one-pass chunks is evaluated
        got2, evaluated2 = gumbel_argmax(scaled, seeds, positions, splits=splits, block=block, passes=2,
                                         return_evaluated=True)
        assert torch.equal(got2, unpruned), (block, splits, got2, unpruned)
        assert (evaluated2 <= evaluated).all() and evaluated2[0].sum() == 0, (evaluated2, evaluated)
        if block == 64 and splits == 5:  # 71 chunks: the spread row and the random rows skip most of theirs
            assert evaluated[7].sum() <= 10 and evaluated[1].sum() < 71 // 2, evaluated
            assert evaluated[0].sum() == 0 and evaluated[5].sum() >= 1  # all -inf: no chunk can be taken
            assert evaluated2[1].sum() < evaluated[1].sum(), (evaluated2, evaluated)
# bfloat16 logits widen exactly: the same tokens as their float32 copy
half = scaled.to(torch.bfloat16)
assert torch.equal(gumbel_argmax(half, seeds, positions), gumbel_argmax(half.float(), seeds, positions, prune=False))
for bad in (0, -1, 2.0):
    try:
        gumbel_argmax(scaled, seeds, positions, splits=bad)
    except ValueError as e:
        assert "splits must be a positive int" in str(e)
    else:
        raise AssertionError(f"splits={bad!r} accepted")
for kw in (dict(passes=3), dict(passes=2, prune=False), dict(passes=2, return_noise=True)):
    try:
        gumbel_argmax(scaled, seeds, positions, **kw)
    except ValueError as e:
        assert "passes=" in str(e)
    else:
        raise AssertionError(f"{kw} accepted")
try:
    gumbel_argmax(scaled.double(), seeds, positions)
except ValueError as e:
    assert "float64" in str(e)
else:
    raise AssertionError("float64 logits accepted")


@triton.jit
def probe(bits_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _fast_noise(tl.load(bits_ptr + i, mask=i < N, other=0)), mask=i < N)


# the estimate at the ends of the range and around its switch at u = 15/16, against the exact noise
edges = [0, 1, 2, 3, 2**20, 2**40, 2**50, 2**51 - 1, 2**51, 15 * 2**48 - 1, 15 * 2**48, 15 * 2**48 + 1,
         2**52 - 2**30, 2**52 - 3, 2**52 - 2, 2**52 - 1]
bits = torch.tensor(edges + torch.randint(0, 2**52, (4096 - len(edges),)).tolist(), dtype=torch.int64)
out = torch.empty(bits.shape, dtype=torch.float32)
probe[(1,)](bits, out, bits.numel(), BLOCK=4096)
u = (bits.double() + 0.5) * 2.0 ** -52
exact = -exact_log(-exact_log(u))
assert (out.double() - exact).abs().max().item() < FAST_NOISE_ERROR, (out.double() - exact).abs().max()
print("ok")
'''


def test_fused_kernel_logic_matches_the_eager_noise():
    """Noise and tokens equal the eager definition; any cut of the vocabulary into ranges, with chunks skipped or
    not, gives the same tokens; the fast estimate stays within its stated error."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


PICKED = r'''
import warnings
warnings.simplefilter("ignore")
import torch
from rlrepro.kernels import triton_rowwise as rw
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for rows, vocab in ((3, 9000), (2, 4096), (4, 5)):
        x = (torch.randn(rows, vocab) * 4).to(dtype)
        ids = torch.randint(0, vocab, (rows,))
        want = rw.log_softmax_fwd(x).gather(-1, ids[:, None])[:, 0]
        assert torch.equal(rw.picked_log_softmax(x, ids), want), (dtype, rows, vocab)
assert torch.isnan(rw.picked_log_softmax(x, torch.tensor([0, 1, 2, 5]))[3])  # an id past the row: NaN
print("ok")
'''


def test_picked_log_softmax_is_the_written_value_interpreted():
    """The sampler's one-value-a-row logprob equals the written log-softmax's value (Triton's CPU interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PICKED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
