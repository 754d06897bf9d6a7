"""``MegatronTrainer(grad_sync="megatron")``: megatron-core's DistributedDataParallel and optimizer (plain and
distributed) on the TP model, over 2 gloo processes with megatron-core's parallel_state (megatron-core's CUDA
allocations redirected to the CPU by ``mcore.cpu_stand_in``; the GPU test is in tests/test_megatron_gpu.py).

On the CPU, with clipping off, the megatron-core path must give the order-fixed path's bits: a sum of two ranks'
float32 grads is the same in any order, megatron-core's Adam is ``torch.optim.AdamW``'s single-tensor path on CPU
tensors (rlrepro's too), and DDP's float32 ``main_grad`` accumulation is rlrepro's. Only the reported grad norm is
another formula (close, not equal). With clipping on, the norm's rounding reaches the weights (close, not equal).
"""
import copy
import math

import pytest
import torch

from rlrepro.model import tiny_model, write_tiny_checkpoint
from rlrepro.trainer import TrainConfig

from _dist import gloo_process_group, spawn_ranks

pytest.importorskip("megatron.core")

TEMPERATURE = 0.9  # the rollout's (Trainer(temperature=...))
CONFIG = dict(lr=3e-3, steps=6, warmup_steps=1, micro_batch_size=2, ppo_epochs=2, clip_high=0.28, max_grad_norm=0.0,
              weight_decay=0.01)


def batch(step: int, vocab: int):
    gen = torch.Generator().manual_seed(900 + step)
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(7)]
    comps = [torch.randint(vocab, (1 + (i * 5) % 6,), generator=gen).tolist() for i in range(7)]
    lps = [(-0.5 - torch.rand(len(c), generator=gen)).tolist() for c in comps]
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp, advantage=(-1.0) ** i * (1 + i / 7))
            for i, (p, c, lp) in enumerate(zip(prompts, comps, lps))]


def _run(model_dir, tp, world, grad_sync, *, steps=3, dopt=False, dtype=None, ckpt=None, **overrides):
    from rlrepro.trainer.megatron import build_megatron_trainer, destroy_parallel

    t = build_megatron_trainer(model_dir, TrainConfig(**{**CONFIG, **overrides}),
                               temperature=TEMPERATURE, tensor_parallel=tp,
                               num_gpus=world, use_megatron_parallel_state=True, grad_sync=grad_sync,
                               distributed_optimizer=dopt, param_dtype=dtype)
    out = {"metrics": [], "ckpt": None}
    for s in range(steps):
        out["metrics"].append(t.train_step(batch(s, t.model.config.vocab_size)))
        if ckpt is not None and s == 0:
            out["ckpt"] = str(t.save_checkpoint(ckpt, 1, extra_state={"cursor": 3}))
            out["dist_ckpt"] = str(t.save_checkpoint(f"{ckpt}_dist", 1, extra_state={"cursor": 3},
                                                     checkpoint_format="dist"))
    out["weights"] = {n: w.clone() for n, w in t.named_weights()}
    out["optim"] = copy.deepcopy(t._full_optimizer_state(keep=True))
    out["trainer"] = t
    if ckpt is None:
        destroy_parallel(t.groups)
    return out


def _strip(run):
    return {k: v for k, v in run.items() if k != "trainer"}


