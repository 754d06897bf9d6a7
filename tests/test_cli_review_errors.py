"""Bad input to the CLI exits 2 with a message naming the value and the fix, before any work."""
from __future__ import annotations

import json

import pytest
import torch

from rlrepro.cli import main
from rlrepro.model import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.mark.parametrize("device, words", [("foo", "'foo' is not a device"), ("cuda:63", "'cuda:63'")])
def test_generate_bad_device_exits_2_before_loading(tiny_dir, capsys, device, words):
    if device.startswith("cuda") and torch.cuda.device_count() > 63:
        pytest.skip("a machine with 64 GPUs")
    assert main(["generate", "--model", str(tiny_dir), "--device", device]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_recipes_refuses_arguments(capsys):
    assert main(["recipes", "grpo_tiny"]) == 2
    assert "rlrepro train recipe=NAME" in capsys.readouterr().err
    assert main(["recipes", "--help"]) == 0
    assert "usage: rlrepro recipes" in capsys.readouterr().out


def test_train_from_another_architecture_exits_2_naming_it(tiny_dir, tmp_path, capsys):
    model = tmp_path / "qwen2"
    model.mkdir()
    for f in tiny_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    assert main(["train", "recipe=grpo_tiny", "model.init=pretrained", f"model.path={model}",
                 f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "'qwen2'" in err and str(model / "config.json") in err and "Qwen3" in err
    assert not (run_dir / "metrics.jsonl").exists()


def test_model_path_with_a_tiny_recipe_is_refused_not_ignored(tiny_dir, capsys):
    assert main(["train", "recipe=grpo_tiny", f"model.path={tiny_dir}", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert str(tiny_dir) in err and "model.init=pretrained" in err
    assert main(["train", "recipe=grpo_tiny", f"model.path={tiny_dir}", "model.init=pretrained", "--cfg"]) == 0
