"""MegatronTrainer: TP=1 == Trainer bit for bit; TP=2 over 2 gloo processes is exactly on-policy against the engine
running the emulated TP=2 model, reproducible run to run, and its checkpoints resume exactly and are TP-agnostic."""
import copy

import pytest
import torch

from rlrepro.model import load_pretrained, tiny_model, write_tiny_checkpoint
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups

from _dist import gloo_process_group, spawn_ranks

TEMPERATURE = 0.9  # the rollout's (Trainer(temperature=...))
CONFIG = dict(lr=3e-3, steps=5, warmup_steps=1, micro_batch_size=3, ppo_epochs=2, clip_high=0.28,
              kl_coef=0.05, max_grad_norm=0.5)


def random_batch(model, step: int):
    gen = torch.Generator().manual_seed(700 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(7)]
    completions = [torch.randint(vocab, ((i * 5) % 6,), generator=gen).tolist() for i in range(7)]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions, TEMPERATURE)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=(-1.0) ** i)
            for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


@pytest.mark.parametrize("logits_chunk_size", [0, 2])
def test_tp1_megatron_trainer_equals_the_default_trainer_bitwise(deterministic_torch, logits_chunk_size):
    """(With ``logits_chunk_size=2`` the megatron trainer chunks its log-softmax, the default trainer does not.)"""
    plain = tiny_model(seed=1)
    trainer = Trainer(plain, TrainConfig(**CONFIG), temperature=TEMPERATURE, ref_model=copy.deepcopy(plain))
    tp_model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), single_process_groups())
    mtrainer = MegatronTrainer(tp_model, TrainConfig(**CONFIG, logits_chunk_size=logits_chunk_size),
                               temperature=TEMPERATURE,
                               ref_model=copy.deepcopy(tp_model))
    for step in range(3):
        batch = random_batch(plain, step)
        assert trainer.train_step(batch) == mtrainer.train_step(batch)
    ours = list(mtrainer.named_weights())
    assert [n for n, _ in ours] == [n for n, _ in trainer.named_weights()]
    for (name, a), (_, b) in zip(ours, trainer.named_weights()):
        assert torch.equal(a, b), name
    assert mtrainer.step == trainer.step == 3


def test_megatron_trainer_needs_a_tp_model():
    with pytest.raises(TypeError, match="TPQwen3ForCausalLM"):
        MegatronTrainer(tiny_model(), TrainConfig())


def test_tp_model_rejects_a_size_that_does_not_divide_the_model():
    from rlrepro.trainer.megatron import ParallelGroups

    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide the model's num_attention_heads=4"):
        TPQwen3ForCausalLM(tiny_model().config, ParallelGroups(None, None, 0, 3, 0, 1))


# ---------------------------------------------------------------------------------------------- 2 processes

PROMPTS = [[1, 10, 11], [1, 12], [1, 13, 14, 15]]


