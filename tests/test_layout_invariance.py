"""train.layout_invariant (issue #26): the micro-batch fold alone, then the Trainer over 1, 2, 3 and 4 gloo
data-parallel ranks gives the same bits (metrics ==, weights torch.equal), which at one rank are the plain step's
(the option costs nothing there), a checkpoint written at DP=2 resumes at DP=1 into the uninterrupted run, and with
the option off the layouts differ (the option is what holds)."""
import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import DataParallel, TrainConfig, Trainer, token_logprobs
from rlrepro.trainer.grad_fold import ShardedGradFold, fold_floats, fold_leaves

from _dist import gloo_process_group, spawn_ranks

# 9 samples in micro-batches of 2: 5 leaves (not a multiple of 2, 3 or 4), one of them skipped (no completion tokens)
CONFIG = dict(lr=3e-3, steps=4, micro_batch_size=2, ppo_epochs=2, clip_high=0.28, entropy_coef=0.01)
STEPS = 2
NUM_SAMPLES = 9
# train.micro_batch_tokens: the samples' 2, 8, 8, 5, 2, 3, 2, 8, 8 tokens in micro-batches of at most 10 tokens:
# [0, 1], [2], [3, 4, 5], [6, 7], [8] (other micro-batches than micro_batch_size=2's, of 1 to 3 samples)
TOKENS = dict(micro_batch_size=4, micro_batch_tokens=10)


# ------------------------------------------------------------------------------------------- the fold on its own

def _clone(leaf):
    return None if leaf is None else [None if t is None else t.clone() for t in leaf]


def reference_fold(leaves: dict, num: int, like) -> list[torch.Tensor]:
    """What one rank's plain step computes: per tensor, the first present leaf widened to float32, each later one
    added in leaf order (zeros where no leaf had the tensor)."""
    out = [None] * len(like)
    for k in range(num):
        for i, t in enumerate(leaves.get(k) or [None] * len(like)):
            if t is not None:
                out[i] = t.float().clone() if out[i] is None else out[i].add_(t)
    return [torch.zeros(t.shape) if o is None else o for o, t in zip(out, like)]


def test_fold_floats_is_the_running_sum_in_leaf_order():
    assert fold_floats({}, 3, width=2) == [0.0, 0.0]
    assert fold_floats({0: [1.0, 5.0], 2: [2.0, 3.0]}, 3, width=2, max_indices=(1,)) == [3.0, 5.0]
    # ((1e16 + 1) - 1e16) + 1 = 1 in float64, the pairwise (1e16 + 1) + (-1e16 + 1) = 0
    assert fold_floats({k: [v] for k, v in enumerate([1e16, 1.0, -1e16, 1.0])}, 4, width=1) == [1.0]
    assert fold_floats({5: [1.0]}, 3, width=1) == [0.0]  # leaves past num_leaves are not part of the step


def test_fold_is_sequential_and_absent_is_not_zero():
    like = [torch.empty(1)]
    # ((1e8 + 1) - 1e8) + 1 = 1 in float32, where the pairwise ((1e8 + 1) + (-1e8 + 1)) = 0: the sum is the fold
    leaves = {k: [torch.tensor([v])] for k, v in enumerate([1e8, 1.0, -1e8, 1.0])}
    fold = ShardedGradFold(4, None, like)
    for k in range(4):
        fold.push(k, _clone(leaves[k]))
    assert fold.finish()[0].item() == 1.0
    # -0.0 + 0.0 == +0.0: adding a zero leaf would change the bits; an absent leaf does not
    fold = ShardedGradFold(3, None, like)
    fold.push(1, [torch.tensor([-0.0])])
    assert str(fold.finish()[0].item()) == "-0.0"
    with pytest.raises(ValueError, match="out of order"):
        fold = ShardedGradFold(3, None, like)
        fold.push(1, None)
        fold.push(0, None)
    with pytest.raises(ValueError, match="must have their parameters' dtype"):  # no silent rounding into bf16
        ShardedGradFold(3, None, [torch.empty(1, dtype=torch.bfloat16)]).push(0, [torch.tensor([0.1])])


# ------------------------------------------------------------------- the accumulator sharded (ZeRO-2 style)

