"""Checkpoints: resumed == uninterrupted (weights, optimizer, RNG), damage is refused, crashes leave the last one."""
import json
import os
import random

import numpy as np
import pytest
import torch

from rlrepro.model import load_pretrained, tiny_model
from rlrepro.trainer import (TrainConfig, Trainer, capture_rng_state, export_hf,
                             latest_checkpoint, list_checkpoints, load_checkpoint, restore_rng_state, save_checkpoint,
                             token_logprobs)
from rlrepro.trainer import checkpoint as ckpt_mod

CONFIG = TrainConfig(lr=3e-3, steps=6, warmup_steps=1, micro_batch_size=3, ppo_epochs=2, clip_high=0.28)


pytestmark = pytest.mark.usefixtures("deterministic_torch")


def make_batch(model, gen: torch.Generator):
    """Samples drawn from the global torch RNG, numpy, python random and a named generator, so that a resume that
    failed to restore any of them would train on different data."""
    vocab = model.config.vocab_size
    prompts, completions, advs = [], [], []
    for i in range(4):
        n_prompt = 1 + random.randrange(4)
        n_completion = 1 + int(np.random.randint(5))
        prompts.append(torch.randint(vocab, (n_prompt,)).tolist())
        completions.append(torch.randint(vocab, (n_completion,), generator=gen).tolist())
        advs.append(float(i % 2) * 2 - 1)
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=a)
            for p, c, lp, a in zip(prompts, completions, lps, advs)]


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


def _optimizer_tensors(trainer):
    state = trainer.optimizer.inner.state_dict()["state"]
    return [(k, name, t) for k in sorted(state) for name, t in sorted(state[k].items())]


def test_resume_equals_uninterrupted(tmp_path):
    total, k = 4, 2
    gen = seed_everything(0)
    straight = Trainer(tiny_model(seed=2), CONFIG)
    metrics_straight = [straight.train_step(make_batch(straight.model, gen)) for _ in range(total)]
    draws_straight = (torch.rand(3), np.random.rand(2), random.random(), torch.rand(2, generator=gen))

    gen = seed_everything(0)
    first = Trainer(tiny_model(seed=2), CONFIG)
    metrics_first = [first.train_step(make_batch(first.model, gen)) for _ in range(k)]
    path = save_checkpoint(tmp_path / "ckpt", k, model=first.model, optimizer=first.optimizer,
                           scheduler=first.scheduler, extra_state={"data_cursor": k, "driver": {"epoch": 0}},
                           rng_state=capture_rng_state({"sampler": gen}))
    del first
    # a fresh process: other weights, other RNG states
    gen = seed_everything(123)
    resumed = Trainer(tiny_model(seed=9), CONFIG)
    loaded = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), model=resumed.model, optimizer=resumed.optimizer,
                             scheduler=resumed.scheduler, generators={"sampler": gen})
    assert loaded.path == path and loaded.step == k and resumed.step == k
    assert loaded.extra_state == {"data_cursor": k, "driver": {"epoch": 0}}
    metrics_resumed = metrics_first + [resumed.train_step(make_batch(resumed.model, gen)) for _ in range(total - k)]
    draws_resumed = (torch.rand(3), np.random.rand(2), random.random(), torch.rand(2, generator=gen))

    assert metrics_resumed == metrics_straight
    for (na, wa), (nb, wb) in zip(straight.named_weights(), resumed.named_weights()):
        assert na == nb and torch.equal(wa, wb), na
    for (ka, na, ta), (kb, nb, tb) in zip(_optimizer_tensors(straight), _optimizer_tensors(resumed)):
        assert (ka, na) == (kb, nb) and torch.equal(ta, tb), (ka, na)
    assert straight.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]
    assert torch.equal(draws_straight[0], draws_resumed[0]) and np.array_equal(draws_straight[1], draws_resumed[1])
    assert draws_straight[2] == draws_resumed[2] and torch.equal(draws_straight[3], draws_resumed[3])


def test_resume_with_master_weights(tmp_path):
    a = Trainer(tiny_model(seed=2), CONFIG, param_dtype=torch.bfloat16)
    gen = seed_everything(0)
    a.train_step(make_batch(a.model, gen))
    path = a.save_checkpoint(tmp_path, 1, extra_state={"data_order": [3, 1]})  # the Trainer's shorthand
    b = Trainer(tiny_model(seed=5), CONFIG, param_dtype=torch.bfloat16)
    assert b.load_checkpoint(path) == {"data_order": [3, 1]} and b.step == 1
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.optimizer.named_master_weights(),
                                                          b.optimizer.named_master_weights()))
    batch = make_batch(a.model, seed_everything(1))
    assert a.train_step(batch) == b.train_step(batch)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights()))


