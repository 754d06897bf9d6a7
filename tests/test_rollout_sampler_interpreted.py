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
idx, noise = gumbel_argmax(scaled, seeds, positions, return_noise=True)
want = gumbel_noise(seeds, positions, vocab)
assert torch.equal(noise, want), (noise - want).abs().max()
assert torch.equal(idx, torch.argmax(scaled.double() + want, -1))
print("ok")
'''


def test_fused_kernel_logic_matches_the_eager_noise():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