def _worker(rank, world, port, model_dir, out):
    with gloo_process_group(rank, world, port):
        from rlrepro.trainer.megatron import destroy_parallel

        bf16 = torch.bfloat16
        res = {
            # TP=1 x DP=2, float32 parameters (their own masters), clipping off
            "dp_ordered": _run(model_dir, 1, world, "ordered"),
            "dp_mcore": _run(model_dir, 1, world, "megatron"),
            "dp_mcore_dist": _run(model_dir, 1, world, "megatron", dopt=True),
            # bf16 compute with float32 masters (megatron-core's Float16 / distributed optimizer)
            "bf16_ordered": _run(model_dir, 1, world, "ordered", dtype=bf16),
            "bf16_mcore_dist": _run(model_dir, 1, world, "megatron", dopt=True, dtype=bf16),
            # clipping on (the norm is megatron-core's)
            "clip_ordered": _run(model_dir, 1, world, "ordered", max_grad_norm=0.05),
            "clip_mcore_dist": _run(model_dir, 1, world, "megatron", dopt=True, max_grad_norm=0.05),
            # TP=2 x DP=1: q_norm/k_norm grads summed over TP before megatron-core's step
            "tp_mcore": _run(model_dir, 2, world, "megatron", dtype=bf16),
            "tp_ordered_bf16": _run(model_dir, 2, world, "ordered", dtype=bf16),
        }
        # checkpoint: save after step 1 (megatron-core distributed optimizer), resume into a fresh trainer of each
        # kind; the snapshot used between PPO epochs puts the optimizer back exactly
        run = _run(model_dir, 1, world, "megatron", dopt=True, dtype=bf16, ckpt=f"{out}_ck")
        t = run.pop("trainer")
        snap = t._snapshot()
        before = copy.deepcopy(t._full_optimizer_state(keep=True))
        t.train_step(batch(7, t.model.config.vocab_size))
        t._restore(snap)
        after = t._full_optimizer_state(keep=True)
        # (the distributed optimizer's state is gathered onto DP rank 0 only; the other ranks get None)
        res["snapshot_restores"] = (before is None and after is None and rank == 1) or (
            len(_flat(before)) == len(_flat(after)) > 0 and all(
                torch.equal(a, b) for a, b in zip(_flat(before), _flat(after))))
        destroy_parallel(t.groups)
        res["uninterrupted"] = run
        for tag, kind, dopt, fmt in (("megatron", "megatron", True, "ckpt"), ("ordered", "ordered", False, "ckpt"),
                                     ("dist_megatron", "megatron", True, "dist_ckpt"),
                                     ("dist_megatron_plain", "megatron", False, "dist_ckpt"),
                                     ("dist_ordered_zero", "ordered", True, "dist_ckpt")):
            from rlrepro.trainer.megatron import build_megatron_trainer

            r = build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                                       temperature=TEMPERATURE, tensor_parallel=1, num_gpus=world,
                                       use_megatron_parallel_state=True, grad_sync=kind, distributed_optimizer=dopt,
                                       param_dtype=bf16)
            extra = r.load_checkpoint(run[fmt])
            loaded = copy.deepcopy(r._full_optimizer_state(keep=True))  # (the order-fixed path's holds live tensors)
            metrics = [r.train_step(batch(s, r.model.config.vocab_size)) for s in (1, 2)]
            res[f"resumed_{tag}"] = {"extra": extra, "loaded": loaded, "metrics": metrics,
                                     "weights": {n: w.clone() for n, w in r.named_weights()}}
            destroy_parallel(r.groups)
        res["nonfinite"] = _nonfinite_check(model_dir, world)
        torch.save({k: (_strip(v) if isinstance(v, dict) and "trainer" in v else v) for k, v in res.items()},
                   f"{out}.rank{rank}")


def _nonfinite_check(model_dir, world) -> dict:
    """A NaN gradient in the second PPO epoch (megatron-core's DDP + DistributedOptimizer): the step raises on every
    rank, the weights and the optimizer state are those from before the step, and the trainer carries on."""
    from rlrepro.trainer.megatron import build_megatron_trainer, destroy_parallel

    t = build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                               temperature=TEMPERATURE, tensor_parallel=1, num_gpus=world,
                               use_megatron_parallel_state=True, grad_sync="megatron", distributed_optimizer=True,
                               param_dtype=torch.bfloat16)
    t.train_step(batch(0, t.model.config.vocab_size))  # optimizer state to protect
    weights = {n: w.clone() for n, w in t.named_weights()}
    optim = copy.deepcopy(t._full_optimizer_state(keep=True))
    calls = [0]
    param = next(p for _, p in sorted(t.model.named_parameters()))

    def poison(g):
        calls[0] += 1
        return torch.full_like(g, float("nan")) if calls[0] > 2 else g  # epoch 1 clean (2 micro-batches here)

    handle = param.register_hook(poison)
    try:
        t.train_step(batch(1, t.model.config.vocab_size))
        raised = ""
    except FloatingPointError as e:
        raised = str(e)
    handle.remove()
    after = copy.deepcopy(t._full_optimizer_state(keep=True))
    out = {"raised": raised, "calls": calls[0],
           "weights_kept": all(torch.equal(w, weights[n]) for n, w in t.named_weights()),
           "optim_kept": optim is None and after is None or (
               optim is not None and after is not None and _same_optim(optim, after))}
    out["next_loss"] = t.train_step(batch(1, t.model.config.vocab_size))["train/loss"]
    destroy_parallel(t.groups)
    return out