def engine_batch(weights: dict, model_dir: str, step: int):
    """Samples from the real engine running the TP=2-emulated model with the trainer's current weights."""
    from rlrepro.rollout import Engine, SamplingParams

    model = load_pretrained(model_dir).set_tensor_parallel_emulation(2)
    model.load_state_dict(weights, strict=True)
    engine = Engine(model, device="cpu", seed=step, max_num_seqs=4)
    prompts = [p for p in PROMPTS for _ in range(2)]
    outs = engine.generate(prompts, [SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=10 * step + i)
                                     for i in range(len(prompts))])
    return [dict(prompt_token_ids=p, completion_token_ids=o.token_ids, rollout_logprobs=o.logprobs,
                 advantage=(-1.0) ** i * (1 + i / 10)) for i, (p, o) in enumerate(zip(prompts, outs))]


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    with gloo_process_group(rank, world, port):
        from rlrepro.trainer.megatron import build_megatron_trainer

        def build():
            return build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                                          temperature=TEMPERATURE, tensor_parallel=2, num_gpus=world,
                                          use_megatron_parallel_state=False)

        trainer = build()
        res = {"metrics": [], "ckpt": None}
        gen = torch.Generator().manual_seed(5)
        for step in range(3):
            batch = engine_batch(dict(trainer.named_weights()), model_dir, step)
            res["metrics"].append(trainer.train_step(batch))
            if step == 0:
                res["batch1"] = engine_batch(dict(trainer.named_weights()), model_dir, 1)
                res["ckpt"] = str(trainer.save_checkpoint(f"{out}_ckpt", 1, extra_state={"cursor": 7},
                                                          generators={"g": gen}))
        res["weights"] = dict(trainer.named_weights())
        res["shapes"] = {n: tuple(p.shape) for n, p in trainer.model.named_parameters()}
        trainer.export_hf(f"{out}_hf")
        # resume from the step-1 checkpoint into a fresh trainer: steps 2 and 3 again, bit for bit
        resumed = build()
        gen2 = torch.Generator()
        res["extra"] = resumed.load_checkpoint(res["ckpt"], generators={"g": gen2})
        res["gen_equal"] = torch.equal(gen2.get_state(), gen.get_state())
        res["resumed_metrics"] = []
        for s in (1, 2):
            res["resumed_metrics"].append(resumed.train_step(engine_batch(dict(resumed.named_weights()), model_dir, s)))
            if s == 1:
                # named_weights yields views of replicated parameters (as Trainer's): copy before the next step
                res["resumed_weights_after_1"] = {n: w.clone() for n, w in resumed.named_weights()}
        res["resumed_weights"] = dict(resumed.named_weights())
        torch.save(res, f"{out}.rank{rank}")


def _launch(tmp_path, tag: str, model_dir: str) -> list[dict]:
    return spawn_ranks(_worker, 2, model_dir, out=str(tmp_path / tag))


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtrain")
    model_dir = str(write_tiny_checkpoint(tmp / "model", seed=2))
    return tmp, model_dir, _launch(tmp, "a", model_dir), _launch(tmp, "b", model_dir)


def test_tp2_trainer_is_exactly_on_policy_with_the_emulating_engine(tp2_runs):
    _, _, run, _ = tp2_runs
    for res in run:
        diffs = [m["train/rollout_logprob_abs_diff"] for m in res["metrics"]]
        assert diffs == [0.0, 0.0, 0.0]  # trainer (real TP=2) logprobs == engine (emulated TP=2) logprobs
        assert all(m["train/grad_norm"] > 0 for m in res["metrics"])
        assert res["shapes"]["model.layers.0.self_attn.o_proj.weight"] == (64, 32)  # really sharded
        assert res["shapes"]["model.embed_tokens.weight"] == (30, 64)


def test_the_on_policy_check_can_fail(tp2_runs, one_thread):
    """The plain (TP=1) model's logprobs for the engine's tokens are not the TP=2 ones: the emulation matters."""
    _, model_dir, run, _ = tp2_runs
    batch = run[0]["batch1"]
    weights = {n: w for n, w in run[0]["weights"].items()}  # any weights show it; take the final ones
    plain = load_pretrained(model_dir)
    plain.load_state_dict(weights)
    emulated = copy.deepcopy(plain).set_tensor_parallel_emulation(2)
    prompts = [s["prompt_token_ids"] for s in batch]
    comps = [s["completion_token_ids"] for s in batch]
    with torch.no_grad():
        a = token_logprobs(plain, prompts, comps, TEMPERATURE)
        b = token_logprobs(emulated, prompts, comps, TEMPERATURE)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


def test_tp2_training_is_bitwise_reproducible_across_ranks_and_runs(tp2_runs):
    _, _, a, b = tp2_runs
    for run in (a, b):
        assert run[0]["metrics"] == run[1]["metrics"]
        assert all(torch.equal(run[0]["weights"][n], run[1]["weights"][n]) for n in run[0]["weights"])
    assert a[0]["metrics"] == b[0]["metrics"]
    for name, w in a[0]["weights"].items():
        assert torch.equal(w, b[0]["weights"][name]), name


