"""A checkpoint load is all or nothing: a load refused for a mismatched optimizer state (other names, shapes, groups,
AdamW settings, a missing master or moment), a bad schedule, a bad RNG state or a missing file leaves every weight,
optimizer tensor, the schedule and every RNG exactly as they were (it used to load the weights first and refuse the
optimizer after: new weights, old optimizer); a good load still gives exactly the saved bits."""
import hashlib
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, capture_rng_state, load_checkpoint, save_checkpoint
from rlrepro.trainer.checkpoint import load_pt
from rlrepro.trainer.optim import MasterWeightAdamW, ShardedMasterWeightAdamW

from test_trainer_checkpoint import make_batch, seed_everything

CONFIG = TrainConfig(lr=3e-3, steps=6, warmup_steps=1, micro_batch_size=3, ppo_epochs=1, clip_high=0.28)

pytestmark = pytest.mark.usefixtures("deterministic_torch")


def _same(a, b) -> bool:
    """Exact equality of nested states: tensors bit for bit (torch.equal, dtype too), arrays, plain values."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _everything(trainer, gen) -> dict:
    """Exact copies of all a load may change: weights and buffers, optimizer state (moments, steps, groups, masters),
    schedule, every RNG (global ones and the named generator)."""
    return {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": {k: v for k, v in trainer.optimizer.state_dict().items()},
            "masters": [(n, m.clone()) for n, m in trainer.optimizer.named_master_weights()],
            "scheduler": trainer.scheduler.state_dict(),
            "lr": [g["lr"] for g in trainer.optimizer.param_groups],
            "rng": capture_rng_state({"sampler": gen})}


def _assert_unchanged(before: dict, after: dict) -> None:
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k]) and v.dtype == after["model"][k].dtype, f"weight {k} changed"
    assert _same(before["optimizer"], after["optimizer"]), "optimizer state changed"
    assert _same(before["masters"], after["masters"]), "master weights changed"
    assert before["scheduler"] == after["scheduler"] and before["lr"] == after["lr"], "schedule changed"
    assert _same(before["rng"], after["rng"]), "an RNG changed"


def _rewrite(path, name: str, mutate) -> None:
    """Change ``path/name`` in place with ``mutate(its contents)`` and record it in the manifest, so the file is intact
    (the hashes match) but does not fit the trainer it is loaded into: the load itself must refuse it."""
    state = load_pt(path / name)
    mutate(state)
    torch.save(state, path / name)
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 trainer (float32 masters) after one step, checkpointed with a named generator."""
    gen = seed_everything(0)
    trainer = Trainer(tiny_model(seed=2), CONFIG, param_dtype=torch.bfloat16)
    trainer.train_step(make_batch(trainer.model, gen))
    root = tmp_path_factory.mktemp("ckpt")
    return trainer.save_checkpoint(root, 1, extra_state={"cursor": 1}, generators={"sampler": gen})


def _copy(saved, tmp_path):
    import shutil

    return shutil.copytree(saved, tmp_path / saved.name)


def _other_trainer():
    """A trainer with other weights, moments and RNG states than the checkpoint's (one step of its own)."""
    gen = seed_everything(7)
    trainer = Trainer(tiny_model(seed=5), CONFIG, param_dtype=torch.bfloat16)
    trainer.train_step(make_batch(trainer.model, gen))
    seed_everything(11)
    return trainer, torch.Generator().manual_seed(13)


def _rename_first(state):
    first = state["names"][0]
    state["names"][0] = first + ".renamed"
    state["master_weights"][first + ".renamed"] = state["master_weights"].pop(first)


def _adamw_entry(state, key, change):
    entry = state["adamw"]["state"][0]
    entry[key] = change(entry[key])


