"""Evaluation during training (eval.every) and after it (rlrepro eval): the pass@k estimator and the metrics by hand,
keyed eval seeds on a stream of their own, the config errors, eval keys bit-neutral on resume and in rlrepro diff,
and end to end: a run with eval has the fingerprints of one without, its eval numbers are the same under 1 and 2
rollout workers, and `rlrepro eval RUN --step K` gives exactly what the run logged at step K."""
import json
import math
import shutil
from fractions import Fraction

import pytest

from rlrepro.checks import ConfigError
from rlrepro.cli import compose_config, main
from rlrepro.data import make_synthetic_records, write_jsonl
from rlrepro.data.config import EvalConfig
from rlrepro.orchestration.config import RunSchema, validate
from rlrepro.orchestration.evaluation import eval_metrics, eval_requests, is_eval_step, pass_at_k
from rlrepro.orchestration.resume import config_at_step, reconcile_resume
from rlrepro.repro.diff import _metric_diffs
from rlrepro.rollout import request_seed


# ------------------------------------------------------------------------------------------ the estimator
@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 0.5),              # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),              # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 1, 0.3),             # pass@1 = c/n
    (6, 0, 3, 0.0),
    (4, 1, 4, 1.0),              # n = k: any correct sample
    (4, 0, 4, 0.0),
    (20, 5, 10, float(1 - Fraction(math.comb(15, 10), math.comb(20, 10)))),   # 1 - 3003/184756
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == expected


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 2), (4, -1, 2), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_eval_metrics_by_hand():
    rewards = [[1.0, 0.0, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 0.25]]
    lengths = [[3, 4, 5], [1, 1, 1], [2, 2, 2]]
    m = eval_metrics(rewards, lengths, [1.0, 0.0, 0.5], k=3, threshold=1.0)
    assert m == {"eval/avg@3": 3.75 / 9, "eval/pass@3": 2 / 3, "eval/response_length_mean": 21 / 9,
                 "eval/num_prompts": 3, "eval/greedy_acc": 1 / 3}
    m = eval_metrics(rewards, lengths, None, k=3, threshold=0.5)   # the threshold decides what passes
    assert m["eval/pass@3"] == 2 / 3 and "eval/greedy_acc" not in m
    m = eval_metrics(rewards, lengths, [1.0, 0.0, 0.5], k=3, threshold=0.25)
    assert m["eval/greedy_acc"] == 2 / 3


# ------------------------------------------------------------------------------------------ requests, seeds
class _P:
    def __init__(self, uid):
        self.uid, self.token_ids = uid, [1, 2, 3]


def _cfg(**eval_keys):
    cfg = RunSchema()
    cfg.eval = EvalConfig(source="x.jsonl", every=2, **eval_keys)
    return cfg


def test_eval_requests_are_keyed_and_on_their_own_seed_stream():
    cfg = _cfg(num_samples=3, temperature=0.7, max_tokens=5)
    prompts = [_P("a"), _P("b")]
    reqs = eval_requests(cfg, 4, prompts, [0])
    assert [r.key for r in reqs] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert [r.params.temperature for r in reqs[:4]] == [0.7, 0.7, 0.7, 0.0]   # the last one greedy
    assert all(r.params.max_tokens == 5 and r.params.stop_token_ids == (0,) for r in reqs)
    again = eval_requests(cfg, 4, prompts[::-1], [0])   # a pure function of the keys, not of the order
    assert {r.key: r.params.seed for r in again} == {r.key: r.params.seed for r in reqs}
    train_seeds = {request_seed(cfg.run.seed, s, u, j) for s in range(10) for u in "ab" for j in range(4)}
    assert not train_seeds & {r.params.seed for r in reqs}
    assert len({r.params.seed for r in reqs}) == len(reqs)
    other_step = eval_requests(cfg, 6, prompts, [0])
    assert not {r.params.seed for r in other_step} & {r.params.seed for r in reqs}


def test_eval_defaults_follow_the_rollout_and_greedy_can_be_off():
    cfg = _cfg(greedy=False)
    reqs = eval_requests(cfg, 1, [_P("a")], [])
    assert len(reqs) == cfg.eval.num_samples
    assert all(r.params.temperature == cfg.rollout.temperature and r.params.max_tokens == cfg.rollout.max_tokens
               for r in reqs)


def test_eval_steps_every_n_and_the_last():
    cfg = _cfg()
    cfg.eval.every, cfg.train.steps = 3, 10
    assert [s for s in range(1, 11) if is_eval_step(cfg, s)] == [3, 6, 9, 10]
    cfg.eval.every = 0
    assert not any(is_eval_step(cfg, s) for s in range(1, 11))


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("override, key", [
    ("eval.every=2", "eval.source"),
    ("eval.num_samples=0", "eval.num_samples"),
    ("eval.every=-1", "eval.every"),
    ("eval.temperature=-1", "eval.temperature"),
    ("eval.temperature=1e-9", "eval.temperature"),
    ("eval.max_tokens=0", "eval.max_tokens"),
])
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(["recipe=grpo_tiny", override])


