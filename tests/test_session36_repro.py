"""Session 36: ``rlrepro diff`` checks each run's rollout files against its own fingerprints; ``--bisect`` has an
override for a changed rlrepro code digest.

* a rollout file edited after the run (one token, one reward) left ``rlrepro diff`` IDENTICAL (exit 0): the
  fingerprints are digests of what the run computed, not of the file kept beside them, and diff compared only
  those. Now each run's files are digested again and a file that does not give its run's digests is a divergence
  (exit 1) naming the run, the step, the sample, the file and, from the other run's file, the value;
* ``--bisect`` stopped whenever rlrepro's own source differed between the runs (``rlrepro_code`` in inputs.json),
  with no way past it; ``--allow-code-change`` replays anyway, with a WARNING, and the stop message names it.
"""
import gzip
import json
import math

from test_repro_bisect import make_run as make_model_run
from test_repro_diff import make_run
from test_repro_turns import make_run as make_turns_run
from test_session35_verify import _tamper_token

from rlrepro.repro.bisect import bisect_report
from rlrepro.repro.diff import diff_runs, load_config, main_diff
from rlrepro.repro.inputs import CODE_KEY, INPUTS_FORMAT, write_inputs
from rlrepro.repro.records import rollouts_path


def _edit_record(run, step, sample, edit):
    path = rollouts_path(run, step)
    recs = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    edit(recs[sample])
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    return path


# ------------------------------------------------------------------------------------- diff: rollout files