def _flat(state):
    out = [state["master_weights"][n] for n in sorted(state["master_weights"])]
    for i in sorted(state["adamw"]["state"]):
        out += [state["adamw"]["state"][i][k] for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore")
    write_tiny_checkpoint(tmp / "m", seed=3)
    return spawn_ranks(_worker, 2, str(tmp / "m"), out=str(tmp / "out"))


def _same_weights(a, b):
    assert list(a) == list(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _same_optim(a, b):
    """Equal optimizer states. A distributed optimizer's gathered state exists on DP rank 0 only (None on the
    other ranks): a None side is skipped, and the tests check that rank 0 compared real states."""
    if a is None or b is None:
        return False
    assert a["names"] == b["names"]
    assert sorted(a["master_weights"]) == sorted(b["master_weights"])
    assert sorted(a["adamw"]["state"]) == sorted(b["adamw"]["state"]) and a["adamw"]["state"]  # moments to compare
    for x, y in zip(_flat(a), _flat(b)):
        assert torch.equal(x, y)
    return True


def _loss(run):
    return [m["train/loss"] for m in run["metrics"]]


@pytest.mark.parametrize("tag", ["dp_mcore", "dp_mcore_dist"])
def test_megatron_core_ddp_and_optimizer_give_the_ordered_paths_bits_on_cpu(runs, tag):
    for rank in runs:
        _same_weights(rank["dp_ordered"]["weights"], rank[tag]["weights"])
        compared = _same_optim(rank["dp_ordered"]["optim"], rank[tag]["optim"])
        assert compared or (rank is runs[1] and tag == "dp_mcore_dist")
        assert _loss(rank["dp_ordered"]) == _loss(rank[tag])
        for a, b in zip(rank["dp_ordered"]["metrics"], rank[tag]["metrics"]):
            assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
            assert b["train/grad_norm"] > 0
    # both DP ranks hold the same weights (the distributed optimizer all-gathered the updated ranges)
    _same_weights(runs[0][tag]["weights"], runs[1][tag]["weights"])


def test_bf16_with_float32_masters_and_the_distributed_optimizer(runs):
    for rank in runs:
        _same_weights(rank["bf16_ordered"]["weights"], rank["bf16_mcore_dist"]["weights"])
        assert _same_optim(rank["bf16_ordered"]["optim"], rank["bf16_mcore_dist"]["optim"]) or rank is runs[1]
        assert all(w.dtype == torch.bfloat16 for w in rank["bf16_mcore_dist"]["weights"].values())
    assert runs[1]["bf16_mcore_dist"]["optim"] is None  # gathered onto DP rank 0 only
    assert all(m.dtype == torch.float32 for m in runs[0]["bf16_mcore_dist"]["optim"]["master_weights"].values())


def test_clipping_uses_megatron_cores_norm(runs):
    for rank in runs:
        a, b = rank["clip_ordered"], rank["clip_mcore_dist"]
        for x, y in zip(a["metrics"], b["metrics"]):
            assert x["train/grad_norm"] > 0.05  # clipping acted
            assert y["train/grad_norm"] == pytest.approx(x["train/grad_norm"], rel=1e-4)
        for n in a["weights"]:
            torch.testing.assert_close(b["weights"][n], a["weights"][n], rtol=0, atol=1e-5)
        # and it changed the update: unclipped weights are farther away
        assert any(not torch.allclose(rank["dp_ordered"]["weights"][n], b["weights"][n], rtol=0, atol=1e-4)
                   for n in b["weights"])


def test_tensor_parallel_2(runs):
    for rank in runs:
        a, b = rank["tp_ordered_bf16"], rank["tp_mcore"]
        _same_weights(a["weights"], b["weights"])  # full (gathered) weights
        assert _same_optim(a["optim"], b["optim"])  # (no data parallel: every rank holds its state)
        assert _loss(a) == _loss(b)
    _same_weights(runs[0]["tp_mcore"]["weights"], runs[1]["tp_mcore"]["weights"])


def test_checkpoint_resumes_exactly_and_crosses_to_the_ordered_path(runs):
    """Full and dist checkpoints of the megatron-core path (distributed optimizer, bf16 + float32 masters) resume a
    fresh megatron-core trainer (with or without its distributed optimizer) to the uninterrupted run's bits, and
    load into the order-fixed path, with or without its ZeRO-1 (the same state; on the CPU also the same steps)."""
    for rank in runs:
        ref = rank["uninterrupted"]
        for kind in ("megatron", "ordered", "dist_megatron", "dist_megatron_plain", "dist_ordered_zero"):
            res = rank[f"resumed_{kind}"]
            assert res["extra"] == {"cursor": 3}
            assert [m["train/loss"] for m in res["metrics"]] == _loss(ref)[1:]
            _same_weights(ref["weights"], res["weights"])
        assert [m["train/grad_norm"] for m in rank["resumed_megatron"]["metrics"]] == \
            [m["train/grad_norm"] for m in ref["metrics"][1:]]
        assert _same_optim(rank["resumed_megatron"]["loaded"], rank["resumed_ordered"]["loaded"]) or rank is runs[1]
        # the dist checkpoint (each DP owner writes whole tensors gathered from the ranges) loads to the same state
        assert _same_optim(rank["resumed_ordered"]["loaded"], rank["resumed_dist_megatron_plain"]["loaded"])
        assert _same_optim(rank["resumed_dist_megatron"]["loaded"], rank["resumed_megatron"]["loaded"]) \
            or rank is runs[1]
        assert rank["snapshot_restores"]


def test_grad_sync_is_checked():
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups

    model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), single_process_groups())
    with pytest.raises(ValueError, match="grad_sync='nccl' is not one of"):
        MegatronTrainer(copy.deepcopy(model), TrainConfig(), grad_sync="nccl")
    with pytest.raises(ValueError, match="init_parallel"):  # plain groups, not megatron-core's parallel_state
        MegatronTrainer(copy.deepcopy(model), TrainConfig(), grad_sync="megatron")


