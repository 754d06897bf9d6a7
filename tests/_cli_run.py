"""``rlrepro`` CLI in a child process for the run-directory tests: the repo on PYTHONPATH, no network, no re-exec,
no inherited debug or fault variables; ``faults`` become ``RLREPRO_FAULTS`` (rlrepro/orchestration/fault_injection)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], cwd: Path, faults: list[dict] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               RAY_USAGE_STATS_ENABLED="0", RLREPRO_NO_REEXEC="1")
    env.pop("RLREPRO_DEBUG", None)
    env.pop("RLREPRO_FAULTS", None)
    if faults:
        env["RLREPRO_FAULTS"] = json.dumps(faults)
    code = "import sys; from rlrepro.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