def test_an_edited_token_is_a_divergence_naming_run_step_sample_file_and_value(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    assert main_diff([str(a), str(b)]) == 0
    assert "rollout files: match their run's fingerprints.jsonl (run A: 4 step(s), run B: 4 step(s))" in \
        capsys.readouterr().out
    new = _tamper_token(a, 2, sample=1, pos=0)
    rep = diff_runs(a, b)
    assert rep.verdict == "diverged" and rep.divergence is None and rep.metric_diffs == []  # the records agree
    (m,) = rep.rollout_mismatches
    path = rollouts_path(a, 2)
    assert (m["run"], m["step"], m["file"], m["fields"], m["sample"]) == ("A", 2, str(path), ["rollout_token_ids"], 1)
    assert (m["prompt_uid"], m["sample_index"]) == ("q0", 1)
    assert m["detail"] == (f"token_ids[0]: this file {new}, run B's file {new - 1} (run B's file gives the "
                           "rollout_token_ids digest both runs recorded)")
    assert m["message"].startswith(f"run A, step 2, sample 1 (prompt_uid 'q0', sample_index 1): {path} does not "
                                   "give run A's recorded rollout_token_ids digest (fingerprints.jsonl)")
    assert rep.rollout_files_checked == {"A": [1, 2, 3, 4], "B": [1, 2, 3, 4]}

    assert main_diff([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "ROLLOUT FILES DO NOT MATCH THEIR RUN'S FINGERPRINTS: 1 file(s)" in out
    assert f"  {m['message']}\n" in out and out.rstrip().endswith("verdict: DIVERGED")
    assert main_diff([str(b), str(a), "--json"]) == 1   # as run B now, the reference is run A's file
    (j,) = json.loads(capsys.readouterr().out)["rollout_mismatches"]
    assert (j["run"], j["step"], j["sample"]) == ("B", 2, 1) and f"run A's file {new - 1}" in j["detail"]
    assert main_diff([str(a), str(b), "--no-detail"]) == 0  # reads no rollout file: documented


def test_an_edited_reward_is_traced_to_its_sample_through_the_other_runs_file(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    _edit_record(b, 3, 4, lambda r: r.update(reward=5.0))
    (m,) = diff_runs(a, b).rollout_mismatches
    assert (m["run"], m["step"], m["fields"], m["sample"], m["prompt_uid"]) == ("B", 3, ["rewards"], 4, "q1")
    assert m["detail"].startswith("reward: this file 5.0, run A's file ")


def test_the_file_is_checked_against_its_own_run_and_the_other_file_only_where_it_recorded_the_same(tmp_path):
    """Runs whose tokens diverge at step 3: each file gives its own run's digests, so no rollout file is named. An
    edit of a field the runs recorded differently there has no reference value; one of a field they recorded alike
    (the logprobs) has run B's."""
    def mutate(step, samples, weights):
        if step == 3:
            samples[0]["token_ids"][0] += 1
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", mutate=mutate)
    rep = diff_runs(a, b)
    assert rep.divergence.step == 3 and rep.rollout_mismatches == []
    _edit_record(a, 3, 0, lambda r: r["token_ids"].__setitem__(1, r["token_ids"][1] + 1))
    (m,) = diff_runs(a, b).rollout_mismatches
    assert (m["run"], m["step"], m["fields"], m["sample"], m["detail"]) == ("A", 3, ["rollout_token_ids"], 0, None)
    assert m["message"].endswith("(fingerprints.jsonl): not what the run computed (edited or damaged after the run "
                                 "wrote it)")
    c = make_run(tmp_path / "c")
    _edit_record(c, 3, 0, lambda r: r["logprobs"].__setitem__(2, -9.0))
    (m,) = diff_runs(c, b).rollout_mismatches
    assert (m["run"], m["step"], m["fields"], m["sample"]) == ("A", 3, ["rollout_logprobs"], 0)
    assert m["detail"].startswith("logprobs[2]: this file -9.0, run B's file -")


def test_a_file_that_cannot_be_read_or_has_another_sample_count_is_named(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    p = rollouts_path(b, 2)
    data = bytearray(p.read_bytes())
    for i in range(20, 60):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    q = rollouts_path(a, 4)
    recs = gzip.decompress(q.read_bytes()).decode().splitlines()
    q.write_bytes(gzip.compress(("\n".join(recs[:-1]) + "\n").encode()))   # a sample dropped
    rep = diff_runs(a, b)
    assert [(m["run"], m["step"]) for m in rep.rollout_mismatches] == [("A", 4), ("B", 2)]
    assert rep.rollout_mismatches[0]["problem"] == ("holds 5 sample(s), run A's fingerprints.jsonl 6: the file is not "
                                                    "what the run computed")
    assert rep.rollout_mismatches[1]["problem"].startswith(f"cannot be checked against run B's fingerprints.jsonl: "
                                                           f"{p}: unreadable (zlib: ")
    assert main_diff([str(a), str(b)]) == 1


def test_multi_turn_files_are_checked_and_a_changed_loss_mask_named(tmp_path):
    a, b = make_turns_run(tmp_path / "a"), make_turns_run(tmp_path / "b")
    rep = diff_runs(a, b)
    assert rep.identical and rep.rollout_files_checked == {"A": [1, 2, 3], "B": [1, 2, 3]}
    _edit_record(a, 2, 0, lambda r: r["loss_mask"].__setitem__(0, 1 - r["loss_mask"][0]))
    (m,) = diff_runs(a, b).rollout_mismatches
    assert (m["run"], m["step"], m["fields"], m["sample"]) == ("A", 2, ["loss_masks"], 0)
    assert m["detail"].startswith("loss_mask[0]: this file ")


def test_a_negative_nan_written_as_nan_is_not_a_mismatch(tmp_path):
    """JSON keeps no NaN sign: a run whose logprob was -nan reads back +nan, and still matches its fingerprints."""
    def nan(step, samples, weights):
        if step == 2:
            samples[1]["logprobs"][0] = -math.nan
    a, b = make_run(tmp_path / "a", mutate=nan), make_run(tmp_path / "b", mutate=nan)
    rep = diff_runs(a, b)
    assert rep.identical and rep.rollout_mismatches == [] and rep.rollout_files_checked["A"] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------- bisect: rlrepro code change


def _code(run, sha, env=None):
    write_inputs(run, {"format": INPUTS_FORMAT, "env": env or {},
                       CODE_KEY: {"sha256": sha, "files": 10, "git_commit": None, "git_dirty": None}})
    return run


def test_a_code_change_stops_bisect_naming_the_flag_and_the_flag_replays_with_a_warning(tmp_path, capsys):
    a = _code(make_model_run(tmp_path / "a"), "aa" * 32)
    b = _code(make_model_run(tmp_path / "b", loss_offset=2.0 ** -20), "bb" * 32)
    stopped = bisect_report(diff_runs(a, b), load_config(a), load_config(b))
    assert stopped.kind == "recorded_inputs" and stopped.code_change.startswith("rlrepro code differs (sha256 ")
    assert stopped.format().endswith("; to replay anyway, rerun with --allow-code-change (the replay runs this "
                                     "machine's rlrepro code, which need not be either run's, so a divergence the "
                                     "code change caused may not show in it)")
    assert main_diff([str(a), str(b), "--bisect"]) == 1
    assert "rerun with --allow-code-change" in capsys.readouterr().out

    replayed = bisect_report(diff_runs(a, b), load_config(a), load_config(b), allow_code_change=True)
    assert (replayed.kind, replayed.replayed_from, replayed.field) == ("none", "starting weights", "loss")
    assert replayed.code_change == stopped.code_change
    assert replayed.format().startswith(f"WARNING: bisect: rlrepro's code differs between the runs "
                                        f"({stopped.code_change}); replayed anyway (--allow-code-change)")
    assert main_diff([str(a), str(b), "--bisect", "--allow-code-change"]) == 1
    out = capsys.readouterr().out
    assert "\nWARNING: bisect: rlrepro's code differs" in out and "trainer side: the policy is identical" in out
    assert main_diff([str(a), str(b), "--bisect", "--allow-code-change", "--json"]) == 1
    captured = capsys.readouterr()
    found = json.loads(captured.out)["bisect"]
    assert found["kind"] == "none" and found["code_change"] == stopped.code_change
    assert captured.err.startswith("rlrepro diff: WARNING: bisect: rlrepro's code differs between the runs")


def test_the_flag_sets_aside_the_code_only_and_needs_bisect(tmp_path, capsys):
    a = _code(make_model_run(tmp_path / "a"), "aa" * 32)
    b = _code(make_model_run(tmp_path / "b", bump=1), "bb" * 32, env={"RLREPRO_ATTENTION_BWD": "torch"})
    res = bisect_report(diff_runs(a, b), load_config(a), load_config(b), allow_code_change=True)
    assert res.kind == "recorded_inputs" and res.note.startswith("RLREPRO_ATTENTION_BWD differs")
    assert res.format().endswith("; --allow-code-change would set aside rlrepro's code only: the other inputs still "
                                 "explain the divergence")
    assert main_diff([str(a), str(b), "--allow-code-change"]) == 2
    assert capsys.readouterr().err == ("rlrepro diff: error: --allow-code-change applies to --bisect only: add "
                                       "--bisect (or drop --allow-code-change)\n")
