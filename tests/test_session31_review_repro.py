"""Session 31 review of rlrepro/repro (``rlrepro diff``, ``--bisect``, ``show``) as a user who wants to prove two
runs identical or find where they first differ.

* a damaged rollout file (corrupt deflate data) crashed ``rlrepro diff`` and ``rlrepro show`` with a bare
  ``zlib.error`` traceback; now it is the note / error (exit 2) naming the file and the fix;
* fingerprint fields this version does not know (written by a newer rlrepro) were silently left out: two runs whose
  records differed only there were IDENTICAL; now they are compared exactly where both runs have them (a note says
  so) and a note names those only one run has;
* ``--bisect`` given a divergent sample past the end of run A's (or B's) rollout file replayed another sample in its
  place (the last one) and said "forward passes are identical"; now it says the sample is in one run only;
* a NaN in both configs (``.nan``) was a config difference (NaN != NaN); config values compare by their bits now;
* an ``inputs.json`` of another rlrepro version (or damaged) made the whole diff exit 2 although inputs never decide
  the verdict; now the records are compared and the inputs are "not compared" (a note; ``--strict-inputs`` fails);
* a malformed record in a rollout file (a turn without ``token_ids``) crashed the token detail with a KeyError;
* "no common fingerprinted steps" now names each run's steps and what to do.
"""
import gzip
import json

from test_repro_bisect import make_run as make_model_run
from test_repro_bisect import samples as model_samples
from test_repro_diff import CONFIG, make_run

from rlrepro.repro.bisect import bisect_report
from rlrepro.repro.diff import diff_runs, load_config, main_diff
from rlrepro.repro.fingerprint import FingerprintWriter, RolloutWriter, fingerprint_from_samples
from rlrepro.repro.records import ReproError
from rlrepro.repro.show import main_show


def _token_changed_at_step_2(step, samples, weights):
    if step == 2:
        samples[1]["token_ids"][0] += 1


