"""scripts/gpu_tests_parallel.py (the GPU suite as parallel pytest processes): its counts, failing ids and exit code,
on a throwaway test module whose tests carry the ``gpu`` marker but need no GPU."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_runner():
    spec = importlib.util.spec_from_file_location("gpu_tests_parallel", ROOT / "scripts" / "gpu_tests_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODULE = '''
import pytest

@pytest.mark.gpu
def test_ok():
    assert 1 + 1 == 2

@pytest.mark.gpu
def test_bad():
    assert 1 + 1 == 3

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3])
def test_skipped(n):
    pytest.skip("no device here")

def test_not_gpu():
    raise AssertionError("not selected by -m gpu")
'''


def test_counts_failures_and_exit_code(tmp_path, capsys):
    runner = load_runner()
    module = tmp_path / "test_fake_gpu.py"
    module.write_text(MODULE)
    code = runner.main([str(module), "--jobs", "2", "--out", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "5 tests in 3 groups" in out
    assert "total: 1 passed, 1 failed, 0 errors, 3 skipped" in out
    assert "FAILING: " in out and "test_bad" in out.split("FAILING: ")[1]
    assert len(list((tmp_path / "logs").glob("*.log"))) == 3


def test_groups_past_the_budget_are_reported_not_run(tmp_path, capsys):
    runner = load_runner()
    module = tmp_path / "test_fake_gpu.py"
    module.write_text(MODULE.replace("assert 1 + 1 == 3", "assert True"))
    code = runner.main([str(module), "--jobs", "1", "--budget", "0", "--out", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert code == 2, out
    assert out.count("not run: ") == 3


def test_a_process_that_dies_without_a_report_counts_as_an_error(tmp_path, capsys):
    """A test that kills its process (as a CUDA fault does) leaves no pytest summary: it must not pass silently."""
    runner = load_runner()
    module = tmp_path / "test_fake_gpu.py"
    module.write_text("import os\nimport pytest\n\n@pytest.mark.gpu\ndef test_dies():\n    os._exit(3)\n")
    code = runner.main([str(module), "--jobs", "1", "--out", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "total: 0 passed, 0 failed, 1 errors" in out and "(pytest exit 3)" in out


def test_a_long_parametrized_function_runs_as_parts(tmp_path, capsys):
    """``--split 3``: a function of 7 parameter sets runs as 3 processes (3, 3, 1 sets), each with its own log; the
    counts and a failing id come through as for a whole function."""
    runner = load_runner()
    module = tmp_path / "test_fake_gpu.py"
    module.write_text("import pytest\n\n@pytest.mark.gpu\n@pytest.mark.parametrize('n', range(7))\n"
                      "def test_many(n):\n    assert n != 4\n\n@pytest.mark.gpu\ndef test_one():\n    pass\n")
    code = runner.main([str(module), "--jobs", "2", "--split", "3", "--out", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "8 tests in 4 groups" in out and "total: 7 passed, 1 failed, 0 errors, 0 skipped" in out
    assert "test_many[4]" in out.split("FAILING: ")[1] and out.count("[part ") == 3
    logs = sorted(p.name for p in (tmp_path / "logs").glob("*.log"))
    assert logs == ["test_fake_gpu__test_many.part1.log", "test_fake_gpu__test_many.part2.log",
                    "test_fake_gpu__test_many.part3.log", "test_fake_gpu__test_one.log"]
    assert runner.split_groups({"f": ["a", "b"]}, 0) == {"f": None}
