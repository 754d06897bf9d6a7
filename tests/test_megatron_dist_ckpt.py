"""Sharded (megatron-core dist_checkpointing) checkpoints of MegatronTrainer, TP=2 over 2 gloo processes on CPU:
each rank writes only its shards, atomically (a failure on any rank leaves the previous checkpoint), resume ==
uninterrupted bit for bit (weights, metrics, every rank's RNG, data cursor), loading at another TP (resharding),
conversion to a full rlrepro checkpoint (== what the full format writes, tensor for tensor), to and from HF."""
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from rlrepro.model import load_pretrained, write_tiny_checkpoint
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint

from _dist import gloo_process_group, spawn_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # megatron-core's checkpoint writer imports it

TEMPERATURE = 0.9  # the rollout's (Trainer(temperature=...))
CONFIG = dict(lr=3e-3, steps=6, warmup_steps=1, micro_batch_size=3, ppo_epochs=2, clip_high=0.28,
              kl_coef=0.05, max_grad_norm=0.5)


def batch(model, step: int):
    """Samples whose rollout logprobs are the model's own (a collective on a TP model: every rank calls it)."""
    gen = torch.Generator().manual_seed(900 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(6)]
    completions = [torch.randint(vocab, (1 + (i * 5) % 5,), generator=gen).tolist() for i in range(6)]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, TEMPERATURE)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.float().tolist(),
                 advantage=(-1.0) ** i * (1 + i / 10)) for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


def _build(model_dir, tp, world, **kw):
    from rlrepro.trainer.megatron import build_megatron_trainer

    return build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                                  temperature=TEMPERATURE, tensor_parallel=tp, num_gpus=world,
                                  param_dtype=torch.bfloat16, checkpoint_format="dist", **kw)


