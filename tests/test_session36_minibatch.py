"""train.mini_batch_size: several optimizer updates a train step (verl's ppo_mini_batch_size, ReTool's 4 updates).

* null, or the whole batch (or more, through the Python API), is today's step bit for bit (weights torch.equal,
  metrics ==);
* M = half the batch is two updates, each the existing step on its half (normalised over that half, the same
  pi_old: the rollout's), at the step's learning rate: bit for bit a hand-driven sequence of whole-batch steps on the
  halves with the LR schedule held; with ppo_epochs=2 the order is epoch by epoch, mini-batch by mini-batch;
* the later mini-batches' proximal logprobs (train.decoupled) and the on-policy check come from the weights before
  any update; the LR schedule advances once per train step; MFU counts the extra no-grad forward;
* repeatable, resumable (a checkpointed trainer resumed equals the uninterrupted one), refused on resume if changed;
* a non-finite update undoes the whole step (error / skip);
* the errors name key, value and fix;
* data parallel (gloo): ranks agree, and with train.layout_invariant DP=2 equals DP=1 bit for bit.
"""
import copy
from types import SimpleNamespace

import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import DataParallel, TrainConfig, Trainer, lr_at, token_logprobs
from rlrepro.trainer.flops import train_flops
from rlrepro.trainer.updates import mini_batches

from _dist import gloo_process_group, spawn_ranks
from test_faults_units import poison  # NaN gradients of one parameter from a given backward on

pytestmark = pytest.mark.usefixtures("deterministic_torch")

NUM_SAMPLES = 8
# a cosine schedule (the rate changes every step) so that a schedule stepped per update would show
CONFIG = dict(lr=3e-3, steps=6, warmup_steps=0, min_lr_ratio=0.1, micro_batch_size=2, clip_high=0.28)


def make_batch(model, step: int, n: int = NUM_SAMPLES, stale: bool = False):
    """``n`` samples of the model's own logprobs (``stale``: shifted, an off-policy batch), sample 5 with an empty
    completion, advantages of both signs."""
    gen = torch.Generator().manual_seed(900 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(n)]
    completions = [torch.randint(vocab, (1 + (i * 5) % 6,), generator=gen).tolist() for i in range(n)]
    if n > 5:
        completions[5] = []
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    out = []
    for i, (p, c, lp) in enumerate(zip(prompts, completions, lps)):
        logprobs = [x - 0.05 * ((j % 3) - 1) for j, x in enumerate(lp.tolist())] if stale else lp.tolist()
        out.append(dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=logprobs,
                        advantage=(-1.0) ** i * (1 + i / 10)))
    return out


def trainer(ref: bool = False, **overrides) -> Trainer:
    model = tiny_model(seed=1)
    return Trainer(model, TrainConfig(**{**CONFIG, **overrides}), ref_model=copy.deepcopy(model) if ref else None)