def _worker_tp2_dp2(rank, world, port, model_dir, out):
    with gloo_process_group(rank, world, port):
        bf16 = torch.bfloat16
        res = {kind: _strip(_run(model_dir, 2, world, kind, dopt=True, dtype=bf16)) for kind in ("ordered", "megatron")}
        torch.save(res, f"{out}.rank{rank}")


@pytest.mark.slow
def test_tp2_x_dp2_with_the_distributed_optimizer(tmp_path):
    """4 processes, TP=2 x DP=2, bf16 with float32 masters, both paths with their distributed optimizer: the same
    weights on every rank and as the order-fixed path; the gathered optimizer state (TP shards gathered after the DP
    owners' ranges) equal on the writer, None on the other replica."""
    write_tiny_checkpoint(tmp_path / "m", seed=4)
    ranks = spawn_ranks(_worker_tp2_dp2, 4, str(tmp_path / "m"), out=str(tmp_path / "out"))
    for r, res in enumerate(ranks):
        _same_weights(res["ordered"]["weights"], res["megatron"]["weights"])
        _same_weights(ranks[0]["megatron"]["weights"], res["megatron"]["weights"])
        assert _loss(res["ordered"]) == _loss(res["megatron"])
        if r in (0, 1):  # replica 0 (DP rank 0): both TP ranks hold the gathered state
            assert _same_optim(res["ordered"]["optim"], res["megatron"]["optim"])
        else:
            assert res["ordered"]["optim"] is None and res["megatron"]["optim"] is None