def _tp2_worker(rank, world, port, model_dir, other_dir, out):
    import rlrepro.trainer.checkpoint as ckpt_mod

    with gloo_process_group(rank, world, port):
        res = {}
        trainer = _build(model_dir, 2, world, use_megatron_parallel_state=True)
        gen = torch.Generator().manual_seed(5)
        torch.manual_seed(100 + rank)  # each rank's own torch RNG state: the resume must restore each rank's
        res["metrics"] = []
        for step in range(3):
            b = batch(trainer.model, step)
            res["metrics"].append(trainer.train_step(b))
            if step == 0:
                res["dist"] = str(trainer.save_checkpoint(f"{out}_dist", 1, extra_state={"cursor": 7},
                                                          generators={"g": gen}))
                res["full"] = str(trainer.save_checkpoint(f"{out}_full", 1, extra_state={"cursor": 7},
                                                          generators={"g": gen}, checkpoint_format="full"))
                res["rng_at_save"] = torch.get_rng_state()
                res["weights_at_save"] = {n: w.clone() for n, w in trainer.named_weights()}
        res["weights"] = {n: w.clone() for n, w in trainer.named_weights()}
        res["local_shapes"] = {n: tuple(p.shape) for n, p in trainer.model.named_parameters()}

        # resume into a fresh trainer: steps 2 and 3 again, bit for bit
        resumed = _build(model_dir, 2, world)
        res["fresh_differs"] = any(not torch.equal(w, res["weights_at_save"][n]) for n, w in resumed.named_weights())
        torch.manual_seed(12345)
        gen2 = torch.Generator()
        res["extra"] = resumed.load_checkpoint(res["dist"], generators={"g": gen2})
        res["gen_equal"] = torch.equal(gen2.get_state(), gen.get_state())
        res["rng_restored"] = torch.equal(torch.get_rng_state(), res["rng_at_save"])
        res["resumed_step"] = resumed.step
        res["resumed_metrics"] = [resumed.train_step(batch(resumed.model, s)) for s in (1, 2)]
        res["resumed_weights"] = {n: w.clone() for n, w in resumed.named_weights()}

        # a failure on rank 1 (writing its RNG file) after megatron's collective save: every rank raises, the
        # temporary directory is removed, step 1 stays the latest
        real_write = ckpt_mod._write_file

        def failing_rng_write(path, write):
            if rank == 1 and path.parent.name == "rng":
                raise RuntimeError("simulated crash on rank 1")
            return real_write(path, write)

        ckpt_mod._write_file = failing_rng_write
        try:
            trainer.save_checkpoint(f"{out}_dist", 2)
        except RuntimeError as e:
            res["crash_rank1"] = str(e)
        finally:
            ckpt_mod._write_file = real_write

        # a crash while rank 0 writes the manifest (the last file)
        def failing_manifest_write(path, write):
            if path.name == "manifest.json":
                raise RuntimeError("simulated crash writing the manifest")
            return real_write(path, write)

        ckpt_mod._write_file = failing_manifest_write
        try:
            trainer.save_checkpoint(f"{out}_dist", 3)
        except RuntimeError as e:
            res["crash_manifest"] = str(e)
        finally:
            ckpt_mod._write_file = real_write
        torch.distributed.barrier()
        res["listing_after_crashes"] = sorted(p.name for p in Path(f"{out}_dist").iterdir())

        # a damaged shard file is refused on every rank before any tensor is read
        if rank == 0:
            bad = Path(f"{out}_bad")
            shutil.copytree(res["dist"], bad / "step_000001")
            victim = sorted((bad / "step_000001" / "dist").glob("*.distcp"))[-1]
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        torch.distributed.barrier()
        try:
            resumed.load_checkpoint(f"{out}_bad/step_000001", generators={"g": torch.Generator()})
        except (ValueError, RuntimeError) as e:
            res["damaged"] = str(e)

        # a checkpoint of another model shape is refused, naming the tensor and the config values
        other = _build(other_dir, 2, world)
        try:
            other.load_checkpoint(res["dist"], generators={"g": torch.Generator()})
        except ValueError as e:
            res["other_shape"] = str(e)

        # start a TP=2 run from a dist checkpoint made from an HF directory (hf_to_dist, written at TP=1)
        fresh = _build(model_dir, 2, world)
        res["from_hf_extra"] = fresh.load_checkpoint(f"{out}_hfdist/step_000000", generators=None)
        res["from_hf_local"] = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
        res["from_hf_masters"] = {n: m.detach().clone() for n, m in fresh.optimizer.named_master_weights()}
        res["from_hf_state"] = len(fresh.optimizer.inner.state)
        res["from_hf_metrics"] = fresh.train_step(batch(fresh.model, 0))
        res["first_metrics_again"] = res["metrics"][0]
        torch.save(res, f"{out}.rank{rank}")


def _tp1_worker(rank, world, port, model_dir, ckpt_path, out):
    """TP=1 (one process, or DP=2 over two) loads the TP=2 dist checkpoint: megatron reshards."""
    with gloo_process_group(rank, world, port):
        trainer = _build(model_dir, 1, world, use_megatron_parallel_state=False)
        res = {"extra": trainer.load_checkpoint(ckpt_path, generators={"g": torch.Generator()}), "step": trainer.step}
        res["weights"] = {n: w.clone() for n, w in trainer.named_weights()}
        res["optim"] = copy.deepcopy(trainer.optimizer.state_dict())
        res["metrics"] = trainer.train_step(batch(trainer.model, 1))
        torch.save(res, f"{out}.rank{rank}")


