"""The megatron backend on 2 GPUs over NCCL, bf16, Triton kernels: real TP=2 logits == the emulated TP=2 model on
one GPU, bit for bit, and the TP=2 trainer is exactly on-policy against the engine running the emulated model,
reproducibly. Needs 2 CUDA devices (scripts/gpu_check.sh on an nvidia-h200-x2)."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]

TEMPERATURE = 0.9  # the rollout's (Trainer(temperature=...))
CONFIG = dict(lr=1e-3, steps=5, micro_batch_size=3)
PROMPTS = [[1, 10, 11], [1, 12], [1, 13, 14, 15]]
IDS = [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


def engine_batch(weights, model_dir, step, device, tp=2):
    from rlrepro.model import load_pretrained
    from rlrepro.rollout import Engine, SamplingParams

    model = load_pretrained(model_dir, device=device, dtype=torch.bfloat16).set_tensor_parallel_emulation(tp)
    model.load_state_dict(weights, strict=True)
    engine = Engine(model, device=device, seed=step, max_num_seqs=4)
    prompts = [p for p in PROMPTS for _ in range(2)]
    outs = engine.generate(prompts, [SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=10 * step + i)
                                     for i in range(len(prompts))])
    return [dict(prompt_token_ids=p, completion_token_ids=o.token_ids, rollout_logprobs=o.logprobs,
                 advantage=(-1.0) ** i) for i, (p, o) in enumerate(zip(prompts, outs))]


def _worker(rank, world, port, model_dir, out):
    from rlrepro.trainer import TrainConfig, enable_determinism
    from rlrepro.trainer.megatron import build_megatron_trainer, megatron_core_version

    enable_determinism()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                                         temperature=TEMPERATURE, tensor_parallel=2, num_gpus=world,
                                         device="cuda", dtype=torch.bfloat16,
                                         use_megatron_parallel_state=megatron_core_version() is not None)
        res = {"megatron": trainer.groups.megatron}
        with torch.no_grad():
            res["logits"] = trainer.model(torch.tensor([IDS], device=f"cuda:{rank}")).cpu()
        res["metrics"] = []
        for step in range(2):
            weights = dict(trainer.named_weights())
            res["metrics"].append(trainer.train_step(engine_batch(weights, model_dir, step, f"cuda:{rank}")))
        res["weights"] = {n: w.cpu() for n, w in trainer.named_weights()}
        torch.save(res, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, tag, model_dir):
    out = str(tmp_path / tag)
    mp.start_processes(_worker, args=(2, _free_port(), model_dir, out), nprocs=2, start_method="spawn", join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]


def test_tp2_nccl_matches_emulation_and_is_on_policy_and_reproducible(tmp_path):
    from rlrepro.model import load_pretrained, write_tiny_checkpoint

    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=2))
    a = _launch(tmp_path, "a", model_dir)
    b = _launch(tmp_path, "b", model_dir)
    emulated = load_pretrained(model_dir, device="cuda:0", dtype=torch.bfloat16).set_tensor_parallel_emulation(2)
    with torch.no_grad():
        want = emulated(torch.tensor([IDS], device="cuda:0")).cpu()
    for res in a + b:
        assert torch.equal(res["logits"], want)
        assert [m["train/rollout_logprob_abs_diff"] for m in res["metrics"]] == [0.0, 0.0]
        assert res["metrics"] == a[0]["metrics"]
        for name, w in a[0]["weights"].items():
            assert torch.equal(res["weights"][name], w), name
    print("megatron parallel_state:", a[0]["megatron"], "metrics:", a[0]["metrics"][-1]["train/loss"])


# ------------------------------------------------ megatron-core's DistributedDataParallel and optimizer (NCCL)

def _mcore_worker(rank, world, port, model_dir, tp, grad_sync, dopt, out):
    from rlrepro.trainer import TrainConfig, enable_determinism
    from rlrepro.trainer.megatron import build_megatron_trainer

    enable_determinism()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trainer = build_megatron_trainer(model_dir, TrainConfig(**CONFIG, max_grad_norm=0.5),
                                         temperature=TEMPERATURE, tensor_parallel=tp,
                                         num_gpus=world, device="cuda", dtype=torch.bfloat16,
                                         use_megatron_parallel_state=True, grad_sync=grad_sync,
                                         distributed_optimizer=dopt)
        res = {"metrics": [], "optimizer": type(trainer.optimizer).__name__}
        for step in range(3):
            weights = dict(trainer.named_weights())
            res["metrics"].append(trainer.train_step(engine_batch(weights, model_dir, step, f"cuda:{rank}", tp)))
            if step == 0:  # full and dist checkpoints (the optimizer state gathered from its owners over NCCL)
                ckpts = {fmt: trainer.save_checkpoint(f"{out}_{fmt}", 1, extra_state={"cursor": 5},
                                                      checkpoint_format=fmt) for fmt in ("full", "dist")}
        res["weights"] = {n: w.cpu() for n, w in trainer.named_weights()}
        for fmt, ckpt in ckpts.items():
            resumed = build_megatron_trainer(model_dir, TrainConfig(**CONFIG, max_grad_norm=0.5),
                                             temperature=TEMPERATURE,
                                             tensor_parallel=tp, num_gpus=world, device="cuda", dtype=torch.bfloat16,
                                             use_megatron_parallel_state=True, grad_sync=grad_sync,
                                             distributed_optimizer=dopt)
            res[f"extra_{fmt}"] = resumed.load_checkpoint(ckpt)
            res[f"resumed_metrics_{fmt}"] = [
                resumed.train_step(engine_batch(dict(resumed.named_weights()), model_dir, s, f"cuda:{rank}", tp))
                for s in (1, 2)]
            res[f"resumed_weights_{fmt}"] = {n: w.cpu() for n, w in resumed.named_weights()}
        torch.save(res, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _launch_mcore(tmp_path, tag, model_dir, tp, grad_sync, dopt):
    out = str(tmp_path / tag)
    mp.start_processes(_mcore_worker, args=(2, _free_port(), model_dir, tp, grad_sync, dopt, out), nprocs=2,
                       start_method="spawn", join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("tp,dopt", [(1, True), (2, False)])
def test_megatron_core_ddp_and_optimizer_on_nccl_are_on_policy_and_reproducible(tmp_path, tp, dopt):
    """grad_sync='megatron' (megatron-core's DDP + optimizer; at TP=1 x DP=2 its DistributedOptimizer): exactly on
    policy at every step, two runs identical, every rank the same weights, resume from a full and from a dist
    checkpoint exact;
    close to the order-fixed path."""
    from rlrepro.model import write_tiny_checkpoint

    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=2))
    a = _launch_mcore(tmp_path, "a", model_dir, tp, "megatron", dopt)
    b = _launch_mcore(tmp_path, "b", model_dir, tp, "megatron", dopt)
    ordered = _launch_mcore(tmp_path, "o", model_dir, tp, "ordered", dopt)
    assert a[0]["optimizer"] == "MegatronCoreOptimizer" and ordered[0]["optimizer"] != "MegatronCoreOptimizer"
    for res, fmt in ((r, f) for r in a + b + ordered for f in ("full", "dist")):
        # a fresh trainer resumed from the step-1 checkpoint takes steps 2 and 3 as the uninterrupted run did
        assert res[f"extra_{fmt}"] == {"cursor": 5}
        assert res[f"resumed_metrics_{fmt}"] == res["metrics"][1:], fmt
        for name, w in res["weights"].items():
            assert torch.equal(res[f"resumed_weights_{fmt}"][name], w), (fmt, name)
    for res in a + b:
        assert [m["train/rollout_logprob_abs_diff"] for m in res["metrics"]] == [0.0, 0.0, 0.0]
        assert res["metrics"] == a[0]["metrics"]
        for name, w in a[0]["weights"].items():
            assert torch.equal(res["weights"][name], w), name
    # the first step's loss is computed before any update: the same bits; later steps close (another Adam, norm)
    assert a[0]["metrics"][0]["train/loss"] == ordered[0]["metrics"][0]["train/loss"]
    for x, y in zip(a[0]["metrics"], ordered[0]["metrics"]):
        assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=2e-2)
    for name, w in a[0]["weights"].items():
        torch.testing.assert_close(w.float(), ordered[0]["weights"][name].float(), rtol=0, atol=2e-2)
    print(f"TP={tp} megatron-core: losses", [m["train/loss"] for m in a[0]["metrics"]],
          "ordered:", [m["train/loss"] for m in ordered[0]["metrics"]])