# file, how it is damaged, what the error must say (the problem and the fix)
TAMPERS = {
    "renamed_param": ("optimizer.pt", _rename_first, r"other parameters.*same model"),
    "moment_shape": ("optimizer.pt", lambda s: _adamw_entry(s, "exp_avg", lambda t: t[:-1].clone()),
                     r"exp_avg of '.*' has shape .*same model, param_dtype and optimizer"),
    "dropped_moment": ("optimizer.pt", lambda s: s["adamw"]["state"][0].pop("exp_avg_sq"),
                       r"lacks \['exp_avg_sq'\].*resume from another checkpoint"),
    "dropped_master": ("optimizer.pt", lambda s: s["master_weights"].pop(sorted(s["master_weights"])[-1]),
                       r"lacks the float32 master weight .*same param_dtype"),
    "master_shape": ("optimizer.pt",
                     lambda s: s["master_weights"].update({k: v.t().clone() for k, v in s["master_weights"].items()
                                                           if v.dim() == 2 and v.shape[0] != v.shape[1]}),
                     r"master weight '.*' is torch.float32 .*same model, param_dtype and optimizer"),
    "other_optimizer_setting": ("optimizer.pt", lambda s: s["adamw"]["param_groups"][0].update(foreach=True),
                                r"saved with AdamW foreach=True.*same model, param_dtype and optimizer"),
    "two_groups": ("optimizer.pt", lambda s: s["adamw"].update(param_groups=[
        {**s["adamw"]["param_groups"][0], "params": [0]},
        {**s["adamw"]["param_groups"][0], "params": list(range(1, len(s["names"])))}]),
        r"2 parameter groups.*expected one group"),
    "scheduler": ("scheduler.pt", lambda s: s.pop("total_steps"), r"not a WarmupCosineLR state.*rlrepro wrote"),
    "torch_rng": ("rng.pt", lambda s: s.update(torch_cpu=s["torch_cpu"][:-8].clone()),
                  r"torch CPU RNG state cannot be restored.*earlier checkpoint"),
    "python_rng": ("rng.pt", lambda s: s.update(python=(3, (1, 2, 3), None)),
                   r"Python random RNG state cannot be restored.*earlier checkpoint"),
    "generator_rng": ("rng.pt", lambda s: s["generators"]["sampler"].update(state=torch.zeros(3, dtype=torch.uint8)),
                      r"generator 'sampler' RNG state cannot be restored"),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_refused_load_changes_nothing(saved, tmp_path, case):
    name, mutate, message = TAMPERS[case]
    path = _copy(saved, tmp_path)
    _rewrite(path, name, mutate)
    trainer, gen = _other_trainer()
    before = _everything(trainer, gen)
    assert not _same(before["model"], load_file(str(path / "model.safetensors")))  # a load would change them
    with pytest.raises(ValueError, match=message):
        trainer.load_checkpoint(path, generators={"sampler": gen})
    _assert_unchanged(before, _everything(trainer, gen))


def test_missing_optimizer_file_is_refused_before_the_weights_change(tmp_path):
    gen = seed_everything(0)
    saver = Trainer(tiny_model(seed=2), CONFIG, param_dtype=torch.bfloat16)
    path = save_checkpoint(tmp_path, 1, model=saver.model, scheduler=saver.scheduler,
                           rng_state=capture_rng_state({"sampler": gen}))  # saved without an optimizer
    trainer, gen = _other_trainer()
    before = _everything(trainer, gen)
    with pytest.raises(ValueError, match=r"no optimizer.pt.*pass optimizer=None"):
        trainer.load_checkpoint(path, generators={"sampler": gen})
    _assert_unchanged(before, _everything(trainer, gen))


def test_good_load_gives_exactly_the_saved_bits(saved):
    trainer, gen = _other_trainer()
    assert trainer.load_checkpoint(saved, generators={"sampler": gen}) == {"cursor": 1}
    after = _everything(trainer, gen)
    assert _same(after["model"], load_file(str(saved / "model.safetensors")))
    assert _same(after["optimizer"], load_pt(saved / "optimizer.pt"))
    assert after["scheduler"] == load_pt(saved / "scheduler.pt") and trainer.step == 1
    assert _same(after["rng"], load_pt(saved / "rng.pt"))
    # the bf16 weights are the casts of the loaded float32 masters (the invariant a half-load broke)
    for p, m in zip(trainer.optimizer.params, trainer.optimizer.masters):
        assert torch.equal(p, m.to(p.dtype))


def test_plain_load_checkpoint_refuses_before_loading_the_model(saved, tmp_path):
    """The module function, with a plain optimizer of other parameter names: the model is untouched."""
    path = _copy(saved, tmp_path)
    _rewrite(path, "optimizer.pt", _rename_first)
    trainer, gen = _other_trainer()
    before = _everything(trainer, gen)
    with pytest.raises(ValueError, match="other parameters"):
        load_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                        generators={"sampler": gen})
    _assert_unchanged(before, _everything(trainer, gen))