def test_tp2_resume_from_checkpoint_equals_the_uninterrupted_run(tp2_runs):
    _, _, run, _ = tp2_runs
    for res in run:
        assert res["extra"] == {"cursor": 7} and res["gen_equal"]
        assert res["resumed_metrics"] == res["metrics"][1:]
        for name, w in res["weights"].items():
            assert torch.equal(res["resumed_weights"][name], w), name


def test_tp2_checkpoint_and_hf_export_are_full_and_tp_agnostic(tp2_runs, deterministic_torch):
    tmp, model_dir, run, _ = tp2_runs
    exported = load_pretrained(tmp / "a_hf")
    for name, w in exported.state_dict().items():
        assert torch.equal(w, run[0]["weights"][name]), name
    # the TP=2 checkpoint loads into a plain single-process Trainer: same weights, optimizer, schedule, data cursor
    model = load_pretrained(model_dir)
    trainer = Trainer(model, TrainConfig(**CONFIG), temperature=TEMPERATURE, ref_model=copy.deepcopy(model))
    before = {n: w.clone() for n, w in trainer.named_weights()}
    extra = trainer.load_checkpoint(run[0]["ckpt"], generators={"g": torch.Generator()})
    assert extra == {"cursor": 7} and trainer.step == 1
    assert trainer.optimizer.inner.state and any(not torch.equal(w, before[n]) for n, w in trainer.named_weights())
    # and its next step is the TP=2 run's next step up to the TP rounding (same batch, same optimizer state)
    metrics = trainer.train_step(run[0]["batch1"])
    assert metrics["train/rollout_logprob_abs_diff"] > 0  # TP=1 trainer vs TP=2 engine: not bitwise
    assert metrics["train/rollout_logprob_abs_diff"] < 1e-4
    tp2 = run[0]["metrics"][1]
    assert abs(metrics["train/loss"] - tp2["train/loss"]) < 1e-4
    assert abs(metrics["train/grad_norm"] - tp2["train/grad_norm"]) < 1e-3 * tp2["train/grad_norm"]
    for name, w in trainer.named_weights():  # and the same update: TP=2 differs from TP=1 only by rounding
        torch.testing.assert_close(w, run[0]["resumed_weights_after_1"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("tie", [True, False])
def test_from_pretrained_reads_each_ranks_shards_and_equals_sharding_the_full_model(tmp_path, tie):
    from rlrepro.trainer.megatron import ParallelGroups

    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=6, max_shard_bytes=20_000, tie_word_embeddings=tie)
    full = load_pretrained(model_dir, dtype=torch.bfloat16)
    for rank in range(2):
        groups = ParallelGroups(None, None, rank, 2, 0, 1)  # reading needs no process group
        direct = TPQwen3ForCausalLM.from_pretrained(model_dir, groups, dtype=torch.bfloat16)
        via_full = TPQwen3ForCausalLM.from_full(full, groups)
        names = [n for n, _ in direct.named_parameters()]
        assert names == [n for n, _ in via_full.named_parameters()] and ("lm_head.weight" in names) == (not tie)
        for (name, a), (_, b) in zip(direct.named_parameters(), via_full.named_parameters()):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
        assert direct.model.layers[0].mlp.down_proj.weight.shape == (64, 64)


# ---------------------------------------------------------------------------------- checks and full-format saving

def test_layout_invariance_at_tp2_refuses_tp_partials_that_tp_does_not_divide():
    """``train.layout_invariant`` at TP=2 with ``train.tp_partials=1`` (valid for the config's own TP=1): no pieces
    would sum the q_norm/k_norm grads over TP, so the replicated weights would drift apart. Refused by the trainer,
    whatever TP the caller (``build_megatron_trainer(tensor_parallel=2)``) put the model at."""
    from rlrepro.trainer.megatron import ParallelGroups

    model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), ParallelGroups(None, None, 0, 2, 0, 1))
    with pytest.raises(ValueError, match=r"train.tp_partials=1 is not a multiple of train.tensor_parallel=2.*"
                                         r"set train.tp_partials to a multiple"):
        MegatronTrainer(model, TrainConfig(layout_invariant=True, tp_partials=1))


