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