# tensors of 33, 2x2 (absent in every third leaf), 7 (bf16 in odd leaves: widened exactly) and 1 element (absent
# everywhere): 45 elements, cut into d shards and exchanged in rounds of 3 elements per sender
SHARD_LIKE = [torch.empty(33), torch.empty(2, 2), torch.empty(7), torch.empty(1)]
BF16_LIKE = [torch.empty(33, dtype=torch.bfloat16), torch.empty(2, 2, dtype=torch.bfloat16)]


def _shard_leaves(num, absent, like):
    g = torch.Generator().manual_seed(1000 + num)
    out = {}
    for k in range(num):
        if like is BF16_LIKE:
            leaf = [(torch.randn(33, generator=g) * 10.0 ** (k % 7 - 3)).bfloat16(),
                    None if k % 3 == 1 else torch.randn(2, 2, generator=g).bfloat16()]
        else:
            small = torch.randn(7, generator=g) * 10.0 ** (k % 5 - 2)
            leaf = [torch.randn(33, generator=g) * 10.0 ** (k % 7 - 3),
                    None if k % 3 == 1 else torch.randn(2, 2, generator=g), small.bfloat16() if k % 2 else small, None]
        if k not in absent:
            out[k] = leaf
    return out


def _absent_patterns(num):
    return ((), (0,), (num - 1,), tuple(range(1, num, 2)), tuple(range(num)))


def _shard_cases(dp, world, rank):
    """For leaf counts 1..13 and several absent sets, float32 and bf16 parameters: whether ShardedGradFold's sum
    equals the one-rank fold's (torch.equal and the printed values, -0.0 included), with the peak accumulator
    bytes, its bound (one float32 shard), the exchange's peak bytes and its bound."""
    results = []
    for like in (SHARD_LIKE, BF16_LIKE):
        total = sum(t.numel() for t in like)
        for num in range(1, 14):
            for absent in _absent_patterns(num):
                leaves = _shard_leaves(num, absent, like)
                fold = ShardedGradFold(num, dp, like, bucket_numel=3 * world)
                for k in fold_leaves(num, world, rank):
                    if k in leaves:
                        fold.push(k, _clone(leaves[k]))
                got = fold.finish(like)
                ref = reference_fold(leaves, num, like)
                same = all(a.dtype == torch.float32 and torch.equal(a, b) and str(a) == str(b)
                           for a, b in zip(got, ref))
                size = like[0].element_size()
                results.append((len(like), num, absent, same, fold.peak_partial_bytes, -(-total // world) * 4,
                                fold.exchange_peak_bytes, 2 * world * fold.chunk * size))
    return results


def _negative_zero(dp, world, rank) -> bool:
    """Leaf 0 is -0.0 everywhere, every other leaf absent: the sum keeps the sign (absent is not a zero)."""
    like = [torch.empty(world + 1)]
    fold = ShardedGradFold(3 * world, dp, like)
    if rank == 0:
        fold.push(0, [torch.full((world + 1,), -0.0)])
    root = fold.finish(like)[0]
    return bool(torch.signbit(root).all()) and not bool(root.any())


def _shard_worker(rank: int, world: int, port: int, out: str) -> None:
    """8 ranks (one spawn): d = 2 on ranks 0-1 and d = 4 on ranks 4-7 at once, then d = 3 on ranks 0-2, then
    d = 8 on all."""
    import torch.distributed as dist

    with gloo_process_group(rank, world, port):
        subgroups = {2: dist.new_group([0, 1]), 4: dist.new_group([4, 5, 6, 7]),
                     3: dist.new_group([0, 1, 2])}  # every rank creates every group, in one order
        res = {}
        for phase in (((2, [0, 1]), (4, [4, 5, 6, 7])), ((3, [0, 1, 2]),)):
            for d, members in phase:
                if rank in members:
                    res[d] = _shard_cases(DataParallel(subgroups[d], bucket_numel=3 * d), d, members.index(rank))
            dist.barrier()
        dp = DataParallel(bucket_numel=3 * world)
        res[world] = _shard_cases(dp, world, rank)
        res["negative_zero"] = _negative_zero(dp, world, rank)
        with pytest.raises(ValueError, match="out of order"):
            fold = ShardedGradFold(2 * world, dp, SHARD_LIKE)  # every rank: leaves rank and rank + world
            fold.push(rank + world, None)
            fold.push(rank, None)
        torch.save(res, f"{out}.rank{rank}")


def test_sharded_fold_gives_the_one_rank_bits_for_any_world(tmp_path):
    ranks = spawn_ranks(_shard_worker, 8, out=str(tmp_path / "shards"))
    assert _negative_zero(None, 1, 0) and all(r["negative_zero"] for r in ranks)
    per_world = {1: [_shard_cases(None, 1, 0)], 2: [r[2] for r in ranks[:2]], 3: [r[3] for r in ranks[:3]],
                 4: [r[4] for r in ranks[4:]], 8: [r[8] for r in ranks]}
    for world, ranks in per_world.items():
        assert len(ranks) == world
        for rank, cases in enumerate(ranks):
            assert len(cases) == 2 * 13 * 5
            for tensors, num, absent, same, peak, bound, exchange, exchange_bound in cases:
                assert same, (world, rank, tensors, num, absent)
                # the held partial sum: one float32 shard of 1/d of the parameters (none if every leaf was absent)
                assert peak <= bound, (world, rank, num, absent, peak, bound)
                assert (peak == 0) == (len(absent) == num) or bound == 0, (world, rank, num, absent, peak)
                assert exchange <= exchange_bound, (world, rank, num, exchange, exchange_bound)
    # bf16 parameters travel as bf16: half the exchange bytes of float32 ones
    bf16 = [c for c in per_world[2][0] if c[0] == len(BF16_LIKE) and c[1] == 13 and c[2] == ()][0]
    f32 = [c for c in per_world[2][0] if c[0] == len(SHARD_LIKE) and c[1] == 13 and c[2] == ()][0]
    assert bf16[6] == 2 * 2 * 2 * 3 and f32[6] == 2 * 2 * 4 * 3  # send + receive, d * chunk elements each


def test_leaves_are_assigned_round_robin():
    assert fold_leaves(5, 2, 1) == [1, 3] and fold_leaves(5, 4, 2) == [2] and fold_leaves(3, 8, 5) == []
    assert fold_leaves(5, 3, 0) == [0, 3]
    for num in range(1, 14):
        for world in (1, 2, 3, 4, 8):
            assert sorted(sum((fold_leaves(num, world, r) for r in range(world)), [])) == list(range(num))
    with pytest.raises(ValueError, match="outside"):
        fold_leaves(5, 2, 2)


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
            "fold": trainer.grad_fold_stats}