def _hf_to_dist_worker(rank, world, port, model_dir, out):
    from rlrepro.trainer.megatron import hf_to_dist

    path = hf_to_dist(model_dir, f"{out}_hfdist", TrainConfig(**CONFIG), param_dtype=torch.bfloat16,
                      extra_state={"cursor": 0})
    torch.save({"path": str(path)}, f"{out}.rank{rank}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distckpt")
    model_dir = str(write_tiny_checkpoint(tmp / "model", seed=3))
    other_dir = str(write_tiny_checkpoint(tmp / "other", seed=3, hidden_size=32))
    out = str(tmp / "a")
    spawn_ranks(_hf_to_dist_worker, 1, model_dir, out=str(tmp / "h"))
    shutil.move(str(tmp / "h_hfdist"), f"{out}_hfdist")
    tp2 = spawn_ranks(_tp2_worker, 2, model_dir, other_dir, out=out)
    tp1 = spawn_ranks(_tp1_worker, 1, model_dir, tp2[0]["dist"], out=str(tmp / "t1"))
    dp2 = spawn_ranks(_tp1_worker, 2, model_dir, tp2[0]["dist"], out=str(tmp / "d2"))
    return tmp, model_dir, tp2, tp1, dp2


def test_each_rank_writes_only_its_shards_into_an_atomic_verified_layout(runs):
    _, _, tp2, _, _ = runs
    path = Path(tp2[0]["dist"])
    assert tp2[1]["dist"] == str(path) and path.name == "step_000001"
    manifest = verify_checkpoint(path)  # sha256 of every file
    assert manifest["layout"] == "megatron-dist" and manifest["step"] == 1
    names = set(manifest["files"])
    assert {"dist_meta.json", "optimizer.pt", "scheduler.pt", "extra_state.pt", "rng/rank_00000.pt",
            "rng/rank_00001.pt", "dist/.metadata", "dist/metadata.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    assert latest_checkpoint(path.parent) == path
    # each rank's shard files hold about half of the state: no rank wrote the full tensors
    shard_bytes = {r: sum(v["size"] for n, v in manifest["files"].items() if n.startswith(f"dist/__{r}_"))
                   for r in (0, 1)}
    full = Path(tp2[0]["full"])
    full_bytes = sum((full / n).stat().st_size for n in ("model.safetensors", "optimizer.pt"))
    assert 0 < shard_bytes[1] < 0.75 * full_bytes and 0 < shard_bytes[0] < 0.75 * full_bytes
    meta = json.loads((path / "dist_meta.json").read_text())
    assert meta["tensor_parallel"] == 2 and meta["world_size"] == 2
    info = meta["tensors"]["optimizer.exp_avg.model.layers.0.self_attn.o_proj.weight"]
    assert info["shape"] == [64, 64] and info["dtype"] == "float32"
    assert meta["tensors"]["model.model.embed_tokens.weight"]["dtype"] == "bfloat16"
    assert "optimizer.master.model.norm.weight" in meta["tensors"]


def test_resume_from_a_dist_checkpoint_equals_the_uninterrupted_run_bitwise(runs):
    _, _, tp2, _, _ = runs
    for res in tp2:
        assert res["local_shapes"]["model.layers.0.self_attn.o_proj.weight"] == (64, 32)  # really sharded
        assert res["fresh_differs"]  # the load has something to do
        assert res["extra"] == {"cursor": 7} and res["gen_equal"] and res["rng_restored"]
        assert res["resumed_step"] == 1
        assert res["resumed_metrics"] == res["metrics"][1:]
        for name, w in res["weights"].items():
            assert torch.equal(res["resumed_weights"][name], w), name
    assert tp2[0]["metrics"] == tp2[1]["metrics"]
    assert not torch.equal(tp2[0]["rng_at_save"], tp2[1]["rng_at_save"])  # each rank got its own state back


def test_a_failure_on_any_rank_leaves_the_previous_checkpoint(runs):
    tmp, model_dir, tp2, _, _ = runs
    for res in tp2:
        assert "rank 1" in res["crash_rank1"] and "simulated crash on rank 1" in res["crash_rank1"]
        assert "simulated crash writing the manifest" in res["crash_manifest"]
        assert res["listing_after_crashes"] == ["step_000001"]
    root = tmp / "a_dist"
    stale = root / "step_000004.tmp-999999"  # a hard kill leaves a temporary directory behind
    (stale / "dist").mkdir(parents=True)
    (stale / "dist" / "__0_0.distcp").write_bytes(b"partial")
    (root / "step_000005").mkdir()  # or a directory without a manifest
    assert latest_checkpoint(root) == root / "step_000001"


def test_a_damaged_or_foreign_dist_checkpoint_is_refused_with_the_fix(runs):
    _, _, tp2, _, _ = runs
    for res in tp2:
        assert "sha256" in res["damaged"] and ".distcp" in res["damaged"] and "resume from an earlier" in \
            res["damaged"]
        msg = res["other_shape"]
        assert "another model shape" in msg and "model.embed_tokens.weight" in msg
        assert "'hidden_size': (64, 32)" in msg and "build the model from the saving run's config" in msg


def test_a_tp2_dist_checkpoint_loads_at_tp1_and_with_dp2(runs):
    _, _, tp2, tp1, dp2 = runs
    saved = tp2[0]["weights_at_save"]
    for res in tp1 + dp2:
        assert res["extra"] == {"cursor": 7} and res["step"] == 1
        assert res["weights"].keys() == saved.keys()
        for name, w in res["weights"].items():
            assert torch.equal(w, saved[name]), name
    full_optim = load_checkpoint_state(tp2[0]["full"])
    assert_optim_equal(tp1[0]["optim"], full_optim)
    assert dp2[0]["metrics"] == dp2[1]["metrics"]


def load_checkpoint_state(path):
    return torch.load(f"{path}/optimizer.pt", map_location="cpu", weights_only=True)


def assert_optim_equal(a, b):
    assert a["names"] == b["names"]
    assert a["adamw"]["param_groups"] == b["adamw"]["param_groups"]
    assert sorted(a["adamw"]["state"]) == sorted(b["adamw"]["state"]) and a["adamw"]["state"]
    for i, per in a["adamw"]["state"].items():
        assert sorted(per) == sorted(b["adamw"]["state"][i])
        for k, v in per.items():
            assert torch.equal(v, b["adamw"]["state"][i][k]), (a["names"][i], k)
    assert sorted(a["master_weights"]) == sorted(b["master_weights"]) and a["master_weights"]
    for n, v in a["master_weights"].items():
        assert torch.equal(v, b["master_weights"][n]), n


def test_dist_to_full_equals_the_full_format_and_a_plain_trainer_resumes_from_it(runs, deterministic_torch):
    from safetensors.torch import load_file

    from rlrepro.trainer.megatron import dist_to_full

    tmp, model_dir, tp2, tp1, _ = runs
    out = dist_to_full(tp2[0]["dist"], tmp / "converted")
    assert out == tmp / "converted" / "step_000001"
    verify_checkpoint(out)
    full = tp2[0]["full"]
    ours, theirs = load_file(out / "model.safetensors"), load_file(f"{full}/model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert_optim_equal(torch.load(out / "optimizer.pt", weights_only=True), load_checkpoint_state(full))
    for f in ("scheduler.pt", "extra_state.pt"):
        assert torch.load(out / f, weights_only=True) == torch.load(f"{full}/{f}", weights_only=True)
    rng_ours, rng_full = torch.load(out / "rng.pt", weights_only=True), torch.load(f"{full}/rng.pt", weights_only=True)
    assert torch.equal(rng_ours["torch_cpu"], rng_full["torch_cpu"])
    assert torch.equal(rng_ours["generators"]["g"]["state"], rng_full["generators"]["g"]["state"])
    # a plain Trainer resumes from the converted checkpoint and takes the TP=1 MegatronTrainer's step, bit for bit
    model = load_pretrained(model_dir)
    trainer = Trainer(model, TrainConfig(**CONFIG),
                      temperature=TEMPERATURE, ref_model=copy.deepcopy(model), param_dtype=torch.bfloat16)
    loaded = load_checkpoint(out, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                             generators={"g": torch.Generator()})
    assert loaded.extra_state == {"cursor": 7} and trainer.step == 1
    assert trainer.train_step(batch(trainer.model, 1)) == tp1[0]["metrics"]


def test_dist_to_hf_and_hf_to_dist(runs):
    from rlrepro.trainer.megatron import dist_to_hf

    tmp, model_dir, tp2, _, _ = runs
    hf = dist_to_hf(tp2[0]["dist"], tmp / "hf")
    exported = load_pretrained(hf)
    assert exported.dtype == torch.bfloat16
    saved = tp2[0]["weights_at_save"]
    for name, w in exported.state_dict().items():
        assert torch.equal(w, saved[name]), name
    # HF -> dist (written at TP=1), loaded at TP=2: this rank's shards of the HF weights, float32 masters from the
    # float32 HF weights, no AdamW moments, step 0; its first step is the TP=2 run's first step, bit for bit
    from rlrepro.trainer.megatron import ParallelGroups, TPQwen3ForCausalLM

    manifest = verify_checkpoint(tmp / "a_hfdist" / "step_000000")
    assert manifest["layout"] == "megatron-dist"
    for rank, res in enumerate(tp2):
        direct = TPQwen3ForCausalLM.from_pretrained(model_dir, ParallelGroups(None, None, rank, 2, 0, 1))
        for name, p in direct.named_parameters():
            assert torch.equal(res["from_hf_masters"][name], p.detach()), name
            assert torch.equal(res["from_hf_local"][name], p.detach().to(torch.bfloat16)), name
        assert res["from_hf_extra"] == {"cursor": 0} and res["from_hf_state"] == 0
        assert res["from_hf_metrics"] == res["first_metrics_again"]


def test_checkpoint_format_is_checked():
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups
    from rlrepro.model import tiny_model

    model = TPQwen3ForCausalLM.from_full(tiny_model(), single_process_groups())
    with pytest.raises(ValueError, match="checkpoint_format='sharded' is not one of"):
        MegatronTrainer(model, TrainConfig(), checkpoint_format="sharded")
    trainer = MegatronTrainer(model, TrainConfig(), checkpoint_format="dist")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        trainer.save_checkpoint("/nonexistent/never", 1)


# --------------------------------------------------------------------------------------- 2 GPUs, NCCL, bf16

def _three_steps_saving_after_the_first(trainer, out, cursor, res):
    """Three train steps; after the first a dist and a full checkpoint (step 1, extra_state cursor). Fills res."""
    for step in range(3):
        res["metrics"].append(trainer.train_step(batch(trainer.model, step)))
        if step == 0:
            res["dist"] = str(trainer.save_checkpoint(f"{out}_dist", 1, extra_state={"cursor": cursor}))
            res["full"] = str(trainer.save_checkpoint(f"{out}_full", 1, extra_state={"cursor": cursor},
                                                      checkpoint_format="full"))
            res["weights_at_save"] = {n: w.cpu() for n, w in trainer.named_weights()}
    res["weights"] = {n: w.cpu() for n, w in trainer.named_weights()}


def _gpu_worker(rank, world, port, model_dir, zero, out):
    import torch.distributed as dist

    from rlrepro.trainer import enable_determinism
    from rlrepro.trainer.megatron import build_megatron_trainer

    enable_determinism()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        def build(tp):  # zero: TP=1 x DP=2 with rlrepro's ZeRO-1 (each DP owner writes its share)
            return build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                                          temperature=TEMPERATURE, tensor_parallel=tp, num_gpus=world,
                                          device="cuda", dtype=torch.bfloat16, checkpoint_format="dist",
                                          use_megatron_parallel_state=False, distributed_optimizer=zero)

        res = {"metrics": []}
        tp = 1 if zero else 2
        if world == 2:
            trainer = build(tp)
            _three_steps_saving_after_the_first(trainer, out, 7, res)
            resumed = build(tp)
            res["extra"] = resumed.load_checkpoint(res["dist"])
            res["resumed_metrics"] = [resumed.train_step(batch(resumed.model, s)) for s in (1, 2)]
            res["resumed_weights"] = {n: w.cpu() for n, w in resumed.named_weights()}
        else:  # TP=1 on one GPU reads the TP=2 checkpoint
            trainer = build(1)
            res["extra"] = trainer.load_checkpoint(f"{out}_dist/step_000001")
            res["weights"] = {n: w.cpu() for n, w in trainer.named_weights()}
        torch.save(res, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("zero", [False, True], ids=["tp2", "tp1_dp2_zero1"])
def test_gpu_tp2_dist_checkpoint_resumes_bitwise_and_reshards(tmp_path, zero):
    from safetensors.torch import load_file

    from rlrepro.trainer.megatron import dist_to_full

    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=3))
    out = str(tmp_path / "g")
    tp2 = spawn_ranks(_gpu_worker, 2, model_dir, zero, out=out)
    for res in tp2:
        assert res["extra"] == {"cursor": 7}
        assert res["resumed_metrics"] == res["metrics"][1:]
        for name, w in res["weights"].items():
            assert w.dtype == torch.bfloat16 and torch.equal(res["resumed_weights"][name], w), name
    if not zero:  # TP=1 on one GPU reads the TP=2 checkpoint
        (tp1,) = spawn_ranks(_gpu_worker, 1, model_dir, zero, out=out)
        for name, w in tp1["weights"].items():
            assert torch.equal(w, tp2[0]["weights_at_save"][name]), name
    converted = dist_to_full(tp2[0]["dist"], tmp_path / "converted")
    ours, theirs = load_file(converted / "model.safetensors"), load_file(f"{tp2[0]['full']}/model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert_optim_equal(torch.load(converted / "optimizer.pt", weights_only=True),
                       load_checkpoint_state(tp2[0]["full"]))


