"""Evaluations are fingerprinted (metrics.jsonl ``repro/eval_fingerprint``): two runs whose eval completions differ
token-wise but give the same eval/* numbers diff as diverged, naming the first differing eval step; runs recorded
before the key existed still diff (a note says what was not compared)."""
import json

import pytest
import torch

from rlrepro.data import PromptRecord
from rlrepro.data.config import EvalConfig
from rlrepro.orchestration.config import RunSchema
from rlrepro.orchestration.evaluation import Evaluator, _logged, run_eval
from rlrepro.repro.diff import diff_runs, main_diff
from rlrepro.repro.fingerprint import (
    EVAL_FINGERPRINT_KEY,
    FingerprintWriter,
    MetricsWriter,
    eval_fingerprint,
    fingerprint_from_samples,
)
from rlrepro.rollout.params import RequestOutput

KEY = "repro/eval_fingerprint"
assert KEY == EVAL_FINGERPRINT_KEY   # the metrics.jsonl key: stable


# ------------------------------------------------------------------------------------------ the digest
def test_eval_fingerprint_covers_keys_tokens_and_logprob_bits_in_key_order():
    s = [(("a", 0), [5, 6], [-0.5, -0.25]), (("a", 1), [7], [-1.0]), (("b", 0), [8, 9], [-0.125, -2.0])]
    d = eval_fingerprint(s)
    assert len(d) == 64 and eval_fingerprint(s[::-1]) == d            # any arrival order: key order
    assert eval_fingerprint([(k, torch.tensor(t), torch.tensor(lp, dtype=torch.float32)) for k, t, lp in s]) == d
    assert eval_fingerprint([s[0], s[1], (("b", 0), [8, 10], [-0.125, -2.0])]) != d          # one token
    assert eval_fingerprint([s[0], s[1], (("b", 0), [8, 9], [-0.125, -2.0000000000000004])]) != d   # one ulp
    assert eval_fingerprint([s[0], s[1], (("c", 0), [8, 9], [-0.125, -2.0])]) != d          # another key
    assert eval_fingerprint(s[:2]) != d
    assert eval_fingerprint([(*x, [1] * len(x[1])) for x in s]) != d   # an episode's loss mask counts


# ------------------------------------------------------------------------------------------ run_eval
class _P:
    def __init__(self, uid):
        self.uid, self.token_ids = uid, [1, 2, 3]
        self.record = PromptRecord(uid=uid, prompt="p", answer="x")


class _Tok:
    def decode(self, ids):
        return "x" if ids and ids[0] == 1 else "y"   # the reward reads the first token only


def _cfg():
    cfg = RunSchema()
    cfg.eval = EvalConfig(source="x.jsonl", every=2, num_samples=2)
    return cfg


def _generate(last_token):
    """Completions [1, 4, last] (reward 1.0) for every request: other last tokens, the same eval/* numbers."""
    def generate(requests):
        return [(r.key, RequestOutput([1, 2, 3], [1, 4, last_token], [-0.5, -0.25, -1.0], "length", 0, 0))
                for r in reversed(requests)]
    return generate


def _reward(completion, record):
    return 1.0 if completion == record.answer else 0.0


def test_run_eval_and_the_evaluator_record_the_completions_fingerprint():
    cfg, prompts = _cfg(), [_P("a"), _P("b")]
    args = (cfg, 2, prompts, _Tok(), _reward, [0])
    plain = run_eval(_generate(7), *args)
    assert KEY not in plain   # the numbers alone unless asked (rlrepro eval prints only them)
    m7, m8 = run_eval(_generate(7), *args, fingerprint=True), run_eval(_generate(8), *args, fingerprint=True)
    assert {k: v for k, v in m7.items() if k != KEY} == plain == {k: v for k, v in m8.items() if k != KEY}
    assert m7[KEY] != m8[KEY] and m7[KEY] == run_eval(_generate(7), *args, fingerprint=True)[KEY]
    want = eval_fingerprint([((u, j), [1, 4, 7], [-0.5, -0.25, -1.0]) for u in "ab" for j in range(3)])
    assert m7[KEY] == want

    class Actors:
        generate = staticmethod(_generate(7))

    ev = object.__new__(Evaluator)   # the driver's evaluator, without loading prompts from a file
    ev.cfg, ev.tokenizer, ev.reward_fn, ev.stop_token_ids, ev.prompts, ev.later = cfg, _Tok(), _reward, [0], prompts, []
    assert ev(Actors(), 2) == m7       # what the driver puts into the step's metrics.jsonl line
    assert ev(Actors(), 3) == {}