def test_eval_is_off_by_default():
    cfg = validate(compose_config(["recipe=grpo_tiny"]))
    assert cfg.eval.every == 0 and cfg.eval.source is None


def test_eval_keys_are_bit_neutral_on_resume():
    rec = {"train": {"steps": 4}, "eval": {"every": 0, "source": None}}
    req = {"train": {"steps": 4}, "eval": {"every": 2, "source": "held.jsonl"}}
    config, amendments = reconcile_resume(rec, req, completed_step=2)
    assert config["eval"] == req["eval"] and {a["key"] for a in amendments} == {"eval.every", "eval.source"}


def test_a_step_is_re_evaluated_with_the_eval_keys_it_ran_with():
    # config.yaml holds a run's latest values; rlrepro verify / eval put back what a later resume amended
    from rlrepro.orchestration.evaluation import Evaluator

    latest = {"train": {"steps": 8, "lr": 1.0}, "eval": {"every": 2, "temperature": 0.2}, "logger": {"wandb": True}}
    amendments = [{"key": "eval.temperature", "old": 0.9, "new": 0.5, "from_step": 3},
                  {"key": "logger.wandb", "old": False, "new": True, "from_step": 3},
                  {"key": "eval.temperature", "old": 0.5, "new": 0.2, "from_step": 6},
                  {"key": "train.steps", "old": 6, "new": 8, "from_step": 6}]
    assert [config_at_step(latest, amendments, s)["eval"]["temperature"] for s in (1, 2, 3, 5, 6, 8)] == [
        0.9, 0.9, 0.5, 0.5, 0.2, 0.2]
    assert [config_at_step(latest, amendments, s)["train"]["steps"] for s in (2, 5, 6)] == [6, 6, 8]
    assert config_at_step(latest, amendments, 1)["logger"] == {"wandb": True}  # not an eval key: the latest
    assert latest["eval"]["temperature"] == 0.2  # not changed in place

    ev = object.__new__(Evaluator)  # the choice of setting alone (no prompts, no engines)
    ev.later = [(3, lambda actors, step: {"by": 3}), (6, lambda actors, step: {"by": 6})]
    assert [ev(None, s)["by"] for s in (3, 5, 6, 9)] == [3, 3, 6, 6]


def test_diff_ignores_eval_metrics_one_run_lacks_but_compares_them_when_both_have_them():
    a = {"step": 2, "train/loss": 0.5}
    b = {"step": 2, "train/loss": 0.5, "eval/avg@4": 0.25}
    assert _metric_diffs(2, a, b) == [] and _metric_diffs(2, b, a) == []
    c = dict(b, **{"eval/avg@4": 0.5})
    assert [d.key for d in _metric_diffs(2, b, c)] == ["eval/avg@4"]
    assert [d.key for d in _metric_diffs(2, a, dict(a, **{"train/x": 1.0}))] == ["train/x"]  # others still count


# ------------------------------------------------------------------------------------------ end to end
BASE = ["recipe=grpo_tiny", "train.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_tokens=6", "warm_start.steps=10", "warm_start.target=answer", "reward.fn=prefix_match",
        "checkpoint.every=2", "logger.progress=false", "train.micro_batch_size=8", "train.warmup_steps=1"]


def _metrics(run):
    return {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}


def _eval_of(m):
    return {k: v for k, v in m.items() if k.startswith("eval/")}


