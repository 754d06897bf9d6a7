"""Optimizer-state sharding over data-parallel ranks (ZeRO-1, ``distributed_optimizer``): the same bits as the
unsharded data-parallel trainer (metrics, weights, optimizer state, checkpoints), with each rank holding the
masters and AdamW moments of its own parameters only."""
import random
from pathlib import Path

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer
from rlrepro.trainer.data_parallel import DataParallel, assign_owners
from rlrepro.trainer.optim import MasterWeightAdamW, ShardedMasterWeightAdamW

from _dist import gloo_process_group, spawn_ranks
from test_trainer_data_parallel import make_batch  # the same self-consistent batches

CONFIG = dict(lr=3e-3, steps=5, warmup_steps=1, micro_batch_size=2, ppo_epochs=2, clip_high=0.28,
              weight_decay=0.01)
STEPS, SAVE_AT = 3, 2
CASES = {"bf16": torch.bfloat16, "fp32": None}  # bf16 params + float32 masters; float32 params, their own masters


# ---------------------------------------------------------------------------------------------- owner assignment

def test_assign_owners_by_hand():
    # name order a, b, c, d: a -> 0; b -> 1 (load 0); c -> 1 (load 2 < 10); d -> 1 (load 5 < 10)
    assert assign_owners({"d": 1, "c": 3, "b": 2, "a": 10}, 2) == {"a": 0, "b": 1, "c": 1, "d": 1}
    assert assign_owners([("x", 4), ("y", 4)], 1) == {"x": 0, "y": 0}
    assert assign_owners({"a": 1}, 3) == {"a": 0}  # more ranks than tensors: some own nothing
    with pytest.raises(ValueError, match="world_size"):
        assign_owners({"a": 1}, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_assign_owners_is_a_balanced_pure_function_of_names_and_sizes(world):
    numels = {n: p.numel() for n, p in tiny_model(seed=0).named_parameters()}
    owners = assign_owners(numels, world)
    assert set(owners) == set(numels) and all(0 <= r < world for r in owners.values())  # each owned exactly once
    assert assign_owners(numels, world) == owners
    items = list(numels.items())
    for seed in range(3):  # the input order does not matter
        random.Random(seed).shuffle(items)
        assert assign_owners(items, world) == owners
    load = [sum(n for name, n in numels.items() if owners[name] == r) for r in range(world)]
    assert max(load) - min(load) <= max(numels.values())
    if world <= len(numels):
        assert all(load)  # the first tensors go to ranks 0, 1, ... in turn


def test_without_data_parallel_the_flag_is_a_no_op():
    trainer = Trainer(tiny_model(seed=1), TrainConfig(**CONFIG), distributed_optimizer=True)
    assert not trainer.distributed_optimizer and type(trainer.optimizer) is MasterWeightAdamW


# ------------------------------------------------------------------------------------------ two gloo ranks

def _trainer(dtype, dp, sharded: bool) -> Trainer:
    return Trainer(tiny_model(seed=1), TrainConfig(**CONFIG), param_dtype=dtype, data_parallel=dp,
                   distributed_optimizer=sharded)


def _weights(trainer) -> dict:
    return {n: w.clone() for n, w in trainer.named_weights()}


def _run(trainer, steps, ckpt=None, collective_save=False) -> list[dict]:
    metrics = []
    for s in range(trainer.step, steps):
        metrics.append(trainer.train_step(make_batch(trainer.model, s)))
        if ckpt is not None and trainer.step == SAVE_AT and (collective_save or trainer.data_parallel.rank == 0):
            trainer.save_checkpoint(ckpt, SAVE_AT)
    return metrics


def _worker(rank: int, world_size: int, port: int, root: str, out_path: str) -> None:
    res = {}
    with gloo_process_group(rank, world_size, port):
        dp = DataParallel(bucket_numel=5000)  # small buckets: exercise the bucketing
        for case, dtype in CASES.items():
            r = res[case] = {}
            # unsharded data parallel (rank 0 writes its checkpoint alone)
            plain = _trainer(dtype, dp, False)
            r["plain_metrics"] = _run(plain, STEPS, f"{root}/{case}_plain")
            r["plain_weights"] = _weights(plain)
            plain_masters = dict(plain.optimizer.named_master_weights())
            plain_state = plain.optimizer.state_dict()["adamw"]["state"]

            # sharded: the same bits, and only this rank's share of the state
            zero = _trainer(dtype, dp, True)
            assert isinstance(zero.optimizer, ShardedMasterWeightAdamW)
            r["zero_metrics"] = _run(zero, STEPS, f"{root}/{case}_zero", collective_save=True)
            r["zero_weights"] = _weights(zero)
            opt = zero.optimizer
            r["owned"] = opt.owned_names()
            r["num_adamw_states"] = len(opt.inner.state)
            r["num_masters"] = len(opt.named_master_weights())
            r["has_copy"] = opt.has_master_copies
            r["masters_equal"] = all(torch.equal(m, plain_masters[n]) for n, m in opt.named_master_weights())
            local = opt.local_state_dict()["adamw"]["state"]
            index = {n: i for i, n in enumerate(opt.names)}
            r["adamw_equal"] = all(torch.equal(v, plain_state[index[n]][k])
                                   for j, n in enumerate(r["owned"]) for k, v in local[j].items())
            # a snapshot within a step (PPO epochs, non-finite undo) is this rank's share, put back exactly
            snapshot = zero._snapshot()
            zero.train_step(make_batch(zero.model, STEPS))
            zero._restore(snapshot)
            r["restored"] = (_same_weights(_weights(zero), r["zero_weights"])
                             and all(torch.equal(m, plain_masters[n]) for n, m in opt.named_master_weights())
                             and all(torch.equal(v, plain_state[index[n]][k]) for j, n in enumerate(r["owned"])
                                     for k, v in opt.local_state_dict()["adamw"]["state"][j].items()))
            r["state_dict_refused"] = False
            try:
                opt.state_dict()
            except RuntimeError as e:
                r["state_dict_refused"] = "gather_state_dict" in str(e)

            # resume the sharded checkpoint, sharded and unsharded; and the unsharded checkpoint, sharded
            for tag, sharded, src in (("zero_from_zero", True, "zero"), ("plain_from_zero", False, "zero"),
                                      ("zero_from_plain", True, "plain")):
                t = _trainer(dtype, dp, sharded)
                t.load_checkpoint(f"{root}/{case}_{src}/step_{SAVE_AT:06d}")
                r[f"{tag}_metrics"] = _run(t, STEPS)
                r[f"{tag}_weights"] = _weights(t)
    torch.save(res, f"{out_path}.rank{rank}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    results = spawn_ranks(_worker, 2, str(root / "ckpt"), out=str(root / "res"), weights_only=True)
    return root / "ckpt", results


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_equals_unsharded_bitwise_on_both_ranks(ranks, case):
    _, results = ranks
    r0 = results[0][case]
    assert r0["plain_weights"][next(iter(r0["plain_weights"]))].dtype == (CASES[case] or torch.float32)
    assert r0["has_copy"] == (case == "bf16")
    for r in (res[case] for res in results):
        assert r["zero_metrics"] == r0["plain_metrics"]  # == on every float, every step
        assert _same_weights(r["zero_weights"], r0["plain_weights"])
        assert r["masters_equal"] and r["adamw_equal"]  # the owned state is the unsharded state's
        assert r["restored"]
        assert r["state_dict_refused"]
    assert all(m["train/grad_norm"] > 0 and m["train/rollout_logprob_abs_diff"] == 0.0 for m in r0["zero_metrics"])


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_only_its_share(ranks, case):
    _, results = ranks
    names = sorted(results[0][case]["plain_weights"])
    numels = {n: w.numel() for n, w in results[0][case]["plain_weights"].items()}
    owners = assign_owners(numels, 2)
    owned = [results[r][case]["owned"] for r in range(2)]
    assert sorted(owned[0] + owned[1]) == names and not set(owned[0]) & set(owned[1])
    for r in range(2):
        assert owned[r] == [n for n in names if owners[n] == r]
        assert results[r][case]["num_adamw_states"] == len(owned[r])
        assert results[r][case]["num_masters"] == len(owned[r])
    share = [sum(numels[n] for n in owned[r]) for r in range(2)]
    assert abs(share[0] - share[1]) <= max(numels.values()) and min(share) > 0.25 * sum(share)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_checkpoint_is_the_unsharded_checkpoint_and_resumes_both(ranks, case):
    root, results = ranks
    load = lambda kind, f: torch.load(root / f"{case}_{kind}" / f"step_{SAVE_AT:06d}" / f,  # noqa: E731
                                      weights_only=True)
    plain, zero = load("plain", "optimizer.pt"), load("zero", "optimizer.pt")
    assert plain["names"] == zero["names"]
    assert plain["adamw"]["param_groups"] == zero["adamw"]["param_groups"]
    assert sorted(plain["adamw"]["state"]) == sorted(zero["adamw"]["state"]) == list(range(len(plain["names"])))
    for i, per in plain["adamw"]["state"].items():
        assert per.keys() == zero["adamw"]["state"][i].keys()
        for k, v in per.items():
            assert torch.equal(v, zero["adamw"]["state"][i][k]), (plain["names"][i], k)
    assert plain["master_weights"].keys() == zero["master_weights"].keys()
    assert (len(plain["master_weights"]) > 0) == (case == "bf16")
    assert all(torch.equal(v, zero["master_weights"][n]) for n, v in plain["master_weights"].items())
    for f in ("scheduler.pt", "extra_state.pt"):
        assert load("plain", f) == load("zero", f)
    from safetensors.torch import load_file

    a, b = (load_file(str(root / f"{case}_{k}" / f"step_{SAVE_AT:06d}" / "model.safetensors")) for k in ("plain",
                                                                                                        "zero"))
    assert _same_weights(a, b)

    r0 = results[0][case]
    for r in (res[case] for res in results):  # resumed == uninterrupted, whichever way round
        for tag in ("zero_from_zero", "plain_from_zero", "zero_from_plain"):
            assert r[f"{tag}_metrics"] == r0["plain_metrics"][SAVE_AT:], tag
            assert _same_weights(r[f"{tag}_weights"], r0["plain_weights"]), tag


# ------------------------------------------------------------------------------------------------------ config

def test_megatron_with_distributed_optimizer_config(tmp_path, capsys):
    from rlrepro.cli import compose_config

    # sharded (dist) checkpoints with the sharded optimizer: each DP owner writes its share (test_megatron_dist_ckpt)
    cfg = compose_config(["recipe=grpo_tiny", "train.backend=megatron", "train.tensor_parallel=2",
                          "train.num_gpus=2", "train.distributed_optimizer=true", "checkpoint.format=dist"])
    assert cfg.checkpoint.format == "dist" and cfg.train.distributed_optimizer is True
    cfg = compose_config(["recipe=grpo_tiny", "train.backend=megatron", "train.tensor_parallel=1",
                          "train.num_gpus=2", "train.distributed_optimizer=true"])
    assert cfg.train.distributed_optimizer is True
    for num_gpus in (1, 2):  # allowed with the default backend (one rank: a no-op)
        cfg = compose_config(["recipe=grpo_tiny", f"train.num_gpus={num_gpus}", "train.distributed_optimizer=true"])
        assert cfg.train.distributed_optimizer is True
    assert compose_config(["recipe=grpo_tiny"]).train.distributed_optimizer is False


# --------------------------------------------------------------------------------- megatron: TP=2 x DP=2, 4 ranks

MCONFIG = dict(lr=3e-3, steps=5, warmup_steps=1, micro_batch_size=2, ppo_epochs=2, clip_high=0.28,
               max_grad_norm=0.5)


def fixed_batch(vocab: int, step: int):
    """Off-policy on purpose (rollout logprobs all -1): only equality between the two optimizers matters here."""
    gen = torch.Generator().manual_seed(900 + step)
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(8)]
    completions = [torch.randint(vocab, (1 + (i * 5) % 6,), generator=gen).tolist() for i in range(8)]
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=[-1.0] * len(c), advantage=(-1.0) ** i)
            for i, (p, c) in enumerate(zip(prompts, completions))]


