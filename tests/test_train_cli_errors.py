"""Bad recipes, keys, values and data sets fail before any work, with the key and the fix."""
import json

import pytest

from rlrepro.cli import compose_config, main
from rlrepro.orchestration.config import ConfigError


def test_unknown_recipe_lists_recipes(capsys):
    assert main(["train", "recipe=grpo_tiy"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'grpo_tiy'" in err and "did you mean grpo_tiny" in err and "grpo_qwen3_8b" in err


def test_missing_recipe(capsys):
    assert main(["train", "train.steps=3"]) == 2
    assert "name a recipe" in capsys.readouterr().err


def test_unknown_key_names_close_keys(capsys):
    assert main(["train", "recipe=grpo_tiny", "train.step=3"]) == 2
    err = capsys.readouterr().err
    assert "train.step" in err and "train.steps" in err


@pytest.mark.parametrize("override,needle", [
    ("train.steps=abc", "train.steps"),
    ("rollout.group_size=1", "rollout.group_size=1"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("train.loss_agg=sum", "train.loss_agg"),
    ("run.device=tpu", "run.device"),
    ("rollout.temperature=-1", "rollout.temperature"),
    ("model.init=pretrained", "model.path"),
    ("+train.lrr=1", "'train.lrr' is not a config key (close: train.lr"),
    ("++rollout.max_num_seq=4", "'rollout.max_num_seq' is not a config key (close: rollout.max_num_seqs"),
    ("train.logits_chunk_size=-8", "train.logits_chunk_size"),
    ("train.dual_clip=0.5", "train.dual_clip=0.5"),
    ("reward.overlong_buffer=12", "reward.overlong_buffer=12"),
    ("reward.overlong_penalty_factor=-1", "reward.overlong_penalty_factor"),
    ("train.entropy_coef=-1", "train.entropy_coef"),
    ("rollout.weight_sync=nccl", "rollout.weight_sync"),
    ("rollout.weight_sync=cuda_ipc", "run.device=cpu"),
    ("train.backend=deepspeed", "train.backend"),
    ("train.tensor_parallel=2", "train.backend=megatron"),
    ("train.backend=megatron train.tensor_parallel=4 train.num_gpus=2", "train.num_gpus=2"),
    ("train.backend=megatron train.tensor_parallel=2 train.num_gpus=3", "not a multiple"),
    ("train.backend=megatron warm_start.steps=5", "warm_start.steps=5"),
    ("checkpoint.format=dist", "train.backend=megatron"),
    ("train.grad_sync=nccl", "train.grad_sync"),
    ("train.grad_sync=megatron", "needs train.backend=megatron"),
    ("run.device=cuda rollout.weight_sync=collective", "duplicate GPU"),
])
def test_bad_values_fail_before_work(tmp_path, override, needle, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "recipe=grpo_tiny", f"run.dir={run_dir}", *override.split()]) == 2
    assert needle in capsys.readouterr().err
    assert not run_dir.exists()  # nothing was started or written


def test_cfg_prints_resolved_config(capsys):
    assert main(["train", "recipe=grpo_tiny", "train.steps=17", "--cfg"]) == 0
    out = capsys.readouterr().out
    assert "steps: 17" in out and "recipe: grpo_tiny" in out


def test_every_recipe_composes():
    from rlrepro.cli import list_recipes

    assert {"grpo_tiny", "grpo_qwen3_8b"} <= set(list_recipes())
    cfg = compose_config(["recipe=grpo_tiny"])
    assert cfg.recipe == "grpo_tiny"
    with pytest.raises(ConfigError, match="model.path"):
        compose_config(["recipe=grpo_qwen3_8b"])


@pytest.mark.parametrize("recipe", ["grpo_qwen3_8b", "grpo_qwen3_8b_tool"])
def test_gpu_recipes_need_a_model_path_and_compose_with_one(recipe, tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        compose_config([f"recipe={recipe}"])
    cfg = compose_config([f"recipe={recipe}", f"model.path={tmp_path}", f"data.source={tmp_path / 'math.jsonl'}"])
    assert cfg.recipe == recipe and cfg.run.device == "cuda" and cfg.data.use_chat_template
    if recipe == "grpo_qwen3_8b_tool":  # multi-turn math with the Python sandbox in Qwen3's tool-call format
        assert (cfg.env.name, list(cfg.env.tools), cfg.env.tool_format) == ("tool", ["python"], "qwen3")
        assert cfg.env.max_episode_tokens <= cfg.rollout.max_model_len


def test_bad_data_set_names_row_and_field(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "copy: ab=", "answer": "ab"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    run_dir = tmp_path / "run"
    assert main(["train", "recipe=grpo_tiny", f"run.dir={run_dir}", f"data.source={data}", "train.steps=1",
                 "train.warmup_steps=0", "logger.progress=false"]) == 2
    err = capsys.readouterr().err
    # the line a person finds in the file (the second), and the keys to type
    assert "bad.jsonl: line 2: field 'answer'" in err and "data.on_bad_row=skip" in err


def test_generate_smoke_is_seeded(capsys):
    """`rlrepro generate`: the tiny model's completions, the same twice for the same seed."""
    assert main(["generate", "--max-tokens", "6", "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--max-tokens", "6", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first
    assert first.count("->") == 3


def test_tensor_parallel_must_divide_the_model(tmp_path, capsys):
    """Checked once the model's shape is known, before any actor starts: the tiny model has 2 KV heads."""
    run_dir = tmp_path / "run"
    assert main(["train", "recipe=grpo_tiny", f"run.dir={run_dir}", "train.backend=megatron",
                 "train.tensor_parallel=4", "train.num_gpus=4", "warm_start.steps=0"]) == 2
    err = capsys.readouterr().err
    assert "num_key_value_heads=2" in err and "[1, 2]" in err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()
