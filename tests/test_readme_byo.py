"""The README's "Bring your own data and reward" section, run as written: its data file, its reward module on the
working directory, `rlrepro train` with `data.source` and `reward.fn`, and `rlrepro show`."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def byo_block() -> str:
    text = README.read_text()
    section = text.split("## Bring your own data and reward", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section holds one bash block"
    return blocks[0]


def test_the_section_uses_the_keys_it_documents():
    block = byo_block()
    for key in ("data.source=", "data.prompt_field=", "data.answer_field=", "data.template=", "reward.fn="):
        assert key in block


@pytest.mark.slow
def test_the_readme_block_runs_as_written(tmp_path):
    exe = shutil.which("rlrepro") or str(Path(sys.executable).with_name("rlrepro"))
    assert Path(exe).exists(), "the rlrepro console script is installed by pip install -e ."
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{Path(exe).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "-e", "-c", byo_block()], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "mine"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in metrics)
    config = (run / "config.yaml").read_text()
    assert "fn: my_reward:reward" in config and "my_data.jsonl" in config
    assert "reverse: " in proc.stdout and "completion:" in proc.stdout  # rlrepro show printed the text
