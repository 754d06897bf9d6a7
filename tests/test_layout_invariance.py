"""train.layout_invariant (issue #26): the tree sum alone, then the Trainer over 1, 2 and 4 gloo data-parallel ranks
gives the same bits (metrics ==, weights torch.equal), a checkpoint written at DP=2 resumes at DP=1 into the
uninterrupted run, and with the option off the layouts differ (the option is what holds)."""
import math

import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import DataParallel, TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.tree_sum import (GradTree, PairwiseStack, ShardedGradTree, combine_grads,
                                      combine_level_order, make_grad_tree, num_leaves_padded, num_subtrees,
                                      owned_leaves, owned_subtrees, shards_partial_sums, tree_leaves, tree_sum,
                                      tree_sum_floats)

from _dist import gloo_process_group, spawn_ranks

# 9 samples in micro-batches of 2: 5 leaves (a tree of 8, 3 absent), one of them skipped (no completion tokens)
CONFIG = dict(lr=3e-3, steps=4, micro_batch_size=2, ppo_epochs=2, clip_high=0.28, entropy_coef=0.01)
STEPS = 2
NUM_SAMPLES = 9


# ------------------------------------------------------------------------------------------- the tree on its own

def _leaves(num, absent=()):
    g = torch.Generator().manual_seed(num)
    return {k: [torch.randn(33, generator=g) * 10.0 ** (k % 7 - 3), None if k % 3 == 1 else torch.randn(2, 2)]
            for k in range(num) if k not in absent}


def _clone(leaf):
    return None if leaf is None else [None if t is None else t.clone() for t in leaf]


def _split_sum(leaves, num, world):
    """What ``world`` ranks compute: each its subtrees with a PairwiseStack, the roots combined in tree order."""
    width = num_leaves_padded(num) // num_subtrees(num, world)
    roots = []
    for rank in range(world):
        mine = owned_leaves(num, world, rank)
        for sub in owned_subtrees(num, world, rank):
            stack = PairwiseStack(combine_grads)
            for k in range(sub * width, (sub + 1) * width):
                assert k >= num or k in mine
                stack.push(_clone(leaves.get(k)))
            roots.append(stack.result())
    return combine_level_order(roots, combine_grads)


@pytest.mark.parametrize("num", [1, 2, 5, 7, 8, 13])
def test_tree_gives_the_same_bits_for_any_world_size_and_absent_leaves(num):
    for absent in ((), (0,), (num - 1,), tuple(range(1, num, 2))):
        leaves = _leaves(num, absent)
        ref = tree_sum({k: _clone(v) for k, v in leaves.items()}, num, combine_grads)
        for world in (1, 2, 3, 4, 8):
            got = _split_sum(leaves, num, world)
            if ref is None:  # every leaf absent
                assert got is None
                continue
            for a, b in zip(ref, got):
                assert (a is None and b is None) or torch.equal(a, b), (num, absent, world)
    # leaf ranges: contiguous, disjoint, covering every leaf
    for world in (1, 2, 3, 4):
        ranges = [owned_leaves(num, world, r) for r in range(world)]
        assert sum(ranges, []) == list(range(num))


def test_absent_is_not_zero():
    # -0.0 + 0.0 == +0.0: adding a zero leaf would change the bits; an absent leaf does not
    leaves = {0: [torch.tensor([-0.0])]}
    assert torch.equal(tree_sum(leaves, 2, combine_grads)[0], torch.tensor([-0.0]))
    assert str(tree_sum(leaves, 2, combine_grads)[0].item()) == "-0.0"
    assert tree_sum({}, 4, combine_grads) is None
    assert tree_sum_floats({}, 3, width=2) == [0.0, 0.0]
    assert tree_sum_floats({0: [1.0, 5.0], 2: [2.0, 3.0]}, 3, width=2, max_indices=(1,)) == [3.0, 5.0]


