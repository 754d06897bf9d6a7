"""MegatronTrainer's checkpoint loads are all or nothing, as ``Trainer``'s: a full checkpoint (through
``_FullOptimizerView.prepare_state_dict``, for rlrepro's optimizer and megatron-core's) and a dist checkpoint
(``dist_format.load_dist_checkpoint``) whose optimizer state, schedule or RNG state is refused leave every weight,
optimizer tensor, the schedule and the RNGs exactly as they were (both used to copy the weights first and refuse
after); a good load still gives exactly the saved bits. The megatron-core optimizer and the dist format run in a
1-rank gloo process group on CPU (megatron-core's parallel_state)."""
import copy
import re
import shutil
from pathlib import Path

import pytest
import torch

from rlrepro.model import tiny_model, write_tiny_checkpoint
from rlrepro.trainer import TrainConfig, capture_rng_state
from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups

from _dist import gloo_process_group, spawn_ranks
from test_session31_checkpoint_atomic_load import _rewrite, _same

CONFIG = dict(lr=3e-3, steps=6, warmup_steps=1, micro_batch_size=3, ppo_epochs=1, clip_high=0.28)


def _batch(vocab: int, step: int):
    gen = torch.Generator().manual_seed(500 + step)
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(5)]
    comps = [torch.randint(vocab, (1 + (i * 3) % 4,), generator=gen).tolist() for i in range(5)]
    lps = [(-0.5 - torch.rand(len(c), generator=gen)).tolist() for c in comps]
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp, advantage=(-1.0) ** i * (1 + i / 5))
            for i, (p, c, lp) in enumerate(zip(prompts, comps, lps))]


def _everything(trainer, gen) -> dict:
    """Exact copies of all a load may change: full weights, the full optimizer state (masters, moments, steps),
    schedule and lr, every RNG."""
    return {"weights": {n: w.clone() for n, w in trainer.named_weights()},
            "optimizer": copy.deepcopy(trainer._full_optimizer_state(keep=True)),
            "scheduler": trainer.scheduler.state_dict(),
            "lr": [g["lr"] for g in trainer.optimizer.param_groups],
            "rng": capture_rng_state({"g": gen})}


def _unchanged(before: dict, after: dict) -> list[str]:
    """What differs (empty: nothing)."""
    bad = [f"weight {n}" for n, w in before["weights"].items() if not _same(w, after["weights"][n])]
    for key in ("optimizer", "scheduler", "lr", "rng"):
        if not _same(before[key], after[key]):
            bad.append(key)
    return bad


def _rename_first(state):
    first = state["names"][0]
    state["names"][0] = first + ".renamed"
    state["master_weights"][first + ".renamed"] = state["master_weights"].pop(first)


def _moment(key, change):
    def mutate(state):
        entry = state["adamw"]["state"][0]
        entry[key] = change(entry[key])
    return mutate


def _first_master(change):
    def mutate(state):
        name = sorted(state["master_weights"])[0]
        state["master_weights"][name] = change(state["master_weights"][name])
    return mutate


def _scalars(change):
    def mutate(state):
        change(state["scalars"], sorted(state["scalars"])[0])
    return mutate


# --- full checkpoints, rlrepro's optimizer, in this process (TP=1) -------------------------------------------------

FULL_TAMPERS = {
    "renamed_param": (_rename_first, r"other parameters.*same model"),
    "moment_shape": (_moment("exp_avg", lambda t: t[:-1].clone()),
                     r"exp_avg of '.*' has shape .*same model, param_dtype and optimizer"),
    "dropped_moment": (lambda s: s["adamw"]["state"][0].pop("exp_avg_sq"),
                       r"lacks \['exp_avg_sq'\].*resume from another checkpoint"),
    "dropped_master": (lambda s: s["master_weights"].pop(sorted(s["master_weights"])[-1]),
                       r"lacks the float32 master weight .*same param_dtype"),
    "master_shape": (_first_master(lambda t: t[:-1].clone()),
                     r"master weight '.*' is torch.float32 .*same model, param_dtype and optimizer"),
}