@pytest.mark.slow
def test_eval_during_training_and_after_it(tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("first_letter", 6, 99, alphabet="abcd"), held)
    ev = ["eval.every=3", f"eval.source={held}", "eval.num_samples=3", "eval.temperature=0.9"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["train", *BASE, f"run.dir={a}"]) == 0
    assert main(["train", *BASE, f"run.dir={b}", *ev]) == 0
    assert main(["train", *BASE, f"run.dir={c}", *ev, "rollout.num_workers=2", "rollout.max_num_seqs=5"]) == 0
    capsys.readouterr()
    # eval on changes no training bit: the same fingerprints (and rlrepro diff says identical)
    assert (a / "fingerprints.jsonl").read_bytes() == (b / "fingerprints.jsonl").read_bytes()
    assert main(["diff", str(a), str(b)]) == 0
    mb, mc = _metrics(b), _metrics(c)
    assert [s for s in mb if _eval_of(mb[s])] == [3, 4]   # every 3rd step and the last
    for s in (3, 4):
        assert set(_eval_of(mb[s])) == {"eval/avg@3", "eval/pass@3", "eval/greedy_acc", "eval/response_length_mean",
                                        "eval/num_prompts"}
        assert _eval_of(mb[s]) == _eval_of(mc[s])   # 1 or 2 workers, other batching: the same numbers
    assert 0 < mb[4]["eval/avg@3"] < 1, mb[4]   # partial credit: not a degenerate comparison
    assert main(["diff", str(b), str(c)]) == 0
    # resumed from the checkpoint of step 2: steps 3 and 4 re-run, their eval numbers those of the uninterrupted run
    d = tmp_path / "d"
    shutil.copytree(b, d)
    shutil.rmtree(d / "checkpoints" / "step_000004")
    assert main(["train", *BASE, f"run.dir={d}", *ev, "run.resume=true"]) == 0
    md = _metrics(d)
    assert [_eval_of(md[s]) for s in (3, 4)] == [_eval_of(mb[s]) for s in (3, 4)]
    assert (d / "fingerprints.jsonl").read_bytes() == (b / "fingerprints.jsonl").read_bytes()
    capsys.readouterr()
    # after the fact: the checkpoint of step 4 evaluated again gives exactly the logged numbers
    assert main(["eval", str(b), "--step", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got.pop("matches_run_log") is True and got.pop("step") == 4
    assert got == _eval_of(mb[4])
    # step 2 was not evaluated by the run (every=3): rlrepro eval computes it, nothing to compare with
    assert main(["eval", str(b), "--step", "2", "--json"]) == 0
    got2 = json.loads(capsys.readouterr().out)
    assert got2["matches_run_log"] is None and got2["eval/num_prompts"] == 6
    # a record that says otherwise is reported (exit 1)
    lines = (b / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])
    rec["eval/avg@3"] += 0.5
    (b / "metrics.jsonl").write_text("\n".join(lines[:3] + [json.dumps(rec)]) + "\n")
    assert main(["eval", str(b), "--step", "4"]) == 1
    assert "DIFFERENT from what the run logged" in capsys.readouterr().out
    # a run trained without eval: its eval.source is named as missing, --source gives one
    assert main(["eval", str(a), "--step", "4"]) == 2 and "--source" in capsys.readouterr().err
    assert main(["eval", str(a), "--step", "4", "--source", str(held), "--json"]) == 0
    got_a = json.loads(capsys.readouterr().out)
    assert got_a["matches_run_log"] is None and got_a["eval/num_prompts"] == 6 and "eval/avg@4" in got_a
    assert main(["eval", str(b), "--step", "3"]) == 2   # no checkpoint of step 3
    assert "no complete checkpoint of step 3" in capsys.readouterr().err


@pytest.mark.slow
def test_verify_and_eval_after_a_resume_amended_eval_keys(tmp_path, capsys):
    # eval.temperature amended on resume (allowed: it changes no training bit): rlrepro verify re-evaluates each step
    # with the value it ran with (before: steps before the amendment got the new one, and verify said DIVERGED)
    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("first_letter", 6, 99, alphabet="abcd"), held)
    ev = ["eval.every=2", f"eval.source={held}", "eval.num_samples=3"]
    run = tmp_path / "run"
    assert main(["train", *BASE, *ev, "eval.temperature=0.9", f"run.dir={run}"]) == 0
    before = _metrics(run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    assert main(["train", *BASE, *ev, "eval.temperature=0.5", f"run.dir={run}", "run.resume=true"]) == 0
    after = _metrics(run)
    assert _eval_of(after[2]) == _eval_of(before[2]) and _eval_of(after[4]) != _eval_of(before[4])
    capsys.readouterr()
    assert main(["verify", str(run)]) == 0
    assert "verdict: IDENTICAL" in capsys.readouterr().out
    assert main(["eval", str(run), "--step", "2", "--json"]) == 0  # step 2 with its own temperature, 0.9
    assert json.loads(capsys.readouterr().out)["matches_run_log"] is True


@pytest.mark.slow
def test_rlrepro_eval_of_a_dist_checkpoint_equals_the_run(tmp_path, capsys, monkeypatch):
    """megatron TP=2 with checkpoint.format=dist: rlrepro eval reads the sharded checkpoint (through its HF export)
    and gives what the run logged, on an engine that computes the TP=2 reduction order (at this size the tokens
    come out the same without it, so the engine's model is checked for the emulation itself)."""
    pytest.importorskip("megatron.core")
    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("first_letter", 5, 98, alphabet="abcd"), held)
    run = tmp_path / "m"
    assert main(["train", "recipe=grpo_tiny", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "rollout.max_tokens=6", "reward.fn=hash", "checkpoint.every=2", "logger.progress=false",
                 "train.micro_batch_size=4", "train.warmup_steps=1", "train.num_gpus=2", "rollout.num_workers=2",
                 "train.backend=megatron", "train.tensor_parallel=2", "checkpoint.format=dist", "eval.every=2",
                 f"eval.source={held}", "eval.num_samples=2", f"run.dir={run}"]) == 0
    capsys.readouterr()
    logged = _eval_of(_metrics(run)[2])
    assert 0 < logged["eval/avg@2"] < 1, logged
    from rlrepro.orchestration import workers

    built = []

    class Recording(workers.RolloutWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self.engine.model)

    monkeypatch.setattr(workers, "RolloutWorker", Recording)
    assert main(["eval", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got.pop("matches_run_log") is True and got.pop("step") == 2 and got == logged
    (model,) = built
    # the run's train.tensor_parallel, as the training engines had: every o_proj/down_proj a 2-way K split
    assert {layer.self_attn.o_proj.tp_split for layer in model.model.layers} == {("row", 2)}
    assert {layer.mlp.down_proj.tp_split for layer in model.model.layers} == {("row", 2)}