def test_tree_shape_is_pairwise_not_sequential():
    # ((a + b) + (c + d)) differs from (((a + b) + c) + d) here: the tree is the pairwise one
    vals = [1e8, 1.0, -1e8, 1.0]
    leaves = {k: [torch.tensor([v], dtype=torch.float32)] for k, v in enumerate(vals)}
    assert float(tree_sum(leaves, 4, combine_grads)[0]) == float((torch.tensor(1e8) + 1.0) + (torch.tensor(-1e8) + 1.0))
    assert tree_sum_floats({k: [v] for k, v in enumerate([0.1, 0.2, 0.3, 0.4])}, 4, width=1) == [(0.1 + 0.2) + (0.3 + 0.4)]


def test_grad_tree_without_data_parallel_is_the_reference():
    leaves = _leaves(6, absent=(2,))
    tree = GradTree(6)
    for k in range(6):
        if k in leaves:
            tree.push(k, _clone(leaves[k]))
    like = [torch.empty(33), torch.empty(2, 2)]
    got = tree.finish(like)
    ref = tree_sum({k: _clone(v) for k, v in leaves.items()}, 6, combine_grads)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    with pytest.raises(ValueError, match="out of order"):
        t = GradTree(3)
        t.push(1, None)
        t.push(0, None)


# ------------------------------------------------------------------- the sharded partial sums (ZeRO-2 style)

# tensors of 33, 2x2 (absent in every third leaf), 7 (bf16 in odd leaves: widened exactly) and 1 element (absent
# everywhere): 45 elements, cut into d shards and exchanged in rounds of 3 elements per sender
SHARD_LIKE = [torch.empty(33), torch.empty(2, 2), torch.empty(7), torch.empty(1)]


def _shard_leaves(num, absent):
    g = torch.Generator().manual_seed(1000 + num)
    out = {}
    for k in range(num):
        small = torch.randn(7, generator=g) * 10.0 ** (k % 5 - 2)
        leaf = [torch.randn(33, generator=g) * 10.0 ** (k % 7 - 3), None if k % 3 == 1 else torch.randn(2, 2, generator=g),
                small.bfloat16() if k % 2 else small, None]
        if k not in absent:
            out[k] = leaf
    return out


def _absent_patterns(num):
    return ((), (0,), (num - 1,), tuple(range(1, num, 2)), tuple(range(num)))