def _tp1_trainer(seed: int):
    model = TPQwen3ForCausalLM.from_full(tiny_model(seed=seed), single_process_groups())
    trainer = MegatronTrainer(model, TrainConfig(**CONFIG), param_dtype=torch.bfloat16, temperature=0.9)
    trainer.train_step(_batch(model.config.vocab_size, seed))
    return trainer


@pytest.fixture(scope="module")
def full_saved(tmp_path_factory):
    trainer = _tp1_trainer(1)
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(4)
    path = trainer.save_checkpoint(tmp_path_factory.mktemp("full"), 1, generators={"g": gen})
    return path, _everything(trainer, gen)


@pytest.mark.parametrize("tamper", sorted(FULL_TAMPERS))
def test_a_refused_full_load_leaves_the_megatron_trainer_as_it_was(full_saved, tmp_path, tamper,
                                                                     deterministic_torch):
    path = Path(shutil.copytree(full_saved[0], tmp_path / full_saved[0].name))
    mutate, message = FULL_TAMPERS[tamper]
    _rewrite(path, "optimizer.pt", mutate)
    trainer, gen = _tp1_trainer(2), torch.Generator().manual_seed(9)
    torch.manual_seed(10)
    before = _everything(trainer, gen)
    assert not _same(before["weights"], full_saved[1]["weights"])  # the load would change them
    with pytest.raises(ValueError, match=message):
        trainer.load_checkpoint(path, generators={"g": gen})
    assert _unchanged(before, _everything(trainer, gen)) == []


def test_a_good_full_load_gives_the_saved_bits(full_saved, deterministic_torch):
    trainer, gen = _tp1_trainer(2), torch.Generator()
    trainer.load_checkpoint(full_saved[0], generators={"g": gen})
    assert _unchanged(full_saved[1], _everything(trainer, gen)) == []


# --- megatron-core's optimizer (full) and the dist format (both optimizers), 1-rank gloo ---------------------------

# name -> (checkpoint format, file, how it is damaged, what the error must say)
WORKER_TAMPERS = {
    "full_dropped_moment": ("full", "optimizer.pt", lambda s: s["adamw"]["state"][0].pop("exp_avg_sq"),
                            r"lacks \['exp_avg_sq'\].*resume from another checkpoint"),
    "full_master_shape": ("full", "optimizer.pt", _first_master(lambda t: t[:-1].clone()),
                          r"master weight '.*' is torch.float32 .*same model, param_dtype and optimizer"),
    "full_renamed_param": ("full", "optimizer.pt", _rename_first, r"other parameters.*same model"),
    "full_moment_shape": ("full", "optimizer.pt", _moment("exp_avg_sq", lambda t: t.t().clone()),
                          r"exp_avg_sq of '.*' has shape .*same model, param_dtype and optimizer"),
    "dist_dropped_step": ("dist", "optimizer.pt", _scalars(lambda sc, n: sc.pop(n)),
                          r"lacks \['step'\].*resume from another checkpoint"),
    "dist_renamed_scalar": ("dist", "optimizer.pt", _scalars(lambda sc, n: sc.update({n + ".x": sc.pop(n)})),
                            r"step counts for \['.*\.x'\].*resume from another checkpoint"),
    "dist_two_groups": ("dist", "optimizer.pt", lambda s: s["param_groups"].append(dict(s["param_groups"][0])),
                        r"2 parameter groups.*same model"),
    "dist_scheduler": ("dist", "scheduler.pt", lambda s: s.pop("base_lr"),
                       r"not a WarmupCosineLR state.*resume from a checkpoint rlrepro wrote"),
    "dist_generators": ("dist", None, None, r"holds generators \['g'\] but \['h'\] were passed.*same named"),
}