def test_plain_loader_refuses_a_sharded_checkpoint_and_names_the_converter(runs):
    """rlrepro.trainer.load_checkpoint on a megatron-dist checkpoint: a clear error pointing at dist_to_full,
    not a confusing 'no model.safetensors'."""
    from rlrepro.model import load_pretrained
    from rlrepro.trainer import load_checkpoint

    tmp, model_dir, tp2, _, _ = runs
    with pytest.raises(ValueError, match="megatron-dist.*dist_to_full"):
        load_checkpoint(tp2[0]["dist"], model=load_pretrained(model_dir))


# ---------------------------------------------- rlrepro's ZeRO-1 (distributed_optimizer) with dist checkpoints

def _zero_worker(rank, world, port, model_dir, out):
    with gloo_process_group(rank, world, port):
        from rlrepro.trainer.megatron import destroy_parallel

        res = {"metrics": []}
        trainer = _build(model_dir, 2, world, use_megatron_parallel_state=True, distributed_optimizer=True)
        _three_steps_saving_after_the_first(trainer, out, 9, res)
        res["owned"] = trainer.optimizer.owned_names()
        # resume the ZeRO-1 dist checkpoint into a fresh ZeRO-1 trainer, and into one with the unsharded optimizer
        for tag, sharded in (("zero", True), ("plain", False)):
            r = _build(model_dir, 2, world, use_megatron_parallel_state=True, distributed_optimizer=sharded)
            res[f"{tag}_extra"] = r.load_checkpoint(res["dist"])
            res[f"{tag}_metrics"] = [r.train_step(batch(r.model, s)) for s in (1, 2)]
            res[f"{tag}_weights"] = {n: w.clone() for n, w in r.named_weights()}
        destroy_parallel(trainer.groups)
        torch.save(res, f"{out}.rank{rank}")


