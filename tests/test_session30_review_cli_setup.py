"""Session 30 review of the command line as a new user meets it: a run.dir that is a file, an unquoted override
value outside hydra's grammar, an unreachable ray.address, an OSError while setting up, `rlrepro eval` on a file.
Each was a raw traceback, a bare lexer message or a minutes-long hang; each is now one line naming the value and
the fix, before any work, with nothing the user had touched."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import cmd_train, compose_config, main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["recipe=grpo_tiny", "train.steps=1", "rollout.prompts_per_step=2", "logger.progress=false"]


def _run_cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               RAY_USAGE_STATS_ENABLED="0", RLREPRO_NO_REEXEC="1")
    env.pop("RLREPRO_DEBUG", None)
    code = "import sys; from rlrepro.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------ run.dir is a file (or under one)
@pytest.mark.parametrize("sub", ["", "/sub"])
def test_run_dir_that_is_a_file_is_refused_in_one_line(tmp_path, capsys, monkeypatch, sub):
    monkeypatch.delenv("RLREPRO_DEBUG", raising=False)
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n", encoding="utf-8")
    rc = cmd_train(SMALL + [f"run.dir={blocker}{sub}"])  # was FileExistsError / NotADirectoryError, a traceback
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "is a file, not a directory" in err and "run.dir" in err
    assert str(blocker) in err and len(err.strip().splitlines()) == 1
    assert blocker.read_text(encoding="utf-8") == "mine\n"  # untouched


# ------------------------------------------------------------------ override values outside hydra's grammar
@pytest.mark.parametrize("value", ["runs/ünï", "runs/a=b", "reverse: {prompt}="])
def test_unquoted_override_value_names_the_quoted_form(value):
    key = "data.template" if "{" in value else "run.dir"
    with pytest.raises(ConfigError) as info:
        compose_config(["recipe=grpo_tiny", f"{key}={value}"])
    msg = str(info.value)
    assert f"{key}={value}" in msg and f"{key}='{value}'" in msg and "quote" in msg
    # the form the message gives is taken, and gives the value back exactly
    cfg = compose_config(["recipe=grpo_tiny", f"{key}='{value}'"])
    assert (cfg.data.template if key == "data.template" else cfg.run.dir) == value


def test_value_with_both_quote_kinds_still_gets_a_hint():
    with pytest.raises(ConfigError, match=r"quote the value for hydra"):
        compose_config(["recipe=grpo_tiny", "data.template=it's \"{prompt}\" ü"])


def test_tilde_run_dir_is_not_offered_a_quoted_literal_tilde():
    with pytest.raises(ConfigError) as info:
        compose_config(["recipe=grpo_tiny", "run.dir=~/runs/a"])
    msg = str(info.value)
    assert "expands ~" in msg and "run.dir=$HOME/runs/a" in msg and "run.dir='~" not in msg


def test_cli_exit_2_on_grammar_error(capsys):
    assert main(["train", "recipe=grpo_tiny", "run.dir=runs/ünï", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert "run.dir='runs/ünï'" in err and "LexerNoViableAltException" not in err


# ------------------------------------------------------------------ OSError while setting up the run
def test_oserror_in_setup_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    import rlrepro.orchestration as orch

    def refuse(cfg, **kw):
        raise PermissionError(13, "Permission denied", str(tmp_path / "runs" / "a" / "config.yaml"))

    monkeypatch.setattr(orch, "run_training", refuse)
    monkeypatch.delenv("RLREPRO_DEBUG", raising=False)
    assert cmd_train(SMALL + [f"run.dir={tmp_path / 'runs' / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Permission denied" in err and "config.yaml" in err
    assert "RLREPRO_DEBUG=1" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("RLREPRO_DEBUG", "1")  # the traceback, when asked for
    with pytest.raises(PermissionError):
        cmd_train(SMALL + [f"run.dir={tmp_path / 'runs' / 'a'}"])


# ------------------------------------------------------------------ ray.address where nothing listens
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_ray_address_is_refused_at_once(tmp_path):
    # ray.init retried such an address for minutes (GCS time-outs) and then hung; now exit 2 in seconds
    port = _free_port()
    run_dir = tmp_path / "run"
    p = _run_cli(["train", *SMALL, f"run.dir={run_dir}", f"ray.address=127.0.0.1:{port}"], cwd=tmp_path, timeout=90)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"ray.address=127.0.0.1:{port}: nothing answers there" in p.stderr and "Traceback" not in p.stderr
    assert not run_dir.exists()  # what the refused start made is gone again, the directory it created too


def test_ray_address_with_a_bad_port_is_refused():
    from rlrepro.orchestration.ray_start import _check_reachable

    with pytest.raises(ConfigError, match=r"ray.address=10.0.0.1:abc: 'abc' is not a port"):
        _check_reachable("10.0.0.1:abc")
    _check_reachable("auto")  # Ray's own forms are left to Ray
    _check_reachable("ray://10.0.0.1:10001")


# ------------------------------------------------------------------ rlrepro eval on a file
def test_eval_of_a_file_is_exit_2_not_a_traceback(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("", encoding="utf-8")
    assert main(["eval", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlrepro eval: ") and "afile" in err and "Traceback" not in err