def _worker(rank, world, port, model_dir, out):
    with gloo_process_group(rank, world, port):
        from rlrepro.trainer.megatron import build_megatron_trainer, destroy_parallel

        def build(kind, steps):
            t = build_megatron_trainer(model_dir, TrainConfig(**CONFIG), temperature=0.9, tensor_parallel=1,
                                       num_gpus=1, use_megatron_parallel_state=True, grad_sync=kind,
                                       param_dtype=torch.bfloat16)
            for s in range(steps):
                t.train_step(_batch(t.model.config.vocab_size, s))
            return t

        res = {}
        for kind in ("ordered", "megatron"):
            t = build(kind, 1)
            gen = torch.Generator().manual_seed(3)
            torch.manual_seed(4)
            saved = {fmt: t.save_checkpoint(f"{out}_{kind}_{fmt}", 1, generators={"g": gen}, checkpoint_format=fmt)
                     for fmt in ("full", "dist")}
            at_save = _everything(t, gen)
            destroy_parallel(t.groups)
            for tag, (fmt, name, mutate, _) in WORKER_TAMPERS.items():
                if tag == "full_master_shape" and kind == "ordered":
                    continue  # (in-process test)
                path = Path(shutil.copytree(saved[fmt], f"{out}_{kind}_{tag}"))
                if name is not None:
                    _rewrite(path, name, mutate)
                r, gen2 = build(kind, 2), torch.Generator().manual_seed(9)
                torch.manual_seed(10)
                before = _everything(r, gen2)
                try:
                    r.load_checkpoint(path, generators={"h" if tag == "dist_generators" else "g": gen2})
                    error = None
                except Exception as e:  # noqa: BLE001 - recorded for the test
                    error = f"{type(e).__name__}: {e}"
                res[(kind, tag)] = {"error": error, "changed": _unchanged(before, _everything(r, gen2)),
                                    "would_change": not _same(before["weights"], at_save["weights"])}
                destroy_parallel(r.groups)
            for fmt, path in saved.items():  # good loads: the saved bits
                r, gen2 = build(kind, 2), torch.Generator()
                r.load_checkpoint(path, generators={"g": gen2})
                res[(kind, f"good_{fmt}")] = _unchanged(at_save, _everything(r, gen2))
                destroy_parallel(r.groups)
        torch.save(res, f"{out}.rank{rank}")


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    pytest.importorskip("megatron.core")
    pytest.importorskip("psutil")
    tmp = tmp_path_factory.mktemp("mcore_atomic")
    write_tiny_checkpoint(tmp / "m", seed=3)
    (res,) = spawn_ranks(_worker, 1, str(tmp / "m"), out=str(tmp / "o"))
    return res


CASES = [(kind, tag) for kind in ("ordered", "megatron") for tag in WORKER_TAMPERS
         if not (tag == "full_master_shape" and kind == "ordered")]


@pytest.mark.parametrize("kind,tag", CASES)
def test_a_refused_megatron_load_leaves_the_trainer_as_it_was(worker_runs, kind, tag):
    """kind: the optimizer (rlrepro's order-fixed one or megatron-core's); tag: which checkpoint format and what
    is damaged. The error names the problem and the fix; nothing live changed though the load would change it."""
    got = worker_runs[(kind, tag)]
    assert got["would_change"]
    assert got["error"] is not None, "the damaged checkpoint was loaded"
    assert got["error"].startswith("ValueError"), got["error"]
    assert re.search(WORKER_TAMPERS[tag][3], got["error"], re.S), got["error"]
    assert got["changed"] == [], f"a refused load changed {got['changed'][:5]}"


@pytest.mark.parametrize("kind", ["ordered", "megatron"])
@pytest.mark.parametrize("fmt", ["full", "dist"])
def test_a_good_megatron_load_gives_the_saved_bits(worker_runs, kind, fmt):
    assert worker_runs[(kind, f"good_{fmt}")] == []
