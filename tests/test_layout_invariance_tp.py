"""train.layout_invariant across tensor parallelism (issue #26): the megatron backend at TP 1 and 2, times DP 1 and 2,
and the default backend at DP 1, all with train.tp_partials=2, give the same bits (metrics ==, weights torch.equal);
the rollout logprobs of an engine-style model emulating the 2 pieces equal the trainer's (on-policy 0.0); a TP=2
checkpoint resumes at TP=1 into the uninterrupted run; without the option TP=2 differs from TP=1."""
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import Trainer, TrainConfig, token_logprobs

from _dist import gloo_process_group, spawn_ranks

PARTIALS = 2
STEPS = 2
CONFIG = dict(lr=3e-3, steps=4, micro_batch_size=2, ppo_epochs=1, clip_high=0.28, max_grad_norm=0.5)


def make_batch(weights: dict, step: int, emulation: int):
    """Samples whose rollout logprobs come from a plain model holding ``weights``, run as the engines run it
    (no grad, tensor-parallel emulation at ``emulation`` pieces)."""
    model = tiny_model(seed=1)
    model.load_state_dict(weights)
    model.set_tensor_parallel_emulation(emulation)
    gen = torch.Generator().manual_seed(900 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (2 + i % 3,), generator=gen).tolist() for i in range(7)]
    completions = [torch.randint(vocab, (1 + (i * 5) % 6,), generator=gen).tolist() for i in range(7)]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=(-1.0) ** i)
            for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


def run(trainer, steps, emulation, start=0):
    metrics = []
    for s in range(start, steps):
        weights = {n: w.clone() for n, w in trainer.named_weights()}
        metrics.append(trainer.train_step(make_batch(weights, s, emulation)))
    return {"weights": {n: w.clone() for n, w in trainer.named_weights()}, "metrics": metrics}


def _config(invariant: bool, tp: int, world: int, backend="megatron") -> TrainConfig:
    return TrainConfig(**CONFIG, backend=backend, tensor_parallel=tp, num_gpus=world, layout_invariant=invariant,
                       tp_partials=PARTIALS if invariant else 1)


def _megatron(invariant: bool, tp: int, world: int):
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, init_parallel

    groups = init_parallel(tp)
    model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), groups)
    return MegatronTrainer(model, _config(invariant, tp, world))


def _tp_worker(rank: int, world: int, port: int, tp: int, ckpt_root: str, out: str) -> None:
    with gloo_process_group(rank, world, port):
        res = {"on": run(_megatron(True, tp, world), STEPS, PARTIALS)}
        if world == tp:  # pure TP: without the option (engines emulate TP, as today)
            res["off"] = run(_megatron(False, tp, world), STEPS, tp)
        if tp == 2 and world == 2:  # checkpoint after step 1 (resumed at TP=1 below)
            trainer = _megatron(True, tp, world)
            run(trainer, 1, PARTIALS)
            trainer.save_checkpoint(ckpt_root, 1)
        torch.save(res, f"{out}.rank{rank}")


def _same(a, b) -> bool:
    return a["metrics"] == b["metrics"] and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])


def _single(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for tp, world in ((2, 2), (1, 2), (2, 4)):
        ranks = spawn_ranks(_tp_worker, world, tp, str(root / "ckpt"), out=str(root / f"tp{tp}w{world}"))
        for r in ranks[1:]:
            assert all(_same(ranks[0][k], r[k]) for k in ranks[0])
        out[tp, world] = ranks[0]
    out["default"] = _single(lambda: run(Trainer(tiny_model(seed=1), _config(True, 1, 1, "default")), STEPS,
                                         PARTIALS))
    out["default_off"] = _single(lambda: run(Trainer(tiny_model(seed=1), _config(False, 1, 1, "default")), STEPS, 1))
    out["ckpt"] = root / "ckpt" / "step_000001"
    return out


def _megatron_tp1_single(**kw):
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups

    model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), single_process_groups())
    return MegatronTrainer(model, _config(True, 1, 1))


def test_every_tp_x_dp_layout_gives_the_same_bits_and_stays_on_policy(tp_runs):
    ref = tp_runs["default"]
    assert all(m["train/grad_norm"] > 0 and m["train/rollout_logprob_abs_diff"] == 0.0 for m in ref["metrics"])
    assert _same(ref, _single(lambda: run(_megatron_tp1_single(), STEPS, PARTIALS)))  # megatron TP=1 DP=1
    for layout in ((2, 2), (1, 2), (2, 4)):
        assert _same(ref, tp_runs[layout]["on"]), layout
        assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in tp_runs[layout]["on"]["metrics"])


def test_without_the_option_tp2_differs_from_tp1(tp_runs):
    off = tp_runs[2, 2]["off"]
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in off["metrics"])  # on-policy, as today
    assert not _same(off, tp_runs["default_off"])


def test_checkpoint_at_tp2_resumes_at_tp1_into_the_uninterrupted_run(tp_runs):
    def resumed():
        trainer = _megatron_tp1_single()
        trainer.load_checkpoint(tp_runs["ckpt"])
        return run(trainer, STEPS, PARTIALS, start=1)

    res = _single(resumed)
    ref = tp_runs["default"]
    assert res["metrics"] == ref["metrics"][1:]
    assert all(torch.equal(w, ref["weights"][n]) for n, w in res["weights"].items())
