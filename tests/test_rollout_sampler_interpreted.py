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
from rlrepro.rollout.sampler import gumbel_noise
from rlrepro.rollout.sampler_triton import gumbel_argmax
torch.manual_seed(0)
rows, vocab = 5, 4500
scaled = torch.randn(rows, vocab) * 3
scaled[2, 100:200] = float("-inf")
scaled[3, :] = 1.0
seeds = torch.tensor([1, 2**63 - 1, 0, 77, 5])
positions = torch.tensor([0, 5, 40000, 3, 2**31 + 1])
scaled[4, :-10] = float("-inf")  # only the last range has candidates
idx, noise = gumbel_argmax(scaled, seeds, positions, return_noise=True)
want = gumbel_noise(seeds, positions, vocab)
assert torch.equal(noise, want), (noise - want).abs().max()
expect = torch.argmax(scaled.double() + want, -1)
assert torch.equal(idx, expect)
assert idx[4] >= vocab - 10
# the vocabulary cut into ranges (one program each, merged in order): the same tokens for every cut, including
# uneven ones, more splits than chunks, and a row with no candidate at all (index 0, as torch.argmax gives)
scaled[0, :] = float("-inf")
expect = torch.argmax(scaled.double() + want, -1)
assert expect[0] == 0
for block, splits in ((512, 1), (512, 2), (512, 4), (512, 9), (512, 20), (1024, 3), (2048, 2)):
    got = gumbel_argmax(scaled, seeds, positions, splits=splits, block=block)
    assert torch.equal(got, expect), (block, splits, got, expect)
for bad in (0, -1, 2.0):
    try:
        gumbel_argmax(scaled, seeds, positions, splits=bad)
    except ValueError as e:
        assert "splits must be a positive int" in str(e)
    else:
        raise AssertionError(f"splits={bad!r} accepted")
print("ok")
'''


def test_fused_kernel_logic_matches_the_eager_noise():
    """Noise and tokens equal the eager definition; any cut of the vocabulary into ranges gives the same tokens."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