def test_build_megatron_trainer_refuses_num_gpus_other_than_the_world_size(tmp_path):
    from rlrepro.trainer.megatron import build_megatron_trainer

    model_dir = write_tiny_checkpoint(tmp_path / "m", seed=1)
    with pytest.raises(ValueError, match=r"train.num_gpus=2 but torch.distributed is not initialised.*"
                                         r"world_size=2.*or pass num_gpus=1"):
        build_megatron_trainer(model_dir, TrainConfig(), tensor_parallel=1, num_gpus=2,
                               use_megatron_parallel_state=False)


def _tracking_gathers(monkeypatch_targets):
    """Wrap ``gather_param`` where the trainer and the model call it: every result is remembered by weak reference,
    so a test can tell which full tensors a rank still holds."""
    import weakref

    refs, originals = [], []
    for module in monkeypatch_targets:
        real = module.gather_param
        originals.append((module, real))

        def tracked(name, local, groups, _real=real):
            out = _real(name, local, groups)
            refs.append(weakref.ref(out))
            return out

        module.gather_param = tracked
    return refs, originals


def _full_save_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import rlrepro.trainer.megatron.model as model_mod
    import rlrepro.trainer.megatron.trainer as trainer_mod
    from rlrepro.trainer.checkpoint import load_pt
    from rlrepro.trainer.megatron import build_megatron_trainer, gather_param
    from safetensors.torch import load_file

    with gloo_process_group(rank, world, port):
        res = {}
        try:  # train.num_gpus must be the process group's size
            build_megatron_trainer(model_dir, TrainConfig(**CONFIG), tensor_parallel=1, num_gpus=1,
                                   use_megatron_parallel_state=False)
            res["num_gpus_error"] = ""
        except ValueError as e:
            res["num_gpus_error"] = str(e)
        # a layout_invariant trainer without the pieces that sum the q_norm/k_norm grads over TP (the state the
        # constructor's check now refuses): the trainer must still sum them itself
        t = build_megatron_trainer(model_dir, TrainConfig(**CONFIG), temperature=TEMPERATURE, tensor_parallel=2,
                                   num_gpus=world, use_megatron_parallel_state=False)
        t.layout_invariant = True
        t.train_step(random_batch(t.model, 0))
        res["q_norm"] = dict(t.model.named_parameters())["model.layers.0.self_attn.q_norm.weight"].detach().clone()
        # full-format saves: the writer (rank 0) keeps the gathered tensors in CPU memory, the other ranks none
        for tag, tp, kwargs in (("tp2", 2, {}), ("dp2", 1, {}), ("dp2_zero", 1, {"distributed_optimizer": True})):
            t = build_megatron_trainer(model_dir, TrainConfig(**CONFIG), temperature=TEMPERATURE, tensor_parallel=tp,
                                       num_gpus=world, use_megatron_parallel_state=False,
                                       param_dtype=torch.bfloat16, **kwargs)
            t.train_step(random_batch(t.model, 0))
            # what the checkpoint must hold: the full weights and the unsharded optimizer's state_dict()
            weights = {n: w.clone() for n, w in t.named_weights()}
            if kwargs:
                expected = t.optimizer.gather_state_dict(dst=0)
            else:
                local = t.optimizer.state_dict()
                expected = {"names": local["names"], "param_groups": local["adamw"]["param_groups"],
                            "state": {i: {k: gather_param(local["names"][i], v, t.groups) if v.dim() else v
                                          for k, v in per.items()} for i, per in local["adamw"]["state"].items()},
                            "master_weights": {n: gather_param(n, m, t.groups)
                                               for n, m in local["master_weights"].items()}}
            refs, originals = _tracking_gathers([trainer_mod, model_mod])
            real_write = trainer_mod.write_on_one_rank
            held = {}

            def write(is_writer, fn, barrier, _held=held, _refs=refs):
                alive = [r() for r in _refs if r() is not None]
                _held.update(gathers=len(_refs), alive=len(alive), devices={str(a.device) for a in alive})
                return real_write(is_writer, fn, barrier)

            trainer_mod.write_on_one_rank = write
            try:
                path = t.save_checkpoint(f"{out}_{tag}", 1)
            finally:
                trainer_mod.write_on_one_rank = real_write
                for module, real in originals:
                    module.gather_param = real
            res[tag] = {"held": held, "weights": weights, "expected": expected,
                        "model": load_file(str(path / "model.safetensors")), "optim": load_pt(path / "optimizer.pt")}
        torch.save(res, f"{out}.rank{rank}")