def _shard_cases(dp, world, rank):
    """For leaf counts 1..13 and several absent sets: whether ShardedGradTree's root equals tree_sum's (torch.equal,
    None-ness too), and each case's (num, peak partial bytes, bound, exchange peak bytes, exchange bound)."""
    results = []
    total = sum(t.numel() for t in SHARD_LIKE)
    for num in range(1, 14):
        for absent in _absent_patterns(num):
            leaves = _shard_leaves(num, absent)
            tree = ShardedGradTree(num, dp, SHARD_LIKE, bucket_numel=3 * world)
            for k in tree_leaves(num, world, rank):
                if k in leaves:
                    tree.push(k, _clone(leaves[k]))
            got = tree.finish(SHARD_LIKE)
            ref = tree_sum({k: [None if t is None else t.float() for t in v] for k, v in leaves.items()}, num,
                           combine_grads)
            ref = [torch.zeros(t.shape) if ref is None or r is None else r for r, t in zip(ref or [None] * 4, SHARD_LIKE)]
            same = all(a.dtype == torch.float32 and torch.equal(a, b) and str(a) == str(b) for a, b in zip(got, ref))
            width = max(num_leaves_padded(num), world)
            bound = (int(math.log2(width // world)) + 1) * -(-total // world) * 4
            results.append((num, absent, same, tree.peak_partial_bytes, bound, tree.exchange_peak_bytes,
                            2 * world * tree.chunk * 4))
    return results


def _negative_zero(dp, world, rank) -> bool:
    """Leaf 0 is -0.0 everywhere, every other leaf absent: the root keeps the sign (absent is not a zero)."""
    like = [torch.empty(world + 1)]
    tree = ShardedGradTree(3 * world, dp, like)
    if rank == 0:
        tree.push(0, [torch.full((world + 1,), -0.0)])
    root = tree.finish(like)[0]
    return bool(torch.signbit(root).all()) and not bool(root.any())


def _shard_worker(rank: int, world: int, port: int, out: str) -> None:
    """8 ranks (one spawn): d = 2 on ranks 0-1 and d = 4 on ranks 4-7 at once, then d = 8 on all."""
    import torch.distributed as dist

    with gloo_process_group(rank, world, port):
        subgroups = {2: dist.new_group([0, 1]), 4: dist.new_group([4, 5, 6, 7])}  # every rank creates both
        res = {}
        for d, members in ((2, [0, 1]), (4, [4, 5, 6, 7])):
            if rank in members:
                res[d] = _shard_cases(DataParallel(subgroups[d], bucket_numel=3 * d), d, members.index(rank))
        dp = DataParallel(bucket_numel=3 * world)
        res[world] = _shard_cases(dp, world, rank)
        res["negative_zero"] = _negative_zero(dp, world, rank)
        with pytest.raises(ValueError, match="out of order"):
            tree = ShardedGradTree(2 * world, dp, SHARD_LIKE)  # every rank: leaves rank and rank + world
            tree.push(rank + world, None)
            tree.push(rank, None)
        torch.save(res, f"{out}.rank{rank}")


def test_sharded_tree_gives_tree_sums_bits_for_any_power_of_two_world(tmp_path):
    ranks = spawn_ranks(_shard_worker, 8, out=str(tmp_path / "shards"))
    assert _negative_zero(None, 1, 0) and all(r["negative_zero"] for r in ranks)
    per_world = {1: [_shard_cases(None, 1, 0)], 2: [r[2] for r in ranks[:2]], 4: [r[4] for r in ranks[4:]],
                 8: [r[8] for r in ranks]}
    for world, ranks in per_world.items():
        assert len(ranks) == world
        for rank, cases in enumerate(ranks):
            assert len(cases) == 13 * 5
            for num, absent, same, peak, bound, exchange, exchange_bound in cases:
                assert same, (world, rank, num, absent)
                # the held partial sums: at most log2(W/d) + 1 shards of 1/d of the parameters
                assert peak <= bound, (world, rank, num, absent, peak, bound)
                assert exchange <= exchange_bound, (world, rank, num, exchange, exchange_bound)
    # sharding is what bounds it: at d = 8, 13 leaves, every leaf present, a rank holds less than one full leaf
    total = sum(t.numel() for t in SHARD_LIKE) * 4
    assert [c for c in per_world[8][0] if c[0] == 13 and c[1] == ()][0][3] < total


def test_sharded_path_applies_to_power_of_two_worlds_and_assigns_round_robin():
    assert [shards_partial_sums(w) for w in (1, 2, 3, 4, 6, 8)] == [False, True, False, True, False, True]
    assert tree_leaves(5, 2, 1) == [1, 3] and tree_leaves(5, 4, 2) == [2] and tree_leaves(3, 8, 5) == []
    assert tree_leaves(5, 3, 0) == owned_leaves(5, 3, 0)  # the fallback: contiguous subtrees
    for num in range(1, 14):
        for world in (2, 4, 8):
            assert sorted(sum((tree_leaves(num, world, r) for r in range(world)), [])) == list(range(num))
    assert isinstance(make_grad_tree(5, None, SHARD_LIKE), GradTree)
    with pytest.raises(ValueError, match="power-of-two"):
        ShardedGradTree(5, type("DP", (), {"world_size": 3, "rank": 0, "device": torch.device("cpu")})(), SHARD_LIKE)


# --------------------------------------------------------------------------------------------- configuration

def test_config_names_the_value_and_the_fix():
    TrainConfig(layout_invariant=True)
    TrainConfig(layout_invariant=True, backend="megatron", tensor_parallel=2, tp_partials=8)
    with pytest.raises(ConfigError, match=r"train.tp_partials=8 changes nothing with train.layout_invariant=false"):
        TrainConfig(tp_partials=8)
    with pytest.raises(ConfigError, match=r"train.tp_partials=2 is not a multiple of train.tensor_parallel=4.*"
                                          r"train.tp_partials=8"):
        TrainConfig(layout_invariant=True, backend="megatron", tensor_parallel=4, tp_partials=2)
    with pytest.raises(ConfigError, match=r"train.grad_sync='megatron' .*needs train.grad_sync=ordered"):
        TrainConfig(layout_invariant=True, backend="megatron", grad_sync="megatron")
    with pytest.raises(ConfigError, match=r"train.layout_invariant"):
        TrainConfig(layout_invariant="yes")
    assert TrainConfig().engine_tp_emulation == 1
    assert TrainConfig(backend="megatron", tensor_parallel=2).engine_tp_emulation == 2
    assert TrainConfig(layout_invariant=True, backend="megatron", tensor_parallel=2,
                       tp_partials=4).engine_tp_emulation == 4


# ------------------------------------------------------------------------------------- the trainer over DP ranks

def make_batch(model, step: int):
    gen = torch.Generator().manual_seed(700 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(NUM_SAMPLES)]
    completions = [torch.randint(vocab, (1 + (i * 5) % 6,), generator=gen).tolist() for i in range(NUM_SAMPLES)]
    completions[4] = completions[5] = []  # micro-batch 2 has nothing to train: an absent leaf
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=(-1.0) ** i)
            for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


def _result(trainer, metrics):
    return {"weights": {n: w.clone() for n, w in trainer.named_weights()}, "metrics": metrics,
            "tree": trainer.grad_tree_stats}


def train(invariant: bool, data_parallel=None, steps=STEPS, resume_from=None, save_to=None, param_dtype=None,
          **extra):
    model = tiny_model(seed=1)
    config = TrainConfig(**CONFIG, layout_invariant=invariant, **extra)
    trainer = Trainer(model, config, data_parallel=data_parallel, param_dtype=param_dtype)
    start = 0
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        start = trainer.step
    metrics = [trainer.train_step(make_batch(model, s)) for s in range(start, steps)]
    if save_to is not None:
        trainer.save_checkpoint(save_to, trainer.step)
    return _result(trainer, metrics)


def _dp_worker(rank: int, world: int, port: int, ckpt_root: str, out: str) -> None:
    with gloo_process_group(rank, world, port):
        dp = DataParallel(bucket_numel=3000)
        if world == 3:  # not a power of two: the unsharded tree (contiguous subtrees), the same bits
            torch.save({"on": train(True, dp)}, f"{out}.rank{rank}")
            return
        res = {"on": train(True, dp), "off": train(False, dp),
               "zero1": train(True, dp, distributed_optimizer=True, decoupled=True, is_correction="tis"),
               # bf16 compute: the sharded tree widens the bf16 leaves itself (no float32 copy of a leaf)
               "bf16": train(True, dp, param_dtype=torch.bfloat16)}
        if world == 2:  # the first step at DP=2 with a sharded optimizer, checkpointed (resumed at DP=1 below)
            train(True, dp, steps=1, save_to=ckpt_root, distributed_optimizer=True)
        torch.save(res, f"{out}.rank{rank}")


def _single(**kw):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        return train(**kw)
    finally:
        torch.set_num_threads(threads)


def _same(a, b) -> bool:
    return a["metrics"] == b["metrics"] and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    runs = {1: {"on": _single(invariant=True), "off": _single(invariant=False),
                "zero1": _single(invariant=True, decoupled=True, is_correction="tis"),
                "bf16": _single(invariant=True, param_dtype=torch.bfloat16)}}
    for world in (2, 3, 4):
        ranks = spawn_ranks(_dp_worker, world, str(root / "ckpt"), out=str(root / f"w{world}"))
        for r in ranks[1:]:  # every rank holds the same weights and metrics
            assert all(_same(ranks[0][k], r[k]) for k in ranks[0])
        runs[world] = ranks[0]
    runs["ckpt"] = root / "ckpt" / "step_000001"
    return runs


def test_any_number_of_data_parallel_ranks_gives_the_same_bits(dp_runs):
    # 5 micro-batches (a tree of 8: 3 padded leaves, not a multiple of 2 or 4), micro-batch 2 absent (at DP=4 its
    # rank pushes nothing at all)
    for world in (2, 4):
        assert _same(dp_runs[1]["on"], dp_runs[world]["on"]), world
        # ZeRO-1 sharded optimizer state, decoupled loss with its off-policy metric sums: the same bits too
        assert _same(dp_runs[1]["zero1"], dp_runs[world]["zero1"]), world
        assert _same(dp_runs[1]["bf16"], dp_runs[world]["bf16"]), world
        for kind in ("on", "zero1", "bf16"):  # the partial sums were sharded over the ranks (ZeRO-2 style)
            assert dp_runs[world][kind]["tree"]["kind"] == "ShardedGradTree", (world, kind)
    assert _same(dp_runs[1]["on"], dp_runs[3]["on"]) and dp_runs[3]["on"]["tree"]["kind"] == "GradTree"
    assert dp_runs[1]["on"]["tree"]["kind"] == "GradTree"
    for m in dp_runs[1]["on"]["metrics"]:
        assert m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0


def test_sharded_partial_sums_hold_a_fraction_of_the_gradient(dp_runs):
    # float32 partials: DP=1 holds up to log2(8) + 1 = 4 full gradients; DP=d at most log2(8/d) + 1 shards of 1/d
    numel = sum(w.numel() for w in dp_runs[1]["on"]["weights"].values())
    full = dp_runs[1]["on"]["tree"]["peak_partial_bytes"]
    assert 4 * numel < full <= 4 * 4 * numel
    for world, levels in ((2, 3), (4, 2)):
        peak = dp_runs[world]["on"]["tree"]["peak_partial_bytes"]
        assert 0 < peak <= levels * -(-numel // world) * 4, (world, peak)


def test_without_the_option_layouts_differ(dp_runs):
    assert not _same(dp_runs[1]["off"], dp_runs[2]["off"])
    assert not _same(dp_runs[1]["off"], dp_runs[4]["off"])


def test_checkpoint_at_dp2_resumes_at_dp1_into_the_uninterrupted_run(dp_runs):
    resumed = _single(invariant=True, resume_from=dp_runs["ckpt"])
    assert resumed["metrics"] == dp_runs[1]["on"]["metrics"][1:]
    assert all(torch.equal(w, dp_runs[1]["on"]["weights"][n]) for n, w in resumed["weights"].items())


# ----------------------------------------------------------------------------------------- resume at another layout

def _recorded(**train):
    return {"run": {"dir": "runs/a", "resume": False}, "checkpoint": {"every": 2},
            "train": {"steps": 4, "lr": 1e-6, "min_lr_ratio": 0.1, "warmup_steps": 0, "num_gpus": 2,
                      "tensor_parallel": 2, "backend": "megatron", **train}}


def test_resume_at_another_layout_is_allowed_with_the_option_and_refused_without():
    from rlrepro.orchestration.resume import reconcile_resume

    rec = _recorded(layout_invariant=True, tp_partials=2)
    req = _recorded(layout_invariant=True, tp_partials=2, num_gpus=1, tensor_parallel=1)
    config, amendments = reconcile_resume(rec, req, completed_step=2)
    assert config["train"]["num_gpus"] == 1 and config["train"]["tensor_parallel"] == 1
    assert [(a["key"], a["old"], a["new"], a["from_step"]) for a in amendments] == [
        ("train.num_gpus", 2, 1, 3), ("train.tensor_parallel", 2, 1, 3)]
    for rec, req in ((_recorded(), _recorded(num_gpus=1)),
                     (_recorded(layout_invariant=False), _recorded(layout_invariant=False, tensor_parallel=1)),
                     # turning the option on at resume does not make the recorded steps layout-free
                     (_recorded(layout_invariant=False), _recorded(layout_invariant=True, num_gpus=1))):
        with pytest.raises(ConfigError, match=r"train.layout_invariant=false, so its gradient sums are grouped by "
                                              r"the layout.*train.layout_invariant=true"):
            reconcile_resume(rec, req, completed_step=2)
    with pytest.raises(ConfigError, match=r"train.tp_partials: 2 -> 4"):  # the pieces are the run's arithmetic
        reconcile_resume(_recorded(layout_invariant=True, tp_partials=2),
                         _recorded(layout_invariant=True, tp_partials=4), completed_step=2)