def _saved(tmp_path, step=1):
    trainer = Trainer(tiny_model(seed=0), CONFIG)
    return trainer, save_checkpoint(tmp_path, step, model=trainer.model, optimizer=trainer.optimizer,
                                    scheduler=trainer.scheduler, extra_state={"cursor": step})


def test_layout_and_manifest(tmp_path):
    _, path = _saved(tmp_path, 7)
    assert path.name == "step_000007"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and sorted(manifest["files"]) == [
        "extra_state.pt", "model.safetensors", "optimizer.pt", "rng.pt", "scheduler.pt"]
    for name, entry in manifest["files"].items():
        assert (path / name).stat().st_size == entry["size"] and len(entry["sha256"]) == 64
    assert [p.name for p in tmp_path.iterdir()] == ["step_000007"]  # no temporary directory left


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.pt", "rng.pt"])
def test_damaged_files_are_refused_naming_the_file(tmp_path, damage, victim):
    trainer, path = _saved(tmp_path)
    f = path / victim
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
        expected = "sha256"
    elif damage == "truncate":
        f.write_bytes(bytes(data[: len(data) - 10]))
        expected = "bytes, the manifest says"
    else:
        f.unlink()
        expected = "missing"
    before = [w.clone() for _, w in trainer.named_weights()]
    with pytest.raises(ValueError, match=rf"{victim}.*{expected}"):
        load_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler)
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, trainer.named_weights()))  # nothing was loaded
    if damage != "flip":  # latest_checkpoint checks presence and sizes, not hashes
        assert latest_checkpoint(tmp_path) is None


def test_missing_manifest_is_refused(tmp_path):
    _, path = _saved(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(ValueError, match="manifest.json is missing"):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path) is None


def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer, first = _saved(tmp_path, 1)
    real_write = ckpt_mod._write_file
    calls = []

    def crashing_write(path, write):
        calls.append(path.name)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real_write(path, write)

    monkeypatch.setattr(ckpt_mod, "_write_file", crashing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(tmp_path, 2, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    # a hard kill leaves a temporary directory behind, and maybe a half-written one without a manifest
    stale = tmp_path / "step_000003.tmp-999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_000004").mkdir()
    assert latest_checkpoint(tmp_path) == first
    loaded = load_checkpoint(first, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler)
    assert loaded.step == 1 and loaded.extra_state == {"cursor": 1}


def test_keep_last_and_latest(tmp_path):
    trainer = Trainer(tiny_model(seed=0), CONFIG)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=trainer.model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path).name == "step_000003"
    (tmp_path / "step_000004.tmp-1").mkdir()
    assert list_checkpoints(tmp_path) == [(2, tmp_path / "step_000002"), (3, tmp_path / "step_000003")]
    save_checkpoint(tmp_path, 3, model=trainer.model)  # saving an existing step replaces it
    assert latest_checkpoint(tmp_path).name == "step_000003"
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    with pytest.raises(ValueError, match="no optimizer.pt"):
        load_checkpoint(tmp_path / "step_000003", optimizer=trainer.optimizer)


def test_rng_state_round_trip_with_registered_generators(tmp_path):
    gens = {"torch": torch.Generator().manual_seed(1), "numpy": np.random.default_rng(2),
            "python": random.Random(3), "mt": np.random.Generator(np.random.MT19937(4))}
    state = capture_rng_state(gens)
    torch.save(state, tmp_path / "rng.pt")
    want = (torch.rand(2), np.random.rand(), random.random(), torch.rand(2, generator=gens["torch"]),
            gens["numpy"].random(), gens["python"].random(), gens["mt"].random())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), gens)
    got = (torch.rand(2), np.random.rand(), random.random(), torch.rand(2, generator=gens["torch"]),
           gens["numpy"].random(), gens["python"].random(), gens["mt"].random())
    assert torch.equal(want[0], got[0]) and torch.equal(want[3], got[3]) and want[1:3] == got[1:3]
    assert want[4:] == got[4:]
    with pytest.raises(ValueError, match="generators"):
        restore_rng_state(state, {})


def test_export_hf_round_trip(tmp_path):
    model = tiny_model(seed=4)
    export_hf(model, tmp_path / "hf")
    loaded = load_pretrained(tmp_path / "hf")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sorted(model.state_dict().items()),
                                                          sorted(loaded.state_dict().items())))
    assert os.path.isfile(tmp_path / "hf" / "config.json")