def test_rlrepro_eval_reads_the_logged_fingerprint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "train/loss": 0.5, "eval/avg@2": 1.0,
                                                        KEY: "ab" * 32, "repro/weights_digest": "cd" * 8}) + "\n")
    assert _logged(tmp_path, 2) == {"eval/avg@2": 1.0, KEY: "ab" * 32}


# ------------------------------------------------------------------------------------------ rlrepro diff
def _samples(step):
    return [{"prompt_uid": "q", "sample_index": i, "prompt_token_ids": [5, 6], "token_ids": [step, i, 3],
             "logprobs": [-0.5, -0.25, -1.0], "reward": float(i % 2), "advantage": (i % 2) - 0.5} for i in range(4)]


def _run(path, evals):
    """A run directory of 4 steps; ``evals``: {step: (eval/avg@2, fingerprint or None)} of the evaluated steps."""
    path.mkdir()
    fw, mw = FingerprintWriter(path), MetricsWriter(path)
    for step in range(1, 5):
        fw.write(fingerprint_from_samples(step, _samples(step), loss=0.25, grad_norm=1.5, weights="ee" * 32))
        rec = {"step": step, "rollout/reward_mean": 0.5, "train/loss": 0.25, "perf/step_time_s": 0.1}
        if step in evals:
            avg, fp = evals[step]
            rec["eval/avg@2"] = avg
            if fp is not None:
                rec[KEY] = fp
        mw.write(rec)
    return path


FA, FB, FC = "aa" * 32, "bb" * 32, "cc" * 32


def test_diff_names_the_first_eval_step_whose_completions_differ(tmp_path, capsys):
    a = _run(tmp_path / "a", {2: (0.5, FA), 4: (0.75, FB)})
    b = _run(tmp_path / "b", {2: (0.5, FA), 4: (0.75, FC)})   # same numbers, other completions at step 4
    rep = diff_runs(a, b)
    assert rep.divergence is None   # training bits equal
    assert rep.verdict == "diverged" and rep.first_divergent_step == 4
    assert rep.eval_steps_compared == [2, 4] and rep.eval_diverged_steps == [4]
    assert [(d.step, d.key, d.a, d.b) for d in rep.metric_diffs] == [(4, KEY, FB, FC)]
    text = rep.format()
    assert "eval completions: first difference at step 4 (1 of 2 evaluated step(s) differ: 4;" in text
    assert json.loads(rep.to_json())["eval_diverged_steps"] == [4]
    assert main_diff([str(a), str(b)]) == 1
    assert "eval completions: first difference at step 4" in capsys.readouterr().out
    same = diff_runs(a, _run(tmp_path / "c", {2: (0.5, FA), 4: (0.75, FB)}))
    assert same.verdict == "identical" and same.eval_steps_compared == [2, 4] and not same.eval_diverged_steps
    assert "eval completions: same on 2 common evaluated step(s)" in same.format()


@pytest.mark.parametrize("old_is", ["A", "B"])
def test_runs_recorded_before_eval_fingerprints_still_diff(tmp_path, old_is):
    new = _run(tmp_path / "new", {2: (0.5, FA), 4: (0.75, FB)})
    old = _run(tmp_path / "old", {2: (0.5, None), 4: (0.75, None)})   # eval/* numbers, no fingerprint
    a, b = (old, new) if old_is == "A" else (new, old)
    rep = diff_runs(a, b)
    assert rep.verdict == "identical" and rep.eval_steps_compared == [] and not rep.metric_diffs
    assert any(f"run {old_is} has no {KEY}" in n and "step(s) 2, 4" in n for n in rep.notes), rep.notes
    assert main_diff([str(a), str(b)]) == 0
    # the numbers still count where the fingerprint cannot
    other = _run(tmp_path / "other", {2: (0.5, None), 4: (0.5, None)})
    assert diff_runs(other, new).verdict == "diverged"
    # a run without eval and one with it: no difference and nothing to say (as for eval/*)
    plain = diff_runs(_run(tmp_path / "plain", {}), new)
    assert plain.verdict == "identical" and not any(KEY in n for n in plain.notes)
