"""Process groups from megatron-core's parallel_state (on gloo): TP=2 x DP=2 over 4 processes trains with every
rank holding the same weights and metrics, and the layout is Megatron's (TP ranks consecutive)."""
import pytest
import torch

from rlrepro.model import write_tiny_checkpoint
from rlrepro.trainer import TrainConfig
from rlrepro.trainer.megatron import megatron_core_version

from _dist import gloo_process_group, spawn_ranks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(megatron_core_version() is None, reason="megatron-core is not installed")]

TEMPERATURE = 1.0  # the rollout's (Trainer(temperature=...))
CONFIG = dict(lr=3e-3, steps=3, micro_batch_size=2)


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    with gloo_process_group(rank, world, port):
        from rlrepro.trainer import token_logprobs
        from rlrepro.trainer.megatron import build_megatron_trainer, destroy_parallel

        trainer = build_megatron_trainer(model_dir, TrainConfig(**CONFIG),
                                         temperature=TEMPERATURE, tensor_parallel=2, num_gpus=world,
                                         use_megatron_parallel_state=True)
        g = trainer.groups
        res = {"layout": (g.megatron, g.tp_rank, g.tp_size, g.dp_rank, g.dp_size)}
        gen = torch.Generator().manual_seed(9)
        prompts = [torch.randint(60, (2,), generator=gen).tolist() for _ in range(5)]
        comps = [torch.randint(60, (3,), generator=gen).tolist() for _ in range(5)]
        with torch.no_grad():
            lps = token_logprobs(trainer.model, prompts, comps)
        batch = [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=i - 2.0)
                 for i, (p, c, lp) in enumerate(zip(prompts, comps, lps))]
        res["metrics"] = [trainer.train_step(batch) for _ in range(2)]
        res["weights"] = dict(trainer.named_weights())
        destroy_parallel(g)
        torch.save(res, f"{out}.rank{rank}")


def test_tp2_dp2_with_megatron_parallel_state(tmp_path):
    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=4))
    out = str(tmp_path / "res")
    runs = spawn_ranks(_worker, 4, model_dir, out=out)
    assert [r["layout"] for r in runs] == [(True, 0, 2, 0, 2), (True, 1, 2, 0, 2), (True, 0, 2, 1, 2),
                                           (True, 1, 2, 1, 2)]
    for r in runs[1:]:
        assert r["metrics"] == runs[0]["metrics"]
        for name, w in runs[0]["weights"].items():
            assert torch.equal(r["weights"][name], w), name
    assert runs[0]["metrics"][0]["train/rollout_logprob_abs_diff"] == 0.0
    assert runs[0]["metrics"][1]["train/grad_norm"] > 0