@pytest.mark.slow
def test_zero1_dist_checkpoint_each_owner_writes_its_share_and_resumes_bitwise(tmp_path):
    """TP=2 x DP=2 over 4 processes with rlrepro's ZeRO-1: the dist checkpoint holds every optimizer tensor once
    (written by its DP owner), converts to the full format's contents, and resumes a fresh ZeRO-1 trainer and an
    unsharded one to the uninterrupted run's metrics and weights."""
    from rlrepro.trainer.megatron import dist_to_full

    write_tiny_checkpoint(tmp_path / "m", seed=6)
    ranks = spawn_ranks(_zero_worker, 4, str(tmp_path / "m"), out=str(tmp_path / "z"))
    assert set(ranks[0]["owned"]) != set(ranks[2]["owned"])  # the DP replicas own different tensors
    for res in ranks:
        for tag in ("zero", "plain"):
            assert res[f"{tag}_extra"] == {"cursor": 9}
            assert res[f"{tag}_metrics"] == res["metrics"][1:], tag
            for n, w in res["weights"].items():
                assert torch.equal(res[f"{tag}_weights"][n], w), (tag, n)
    meta = json.loads((Path(ranks[0]["dist"]) / "dist_meta.json").read_text())
    assert {i["kind"] for i in meta["tensors"].values()} == {"model", "master", "state"}
    converted = dist_to_full(ranks[0]["dist"], tmp_path / "converted")
    assert_optim_equal(torch.load(converted / "optimizer.pt", weights_only=True),
                       load_checkpoint_state(ranks[0]["full"]))


