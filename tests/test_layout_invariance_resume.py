"""train.layout_invariant with the sharded checkpoint format and with the supervised warm start (issue #26).

``checkpoint.format=dist`` (megatron-core's dist_checkpointing, megatron backend only): a checkpoint written at DP=2
(ZeRO-1: each owner writes its share), at TP=2 and at DP=1 resumes at DP=1, TP=1 and DP=2 / TP=2 into the
uninterrupted run (metrics ==, weights torch.equal). The warm start (``warm_start.steps > 0``, default backend)
with the option on runs on the ``train.tp_partials`` pieces, repeats itself bit for bit, and is one run at
``train.num_gpus`` 1 and 2 (``rlrepro diff --strict`` exit 0).
"""
import contextlib
import json

import pytest
import torch

from rlrepro.cli import main
from rlrepro.model import tiny_model
from rlrepro.trainer import Trainer

from _dist import free_port, gloo_process_group, spawn_ranks
from test_layout_invariance_tp import PARTIALS, STEPS, _config, run


def _megatron(tp: int, world: int, **kw):
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, init_parallel

    groups = init_parallel(tp)
    model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), groups)
    return MegatronTrainer(model, _config(True, tp, world), checkpoint_format="dist", **kw)


def _resumed(trainer, path) -> dict:
    trainer.load_checkpoint(path)
    return run(trainer, STEPS, PARTIALS, start=1)


def _save_after_one_step(trainer, root: str) -> None:
    run(trainer, 1, PARTIALS)
    trainer.save_checkpoint(root, 1)


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    """2 ranks: resume the DP=1 checkpoint at DP=2 (ZeRO-1: each owner reads its share) and at TP=2, then save
    after step 1 at DP=2 (ZeRO-1: each owner writes its share) and at TP=2."""
    with gloo_process_group(rank, world, port):
        res = {"dp1->dp2": _resumed(_megatron(1, 2, distributed_optimizer=True), f"{root}/dp1/step_000001"),
               "dp1->tp2": _resumed(_megatron(2, 2), f"{root}/dp1/step_000001")}
        _save_after_one_step(_megatron(1, 2, distributed_optimizer=True), f"{root}/dp2")
        _save_after_one_step(_megatron(2, 2), f"{root}/tp2")
    torch.save(res, f"{out}.rank{rank}")


@contextlib.contextmanager
def _one_rank_group():
    """A 1-rank gloo group in this process (dist_checkpointing is collective), one torch thread, restored after."""
    threads = torch.get_num_threads()
    try:
        with gloo_process_group(0, 1, free_port()):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_dist_checkpoints_resume_at_another_dp_and_tp_into_the_uninterrupted_run(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("psutil")  # megatron-core's checkpoint writer imports it
    from rlrepro.trainer.megatron.dist_checkpoint import read_dist_meta

    root = str(tmp_path / "ckpt")
    with _one_rank_group():
        ref = run(Trainer(tiny_model(seed=1), _config(True, 1, 1, "default")), STEPS, PARTIALS)
        _save_after_one_step(_megatron(1, 1), f"{root}/dp1")
    assert all(m["train/grad_norm"] > 0 for m in ref["metrics"])
    ranks = spawn_ranks(_worker, 2, root, out=str(tmp_path / "two"))
    resumed = {k: [r[k] for r in ranks] for k in ranks[0]}
    meta = read_dist_meta(f"{root}/dp2/step_000001")
    assert (meta["data_parallel"], meta["tensor_parallel"]) == (2, 1)
    assert read_dist_meta(f"{root}/tp2/step_000001")["tensor_parallel"] == 2
    with _one_rank_group():
        resumed["dp2->dp1"] = [_resumed(_megatron(1, 1), f"{root}/dp2/step_000001")]
        resumed["tp2->tp1"] = [_resumed(_megatron(1, 1), f"{root}/tp2/step_000001")]
    for change, per_rank in resumed.items():
        for res in per_rank:
            assert res["metrics"] == ref["metrics"][1:], change
            assert all(torch.equal(w, ref["weights"][n]) for n, w in res["weights"].items()), change


# ------------------------------------------------------------------------------------------ the supervised warm start

WARM_START = dict(steps=3, lr=3e-3, batch_size=4, seed=5)


def _examples(vocab: int) -> list:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(vocab, (2 + i % 4,), generator=gen).tolist(),
             torch.randint(vocab, (1 + i % 3,), generator=gen).tolist()) for i in range(12)]


def _warm_started(model_dir, invariant: bool):
    """The trainer actor's warm start (rlrepro.orchestration.workers.TrainerWorker.warm_start), in this process."""
    from rlrepro.orchestration.workers import TrainerWorker

    threads = torch.get_num_threads()
    try:
        worker = TrainerWorker(str(model_dir), _config(invariant, 1, 1, "default"), temperature=1.0,
                               max_response_length=None, device="cpu", dtype=None, deterministic=True)
        pieces = worker.model.tensor_parallel_emulation
        losses = worker.warm_start(_examples(worker.model.config.vocab_size), **WARM_START)
        return pieces, losses, {n: w.clone() for n, w in worker.trainer.named_weights()}
    finally:
        torch.set_num_threads(threads)


def test_warm_start_runs_on_the_pieces_and_repeats_itself(tmp_path):
    from rlrepro.model import load_pretrained, write_tiny_checkpoint
    from rlrepro.trainer.warm_start import supervised_warm_start

    model_dir = write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    pieces, losses, weights = _warm_started(model_dir, True)
    assert pieces == PARTIALS  # the trainer put the policy into the P-piece emulation before the warm start
    again = _warm_started(model_dir, True)
    assert again[1] == losses and all(torch.equal(w, again[2][n]) for n, w in weights.items())
    # the same bits as the warm start of one plain process computing the P pieces
    model = load_pretrained(model_dir).set_tensor_parallel_emulation(PARTIALS)
    assert supervised_warm_start(model, _examples(model.config.vocab_size), **WARM_START) == losses
    assert all(torch.equal(w, weights[n]) for n, w in model.named_parameters())
    # without the option the warm start runs on plain products: other bits (so the pieces did apply above)
    _, off_losses, off_weights = _warm_started(model_dir, False)
    assert off_losses != losses or not all(torch.equal(w, off_weights[n]) for n, w in weights.items())


@pytest.mark.slow
def test_warm_start_run_is_one_run_at_one_and_two_gpus(tmp_path, capsys):
    """`rlrepro train` with warm_start.steps > 0 and the option on: train.num_gpus 1 and 2 (every trainer rank
    runs the whole warm start; then the tree) give the same run (`rlrepro diff --strict` exit 0)."""
    base = ["recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_tokens=6", "warm_start.steps=4", "warm_start.batch_size=8", "reward.fn=hash",
            "train.micro_batch_size=2", "train.warmup_steps=1", "train.layout_invariant=true", "train.tp_partials=2"]
    lines = {}
    for gpus in (1, 2):
        assert main(["train", *base, f"run.dir={tmp_path / f'dp{gpus}'}", f"train.num_gpus={gpus}"]) == 0
        lines[gpus] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warm start: 4 steps")]
    assert len(lines[1]) == 1 and lines[1] == lines[2]
    metrics = [json.loads(x) for x in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0 for m in metrics)
    assert main(["diff", "--strict", str(tmp_path / "dp1"), str(tmp_path / "dp2")]) == 0
