"""RUN/base_model (prepare_base_model: atomic, with a manifest, verified on reuse) and model paths
(resolve_model_dir: an HF directory, a run directory or a checkpoint; `rlrepro generate --model` on each)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlrepro.cli import main
from rlrepro.model import (BaseModelError, ModelDirError, Qwen3Config, Qwen3ForCausalLM, init_random_weights,
                           load_pretrained, load_tokenizer, prepare_base_model, resolve_model_dir, save_pretrained,
                           tiny_model, verify_base_model, write_tiny_checkpoint)
from rlrepro.rollout import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(init="tiny", path=None, init_seed=0, dtype=None,
            tiny_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2})
TINY_RECIPE = {"init": "tiny", "init_seed": 0, "tiny_overrides": TINY["tiny_overrides"]}


def _old_prepare_model_dir(run_dir: Path, *, init, path, init_seed, dtype, tiny_overrides) -> Path:
    """orchestration.driver.prepare_model_dir as it was before prepare_base_model (frozen copy, minus the cfg)."""
    target, tmp = run_dir / "base_model", run_dir / "base_model.tmp"
    run_dir.mkdir(parents=True, exist_ok=True)
    if init == "tiny":
        write_tiny_checkpoint(tmp, seed=init_seed, **tiny_overrides)
    else:
        config = Qwen3Config.from_file(path)
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype or "", config.dtype)
        model = init_random_weights(Qwen3ForCausalLM(config).to(dt), init_seed)
        save_pretrained(model, tmp, max_shard_bytes=5 << 30, tokenizer_from=path)
    os.replace(tmp, target)
    return target


def _files(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if p.is_file() and p.name != "manifest.json"}


def _assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


# ------------------------------------------------------------------------------------------------ base_model

def test_tiny_base_model_is_todays_bytes_with_a_manifest(tmp_path):
    target = prepare_base_model(tmp_path / "run", **TINY)
    assert target == tmp_path / "run" / "base_model"
    plain = write_tiny_checkpoint(tmp_path / "plain", seed=0, **TINY["tiny_overrides"])
    _assert_same_tensors(target, plain)
    old = _old_prepare_model_dir(tmp_path / "old", **TINY)
    assert _files(target) == _files(old)  # every file byte for byte, config.json and tokenizer included
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["format"] == "rlrepro-base-model" and manifest["version"] == 1
    assert manifest["recipe"] == TINY_RECIPE
    assert set(manifest["files"]) == set(_files(target))
    assert manifest["files"]["model.safetensors"]["sha256"] == _files(target)["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["base_model"]  # no temporary left


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_random_base_model_is_todays_bytes(tmp_path, dtype):
    source = write_tiny_checkpoint(tmp_path / "source", seed=7, num_hidden_layers=1)
    args = dict(init="random", path=str(source), init_seed=3, dtype=dtype, tiny_overrides={})
    target = prepare_base_model(tmp_path / "run", **args)
    old = _old_prepare_model_dir(tmp_path / "old", **args)
    _assert_same_tensors(target, old)
    assert _files(target) == _files(old)
    recipe = json.loads((target / "manifest.json").read_text())["recipe"]
    assert recipe["dtype"] == (dtype or "float32") and recipe["init_seed"] == 3
    assert recipe["source_config_sha256"] == hashlib.sha256((source / "config.json").read_bytes()).hexdigest()
    assert set(recipe["source_tokenizer_sha256"]) == {"tokenizer.json", "tokenizer_config.json",
                                                      "generation_config.json"}


def test_base_model_gets_the_default_modes(tmp_path):
    """Like every directory and file rlrepro writes: what mkdir() / open() give, not a private temp dir's 0o700."""
    from rlrepro._files import current_umask

    target = prepare_base_model(tmp_path / "run", **TINY)
    assert target.stat().st_mode & 0o777 == 0o777 & ~current_umask()
    for f in target.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~current_umask(), f.name


def test_pretrained_is_the_path_itself(tmp_path):
    assert prepare_base_model(tmp_path / "run", init="pretrained", path="/some/model", init_seed=0, dtype=None,
                              tiny_overrides={}) == Path("/some/model")
    assert not (tmp_path / "run").exists()