def weights(tr: Trainer) -> dict:
    return {n: w.clone() for n, w in tr.named_weights()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def same_state(a, b) -> bool:
    """Nested optimizer states equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def run(steps: int = 2, ref: bool = False, stale: bool = False, **overrides):
    tr = trainer(ref=ref, **overrides)
    metrics = [tr.train_step(make_batch(tr.model, s, stale=stale)) for s in range(steps)]
    return tr, metrics


# ----------------------------------------------------------------------------------- (1) null / the whole batch

@pytest.mark.parametrize("extra", [dict(ppo_epochs=2, entropy_coef=0.01),
                                   dict(ppo_epochs=2, decoupled=True, is_correction="tis", kl_coef=0.1)])
def test_null_or_the_whole_batch_is_todays_step(extra):
    kw = dict(ref=extra.get("kl_coef", 0) > 0, stale="decoupled" in extra, **extra)
    base_tr, base = run(**kw)  # no key at all: today's trainer
    for m in (None, NUM_SAMPLES, 100):  # 100 > the batch (a partial batch through the Python API): one mini-batch
        tr, metrics = run(mini_batch_size=m, **kw)
        assert same_weights(weights(tr), weights(base_tr)), m
        if m is not None:  # set: the updates are reported (one per epoch here); nothing else changes
            assert [x.pop("train/optimizer_updates") for x in metrics] == [2.0, 2.0]
        assert metrics == base, m
    assert "train/optimizer_updates" not in base[0]  # a default run's metrics are today's keys


# ------------------------------------------------------------------------ (2) two updates == a hand-driven pair

def _hand_driven(batches, epochs: int, ref: bool, **overrides):
    """The existing whole-batch step, called once per half and epoch (epoch by epoch, half by half), with the LR
    schedule held at the train step's rate: what M = half the batch promises."""
    tr = trainer(ref=ref, **{**overrides, "ppo_epochs": 1})
    out = []
    for batch in batches:
        step = tr.scheduler.state_dict()
        for _ in range(epochs):
            for half in (batch[:NUM_SAMPLES // 2], batch[NUM_SAMPLES // 2:]):
                tr.scheduler.load_state_dict(step)  # hold the rate: one scheduler step per train step
                out.append(tr.train_step(half))
        tr.scheduler.load_state_dict({**step, "last_step": step["last_step"] + 1})
    return tr, out


@pytest.mark.parametrize("extra", [dict(), dict(kl_coef=0.1, entropy_coef=0.01)])
@pytest.mark.parametrize("epochs", [1, 2])
def test_half_the_batch_is_two_updates_each_the_step_on_its_half(epochs, extra):
    ref = extra.get("kl_coef", 0) > 0
    start = tiny_model(seed=1)
    batches = [make_batch(start, s, stale=True) for s in range(2)]  # off policy: the rollout's logprobs are pi_old
    tr = trainer(ref=ref, mini_batch_size=NUM_SAMPLES // 2, ppo_epochs=epochs, **extra)
    metrics = [tr.train_step(b) for b in batches]
    hand_tr, hand = _hand_driven(batches, epochs, ref, **extra)
    assert same_weights(weights(tr), weights(hand_tr))
    assert same_state(tr.optimizer.state_dict(), hand_tr.optimizer.state_dict())  # masters, moments, step counts
    per_step = 2 * epochs
    for s, m in enumerate(metrics):
        mine = hand[s * per_step:(s + 1) * per_step]
        assert m["loss_per_update"] == [h["train/loss"] for h in mine]
        assert m["grad_norm_per_update"] == [h["train/grad_norm"] for h in mine]
        assert m["train/loss"] == sum(h["train/loss"] for h in mine) / per_step  # the mean over the updates
        assert m["train/grad_norm"] == sum(h["train/grad_norm"] for h in mine) / per_step
        assert m["train/optimizer_updates"] == per_step
        assert m["train/lr"] == lr_at(s, base_lr=CONFIG["lr"], warmup_steps=0, total_steps=CONFIG["steps"],
                                      min_lr_ratio=CONFIG["min_lr_ratio"]) == mine[0]["train/lr"]
        assert m["train/num_tokens"] == sum(h["train/num_tokens"] for h in mine[:2])
        assert len(m["loss_per_epoch"]) == epochs
    assert tr.step == 2  # the LR schedule counts train steps, not updates
    assert metrics[0]["train/clip_frac"] > 0  # the stale ratios reach the clip bounds


def test_the_later_mini_batches_are_anchored_before_any_update():
    # on an on-policy batch the proximal policy (train.decoupled, weights at the start of the step) is the rollout's:
    # decoupled with no correction is then the plain loss bit for bit, only if mini-batch 2's proximal logprobs
    # were taken before mini-batch 1's update; and the on-policy check over the whole batch is exactly 0
    plain_tr, plain = run(steps=1, mini_batch_size=3, ppo_epochs=2)
    dec_tr, dec = run(steps=1, mini_batch_size=3, ppo_epochs=2, decoupled=True)
    assert same_weights(weights(plain_tr), weights(dec_tr))
    assert dec[0]["train/behaviour_proximal_kl"] == 0.0 and dec[0]["train/is_weight_max"] == 1.0
    assert plain[0]["train/rollout_logprob_abs_diff"] == 0.0 == dec[0]["train/rollout_logprob_abs_diff"]
    assert plain[0]["train/optimizer_updates"] == 6.0  # 3 mini-batches (3, 3, 2 samples) x 2 epochs
    # a stale batch shows the check is not vacuous over the later mini-batches (their forwards come after updates)
    stale = make_batch(tiny_model(seed=1), 0, stale=True)
    for i in range(3):  # the first mini-batch as the rollout reported it: only the later ones are off
        stale[i]["rollout_logprobs"] = make_batch(tiny_model(seed=1), 0)[i]["rollout_logprobs"]
    m = trainer(mini_batch_size=3).train_step(stale)
    assert m["train/rollout_logprob_abs_diff"] > 0.04


def test_mini_batches_and_the_micro_batches_within_them():
    assert mini_batches(8, None) == [range(0, 8)] == mini_batches(8, 8) == mini_batches(8, 9)
    assert mini_batches(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]  # the last one smaller
    tr = trainer(mini_batch_size=3, micro_batch_size=2)
    batch = make_batch(tr.model, 0)
    plan = tr.update_plan(batch)
    assert [(list(mini), [list(m) for m in micro]) for mini, micro in plan] == [
        ([0, 1, 2], [[0, 1], [2]]), ([3, 4, 5], [[3, 4], [5]]), ([6, 7], [[6, 7]])]
    assert tr.micro_batches(batch) == [m for _, micro in plan for m in micro]


def test_mfu_counts_the_no_grad_pass_of_the_later_mini_batches():
    model = tiny_model(seed=1)
    batch = [SimpleNamespace(**x) for x in make_batch(model, 0)]
    whole = TrainConfig(**CONFIG)
    halves = TrainConfig(**CONFIG, mini_batch_size=NUM_SAMPLES // 2)
    later = train_flops(model.config, batch[NUM_SAMPLES // 2:], whole) / 3  # one forward of the second half
    assert train_flops(model.config, batch, halves) == train_flops(model.config, batch, whole) + later
    assert train_flops(model.config, batch, TrainConfig(**CONFIG, mini_batch_size=NUM_SAMPLES)) == \
        train_flops(model.config, batch, whole)


# ------------------------------------------------------------------------- (3) repeatable, resumable, on resume

def test_two_runs_are_identical_and_a_resume_equals_the_uninterrupted_run(tmp_path):
    kw = dict(steps=3, ref=True, stale=True, mini_batch_size=3, ppo_epochs=2, decoupled=True, is_correction="tis",
              kl_coef=0.1, entropy_coef=0.01)
    a_tr, a = run(**kw)
    b_tr, b = run(**kw)
    assert a == b and same_weights(weights(a_tr), weights(b_tr))
    assert all(m["train/optimizer_updates"] == 6.0 and m["train/grad_norm"] > 0 for m in a)
    cfg = {k: v for k, v in kw.items() if k not in ("steps", "ref", "stale")}
    first = trainer(ref=True, **cfg)
    first.train_step(make_batch(first.model, 0, stale=True))
    ckpt = first.save_checkpoint(tmp_path / "ckpt", 1)
    resumed = trainer(ref=True, **cfg)
    resumed.load_checkpoint(ckpt)
    rest = [resumed.train_step(make_batch(resumed.model, s, stale=True)) for s in (1, 2)]
    assert rest == a[1:]
    assert same_weights(weights(resumed), weights(a_tr))


def test_a_run_with_mini_batches_repeats_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """``rlrepro train`` in process (the driver with one real rollout and trainer worker, no Ray): two runs give
    the same records; a run stopped after step 2 (the trainer refuses step 3) and resumed equals the uninterrupted
    one; a resume that changes train.mini_batch_size is refused, naming the key."""
    from test_review26_pipe_pipeline import BASE, LocalActors, RefusedAtStep3, _bits, _run

    from rlrepro.orchestration import driver as driver_mod

    args = [*BASE, "rollout.group_size=4", "train.mini_batch_size=3", "train.ppo_epochs=2", "train.micro_batch_size=2"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _run(monkeypatch, LocalActors, [*args, f"run.dir={a}"])
    _run(monkeypatch, LocalActors, [*args, f"run.dir={b}"])
    assert _bits(a) == _bits(b)
    metrics = _bits(a)[1]
    assert [m["train/optimizer_updates"] for m in metrics] == [6.0] * 4  # 8 samples: mini-batches of 3, 3, 2
    with pytest.raises(driver_mod.RunFailed, match="Saved a checkpoint of the last completed step 2"):
        _run(monkeypatch, RefusedAtStep3, [*args, "checkpoint.every=0", f"run.dir={c}"])
    with pytest.raises(ConfigError, match=r"train\.mini_batch_size: 3 -> 4"):
        _run(monkeypatch, LocalActors, [*args, "train.mini_batch_size=4", f"run.dir={c}", "run.resume=true"])
    _run(monkeypatch, LocalActors, [*args, "checkpoint.every=0", f"run.dir={c}", "run.resume=true"])
    assert _bits(c) == _bits(a)


# --------------------------------------------------------------------------------------- non-finite updates

def _state(tr: Trainer):
    return weights(tr), copy.deepcopy(tr.optimizer.state_dict())


def test_a_nonfinite_later_update_undoes_the_whole_step():
    # 4 samples in micro-batches of 2, mini-batches of 2: update 1 (one backward) is clean, update 2 is not
    tr = trainer(mini_batch_size=2)
    tr.train_step(make_batch(tr.model, 0, n=4))  # optimizer state to protect
    before = _state(tr)
    handle = poison(tr, from_call=1)
    with pytest.raises(FloatingPointError, match=r"mini-batch 2 of 2\).* train step 2\b"):
        tr.train_step(make_batch(tr.model, 1, n=4))
    handle.remove()
    after = _state(tr)
    assert same_weights(after[0], before[0]) and same_state(after[1], before[1]) and tr.step == 1

    skip = trainer(mini_batch_size=2, on_nonfinite="skip")
    skip.train_step(make_batch(skip.model, 0, n=4))
    before = _state(skip)
    handle = poison(skip, from_call=1)
    m = skip.train_step(make_batch(skip.model, 1, n=4))
    handle.remove()
    after = _state(skip)
    assert m["train/nonfinite_skipped"] == 1.0 and m["train/optimizer_updates"] == 0.0
    assert same_weights(after[0], before[0])  # the moments, step counts and masters too (only the rate moved on)
    assert same_state(after[1]["adamw"]["state"], before[1]["adamw"]["state"])
    assert same_state(after[1]["master_weights"], before[1]["master_weights"])
    assert skip.step == 2  # the LR schedule advances, as for any skipped step


def test_a_mini_batch_with_nothing_to_train_takes_no_update():
    tr = trainer(mini_batch_size=2, ppo_epochs=2)
    batch = make_batch(tr.model, 0, n=6)
    batch[2]["completion_token_ids"] = batch[3]["completion_token_ids"] = []
    batch[2]["rollout_logprobs"] = batch[3]["rollout_logprobs"] = []
    m = tr.train_step(batch)
    assert m["train/optimizer_updates"] == 4.0 and len(m["loss_per_update"]) == 4  # 2 mini-batches x 2 epochs
    assert tr.optimizer.state_dict()["adamw"]["state"]  # the others were trained


def test_the_megatron_backend_takes_the_same_mini_batch_updates():
    # the megatron trainer runs Trainer's update loop through its hooks (TP=1 here, in one process): the same bits
    from rlrepro.trainer.megatron import MegatronTrainer, TPQwen3ForCausalLM, single_process_groups

    cfg = TrainConfig(**CONFIG, mini_batch_size=3, ppo_epochs=2, decoupled=True, is_correction="tis", kl_coef=0.1,
                      logits_chunk_size=2)
    plain = trainer(ref=True, **{k: getattr(cfg, k) for k in ("mini_batch_size", "ppo_epochs", "decoupled",
                                                              "is_correction", "kl_coef", "logits_chunk_size")})
    tp_model = TPQwen3ForCausalLM.from_full(tiny_model(seed=1), single_process_groups())
    mtr = MegatronTrainer(tp_model, cfg, ref_model=copy.deepcopy(tp_model))
    start = tiny_model(seed=1)
    for s in range(2):
        batch = make_batch(start, s, stale=True)
        assert plain.train_step(batch) == mtr.train_step(batch)
    assert same_weights(dict(mtr.named_weights()), weights(plain))


# ------------------------------------------------------------------------------------------------- (4) errors

@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "4"])
def test_a_bad_mini_batch_size_names_the_value_and_the_fix(bad):
    with pytest.raises(ConfigError, match=rf"train\.mini_batch_size={bad!r} must be a positive number of samples "
                                          r"per optimizer update .*or null"):
        TrainConfig(mini_batch_size=bad)


def test_a_mini_batch_larger_than_the_step_batch_is_refused_before_any_work():
    from rlrepro.cli import compose_config

    base = ["recipe=grpo_tiny", "rollout.prompts_per_step=4", "rollout.group_size=8"]
    with pytest.raises(ConfigError, match=r"train\.mini_batch_size=33 is larger than the step's batch of "
                                          r"rollout\.prompts_per_step x rollout\.group_size = 4 x 8 = 32 samples.*"
                                          r"Fix: give at most 32"):
        compose_config([*base, "train.mini_batch_size=33"])
    assert compose_config([*base, "train.mini_batch_size=32"]).train.mini_batch_size == 32
    assert compose_config([*base, "train.mini_batch_size=5"]).train.mini_batch_size == 5  # the last one smaller
    assert compose_config(base).train.mini_batch_size is None


# -------------------------------------------------------------------------------------- (5) data parallel

DP_STEPS = 2


def _dp_train(dp, invariant: bool):
    tr = Trainer(tiny_model(seed=1), TrainConfig(**CONFIG, mini_batch_size=3, ppo_epochs=2, decoupled=True,
                                                 is_correction="tis", layout_invariant=invariant),
                 data_parallel=dp)
    metrics = [tr.train_step(make_batch(tr.model, s, stale=True)) for s in range(DP_STEPS)]
    return {"weights": weights(tr), "metrics": metrics}


def _dp_worker(rank: int, world: int, port: int, out: str) -> None:
    with gloo_process_group(rank, world, port):
        dp = DataParallel(bucket_numel=3000)
        torch.save({"on": _dp_train(dp, True), "off": _dp_train(dp, False)}, f"{out}.rank{rank}")


def _same(a, b) -> bool:
    return a["metrics"] == b["metrics"] and same_weights(a["weights"], b["weights"])


def test_data_parallel_mini_batches(tmp_path):
    ranks = spawn_ranks(_dp_worker, 2, out=str(tmp_path / "dp"))
    for kind in ("on", "off"):  # the ranks agree
        assert _same(ranks[0][kind], ranks[1][kind]), kind
    single = _dp_train(None, True)  # one thread, as the ranks (deterministic_torch)
    # with train.layout_invariant every mini-batch's micro-batch fold gives DP=2 the one-rank bits
    assert _same(ranks[0]["on"], single)
    assert _same(_dp_train(None, False), single)  # at one rank the option is the plain step
    assert all(m["train/optimizer_updates"] == 6.0 for m in ranks[0]["on"]["metrics"])
    # without it each update's sum is grouped by rank: the same math, not promised to the bit
    for m, s in zip(ranks[0]["off"]["metrics"], single["metrics"]):
        assert m["train/loss"] == pytest.approx(s["train/loss"], rel=1e-5, abs=1e-7)
