"""What the Triton kernel tests share (tests/test_triton_kernels.py, tests/test_attention_bwd.py): the repo on
``sys.path``, CUDA/Triton availability marks, the relative error, and the interpreter run.

Imported as ``from _triton_helpers import ...`` (``tests/`` is on ``sys.path`` under pytest, and is the script's
directory when a test file runs itself with ``--interpret``)."""
import json
import os
import random
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    HAS_TRITON = False

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device and Triton")


def fresh_seed() -> int:
    """Seed torch (and CUDA, where present) with a random seed and return it, for the failure message."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    if HAS_CUDA:
        torch.cuda.manual_seed(seed)
    return seed


def attention_data(kind: str, q: torch.Tensor, k: torch.Tensor, lens) -> None:
    """Shape random packed ``q``/``k`` in place as attention inputs of kind ``sink`` (every query's largest score on
    its sequence's first key, as a trained model's attention sink: a row's max is set on its first KV tile) or
    ``rising`` (the scores step up with each 64-position tile of the sequence: every tile raises every row's max);
    ``random`` leaves them. For the rescale the Gluon forward skips where no max grew (``GLW_SKIP``)."""
    if kind == "random":
        return
    if kind not in ("sink", "rising"):
        raise ValueError(f"attention data {kind!r}: use random, sink or rising")
    q[..., 0] = 4.0
    if kind == "sink":
        starts = torch.tensor([0] + list(lens[:-1]), device=k.device).cumsum(0)
        k[starts, :, 0] = 60.0
    else:
        # a step of 170 a 64-position tile: each tile's scores ~60 above the last's, far past the noise's spread
        pos = torch.cat([torch.arange(n, device=k.device) for n in lens])
        k[:, :, 0] = (pos // 64 * 170).to(k.dtype)[:, None]


def rel_err(out: torch.Tensor, expect: torch.Tensor) -> float:
    out, expect = out.double().cpu(), expect.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out - expect).norm() / expect.norm().clamp_min(1e-30))


def run_interpreter(test_file: str, drop_env: tuple[str, ...] = ()) -> dict:
    """Run ``python test_file --interpret`` with ``TRITON_INTERPRET=1`` (the variable must be set before Triton is
    imported, hence the subprocess) and return the JSON object its last ``{...}`` line prints: check name ->
    "ok" or the failure. Skips without Triton >= 3.9 (3.6's interpreter breaks on these kernels with numpy 2:
    'only 0-dimensional arrays can be converted')."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter breaks on these kernels with numpy 2; the CPU "
                    "checks need Triton >= 3.9")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for name in drop_env:
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(Path(test_file).resolve()), "--interpret"], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def run_checks(checks: dict, names) -> dict:
    """Run the named check functions; name -> "ok" or the traceback (every check reports, not only the first)."""
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            checks[name]()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    return results


def interpreter_test_items(test_file: str, checks: dict, drop_env: tuple[str, ...] = ()):
    """The pytest side of a file's interpreter checks, made once its checks are all registered: a module-scoped
    fixture running them in one interpreter subprocess, and a test per check. Assign both at module level:
    ``interp_results, test_interpreter = interpreter_test_items(__file__, INTERP_CHECKS)``."""

    @pytest.fixture(scope="module")
    def interp_results():
        return run_interpreter(test_file, drop_env)

    @pytest.mark.parametrize("name", sorted(checks))
    def test_interpreter(interp_results, name):
        result = interp_results.get(name, "missing")
        assert result == "ok", result

    return interp_results, test_interpreter


def shape_invariant_dot() -> None:
    """Make the Triton interpreter's ``tl.dot`` give each output element by its own row and column alone, summing
    the K products one after another in the accumulator's type. The interpreter hands a dot to ``np.matmul``, whose
    BLAS picks its kernel and summation order by the operands' shapes and the CPU (OpenBLAS on an AMD EPYC with
    AVX-512: a row differs between M = 1 and M = 2), so a kernel's tile shape would change bits that a GPU's MMA
    computes per element. The invariance checks model the GPU's per-element product here; their closeness to the
    float64 reference is checked as before."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_rlrepro_dot", False):
        return
    stock = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        x, y = a.data, b.data
        if not all(np.issubdtype(t.dtype, np.floating) and t.dtype.itemsize >= 2 for t in (x, y)) or \
                a.dtype.primitive_bitwidth == 8:  # fp8 and integer dots: the interpreter's own way
            return stock(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = x.astype(acc), y.astype(acc)
        out = x[..., :, 0:1] * y[..., 0:1, :]
        for k in range(1, x.shape[-1]):
            out = out + x[..., :, k:k + 1] * y[..., k:k + 1, :]
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot, builder._rlrepro_dot = create_dot, True


def main(checks: dict, test_file: str) -> None:
    """A test file run as a script: ``--interpret [NAME ...]`` runs its interpreter checks and prints the JSON line
    :func:`run_interpreter` reads; anything else runs pytest on the file."""
    if len(sys.argv) > 1 and sys.argv[1] == "--interpret":
        if os.environ.get("TRITON_INTERPRET") != "1":  # too late to set here: Triton is imported already
            sys.exit("set TRITON_INTERPRET=1 in the environment: TRITON_INTERPRET=1 python " + test_file + " --interpret")
        res = run_checks(checks, sys.argv[2:] or sorted(checks))
        for name, r in res.items():
            if r != "ok":
                print(f"--- {name} FAILED\n{r}", file=sys.stderr)
        print(json.dumps(res))
        sys.exit(0)
    sys.exit(pytest.main([test_file, *sys.argv[1:]]))


if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":  # every interpreted process, ranks spawned by one too
    shape_invariant_dot()