# ------------------------------------------------------------------------- hf_to_dist (in this process, 1 rank)

def test_hf_to_dist_takes_a_megatron_core_run_config_and_writes_the_same_checkpoint(tmp_path):
    """``hf_to_dist`` with the config of a ``train.grad_sync=megatron`` run (whose optimizer needs megatron-core's
    parallel_state, which hf_to_dist does not set up) writes what it writes for an ``ordered`` run: the layout does
    not depend on grad_sync (the same files, the same tensors)."""
    from rlrepro.trainer.megatron import hf_to_dist
    from rlrepro.trainer.megatron.dist_checkpoint import _read_full_tensors

    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=3)
    common = dict(lr=1e-3, steps=4, backend="megatron")
    paths = {}
    for tag, cfg in (("ordered", TrainConfig(**common)),
                     ("megatron", TrainConfig(**common, grad_sync="megatron", num_gpus=2, distributed_optimizer=True))):
        paths[tag] = hf_to_dist(model_dir, tmp_path / tag, cfg, param_dtype=torch.bfloat16, extra_state={"c": 0})
    files = {tag: verify_checkpoint(p)["files"] for tag, p in paths.items()}
    assert set(files["megatron"]) == set(files["ordered"])
    for name in ("dist_meta.json", "optimizer.pt", "scheduler.pt", "extra_state.pt"):
        assert files["megatron"][name]["sha256"] == files["ordered"][name]["sha256"], name
    meta = json.loads((paths["ordered"] / "dist_meta.json").read_text())
    a, b = (_read_full_tensors(paths[tag], meta, ("model", "master", "state")) for tag in ("ordered", "megatron"))
    assert a.keys() == b.keys() and {i["kind"] for i in meta["tensors"].values()} == {"model", "master"}
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_every_file_of_megatron_cores_folder_is_fsynced_before_the_manifest(tmp_path, monkeypatch):
    """megatron-core writes ``common.pt`` and ``metadata.json`` without an fsync: the writing rank syncs every file it
    wrote under ``dist/`` before the manifest is written and the directory renamed into place."""
    import os

    from rlrepro.trainer.megatron import hf_to_dist

    synced = []  # paths relative to the checkpoint's temporary directory, in order (this process only)
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if ".tmp-" in path:
            synced.append(path.split(".tmp-", 1)[1].partition("/")[2])
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=3)
    path = hf_to_dist(model_dir, tmp_path / "c", TrainConfig(lr=1e-3, steps=4), param_dtype=torch.bfloat16)
    monkeypatch.undo()
    dist_files = sorted(str(f.relative_to(path)) for f in (path / "dist").rglob("*") if f.is_file())
    assert {"dist/common.pt", "dist/metadata.json", "dist/.metadata"} <= set(dist_files)
    manifest_at = synced.index("manifest.json")
    for f in dist_files:
        assert f in synced[:manifest_at], f