def test_reuse_verifies_and_keeps_the_directory(tmp_path):
    target = prepare_base_model(tmp_path / "run", **TINY)
    inode = (target / "model.safetensors").stat().st_ino
    assert prepare_base_model(tmp_path / "run", **TINY) == target
    assert (target / "model.safetensors").stat().st_ino == inode  # reused, not rewritten


def test_corrupted_base_model_is_refused_naming_file_and_fix(tmp_path):
    """Today a base_model with a config.json is reused without a look; a flipped byte must be refused."""
    target = prepare_base_model(tmp_path / "run", **TINY)
    f = target / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(BaseModelError) as err:
        prepare_base_model(tmp_path / "run", **TINY)
    msg = str(err.value)
    assert str(target) in msg and "model.safetensors" in msg and "sha256" in msg
    assert f"delete {target}" in msg and "run.overwrite=true" in msg
    fresh = prepare_base_model(tmp_path / "run", **TINY, overwrite=True)
    assert _files(fresh) == _files(prepare_base_model(tmp_path / "other", **TINY))
    verify_base_model(fresh, None)


@pytest.mark.parametrize("change, key", [({"init_seed": 1}, "init_seed"),
                                         ({"tiny_overrides": {"num_hidden_layers": 1}}, "tiny_overrides")])
def test_other_recipe_is_refused(tmp_path, change, key):
    prepare_base_model(tmp_path / "run", **TINY)
    with pytest.raises(BaseModelError, match=key) as err:
        prepare_base_model(tmp_path / "run", **{**TINY, **change})
    assert "base_model was made with" in str(err.value)


