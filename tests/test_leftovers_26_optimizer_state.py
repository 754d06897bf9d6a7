"""The step fingerprint covers the optimizer's state, not only the compute-dtype weights: a bf16 policy's float32
master weights hold bits its weights do not show, and AdamW's moments decide every later update. Two runs whose
masters (or moments) differ had the same ``weights`` digest at that step, and diff named a later step (where the
difference finally reached the bf16 weights) as the first divergence. Now ``optimizer_state`` (fingerprints.jsonl)
changes with them; the ``weights`` digest is unchanged, so older runs' records still compare (a note says what was
not compared)."""
import json
import types

import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.orchestration.workers import TrainerWorker
from rlrepro.repro.diff import diff_runs
from rlrepro.repro.fingerprint import optimizer_state_digest, weights_digest
from rlrepro.trainer import TrainConfig, Trainer
from test_repro_diff import make_run
from test_trainer_train import make_batch

CFG = TrainConfig(lr=1e-3, steps=10, warmup_steps=0, min_lr_ratio=1.0, micro_batch_size=4, ppo_epochs=1)


def _trainer(dtype=torch.bfloat16):
    model = tiny_model(seed=1).to(dtype)
    return Trainer(model, CFG, param_dtype=dtype)


def _state(trainer) -> str:
    return optimizer_state_digest(TrainerWorker.optimizer_state_digests(
        types.SimpleNamespace(backend="default", trainer=trainer)))


@pytest.fixture
def two_trainers(deterministic_torch):
    a, b = _trainer(), _trainer()
    batch = make_batch(tiny_model(seed=1), 1)
    for t in (a, b):
        t.train_step(batch)
    assert a.optimizer.has_master_copies
    assert weights_digest(a.named_weights()) == weights_digest(b.named_weights())
    assert _state(a) == _state(b)  # the same steps: the same state
    return a, b


def test_float32_masters_hidden_by_bf16_rounding_change_the_fingerprint(two_trainers):
    a, b = two_trainers
    with torch.no_grad():
        m = b.optimizer.masters[0]
        up = torch.nextafter(m, torch.full_like(m, float("inf")))  # one float32 ulp, where bf16 rounding hides it
        hidden = up.to(torch.bfloat16) == m.to(torch.bfloat16)
        assert int(hidden.sum()) > 0
        m.copy_(torch.where(hidden, up, m))
        b.optimizer._copy_masters_to_params()
    assert weights_digest(a.named_weights()) == weights_digest(b.named_weights())  # what the weights show
    assert _state(a) != _state(b)  # what the fingerprint now covers


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_adamw_moments_change_the_fingerprint(two_trainers, key):
    a, b = two_trainers
    with torch.no_grad():
        st = b.optimizer.inner.state[b.optimizer.masters[-1]]
        st[key].view(-1)[0] = torch.nextafter(st[key].view(-1)[0], torch.tensor(float("inf")))
    assert weights_digest(a.named_weights()) == weights_digest(b.named_weights())
    assert _state(a) != _state(b)


def test_names_cover_masters_and_adamw_state(two_trainers):
    a, _ = two_trainers
    named = TrainerWorker.optimizer_state_digests(types.SimpleNamespace(backend="default", trainer=a))
    names = a.optimizer.names
    assert sorted(named) == sorted([f"master/{n}" for n in names]
                                   + [f"adamw/{n}/{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")])
    assert TrainerWorker.optimizer_state_digests(types.SimpleNamespace(backend="megatron", trainer=a)) is None


def test_float32_params_are_their_own_masters_and_only_adamw_state_is_added(deterministic_torch):
    t = _trainer(torch.float32)
    t.train_step(make_batch(tiny_model(seed=1), 1))
    named = TrainerWorker.optimizer_state_digests(types.SimpleNamespace(backend="default", trainer=t))
    assert named and all(n.startswith("adamw/") for n in named)


def test_the_shares_of_a_sharded_optimizer_merge_into_the_unsharded_digest(two_trainers):
    """ZeRO-1 keeps each parameter's master and moments on one owner rank (masters[i] None elsewhere): the merge
    of every rank's digests is the unsharded optimizer's."""
    a, _ = two_trainers
    opt = a.optimizer
    shares = []
    for rank in (0, 1):
        view = types.SimpleNamespace(names=opt.names, params=opt.params, inner=opt.inner,
                                     masters=[m if i % 2 == rank else None for i, m in enumerate(opt.masters)])
        shares.append(TrainerWorker.optimizer_state_digests(
            types.SimpleNamespace(backend="default", trainer=types.SimpleNamespace(optimizer=view))))
    assert not set(shares[0]) & set(shares[1])
    assert optimizer_state_digest({**shares[0], **shares[1]}) == _state(a)


# ------------------------------------------------------------------------------------------------------- diff
def _with_state(run, states: dict[int, str | None]):
    path = run / "fingerprints.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        if states.get(r["step"]) is not None:
            r["optimizer_state"] = states[r["step"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_diff_names_the_step_where_only_the_optimizer_state_differs(tmp_path):
    a = _with_state(make_run(tmp_path / "a", steps=3), {1: "1" * 64, 2: "2" * 64, 3: "3" * 64})
    b = _with_state(make_run(tmp_path / "b", steps=3), {1: "1" * 64, 2: "f" * 64, 3: "e" * 64})
    rep = diff_runs(a, b)
    assert rep.verdict == "diverged"
    assert rep.divergence.step == 2 and rep.divergence.field == "optimizer_state"
    assert rep.divergence.fields == ["optimizer_state"]
    assert rep.diverged_steps == [2, 3]
    assert "FIRST DIVERGENCE: step 2, field optimizer_state" in rep.format()


def test_an_older_run_without_the_field_is_compared_by_its_weights_with_a_note(tmp_path):
    old = make_run(tmp_path / "old", steps=3)  # recorded before the optimizer state was fingerprinted
    new = _with_state(make_run(tmp_path / "new", steps=3), {1: "1" * 64, 2: "2" * 64, 3: "3" * 64})
    for x, y, lacking in ((old, new, "A"), (new, old, "B")):
        rep = diff_runs(x, y)
        assert rep.verdict == "identical" and rep.divergence is None
        assert rep.notes == [f"optimizer_state not compared at step(s) 1-3: run {lacking} has no optimizer_state "
                             "digest (recorded before the optimizer's state was fingerprinted, or a megatron run); "
                             "its weights are compared alone"]


def test_diffs_field_lists_are_the_fingerprints():
    # repro.diff keeps its own copies (it must not import torch): a field added to the fingerprint and not to diff
    # would go uncompared
    from rlrepro.repro import diff as D
    from rlrepro.repro import fingerprint as FP

    assert D.FIELDS == FP.FIELDS
    assert D.SAMPLE_FIELDS == FP.SAMPLE_FIELDS
    assert D.TURN_SAMPLE_FIELDS == FP.TURN_SAMPLE_FIELDS
    assert D.STATE_FIELDS == FP.STATE_FIELDS
