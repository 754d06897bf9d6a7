"""The trained model out as an HF directory: `rlrepro export RUN [--step K] OUT` from full and dist checkpoints,
`checkpoint.export_hf=true` during a run (RUN/export/step_NNNNNN), transformers loads the result, its logits match
rlrepro's, its weights are the checkpoint's bit for bit, and exporting changes no bit of the run."""
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlrepro.cli import main
from rlrepro.model import load_pretrained, write_tiny_checkpoint
from rlrepro.orchestration.export import (export_checkpoint, export_path, export_run_step, list_exports,
                                          prune_exports)
from rlrepro.trainer import list_checkpoints, save_checkpoint
from rlrepro.trainer.checkpoint import verify_checkpoint

transformers = pytest.importorskip("transformers")


def _fake_run(root: Path, steps=(2, 4), dtype=torch.float32) -> Path:
    """A run directory as a model.init=tiny run leaves it: base_model/, config.yaml, full checkpoints whose
    weights differ from the base (so an export of the base weights could not pass)."""
    run = root / "run"
    base = write_tiny_checkpoint(run / "base_model", seed=5, num_hidden_layers=2)
    (run / "config.yaml").write_text("model:\n  init: tiny\n  path: null\n")
    model = load_pretrained(base, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
        save_checkpoint(run / "checkpoints", step, model=model, extra_state={"step": step})
    return run


def _assert_same_tensors(hf_dir: Path, ckpt_weights: Path) -> None:
    exported, saved = load_file(str(hf_dir / "model.safetensors")), load_file(str(ckpt_weights))
    assert sorted(exported) == sorted(saved)
    for name in saved:
        assert exported[name].dtype == saved[name].dtype, name
        assert torch.equal(exported[name], saved[name]), name


def _assert_transformers_parity(hf_dir: Path) -> None:
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    ours = load_pretrained(hf_dir, dtype=torch.float32)
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(60) for _ in range(29)] for _ in range(2)])
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()  # tests/test_model.py's parity tolerance


def test_export_command_from_a_full_checkpoint(tmp_path):
    run = _fake_run(tmp_path)
    before = list_checkpoints(run / "checkpoints")
    out = tmp_path / "out"
    assert main(["export", str(run), str(out)]) == 0  # the newest checkpoint: step 4
    _assert_same_tensors(out, run / "checkpoints" / "step_000004" / "model.safetensors")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "generation_config.json").read_text()).get("eos_token_id") is not None
    assert not list(tmp_path.glob("out.tmp-*"))
    _assert_transformers_parity(out)
    assert transformers.AutoTokenizer.from_pretrained(str(out)).encode("ab")
    # --step picks an older one; its weights are that checkpoint's, not the newest's
    assert main(["export", str(run), "--step", "2", str(tmp_path / "out2")]) == 0
    _assert_same_tensors(tmp_path / "out2", run / "checkpoints" / "step_000002" / "model.safetensors")
    base = load_file(str(run / "base_model" / "model.safetensors"))
    two = load_file(str(tmp_path / "out2" / "model.safetensors"))
    assert not all(torch.equal(base[k], two[k]) for k in base)
    # the checkpoints are untouched
    assert list_checkpoints(run / "checkpoints") == before
    for _, path in before:
        verify_checkpoint(path)


def test_export_command_leaves_the_destinations_neighbours_alone(tmp_path):
    """OUT's parent is the user's: folders there named like rlrepro's set-aside or temporary copies of other
    names (or not ending in a pid) stay as they are; only OUT's own leftovers are cleaned up."""
    run = _fake_run(tmp_path, steps=(2,))
    models = tmp_path / "models"
    mine = ["photos", "photos.old-2019", "thesis.old-draft", "notes.old-12", "policy.old-draft", "policy.tmp-x"]
    for name in mine:
        (models / name).mkdir(parents=True)
        (models / name / "f.txt").write_text(name)
    (models / "policy.tmp-999999").mkdir()  # a killed export of OUT itself: removed
    assert main(["export", str(run), str(models / "policy")]) == 0
    assert sorted(p.name for p in models.iterdir()) == sorted([*mine, "policy"])
    assert all((models / name / "f.txt").read_text() == name for name in mine)


def test_export_keeps_a_bf16_checkpoint_bitwise(tmp_path):
    run = _fake_run(tmp_path, steps=(1,), dtype=torch.bfloat16)
    out = export_checkpoint(run, tmp_path / "bf16")
    _assert_same_tensors(out, run / "checkpoints" / "step_000001" / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(out))
    saved = load_file(str(run / "checkpoints" / "step_000001" / "model.safetensors"))
    state = hf.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name


def test_export_command_refusals(tmp_path, capsys):
    run = _fake_run(tmp_path, steps=(2,))
    assert main(["export", str(run), "--step", "3", str(tmp_path / "x")]) == 2
    assert "no complete checkpoint of step 3" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", str(run), str(tmp_path / "full")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "x").exists()
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2
    assert f"run directory {tmp_path / 'nothing'} not found" in capsys.readouterr().err