def test_a_nonfinite_gradient_leaves_the_megatron_core_optimizer_untouched(runs):
    for rank in runs:
        r = rank["nonfinite"]
        assert "PPO epoch 2" in r["raised"] and r["calls"] > 2
        assert r["weights_kept"] and r["optim_kept"]
        assert math.isfinite(r["next_loss"])  # the trainer carries on
    assert runs[0]["nonfinite"]["optim_kept"] is True


def test_checkpoints_refuse_an_adam_other_than_torchs():
    """With Transformer Engine's or Apex's fused Adam (the step count kept elsewhere) the checkpoint layout would lose
    the step: refused, naming the way out. torch's Adam/AdamW (megatron-core's fallback) passes."""
    from types import SimpleNamespace

    from rlrepro.trainer.megatron.mcore import _require_torch_adam

    w = torch.zeros(2, requires_grad=True)
    _require_torch_adam(SimpleNamespace(optimizer=torch.optim.AdamW([w], lr=1.0)))
    with pytest.raises(NotImplementedError, match="train.grad_sync=ordered"):
        _require_torch_adam(SimpleNamespace(optimizer=torch.optim.SGD([w], lr=1.0)))


def test_the_cpu_stand_in_follows_the_models_device_not_the_machine(monkeypatch):
    """A model on the CPU on a machine with CUDA (``run.device=cpu``) still needs megatron-core's CUDA calls on the
    CPU; a model on CUDA needs none of it, whatever ``torch.cuda.is_available()`` says."""
    from rlrepro.trainer.megatron.mcore import cpu_stand_in, cuda_calls_on_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with CUDA
    current = torch.cuda.current_device
    for device in ("cpu", torch.device("cpu")):
        with cpu_stand_in(device):
            assert torch.zeros(2, device="cuda").device == torch.device("cpu")
            assert torch.cuda.current_device() == "cpu"
            assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        with cuda_calls_on_cpu(device):
            torch.cuda.synchronize()
            assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is current
    for device in ("cuda", torch.device("cuda", 0)):  # the real path: nothing redirected
        with cpu_stand_in(device), cuda_calls_on_cpu(device):
            assert torch.cuda.current_device is current and torch.zeros(1).type() == "torch.FloatTensor"


def _cuda_host_worker(rank, world, port, model_dir, out):
    """grad_sync=megatron with the model on the CPU, on a machine without and (faked) with CUDA: train, save a dist
    checkpoint, load it into a fresh trainer, train on."""
    from rlrepro.trainer.megatron import build_megatron_trainer, destroy_parallel

    real = torch.cuda.is_available
    res = {}
    with gloo_process_group(rank, world, port):
        for fake in (False, True):
            torch.cuda.is_available = (lambda: True) if fake else real
            try:
                def build():
                    return build_megatron_trainer(model_dir, TrainConfig(**CONFIG), temperature=TEMPERATURE,
                                                  tensor_parallel=1, num_gpus=world, device="cpu",
                                                  use_megatron_parallel_state=True, grad_sync="megatron",
                                                  param_dtype=torch.bfloat16, checkpoint_format="dist")

                t = build()
                metrics = [t.train_step(batch(0, t.model.config.vocab_size))]
                path = t.save_checkpoint(f"{out}_{fake}", 1)
                destroy_parallel(t.groups)
                t = build()
                t.load_checkpoint(path)
                metrics.append(t.train_step(batch(1, t.model.config.vocab_size)))
                res[fake] = {"metrics": metrics, "weights": {n: w.clone() for n, w in t.named_weights()}}
                destroy_parallel(t.groups)
            finally:
                torch.cuda.is_available = real
    torch.save(res, f"{out}.rank{rank}")


def test_megatron_core_on_a_cpu_model_runs_on_a_machine_with_cuda(tmp_path):
    pytest.importorskip("psutil")  # megatron-core's checkpoint writer imports it
    write_tiny_checkpoint(tmp_path / "m", seed=3)
    res = spawn_ranks(_cuda_host_worker, 1, str(tmp_path / "m"), out=str(tmp_path / "out"))[0]
    assert res[True]["metrics"] == res[False]["metrics"]  # the same bits as on a machine without CUDA
    _same_weights(res[False]["weights"], res[True]["weights"])
