"""Code in the working directory never runs unasked (issue 22, item 3).

``rlrepro train`` re-executes itself to pin PYTHONHASHSEED. It did so as ``python -m rlrepro.cli``, which puts the
working directory first on ``sys.path``: a ``difflib.py`` there was executed. The test plants a module named after
every standard-library module in a temporary working directory, each writing a marker when it is imported (and
then loading the real module, so the run goes on), and runs the console script there. A module found only in the
working directory (a ``reward.fn`` module) is still imported: the working directory is searched last."""
import importlib.machinery
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlrepro import cli

HOSTILE = textwrap.dedent("""
    import importlib.machinery, importlib.util, os, sys
    with open(os.path.join({markers!r}, __name__ + "." + str(os.getpid())), "w") as f:
        f.write(" ".join(sys.argv[:2]))
    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _mod
    _spec.loader.exec_module(_mod)
""")
# modules the interpreter has loaded before any sys.path entry could matter, or that must stay real
NOT_PLANTED = {"site", "sitecustomize", "usercustomize", "encodings", "os", "io", "abc", "codecs", "stat",
               "posixpath", "genericpath", "zipimport", "importlib", "this", "antigravity", "_collections_abc"}


def stdlib_names() -> list[str]:
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in NOT_PLANTED or name in sys.builtin_module_names:
            continue
        if importlib.machinery.PathFinder.find_spec(name) is not None:
            names.append(name)
    return names


def hostile_directory(tmp_path: Path) -> tuple[Path, Path]:
    cwd, markers = tmp_path / "cwd", tmp_path / "markers"
    cwd.mkdir()
    markers.mkdir()
    text = HOSTILE.format(markers=str(markers))
    for name in stdlib_names():
        (cwd / f"{name}.py").write_text(text)
    return cwd, markers


def rlrepro_exe() -> str:
    exe = shutil.which("rlrepro") or str(Path(sys.executable).with_name("rlrepro"))
    assert Path(exe).exists(), "the rlrepro console script is installed by pip install -e ."
    return exe


def environment() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0")
    for key in ("PYTHONHASHSEED", "RLREPRO_NO_REEXEC", "PYTHONPATH", "PYTHONSAFEPATH"):
        env.pop(key, None)
    return env


def ran(markers: Path) -> dict[str, list[str]]:
    """module name -> the argv[0:2] of each process that imported the planted module."""
    out: dict[str, list[str]] = {}
    for f in sorted(markers.iterdir()):
        out.setdefault(f.name.rsplit(".", 1)[0], []).append(f.read_text())
    return out


def test_the_reexec_puts_no_directory_before_the_standard_library(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("RLREPRO_NO_REEXEC", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), ""] + [p for p in sys.path if p not in ("", str(tmp_path))])
    cli._pin_hash_seed(["train", "recipe=grpo_tiny"])
    (exe, argv, env), = calls
    assert exe == sys.executable and argv[:3] == [sys.executable, "-P", "-c"] and argv[4:] == ["train",
                                                                                               "recipe=grpo_tiny"]
    assert "-m" not in argv and env["PYTHONHASHSEED"] == "0"
    assert sys.path[-1] == str(tmp_path) and str(tmp_path) not in sys.path[:-1] and "" not in sys.path


def test_planted_standard_library_modules_do_not_run_in_rlrepro_train(tmp_path):
    cwd, markers = hostile_directory(tmp_path)
    assert {"difflib", "json", "statistics", "argparse"} <= set(stdlib_names())
    proc = subprocess.run([rlrepro_exe(), "train", "recipe=nope"], cwd=cwd, env=environment(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "unknown recipe 'nope'" in proc.stderr, proc.stderr[-2000:]
    assert ran(markers) == {}  # before: difflib, json, argparse, ... ran in the re-executed process


def test_a_reward_module_found_only_in_the_working_directory_is_still_imported(tmp_path):
    cwd, markers = hostile_directory(tmp_path)
    (cwd / "my_reward.py").write_text(f"open({str(markers / 'my_reward.0')!r}, 'w').write('imported')\n"
                                      "def reward(completion, record):\n    return 0.0\n")
    proc = subprocess.run([rlrepro_exe(), "train", "recipe=grpo_tiny", f"run.dir={tmp_path / 'run'}",
                           "reward.fn=my_reward:reward", "rollout.prompts_per_step=100000"], cwd=cwd,
                          env=environment(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "rollout.prompts_per_step=100000" in proc.stderr, proc.stderr[-2000:]
    assert ran(markers) == {"my_reward": ["imported"]}


@pytest.mark.slow
def test_planted_modules_do_not_run_in_the_ray_actors_either(tmp_path):
    """A whole run: the driver and every Ray process (rollout workers, trainer, Ray's own). Ray puts the driver's
    working directory first on each worker's sys.path unless its JobConfig says otherwise."""
    cwd, markers = hostile_directory(tmp_path)
    proc = subprocess.run([rlrepro_exe(), "train", "recipe=grpo_tiny", f"run.dir={tmp_path / 'run'}",
                           "train.steps=1", "logger.progress=false", "rollout.num_workers=2",
                           "warm_start.steps=0"], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ran(markers) == {}  # before: 16 modules (statistics, difflib, gzip, ...) ran in the actors


def test_every_command_that_computes_rewards_pins_the_hash_seed(monkeypatch):
    # rlrepro eval scores with the run's reward.fn as the run did; it ran with whatever hash seed it was given
    pinned = []
    monkeypatch.setattr(cli, "_pin_hash_seed", lambda argv: pinned.append(argv[0]))
    for cmd in ("train", "verify", "eval", "diff", "show"):
        monkeypatch.setattr(sys, "argv", ["rlrepro", cmd, "--help"])
        try:
            cli.main()
        except SystemExit:  # argparse's --help
            pass
    assert pinned == ["train", "verify", "eval"] and cli.HASH_SEED_COMMANDS == ("train", "verify", "eval")