def test_export_command_from_a_dist_checkpoint(tmp_path):
    pytest.importorskip("megatron.core")
    from rlrepro.trainer import TrainConfig
    from rlrepro.trainer.megatron import hf_to_dist

    src = _fake_run(tmp_path / "src", steps=(3,))
    assert main(["export", str(src), str(tmp_path / "trained")]) == 0  # an HF dir of trained weights
    run = tmp_path / "run"
    write_tiny_checkpoint(run / "base_model", seed=5, num_hidden_layers=2)
    (run / "config.yaml").write_text("model:\n  init: tiny\n  path: null\n")
    ckpt = hf_to_dist(tmp_path / "trained", run / "checkpoints", TrainConfig(lr=1e-3, steps=4), step=3)
    assert json.loads((ckpt / "manifest.json").read_text())["layout"] == "megatron-dist"
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    _assert_same_tensors(tmp_path / "out", tmp_path / "trained" / "model.safetensors")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    _assert_transformers_parity(tmp_path / "out")


class _FakeActors:
    def __init__(self, model, fail=False):
        self.model, self.fail = model, fail

    def export_hf(self, path):
        from rlrepro.trainer import export_hf

        export_hf(self.model, path)
        if self.fail:
            raise OSError(28, "No space left on device")
        return path


def test_run_export_is_complete_or_absent_and_keeps_the_last(tmp_path):
    base = write_tiny_checkpoint(tmp_path / "base", seed=1)
    model = load_pretrained(base)
    run = tmp_path / "run"
    for step in (1, 2, 3):
        export_run_step(_FakeActors(model), run, step, keep_last=2, tokenizer_from=base)
    assert [s for s, _ in list_exports(run)] == [2, 3]
    with pytest.raises(OSError):
        export_run_step(_FakeActors(model, fail=True), run, 4, keep_last=2, tokenizer_from=base)
    assert not export_path(run, 4).exists()
    assert sorted(p.name for p in (run / "export").iterdir()) == ["step_000002", "step_000003"]
    # the same step again replaces it whole
    export_run_step(_FakeActors(model), run, 3, keep_last=2, tokenizer_from=base)
    assert (export_path(run, 3) / "tokenizer.json").is_file()
    prune_exports(run, 1)
    assert [s for s, _ in list_exports(run)] == [3]
    # a run started over in the same directory: the old run's later exports never count among the newest
    export_run_step(_FakeActors(model), run, 9, keep_last=2, tokenizer_from=base)
    export_run_step(_FakeActors(model), run, 1, keep_last=1, tokenizer_from=base)
    assert [s for s, _ in list_exports(run)] == [1]


@pytest.mark.slow
def test_export_during_a_run_changes_no_bit(tmp_path):
    """grpo_tiny with checkpoint.export_hf=true vs without: rlrepro diff identical; an export beside each
    checkpoint and at the end (save_last=false here, so the end's is not a checkpoint's), each the weights of
    its checkpoint bit for bit; the checkpoints are the same set either way."""
    base = ["recipe=grpo_tiny", "train.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
            "checkpoint.every=2", "checkpoint.save_last=false", "logger.progress=false", "train.warmup_steps=1"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *base, f"run.dir={a}", "checkpoint.export_hf=true"]) == 0
    assert main(["train", *base, f"run.dir={b}"]) == 0
    assert main(["diff", str(a), str(b)]) == 0
    assert [s for s, _ in list_checkpoints(a / "checkpoints")] == [2] == [s for s, _ in
                                                                           list_checkpoints(b / "checkpoints")]
    assert [s for s, _ in list_exports(a)] == [2, 3]
    assert not (b / "export").exists()
    _assert_same_tensors(export_path(a, 2), a / "checkpoints" / "step_000002" / "model.safetensors")
    assert main(["export", str(b), str(tmp_path / "b2")]) == 0
    _assert_same_tensors(export_path(a, 2), tmp_path / "b2" / "model.safetensors")
    _assert_transformers_parity(export_path(a, 3))
    summary = json.loads((a / "summary.json").read_text())
    assert summary["files"]["exported_model"] == str(export_path(a, 3))


@pytest.mark.slow
def test_megatron_tp2_dist_run_exports_what_its_dist_checkpoints_hold(tmp_path):
    """train.backend=megatron at TP=2 with checkpoint.format=dist: the in-run export (a collective: the shards
    gathered, one rank writes) equals `rlrepro export` of that step's dist checkpoint (dist_to_hf), bit for bit."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "m"
    args = ["recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_tokens=6", "warm_start.steps=0", "reward.fn=hash", "logger.progress=false",
            "train.micro_batch_size=4", "train.warmup_steps=1", "train.num_gpus=2", "rollout.num_workers=2",
            "train.backend=megatron", "train.tensor_parallel=2", "checkpoint.format=dist", "checkpoint.every=1",
            "checkpoint.export_hf=true", f"run.dir={run}"]
    assert main(["train", *args]) == 0
    assert [s for s, _ in list_exports(run)] == [1, 2]
    for step in (1, 2):
        out = tmp_path / f"after{step}"
        assert main(["export", str(run), "--step", str(step), str(out)]) == 0
        _assert_same_tensors(export_path(run, step), out / "model.safetensors")
    a, b = (load_file(str(export_path(run, s) / "model.safetensors")) for s in (1, 2))
    assert not all(torch.equal(a[k], b[k]) for k in a)  # two different steps' weights
    _assert_transformers_parity(export_path(run, 2))