def test_full_save_gathers_onto_the_writer_only_and_tp_sums_norm_grads_without_pieces(tmp_path):
    """2 gloo processes. ``build_megatron_trainer`` refuses a ``num_gpus`` other than the process group's size. A
    trainer at TP=2 with ``layout_invariant`` set but no pieces installed still sums the q_norm/k_norm grads over TP
    (the replicated weights stay equal on both ranks). A full-format save holds the gathered full tensors on the
    writer only (CPU memory): the other TP rank drops each as it arrives, the other DP replica gathers nothing; and
    the files hold exactly the full weights and the unsharded optimizer state (``torch.equal``)."""
    model_dir = str(write_tiny_checkpoint(tmp_path / "m", seed=2))
    ranks = spawn_ranks(_full_save_worker, 2, model_dir, out=str(tmp_path / "o"))
    for res in ranks:
        assert "train.num_gpus=1 but the torch.distributed process group has 2 ranks" in res["num_gpus_error"]
        assert "or pass num_gpus=2" in res["num_gpus_error"]
    assert torch.equal(ranks[0]["q_norm"], ranks[1]["q_norm"])
    writer, other = ranks
    for tag in ("tp2", "dp2", "dp2_zero"):
        assert writer[tag]["held"]["alive"] > 0 and writer[tag]["held"]["devices"] == {"cpu"}, tag
        assert other[tag]["held"]["alive"] == 0, tag  # nothing full kept off the writer
    assert other["tp2"]["held"]["gathers"] > 0  # the other TP rank takes part in the gathers ...
    assert other["dp2"]["held"]["gathers"] == 0 and other["dp2_zero"]["held"]["gathers"] == 0  # ... replica 1 not
    for tag in ("tp2", "dp2", "dp2_zero"):
        res = writer[tag]
        assert list(res["model"]) == sorted(res["weights"])
        for name, w in res["weights"].items():
            assert torch.equal(res["model"][name], w), (tag, name)
        saved, exp = res["optim"], res["expected"]
        assert saved["names"] == exp["names"]
        assert saved["adamw"]["param_groups"] == (exp["param_groups"] if "param_groups" in exp
                                                  else exp["adamw"]["param_groups"])
        exp_state = exp["state"] if "state" in exp else exp["adamw"]["state"]
        assert sorted(saved["adamw"]["state"]) == sorted(exp_state) and exp_state
        for i, per in exp_state.items():
            assert sorted(saved["adamw"]["state"][i]) == sorted(per)
            for k, v in per.items():
                assert torch.equal(saved["adamw"]["state"][i][k], v), (tag, i, k)
        assert sorted(saved["master_weights"]) == sorted(exp["master_weights"]) and exp["master_weights"]
        for n, m in exp["master_weights"].items():
            assert saved["master_weights"][n].dtype == torch.float32 and torch.equal(saved["master_weights"][n], m)