def train(invariant: bool, data_parallel=None, steps=STEPS, resume_from=None, save_to=None, param_dtype=None,
          **extra):
    model = tiny_model(seed=1)
    config = TrainConfig(**{**CONFIG, **extra}, layout_invariant=invariant)
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
        if world == 3:  # not a power of two, not a divisor of the 5 micro-batches: the same bits
            torch.save({"on": train(True, dp), "bf16": train(True, dp, param_dtype=torch.bfloat16)},
                       f"{out}.rank{rank}")
            return
        res = {"on": train(True, dp), "off": train(False, dp),
               "zero1": train(True, dp, distributed_optimizer=True, decoupled=True, is_correction="tis"),
               # bf16 compute: the bf16 leaves travel as bf16 and are widened into the float32 accumulator
               "bf16": train(True, dp, param_dtype=torch.bfloat16),
               "tokens": train(True, dp, **TOKENS)}
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
                "zero1_off": _single(invariant=False, decoupled=True, is_correction="tis"),
                "bf16": _single(invariant=True, param_dtype=torch.bfloat16),
                "bf16_off": _single(invariant=False, param_dtype=torch.bfloat16),
                "tokens": _single(invariant=True, **TOKENS), "tokens_off": _single(invariant=False, **TOKENS)}}
    for world in (2, 3, 4):
        ranks = spawn_ranks(_dp_worker, world, str(root / "ckpt"), out=str(root / f"w{world}"))
        for r in ranks[1:]:  # every rank holds the same weights and metrics
            assert all(_same(ranks[0][k], r[k]) for k in ranks[0])
        runs[world] = ranks[0]
    runs["ckpt"] = root / "ckpt" / "step_000001"
    return runs