# ------------------------------------------------------------------------- the sharded optimizer (ZeRO-1), rank 0

def _full_state(model) -> dict:
    """The unsharded optimizer's state after one step with fixed gradients."""
    opt = MasterWeightAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.01)
    opt.set_grads([torch.full(p.shape, 0.5) for p in opt.params])
    opt.step()
    return opt.state_dict()


def _sharded(model):
    dp = SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"), broadcast_=lambda t, src: None)
    return ShardedMasterWeightAdamW(model.named_parameters(), dp, lr=1e-2, weight_decay=0.01)


def _sharded_snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()}, opt.local_state_dict())


def test_sharded_optimizer_refuses_before_changing_its_share():
    full = _full_state(tiny_model(seed=1).to(torch.bfloat16))
    model = tiny_model(seed=3).to(torch.bfloat16)
    opt = _sharded(model)
    assert 0 < len(opt.owned_names()) < len(opt.names)
    bad = {**full, "adamw": {**full["adamw"], "state": dict(full["adamw"]["state"])}}
    other = opt.owners.index(1)  # owned by rank 1 (every rank checks every shape: the same error everywhere)
    bad["adamw"]["state"][other] = {**bad["adamw"]["state"][other], "exp_avg": torch.zeros(2, 3)}
    before = _sharded_snapshot(model, opt)
    with pytest.raises(ValueError, match="has shape"):
        opt.load_state_dict(bad)
    assert _same(before, _sharded_snapshot(model, opt))
    opt.load_state_dict(full)  # the good state loads: this rank's share, exactly
    mine = opt.local_state_dict()
    assert all(torch.equal(mine["master_weights"][n], full["master_weights"][n]) for n in opt.owned_names())


def test_sharded_optimizer_takes_a_dist_share_without_other_ranks_tensors():
    """A dist checkpoint gives each rank only its share: others' masters as None, others' moments absent."""
    full = _full_state(tiny_model(seed=1).to(torch.bfloat16))
    opt = _sharded(tiny_model(seed=3).to(torch.bfloat16))
    mine = set(opt.owned_names())
    share = {"names": full["names"], "adamw": {"param_groups": full["adamw"]["param_groups"], "state": {
        i: e for i, e in full["adamw"]["state"].items() if full["names"][i] in mine}},
        "master_weights": {n: (t if n in mine else None) for n, t in full["master_weights"].items()}}
    opt.load_state_dict(share)
    assert all(torch.equal(opt.local_state_dict()["master_weights"][n], full["master_weights"][n]) for n in mine)


def test_python_rng_untouched_by_a_refused_load(saved, tmp_path):
    """The draws after a refused load are those the process would have made without it."""
    path = _copy(saved, tmp_path)
    _rewrite(path, "scheduler.pt", lambda s: s.pop("last_step"))
    trainer, gen = _other_trainer()
    state = random.getstate()
    expected = random.random()
    random.setstate(state)
    with pytest.raises(ValueError):
        trainer.load_checkpoint(path, generators={"sampler": gen})
    assert random.random() == expected
