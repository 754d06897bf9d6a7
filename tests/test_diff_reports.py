"""``rlrepro diff``: --strict over metrics.jsonl, torn last lines, the head of the report, standard JSON."""
import json
import math

import pytest

from rlrepro.repro.diff import diff_runs, main_diff
from rlrepro.repro.records import ReproError, read_step_records
from test_repro_diff import make_run


def _no_constants(text):
    """json.loads that refuses NaN / Infinity (standard JSON has neither)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _drop_metrics_step(run, step):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    kept = [x for x in lines if json.loads(x)["step"] != step]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in kept))


def test_strict_fails_when_metrics_are_missing_or_cover_other_steps(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    no_metrics = make_run(tmp_path / "m")
    (no_metrics / "metrics.jsonl").unlink()
    assert main_diff([str(a), str(no_metrics)]) == 0      # without --strict: a note, as before
    assert main_diff([str(a), str(no_metrics), "--strict"]) == 1
    out = capsys.readouterr().out
    assert "--strict: run B has no metrics.jsonl" in out and "exit 1: --strict failed" in out
    rep = diff_runs(a, no_metrics)
    assert rep.metrics_missing == ["B"] and not rep.complete

    fewer = make_run(tmp_path / "m2")
    _drop_metrics_step(fewer, 4)
    rep = diff_runs(a, fewer)
    assert rep.verdict == "identical" and rep.metrics_only_a == [4] and rep.metrics_only_b == [] and not rep.complete
    assert main_diff([str(a), str(fewer)]) == 0
    assert main_diff([str(a), str(fewer), "--strict"]) == 1
    assert "--strict: metrics.jsonl steps in one run only: A: 4" in capsys.readouterr().out
    assert main_diff([str(a), str(fewer), "--strict", "--json"]) == 1
    report = _no_constants(capsys.readouterr().out)
    assert report["metrics_only_a"] == [4] and report["complete"] is False
    assert report["strict_failures"] == ["--strict: metrics.jsonl steps in one run only: A: 4"]

    same = make_run(tmp_path / "same")
    assert main_diff([str(a), str(same), "--strict"]) == 0
    assert diff_runs(a, same).complete


def test_a_torn_last_line_is_dropped_with_a_note(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    t = make_run(tmp_path / "t")
    fp = t / "fingerprints.jsonl"
    data = fp.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    fp.write_bytes(data[:last + 40])          # a crash while appending step 4: no newline, half a record
    rep = diff_runs(a, t)
    assert rep.verdict == "identical" and rep.steps_compared == [1, 2, 3] and rep.steps_only_a == [4]
    assert any(f"{fp}:4: torn last line dropped (the run crashed or is still writing; a resume repairs it)" == n
               for n in rep.notes), rep.notes
    assert main_diff([str(a), str(t)]) == 0
    assert "torn last line dropped" in capsys.readouterr().out
    assert main_diff([str(a), str(t), "--strict"]) == 1   # the steps recorded differ

    t2 = make_run(tmp_path / "t2")
    mp = t2 / "metrics.jsonl"
    mp.write_bytes(mp.read_bytes() + '{"step": 5, "train/loss": "\u00e9'.encode()[:-1])  # cut inside a character
    notes = []
    assert sorted(read_step_records(mp, notes=notes)) == [1, 2, 3, 4]
    assert notes == [f"{mp}:5: torn last line dropped (the run crashed or is still writing; a resume repairs it)"]
    assert main_diff([str(a), str(t2)]) == 0

    # a malformed line before the last one is still an error
    lines = mp.read_text(errors="replace").splitlines()
    lines[1] = lines[1][:30]
    mp.write_text("\n".join(lines[:4]) + "\n")
    with pytest.raises(ReproError, match=r"metrics.jsonl:2: invalid JSON"):
        diff_runs(a, t2)
    assert main_diff([str(a), str(t2)]) == 2


def test_the_report_is_headed_by_the_first_divergent_step_overall(tmp_path, capsys):
    a = make_run(tmp_path / "a")

    def mutate(step, samples, weights):
        if step >= 3:
            for v in weights.values():
                v += 1
    e = make_run(tmp_path / "e", mutate=mutate, metrics_extra={1: {"train/entropy": math.nextafter(1.0, 2.0)}})
    rep = diff_runs(a, e)
    assert rep.first_divergent_step == 1 and rep.first_divergence_source == "metrics"
    assert rep.divergence.step == 3
    assert main_diff([str(a), str(e)]) == 1
    out = capsys.readouterr().out
    head = [x for x in out.splitlines() if x.startswith("FIRST DIVERGENCE")]
    assert head == ["FIRST DIVERGENCE: step 1, in metrics.jsonl (train/entropy); the fingerprints agree there and "
                    "first differ at step 3"]
    assert "  first fingerprint divergence: step 3, field grad_norm (also differ: weights)" in out
    assert out.index("FIRST DIVERGENCE: step 1") < out.index("first fingerprint divergence: step 3")
    assert main_diff([str(a), str(e), "--json"]) == 1
    report = _no_constants(capsys.readouterr().out)
    assert report["first_divergent_step"] == 1 and report["first_divergence_source"] == "metrics"
    assert report["divergence"]["step"] == 3          # the keys keep their meaning

    only_metrics = make_run(tmp_path / "om", metrics_extra={2: {"train/kl": 0.5}})
    rep = diff_runs(a, only_metrics)
    assert rep.divergence is None and rep.first_divergence_source == "metrics"
    assert "FIRST DIVERGENCE: step 2, in metrics.jsonl (train/kl); every common fingerprinted step is equal" \
        in rep.format()

    def tokens(step, samples, weights):
        if step == 2:
            samples[1]["token_ids"][0] += 1
    both = make_run(tmp_path / "both", mutate=tokens, metrics_extra={2: {"train/kl": 0.5}})
    rep = diff_runs(a, both)
    assert rep.first_divergence_source == "fingerprints and metrics"
    assert "FIRST DIVERGENCE: step 2, field rollout_token_ids" in rep.format()   # unchanged when they agree


def test_json_writes_non_finite_floats_as_strings(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    n = make_run(tmp_path / "n", metrics_extra={2: {"train/loss": float("nan"), "train/grad_norm": float("inf"),
                                                    "train/kl": float("-inf")}})
    assert main_diff([str(a), str(n), "--json"]) == 1
    report = _no_constants(capsys.readouterr().out)
    got = {m["key"]: m["b"] for m in report["metric_diffs"]}
    assert got == {"train/loss": "NaN", "train/grad_norm": "Infinity", "train/kl": "-Infinity"}
    assert _no_constants(diff_runs(a, n).to_json())["metric_diffs"][0]["b"] in ("NaN", "Infinity", "-Infinity")
    # a NaN in both runs is still no difference (bits, not the JSON text, are compared)
    assert diff_runs(n, make_run(tmp_path / "n2", metrics_extra={2: {"train/loss": float("nan"),
                                                                     "train/grad_norm": float("inf"),
                                                                     "train/kl": float("-inf")}})).identical