def _rewrite_jsonl(path, edit):
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        edit(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_damaged_rollout_file_is_a_note_in_diff_and_an_error_in_show_not_a_traceback(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", mutate=_token_changed_at_step_2)
    p = b / "rollouts" / "step_000002.jsonl.gz"
    data = bytearray(p.read_bytes())
    for i in range(20, 60):     # inside the deflate stream: zlib.error, not a gzip header / CRC error
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    assert main_diff([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "FIRST DIVERGENCE: step 2, field rollout_token_ids" in out and "sample 1" in out
    assert f"rollout detail unavailable: {p}: unreadable (zlib: " in out and "restore it from a copy" in out
    assert main_show([str(b), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlrepro show: error: {p}: unreadable (zlib: ") and "the file is damaged" in err


def test_fingerprint_fields_of_a_newer_version_are_compared_not_dropped(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    _rewrite_jsonl(a / "fingerprints.jsonl", lambda r: r.update(ref_weights="ab" * 32))
    _rewrite_jsonl(b / "fingerprints.jsonl", lambda r: r.update(ref_weights="ab" * 32 if r["step"] < 3 else "cd"))
    rep = diff_runs(a, b)
    assert rep.verdict == "diverged" and rep.diverged_steps == [3, 4]
    assert rep.divergence.step == 3 and rep.divergence.field == "ref_weights"
    assert "fingerprint field(s) unknown to this rlrepro, compared exactly: ref_weights" in rep.notes
    assert main_diff([str(a), str(b)]) == 1
    assert "FIRST DIVERGENCE: step 3, field ref_weights" in capsys.readouterr().out
    # equal where both have it: identical, and said
    _rewrite_jsonl(b / "fingerprints.jsonl", lambda r: r.update(ref_weights="ab" * 32))
    rep = diff_runs(a, b)
    assert rep.identical and "fingerprint field(s) unknown to this rlrepro, compared exactly: ref_weights" in rep.notes


def test_a_fingerprint_field_of_one_run_only_is_said_not_silently_dropped(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    _rewrite_jsonl(b / "fingerprints.jsonl", lambda r: r.update(ref_weights="cd" * 32) if r["step"] > 1 else None)
    rep = diff_runs(a, b)
    assert rep.identical
    assert rep.notes == ["fingerprint field 'ref_weights' not compared at step(s) 2-4: only run B has it (recorded "
                         "by another rlrepro version); compare with the version that wrote it"]


def test_bisect_never_replays_another_sample_in_place_of_the_divergent_one(tmp_path):
    a = make_model_run(tmp_path / "a")
    b = make_model_run(tmp_path / "b")
    more = model_samples(1)
    more.append(dict(more[-1], sample_index=2))    # B kept a fifth sample, the prompts and tokens of A's last
    (b / "fingerprints.jsonl").unlink()
    FingerprintWriter(b).write(fingerprint_from_samples(1, more, loss=0.25, grad_norm=1.0, weights=None))
    RolloutWriter(b).write(1, more)
    rep = diff_runs(a, b)
    assert rep.divergence.sample_index == 4 and (rep.divergence.num_samples_a, rep.divergence.num_samples_b) == (4, 5)
    res = bisect_report(rep, load_config(a), load_config(b))
    assert res.kind == "inputs" and res.step == 1
    assert res.note.startswith("sample 4 is in run B only (A has 4 sample(s) at step 1, B 5)")
    # and the other way round
    res = bisect_report(diff_runs(b, a), load_config(b), load_config(a))
    assert res.kind == "inputs" and res.note.startswith("sample 4 is in run A only (A has 5 sample(s) at step 1, B 4)")


def test_nan_in_both_configs_is_the_same_config(tmp_path):
    cfg = {**CONFIG, "train": {**CONFIG["train"], "clip": float("nan"), "bounds": [float("nan"), 1.0]}}
    a, b = make_run(tmp_path / "a", config=cfg), make_run(tmp_path / "b", config=cfg)
    assert diff_runs(a, b).config_diffs == []
    zero = {**CONFIG, "train": {**CONFIG["train"], "clip": -0.0}}
    c = make_run(tmp_path / "c", config={**CONFIG, "train": {**CONFIG["train"], "clip": 0.0}})
    d = make_run(tmp_path / "d", config=zero)
    assert [(x.key, x.a, x.b) for x in diff_runs(c, d).config_diffs] == [("train.clip", 0.0, -0.0)]


def test_an_inputs_json_of_another_version_leaves_the_records_compared(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", mutate=_token_changed_at_step_2)
    (a / "inputs.json").write_text(json.dumps({"format": "rlrepro.inputs.v999"}))
    (b / "inputs.json").write_text(json.dumps({"format": "rlrepro.inputs.v1"}))
    rep = diff_runs(a, b)
    assert rep.divergence.step == 2 and not rep.inputs_compared
    assert rep.inputs_not_compared == [f"inputs.json unreadable in run A: {a / 'inputs.json'}: unknown format "
                                       "'rlrepro.inputs.v999' (expected 'rlrepro.inputs.v1')"]
    assert main_diff([str(a), str(b)]) == 1
    c = make_run(tmp_path / "c")
    (c / "inputs.json").write_text("{not json")
    assert main_diff([str(a), str(c)]) == 0   # the records are identical
    assert main_diff([str(a), str(c), "--strict-inputs"]) == 1
    out = capsys.readouterr().out
    assert "--strict-inputs: inputs not compared: inputs.json unreadable in run B:" in out
    assert "not valid JSON" in out


def test_a_malformed_rollout_record_is_a_note_not_a_traceback(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", mutate=_token_changed_at_step_2)
    p = b / "rollouts" / "step_000002.jsonl.gz"
    recs = [json.loads(line) for line in gzip.decompress(p.read_bytes()).decode().splitlines()]
    recs[1]["turns"] = [{"role": "policy"}]     # no token_ids
    p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    rep = diff_runs(a, b)
    assert rep.divergence.step == 2 and rep.divergence.sample_index == 1 and rep.divergence.token is None
    assert rep.divergence.detail_note.startswith("rollout detail unavailable: a malformed record in the rollout "
                                                 "files of step 2 (KeyError: 'token_ids')")
    assert main_diff([str(a), str(b)]) == 1
    assert "compare with --no-detail" in capsys.readouterr().out


def test_no_common_steps_names_each_runs_steps_and_the_fix(tmp_path):
    a = make_run(tmp_path / "a", steps=2)
    b = tmp_path / "b"
    b.mkdir()
    (b / "fingerprints.jsonl").write_text("")
    try:
        diff_runs(a, b)
    except ReproError as e:
        msg = str(e)
    assert msg == (f"no common fingerprinted steps to compare ({a / 'fingerprints.jsonl'}: 2 step(s) (1-2), "
                   f"{b / 'fingerprints.jsonl'}: 0 step(s)); a run with 0 steps has not finished one yet: wait for "
                   "it, or check that the paths name the runs meant")
    try:
        diff_runs(a, a, steps=[7])
    except ReproError as e:
        msg = str(e)
    assert msg.startswith("no common fingerprinted steps to compare among the steps asked for (7) (")


def test_a_directory_without_fingerprints_is_told_what_to_give(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    assert main_diff([str(a), str(a / "rollouts")]) == 2
    err = capsys.readouterr().err
    assert (f"{a / 'rollouts' / 'fingerprints.jsonl'}: file not found; {a / 'rollouts'} is inside the run "
            f"directory {a.resolve()}: give that") in err
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("run: {seed: 1}\n")
    assert main_diff([str(a), str(fresh)]) == 2
    assert "file not found; the run has not finished a step yet: wait for its first step" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main_diff([str(empty), str(a)]) == 2
    assert (f"file not found; {empty} is not a run directory (no fingerprints.jsonl, metrics.jsonl or config.yaml); "
            "give the run.dir of a run") in capsys.readouterr().err


def test_show_names_a_turn_text_that_is_not_a_string_instead_of_a_traceback(tmp_path, capsys):
    b = make_run(tmp_path / "b", steps=2)
    p = b / "rollouts" / "step_000002.jsonl.gz"
    recs = [json.loads(line) for line in gzip.decompress(p.read_bytes()).decode().splitlines()]
    recs[0]["turns"] = [{"role": "policy", "token_ids": recs[0]["token_ids"], "text": 3}]
    p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    assert main_show([str(b), "--n", "1"]) == 2
    assert capsys.readouterr().err == (f"rlrepro show: error: {p}: sample 0: malformed record (turns[0].text is int, "
                                       "not a string)\n")


def test_config_values_that_differ_past_the_cut_say_where_they_differ(tmp_path):
    ids_b = list(range(40))
    ids_b[-1] = 99
    a = make_run(tmp_path / "a", steps=1, config={**CONFIG, "data": {"ids": list(range(40)), "tpl": "x" * 100 + "a"}})
    b = make_run(tmp_path / "b", steps=1, config={**CONFIG, "data": {"ids": ids_b, "tpl": "x" * 100 + "b"}})
    lines = [line for line in diff_runs(a, b).format().splitlines() if line.startswith("  data.")]
    assert len(lines) == 2
    assert lines[0].startswith("  data.ids: A=[0, 1, 2") and lines[0].endswith("(first difference at [39]: A=39  B=99)")
    assert lines[1].endswith("(first difference at [100:]: A='a'  B='b')")
