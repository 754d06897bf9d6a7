"""Session 31 review of the model's way in and out (HF directories, `rlrepro export`): a save_pretrained that
fails half way over an earlier save must not leave a directory that loads as a mix of old and new weights; the
RoPE inv_freq buffers older transformers saved are skipped as transformers skips them; a non-float dtype is
refused by name; an export into the run's checkpoints/ is refused."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import rlrepro.model.checkpoint_io as checkpoint_io
from rlrepro.model import load_pretrained, save_pretrained, write_tiny_checkpoint
from rlrepro.model.checkpoint_io import check_pretrained
from rlrepro.orchestration.export import export_checkpoint
from rlrepro.trainer.checkpoint import verify_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from test_export import _fake_run  # noqa: E402


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(sa) == sorted(sb) and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def test_save_that_fails_half_way_over_an_earlier_save_is_not_loadable(tmp_path, monkeypatch):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)
    old = load_pretrained(src)
    out = save_pretrained(old, tmp_path / "out", max_shard_bytes=20000)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    new = load_pretrained(src)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1)
    real, calls = checkpoint_io.save_file, []

    def fail_on_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_io, "save_file", fail_on_second_shard)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(new, out, max_shard_bytes=20000)
    monkeypatch.setattr(checkpoint_io, "save_file", real)
    # before: config.json of the earlier save + the new first shard + the old others loaded as a silent mix
    with pytest.raises(FileNotFoundError, match="did not finish"):
        load_pretrained(out)
    save_pretrained(new, out, max_shard_bytes=20000)  # saving again completes it
    assert _same_weights(load_pretrained(out), new)
    assert not [f.name for f in out.iterdir() if f.name.startswith(".")]


@pytest.mark.parametrize("tied", [True, False])
def test_rotary_inv_freq_buffers_in_the_weights_are_skipped(tmp_path, tied):
    src = write_tiny_checkpoint(tmp_path / "src", seed=2, tie_word_embeddings=tied)
    d = tmp_path / "with_inv_freq"
    shutil.copytree(src, d)
    state = load_file(str(d / "model.safetensors"))
    for i in range(2):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.arange(8, dtype=torch.float32)
    state["model.rotary_emb.inv_freq"] = torch.arange(8, dtype=torch.float32)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    check_pretrained(d)
    assert _same_weights(load_pretrained(d), load_pretrained(src))
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # any other unknown tensor: still refused
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_pretrained(d)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "bf16"])
def test_load_pretrained_names_the_dtypes_it_takes(tmp_path, dtype):
    src = write_tiny_checkpoint(tmp_path / "src")
    with pytest.raises(ValueError, match="is not one of None, 'auto', float32, float16, bfloat16"):
        load_pretrained(src, dtype=dtype)


def test_export_into_the_runs_checkpoints_is_refused(tmp_path):
    run = _fake_run(tmp_path, steps=(2,))
    ckpt = run / "checkpoints" / "step_000002"
    for out in (ckpt / "hf", run / "checkpoints" / "step_000009"):
        with pytest.raises(ValueError, match="inside the run's checkpoints/"):
            export_checkpoint(run, out)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    verify_checkpoint(ckpt, check_hashes=True)
    out = export_checkpoint(run, tmp_path / "hf")  # beside the run: fine, and complete
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