def _megatron_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    with gloo_process_group(rank, world, port):
        from rlrepro.trainer.megatron import build_megatron_trainer

        res = {}
        for sharded in (False, True):
            trainer = build_megatron_trainer(model_dir, TrainConfig(**MCONFIG), tensor_parallel=2, num_gpus=world,
                                             use_megatron_parallel_state=False, distributed_optimizer=sharded)
            vocab = trainer.model.config.vocab_size
            metrics = [trainer.train_step(fixed_batch(vocab, step)) for step in range(3)]
            ckpt = trainer.save_checkpoint(f"{out}_ckpt_{int(sharded)}", 3)
            res[sharded] = dict(metrics=metrics, ckpt=str(ckpt), distributed=trainer.distributed_optimizer,
                                weights={n: w.clone() for n, w in trainer.named_weights()},
                                owned=len(trainer.optimizer.inner.state_dict()["state"]))
        torch.save(res, f"{out}.rank{rank}")


@pytest.mark.slow
def test_megatron_tp2_dp2_sharded_optimizer_is_bitwise_the_unsharded_one(tmp_path):
    from rlrepro.model import write_tiny_checkpoint

    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=3))
    ranks = spawn_ranks(_megatron_worker, 4, model_dir, out=str(tmp_path / "mz"))
    for r in ranks:
        plain, zero = r[False], r[True]
        assert zero["distributed"] and not plain["distributed"]
        assert zero["metrics"] == plain["metrics"]
        assert plain["weights"].keys() == zero["weights"].keys()
        assert all(torch.equal(plain["weights"][n], zero["weights"][n]) for n in plain["weights"])
        assert 0 < zero["owned"] < plain["owned"]  # each DP replica keeps AdamW state for its share only
    # TP ranks 0/1 of DP replica 0 and 1 own complementary shares
    assert ranks[0][True]["owned"] + ranks[2][True]["owned"] == ranks[0][False]["owned"]
    # the full checkpoint gathers the DP owners' state, then the TP shards: the same optimizer.pt
    a = torch.load(Path(ranks[0][False]["ckpt"]) / "optimizer.pt", weights_only=True)
    b = torch.load(Path(ranks[0][True]["ckpt"]) / "optimizer.pt", weights_only=True)
    assert a["names"] == b["names"] and a["master_weights"].keys() == b["master_weights"].keys()
    assert all(torch.equal(a["master_weights"][n], b["master_weights"][n]) for n in a["master_weights"])
    assert a["adamw"]["state"].keys() == b["adamw"]["state"].keys()
    for i, per in a["adamw"]["state"].items():
        for k, v in per.items():
            assert torch.equal(v, b["adamw"]["state"][i][k]) if torch.is_tensor(v) else v == b["adamw"]["state"][i][k]