def test_any_number_of_data_parallel_ranks_gives_the_same_bits(dp_runs):
    # 5 micro-batches (not a multiple of 2, 3 or 4), micro-batch 2 absent (at DP=4 its rank pushes nothing at all)
    for world in (2, 3, 4):
        assert _same(dp_runs[1]["on"], dp_runs[world]["on"]), world
        assert _same(dp_runs[1]["bf16"], dp_runs[world]["bf16"]), world
        kinds = ("on", "bf16") if world == 3 else ("on", "zero1", "bf16")
        for kind in kinds:  # the accumulator was sharded over the ranks (ZeRO-2 style)
            assert dp_runs[world][kind]["fold"]["kind"] == "ShardedGradFold", (world, kind)
    for world in (2, 4):  # ZeRO-1 sharded optimizer state, decoupled loss with its off-policy metric sums
        assert _same(dp_runs[1]["zero1"], dp_runs[world]["zero1"]), world
        # micro-batches cut by a token budget (train.micro_batch_tokens) are a function of the batch alone
        assert _same(dp_runs[1]["tokens"], dp_runs[world]["tokens"]), world
    for m in dp_runs[1]["on"]["metrics"]:
        assert m["train/rollout_logprob_abs_diff"] == 0.0 and m["train/grad_norm"] > 0


def test_at_one_rank_the_option_is_the_plain_step(dp_runs):
    # the fold is what a one-rank step does anyway: the same bits with the option off, and no extra state
    for on, off in (("on", "off"), ("zero1", "zero1_off"), ("bf16", "bf16_off"), ("tokens", "tokens_off")):
        assert _same(dp_runs[1][on], dp_runs[1][off]), on
        assert dp_runs[1][on]["fold"] is None
    assert dp_runs[1]["zero1"]["metrics"][0]["train/is_weight_mean"] > 0  # the off-policy sums are exercised


def test_sharded_accumulator_holds_a_fraction_of_the_gradient(dp_runs):
    # one float32 shard of 1/d of the parameters per rank (a plain data-parallel rank holds the whole float32 sum)
    numel = sum(w.numel() for w in dp_runs[1]["on"]["weights"].values())
    for world in (2, 3, 4):
        peak = dp_runs[world]["on"]["fold"]["peak_partial_bytes"]
        assert 0 < peak <= -(-numel // world) * 4, (world, peak)


def test_the_token_budget_decides_the_micro_batches(dp_runs):
    model = tiny_model(seed=1)
    batch = make_batch(model, 0)
    budget = Trainer(model, TrainConfig(**{**CONFIG, **TOKENS}, layout_invariant=True)).micro_batches(batch)
    assert [list(c) for c in budget] == [[0, 1], [2], [3, 4, 5], [6, 7], [8]]
    assert not _same(dp_runs[1]["tokens"], dp_runs[1]["on"])  # other micro-batches than micro_batch_size=2's
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in dp_runs[1]["tokens"]["metrics"])


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
        with pytest.raises(ConfigError, match=r"train.layout_invariant=false on more than one trainer rank, so its "
                                              r"gradient sums are grouped by the layout.*train.layout_invariant=true"):
            reconcile_resume(rec, req, completed_step=2)
    # a run recorded on one GPU without the option: its steps are the option's, so it may be turned on at resume
    # (and the layout changed with it); without turning it on the layout stays
    one = dict(num_gpus=1, tensor_parallel=1, backend="default")
    config, amendments = reconcile_resume(_recorded(**one), _recorded(**one, layout_invariant=True), completed_step=2)
    assert config["train"]["layout_invariant"] is True and [a["key"] for a in amendments] == ["train.layout_invariant"]
    config, amendments = reconcile_resume(_recorded(**one, layout_invariant=False),
                                          _recorded(layout_invariant=True, backend="default"), completed_step=2)
    assert sorted((a["key"], a["old"], a["new"]) for a in amendments) == [
        ("train.layout_invariant", False, True), ("train.num_gpus", 1, 2), ("train.tensor_parallel", 1, 2)]
    with pytest.raises(ConfigError, match=r"train.num_gpus: 1 -> 2 \(train.layout_invariant=false groups.*recorded "
                                          r"on one GPU.*add train.layout_invariant=true"):
        reconcile_resume(_recorded(**one, layout_invariant=False),
                         _recorded(layout_invariant=False, backend="default", num_gpus=2), completed_step=2)
    with pytest.raises(ConfigError, match=r"train.layout_invariant: <absent> -> true"):  # two ranks: its sums differ
        reconcile_resume(_recorded(backend="default", tensor_parallel=1),
                         _recorded(backend="default", tensor_parallel=1, layout_invariant=True), completed_step=2)
    with pytest.raises(ConfigError, match=r"train.tp_partials: 2 -> 4"):  # the pieces are the run's arithmetic
        reconcile_resume(_recorded(layout_invariant=True, tp_partials=2),
                         _recorded(layout_invariant=True, tp_partials=4), completed_step=2)