def test_random_source_that_changed_is_refused(tmp_path):
    source = write_tiny_checkpoint(tmp_path / "source", seed=7)
    args = dict(init="random", path=str(source), init_seed=3, dtype=None, tiny_overrides={})
    prepare_base_model(tmp_path / "run", **args)
    raw = json.loads((source / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-5
    (source / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BaseModelError, match="source_config_sha256"):
        prepare_base_model(tmp_path / "run", **args)
    prepare_base_model(tmp_path / "run2", **args)
    with pytest.raises(BaseModelError, match="dtype"):  # and the dtype written is part of the recipe
        prepare_base_model(tmp_path / "run2", **{**args, "dtype": "bfloat16"})
    assert prepare_base_model(tmp_path / "run2", **{**args, "dtype": "float32"}) == tmp_path / "run2" / "base_model"


def test_missing_and_extra_files_are_refused(tmp_path):
    target = prepare_base_model(tmp_path / "run", **TINY)
    (target / "stray.safetensors").write_bytes(b"x")
    with pytest.raises(BaseModelError, match="stray.safetensors is not in the manifest"):
        prepare_base_model(tmp_path / "run", **TINY)
    (target / "stray.safetensors").unlink()
    (target / "tokenizer.json").unlink()
    with pytest.raises(BaseModelError, match="tokenizer.json is missing"):
        prepare_base_model(tmp_path / "run", **TINY)


def test_unreadable_manifest_is_refused_and_overwrite_replaces_it(tmp_path):
    target = prepare_base_model(tmp_path / "run", **TINY)
    (target / "manifest.json").write_text("{not json")
    with pytest.raises(BaseModelError, match="not valid JSON") as err:
        prepare_base_model(tmp_path / "run", **TINY)
    assert str(target) in str(err.value)
    verify_base_model(prepare_base_model(tmp_path / "run", **TINY, overwrite=True), TINY_RECIPE)


def test_base_model_of_an_older_version_is_adopted_when_bit_identical(tmp_path):
    old = _old_prepare_model_dir(tmp_path / "run", **TINY)
    before = _files(old)
    assert prepare_base_model(tmp_path / "run", **TINY) == old
    assert _files(old) == before and (old / "manifest.json").is_file()
    verify_base_model(old, json.loads((old / "manifest.json").read_text())["recipe"])


def test_base_model_without_manifest_that_differs_is_refused(tmp_path):
    _old_prepare_model_dir(tmp_path / "run", **{**TINY, "init_seed": 5})  # another seed, no manifest
    with pytest.raises(BaseModelError, match="no manifest.json") as err:
        prepare_base_model(tmp_path / "run", **TINY)
    assert "model.safetensors" in str(err.value) and "run.overwrite=true" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["base_model"]  # the trial build is gone
    half = tmp_path / "half" / "base_model"  # cut short: a config.json alone
    half.mkdir(parents=True)
    shutil.copy(tmp_path / "run" / "base_model" / "config.json", half)
    with pytest.raises(BaseModelError, match="model.safetensors is missing"):
        prepare_base_model(tmp_path / "half", **TINY)
    assert _files(prepare_base_model(tmp_path / "half", **TINY, overwrite=True)) == _files(
        prepare_base_model(tmp_path / "fresh", **TINY))


def test_stale_temporaries_are_removed_and_an_empty_dir_replaced(tmp_path):
    run = tmp_path / "run"
    (run / "base_model.tmp").mkdir(parents=True)  # what a failed start of the old code left
    (run / "base_model.tmp" / "config.json").write_text("{}")
    (run / "base_model.tmp-abc123").mkdir()
    (run / "base_model").mkdir()  # empty
    target = prepare_base_model(run, **TINY)
    assert sorted(p.name for p in run.iterdir()) == ["base_model"]
    verify_base_model(target, None)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import rlrepro.model.base_model as bm

    def broken(path, **kw):
        Path(path, "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(bm, "write_tiny_checkpoint", broken)
    with pytest.raises(OSError, match="disk full"):
        prepare_base_model(tmp_path / "run", **TINY)
    assert list((tmp_path / "run").iterdir()) == []


# ------------------------------------------------------------------------------------------------ model paths

def _trained(seed: int, dtype=torch.float32):
    """A tiny model whose weights differ from base_model's (seed 0), as a trained policy would."""
    return tiny_model(seed=seed, dtype=dtype)


def _fake_run(tmp_path: Path, *, pretrained: Path | None = None, dtype=torch.float32) -> Path:
    """A run directory as rlrepro train leaves it: config.yaml, base_model/ (init=tiny) or model.path
    (init=pretrained), checkpoints of steps 1 and 2 (rlrepro.trainer.save_checkpoint), a partial step 3 and an
    incomplete step 4."""
    from rlrepro.trainer import save_checkpoint

    run = tmp_path / "run"
    if pretrained is None:
        prepare_base_model(run, **TINY)
        model_cfg = "  init: tiny\n  path: null\n"
    else:
        run.mkdir()
        model_cfg = f"  init: pretrained\n  path: {pretrained}\n"
    (run / "config.yaml").write_text(f"recipe: grpo_tiny\nmodel:\n{model_cfg}  init_seed: 0\n  dtype: null\n")
    for step in (1, 2):
        save_checkpoint(run / "checkpoints", step, model=_trained(10 + step, dtype))
    partial = run / "checkpoints" / "step_000003.tmp-999"
    shutil.copytree(run / "checkpoints" / "step_000002", partial)
    incomplete = run / "checkpoints" / "step_000004"
    shutil.copytree(run / "checkpoints" / "step_000002", incomplete)
    (incomplete / "manifest.json").unlink()
    return run


def _assert_weights(model, expected) -> None:
    got, want = model.state_dict(), expected.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_hf_directory_resolves_to_itself(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "hf", seed=4)
    r = resolve_model_dir(d)
    assert r.kind == "hf" and r.weights_dir == r.tokenizer_dir == r.config_dir == d
    _assert_weights(r.load(), load_pretrained(d))


def test_run_directory_and_checkpoints_resolve_to_the_newest_complete_checkpoint(tmp_path):
    run = _fake_run(tmp_path)
    for path in (run, run / "checkpoints", run / "checkpoints" / "step_000002"):
        r = resolve_model_dir(path)
        assert r.kind == "checkpoint" and r.step == 2 and r.run_dir == run
        assert r.weights_dir == run / "checkpoints" / "step_000002"
        assert r.tokenizer_dir == r.config_dir == run / "base_model"
        _assert_weights(r.load(), _trained(12))
    r = resolve_model_dir(run / "checkpoints" / "step_000001")
    assert r.step == 1
    model = r.load()
    _assert_weights(model, _trained(11))
    out = save_pretrained(model, tmp_path / "export")  # a complete HF directory: tokenizer from base_model
    assert load_tokenizer(out).vocab_size == load_tokenizer(run / "base_model").vocab_size


def test_checkpoint_of_a_pretrained_run_takes_config_and_tokenizer_from_model_path(tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf", seed=4)  # float32 config
    run = _fake_run(tmp_path, pretrained=hf, dtype=torch.bfloat16)  # trained in bf16
    r = resolve_model_dir(run)
    assert r.tokenizer_dir == r.config_dir == hf and r.step == 2
    model = r.load()
    assert model.dtype == torch.bfloat16 and model.config.torch_dtype == "bfloat16"
    _assert_weights(model, _trained(12, torch.bfloat16))


def test_bad_model_paths_name_the_path_and_what_is_accepted(tmp_path):
    accepts = "HF model directory"
    with pytest.raises(ModelDirError, match=accepts) as err:
        resolve_model_dir(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value) and "does not exist" in str(err.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match="is a file"):
        resolve_model_dir(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirError, match=accepts):
        resolve_model_dir(tmp_path / "empty")
    run = tmp_path / "run"
    prepare_base_model(run, **TINY)
    (run / "config.yaml").write_text("model:\n  init: tiny\n")
    with pytest.raises(ModelDirError, match="no complete checkpoint") as err:
        resolve_model_dir(run)
    assert str(run / "base_model") in str(err.value)
    hf = write_tiny_checkpoint(tmp_path / "notok", seed=0)
    (hf / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError, match="no tokenizer.json"):
        resolve_model_dir(hf)


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    run = _fake_run(tmp_path)
    with pytest.raises(ModelDirError, match="did not finish"):
        resolve_model_dir(run / "checkpoints" / "step_000003.tmp-999")
    with pytest.raises(ModelDirError, match="no manifest.json"):
        resolve_model_dir(run / "checkpoints" / "step_000004")
    f = run / "checkpoints" / "step_000002" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    r = resolve_model_dir(run)  # the sizes are right: the hash is checked when loading
    with pytest.raises(ModelDirError, match="sha256") as err:
        r.load()
    assert str(f) in str(err.value)
    manifest = json.loads((run / "checkpoints" / "step_000001" / "manifest.json").read_text())
    alone = tmp_path / "alone" / "step_000001"
    shutil.copytree(run / "checkpoints" / "step_000001", alone)
    with pytest.raises(ModelDirError, match="base=HF_DIR"):
        resolve_model_dir(alone)
    r = resolve_model_dir(alone, base=run / "base_model")
    _assert_weights(r.load(), _trained(11))
    manifest["layout"] = "megatron-dist"
    (alone / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match="dist_to_hf"):
        resolve_model_dir(alone, base=run / "base_model")


# ------------------------------------------------------------------------------------------ rlrepro generate

def _expected_lines(model, tok_dir, prompts, max_tokens):
    tok = load_tokenizer(tok_dir)
    outs = Engine(model, seed=0).generate([tok.encode(p) for p in prompts],
                                          SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0))
    return [f"{p!r} -> {tok.decode(o.token_ids)!r} " for p, o in zip(prompts, outs)]


@pytest.mark.parametrize("kind", ["hf", "run", "checkpoint"])
def test_generate_takes_every_kind_of_model_path(tmp_path, capsys, kind):
    """Today `rlrepro generate --model RUN/checkpoints/step_N` dies with a traceback (no tokenizer.json)."""
    run = _fake_run(tmp_path)
    path = {"hf": run / "base_model", "run": run, "checkpoint": run / "checkpoints" / "step_000001"}[kind]
    expected_model = {"hf": tiny_model(seed=0), "run": _trained(12), "checkpoint": _trained(11)}[kind]
    prompts = ["first: cabd=", "copy: ab="]
    argv = ["generate", "--model", str(path), "--temperature", "0", "--max-tokens", "5"]
    assert main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2
    for line, want in zip(lines, _expected_lines(expected_model, run / "base_model", prompts, 5)):
        assert line.startswith(want), (line, want)
    assert ("step 1" in captured.err) if kind == "checkpoint" else True
    assert ("step 2" in captured.err) if kind == "run" else True


def test_generate_default_is_the_tiny_model_and_says_so(capsys):
    assert main(["generate", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "random, untrained" in captured.err
    lines = captured.out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("'first: cabd=' -> ")
    assert all(("stopped at '<|im_end|>'" in ln) or ("cut at --max-tokens 4" in ln) for ln in lines)
    assert main(["generate", "--max-tokens", "4", "--prompt", "first: AB="]) == 0
    assert "does not know" in capsys.readouterr().err


def test_generate_bad_model_path_exits_2_with_the_reason(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--model", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "empty") in err and "run directory" in err and "Traceback" not in err
