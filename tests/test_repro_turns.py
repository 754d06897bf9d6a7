"""Multi-turn episodes in the records (issue 24): fingerprints cover loss masks and turn structure, ``rlrepro diff``
names the episode, turn and token of a difference, ``rlrepro show`` prints turns. Run directories built by hand."""
import copy
import json

import pytest
import torch

from rlrepro.repro.diff import diff_runs, main_diff, read_fingerprints
from rlrepro.repro.fingerprint import (
    FIELDS,
    SAMPLE_FIELDS,
    TURN_FIELDS,
    TURN_SAMPLE_FIELDS,
    FingerprintWriter,
    MetricsWriter,
    RolloutWriter,
    digest_values,
    fingerprint_from_samples,
    fingerprint_step,
)
from rlrepro.repro.show import show_step
from rlrepro.repro.turns import locate_turn, turn_spans
from rlrepro.samples import Sample, Turn

KW = dict(loss=0.125, grad_norm=1.5, weights=None)
SINGLE_TURN_KEYS = {"step", "format", "num_samples", *FIELDS, *SAMPLE_FIELDS.values()}

# Pinned with the code before Sample support existed (tests/test_repro_records_samples.py FIXED_DIGESTS, commit
# 07f72b1) for the batch of single_turn_dicts(): single-turn records must not move.
PINNED = {"rollout_token_ids": "1f8581b53429fd7a73773c06b20e75fca952a2db76648136d3062f169bbcbc23",
          "rollout_logprobs": "a6676290332370ef02d38ac8f6aabb0e7036a17a84d80f670b4252222e6029b7",
          "sample_token_ids": ["e3f996a7eecaf3a3", "7f338a9704c945d4"]}


def single_turn_dicts():
    return [{"prompt_uid": "a", "sample_index": 0, "prompt_token_ids": [1, 2, 3], "token_ids": [4, 5],
             "logprobs": [-0.5, -0.25], "reward": 1.0, "advantage": 0.5},
            {"prompt_uid": "a", "sample_index": 1, "prompt_token_ids": [1, 2, 3], "token_ids": [6],
             "logprobs": [-1.0 / 3], "reward": 0.0, "advantage": -0.5}]


def episode(uid, k, split=(3, 2, 2), roles=("policy", "tool", "policy"), tokens=None, mask=None):
    """A multi-turn Sample: turns of lengths ``split``; tool tokens have logprob 0.0 and mask 0."""
    n = sum(split)
    tokens = list(tokens) if tokens is not None else [100 + 10 * k + j for j in range(n)]
    turns, pos = [], 0
    for role, m in zip(roles, split):
        turns.append(Turn(role, tokens[pos:pos + m], f"{role}:{tokens[pos:pos + m]}"))
        pos += m
    auto_mask = [1 if t.role == "policy" else 0 for t in turns for _ in t.token_ids]
    mask = auto_mask if mask is None else list(mask)
    return Sample(prompt_uid=uid, sample_index=k, prompt_token_ids=[1, 2, 3], completion_token_ids=tokens,
                  rollout_logprobs=[-0.125 * (j + 1) if b else 0.0 for j, b in enumerate(mask)],
                  finish_reason="done", reward=float(k % 2), advantage=(k % 2) - 0.5, loss_mask=mask, turns=turns,
                  completion_text="".join(t.text for t in turns))


def batch():
    return [episode("q0", 0), episode("q0", 1), episode("q1", 0, split=(7,), roles=("policy",)), episode("q1", 1)]


def diffs(fa, fb):
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


# -------------------------------------------------------------------------------------------- fingerprints


def test_single_turn_fingerprint_is_unchanged():
    dicts = single_turn_dicts()
    fp = fingerprint_from_samples(2, dicts, **KW)
    assert set(fp) == SINGLE_TURN_KEYS                       # no new keys for single-turn steps
    for k, v in PINNED.items():
        assert fp[k] == v, k
    # explicit None masks / turns, as Samples or as dicts carrying the keys, change nothing
    samples = [Sample.from_record(d) for d in dicts]
    assert all(s.loss_mask is None and s.turns is None for s in samples)
    assert fingerprint_from_samples(2, samples, **KW) == fp
    assert fingerprint_from_samples(2, [{**d, "loss_mask": None, "turns": None} for d in dicts], **KW) == fp
    old_path = fingerprint_step(2, prompt_ids=[d["prompt_token_ids"] for d in dicts],
                                token_ids=[d["token_ids"] for d in dicts], logprobs=[d["logprobs"] for d in dicts],
                                rewards=[d["reward"] for d in dicts], advantages=[d["advantage"] for d in dicts], **KW)
    assert old_path == fp
    assert fingerprint_step(2, prompt_ids=[d["prompt_token_ids"] for d in dicts],
                            token_ids=[d["token_ids"] for d in dicts], logprobs=[d["logprobs"] for d in dicts],
                            rewards=[d["reward"] for d in dicts], advantages=[d["advantage"] for d in dicts],
                            loss_masks=[None, None], turns=[None, None], **KW) == fp


def test_multi_turn_fingerprint_fields():
    s = batch()
    fp = fingerprint_from_samples(1, s, **KW)
    assert set(fp) == SINGLE_TURN_KEYS | set(TURN_FIELDS) | set(TURN_SAMPLE_FIELDS.values())
    assert all(len(fp[f]) == 64 for f in TURN_FIELDS)
    assert all(len(fp[k]) == 4 for k in TURN_SAMPLE_FIELDS.values())
    json.dumps(fp)
    # the rollout file's dicts, bool or tensor masks give the same record; the turns' text is not hashed
    assert fingerprint_from_samples(1, [x.to_record() for x in s], **KW) == fp
    s2 = batch()
    s2[0].loss_mask = [bool(b) for b in s2[0].loss_mask]
    s2[1].loss_mask = torch.tensor(s2[1].loss_mask)
    for t in s2[3].turns:
        t.text = "other text"
    assert fingerprint_from_samples(1, s2, **KW) == fp
    # what the turns digest hashes: role and span per turn
    assert turn_spans(s[0].turns) == [["policy", 0, 3], ["tool", 3, 5], ["policy", 5, 7]]
    assert locate_turn(s[0].turns, 4) == (1, "tool", 1) and locate_turn(s[0].turns, 7) is None
    assert locate_turn(None, 0) is None
    # one multi-turn sample among single-turn ones: the others count as None
    mixed = [Sample.from_record(d) for d in single_turn_dicts()] + [episode("b", 0)]
    fm = fingerprint_from_samples(1, mixed, **KW)
    assert fm["sample_loss_masks"][:2] == fm["sample_turns"][:2] == [digest_values(None)[:16]] * 2
    assert fm["sample_loss_masks"][2] != fm["sample_loss_masks"][0]
    with pytest.raises(ValueError, match="loss_masks 1"):
        fingerprint_step(0, prompt_ids=[[1], [1]], token_ids=[[1], [2]], logprobs=[[0.0], [0.0]], rewards=[0, 0],
                         advantages=[0, 0], loss_masks=[[1]], **KW)


def test_one_mask_bit_or_one_turn_boundary_changes_only_its_field():
    fp = fingerprint_from_samples(1, batch(), **KW)
    s = batch()
    s[1].loss_mask[3] = 1                                    # one bit, tokens and turns the same
    fm = fingerprint_from_samples(1, s, **KW)
    assert diffs(fp, fm) == ["loss_masks", "sample_loss_masks"]
    assert [i for i, (a, b) in enumerate(zip(fp["sample_loss_masks"], fm["sample_loss_masks"])) if a != b] == [1]
    s = batch()
    s[3] = episode("q1", 1, split=(4, 1, 2))                 # same tokens, logprobs and mask, another split
    s[3].loss_mask = batch()[3].loss_mask
    s[3].rollout_logprobs = batch()[3].rollout_logprobs
    ft = fingerprint_from_samples(1, s, **KW)
    assert diffs(fp, ft) == ["sample_turns", "turns"]
    assert [i for i, (a, b) in enumerate(zip(fp["sample_turns"], ft["sample_turns"])) if a != b] == [3]
    s = batch()
    s[0].turns[1].role = "env"                               # a role
    assert diffs(fp, fingerprint_from_samples(1, s, **KW)) == ["sample_turns", "turns"]
    s = batch()
    s[2].turns = s[2].turns + [Turn("tool", [], "")]         # an empty turn is structure too
    assert diffs(fp, fingerprint_from_samples(1, s, **KW)) == ["sample_turns", "turns"]
    s = batch()
    s[2].loss_mask = None                                    # a sample losing its mask
    assert diffs(fp, fingerprint_from_samples(1, s, **KW)) == ["loss_masks", "sample_loss_masks"]


# ----------------------------------------------------------------------------------------------------- diff


def make_run(path, mutate=None, steps=3):
    """A multi-turn run as the driver writes it; ``mutate(step, samples)`` edits a step's samples."""
    path.mkdir(parents=True)
    fw, mw, rw = FingerprintWriter(path), MetricsWriter(path), RolloutWriter(path)
    for step in range(1, steps + 1):
        samples = batch()
        if mutate:
            mutate(step, samples)
        rw.write(step, samples)
        fw.write(fingerprint_from_samples(step, samples, loss=0.5 * step, grad_norm=1.0, weights=None))
        mw.write({"step": step, "train/loss": 0.5 * step})
    return path


def at_step(k, fn):
    def mutate(step, samples):
        if step == k:
            fn(samples)
    return mutate


def set_token(i, pos, value):
    def fn(samples):
        s = samples[i]
        s.completion_token_ids[pos] = value
        for t, (_, start, end) in zip(s.turns, turn_spans(s.turns)):
            if start <= pos < end:
                t.token_ids[pos - start] = value
    return fn


def report(a, b, capsys):
    rep = diff_runs(a, b)
    assert main_diff([str(a), str(b)]) == 1
    return rep, capsys.readouterr().out


def test_identical_multi_turn_runs(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    assert diff_runs(a, b).verdict == "identical"
    assert all("loss_masks" in r and "sample_turns" in r for r in read_fingerprints(a).values())


def token_divergence(tmp_path, capsys, step, i, pos, value):
    """Runs differing in one completion token of sample ``i`` at ``step``; the report names that sample."""
    rep, out = report(make_run(tmp_path / "a"), make_run(tmp_path / "b", at_step(step, set_token(i, pos, value))),
                      capsys)
    dv = rep.divergence
    assert (dv.step, dv.field, dv.sample_index, dv.prompt_uid, dv.sample_index_in_prompt) == \
        (step, "rollout_token_ids", i, f"q{i // 2}", i % 2)
    assert (dv.num_turns_a, dv.num_turns_b) == (3, 3)
    return rep, out


def test_policy_token_difference_names_episode_turn_and_token(tmp_path, capsys):
    rep, out = token_divergence(tmp_path, capsys, 2, 1, 5, 999)       # turn 3 (policy), its first token
    dv = rep.divergence
    t = dv.token
    assert (t.what, t.position, t.a, t.b) == ("token_ids", 5, 115, 999)
    assert (t.turn_a.index, t.turn_a.role, t.turn_a.position, t.turn_a.num_turns) == (2, "policy", 0, 3)
    assert t.turn_b == t.turn_a
    assert "  sample 1 (prompt_uid 'q0', sample_index 1), a multi-turn episode: 3 turns\n" in out
    assert ("    first differing token at position 5 (turn 3 of 3, policy, position 0 in the turn): A=115 B=999  "
            "(logprobs A=-0.75 B=-0.75)\n    a policy token (sampled): the policy sampled a different token\n") in out
    assert "ENVIRONMENT" not in out
    js = json.loads(rep.to_json())["divergence"]["token"]
    assert js["turn_a"] == {"index": 2, "role": "policy", "position": 0, "num_turns": 3}


def test_observation_token_difference_is_an_environment_difference(tmp_path, capsys):
    rep, out = token_divergence(tmp_path, capsys, 1, 3, 4, 7)         # turn 2 (tool), its second token
    dv = rep.divergence
    assert (dv.token.turn_a.index, dv.token.turn_a.role, dv.token.turn_a.position) == (1, "tool", 1)
    assert ("    first differing token at position 4 (turn 2 of 3, tool, position 1 in the turn): A=114 B=7  "
            "(logprobs A=0.0 B=0.0)\n") in out
    assert ("    an observation token (tool, not sampled by the policy): every token before it is the same, so the "
            "environment answered the same transcript differently: an ENVIRONMENT difference\n") in out


def test_logprob_difference_in_a_turn(tmp_path, capsys):
    def fn(samples):
        samples[0].rollout_logprobs[1] = -0.25000000000000006
    rep, out = report(make_run(tmp_path / "a"), make_run(tmp_path / "b", at_step(3, fn)), capsys)
    assert rep.divergence.field == "rollout_logprobs" and rep.divergence.token.position == 1
    assert ("    first differing logprob at position 1 (token 101; turn 1 of 3, policy, position 1 in the turn): "
            "A=-0.25 B=-0.25000000000000006\n    a policy token (sampled): the same token with a different "
            "sampling logprob\n") in out


def test_turn_boundary_with_a_token_difference(tmp_path, capsys):
    def fn(samples):       # B's policy turn ends one token earlier: position 3 is a tool token there
        samples[0] = episode("q0", 0, split=(3, 2, 2))
        samples[0].completion_token_ids[3] = samples[0].turns[1].token_ids[0] = 5
    a = make_run(tmp_path / "a", at_step(1, lambda s: s.__setitem__(0, episode("q0", 0, split=(4, 1, 2)))))
    rep, out = report(a, make_run(tmp_path / "b", at_step(1, fn)), capsys)
    t = rep.divergence.token
    assert (t.turn_a.role, t.turn_b.role) == ("policy", "tool")
    assert ("    first differing token at position 3 (A: turn 1 of 3, policy, position 3 in the turn; B: turn 2 of 3, "
            "tool, position 0 in the turn): A=103 B=5") in out
    assert "    a policy token in A, a tool token in B: the turns end at different tokens" in out


def test_loss_mask_difference(tmp_path, capsys):
    def fn(samples):
        samples[1].loss_mask[3] = 1
    rep, out = report(make_run(tmp_path / "a"), make_run(tmp_path / "b", at_step(2, fn)), capsys)
    dv = rep.divergence
    assert (dv.step, dv.field, dv.fields, dv.sample_index) == (2, "loss_masks", ["loss_masks"], 1)
    assert ("FIRST DIVERGENCE: step 2, field loss_masks\n  sample 1 (prompt_uid 'q0', sample_index 1), a multi-turn "
            "episode: 3 turns\n    first differing loss-mask bit at position 3 (turn 2 of 3, tool, position 0 in the "
            "turn): A=0 B=1 (1 = sampled by the policy and trained on)\n    an observation token (tool, not sampled "
            "by the policy)\n") in out

    def drop(samples):
        samples[2].loss_mask = None
    rep, out = report(tmp_path / "a", make_run(tmp_path / "c", at_step(1, drop)), capsys)
    assert rep.divergence.field == "loss_masks" and rep.divergence.sample_index == 2
    assert "    loss mask: A=a loss mask of 7 tokens B=no loss mask\n" in out


def test_turn_structure_difference(tmp_path, capsys):
    def fn(samples):
        s = episode("q1", 1, split=(4, 1, 2))
        s.loss_mask, s.rollout_logprobs = samples[3].loss_mask, samples[3].rollout_logprobs
        samples[3] = s
    rep, out = report(make_run(tmp_path / "a"), make_run(tmp_path / "b", at_step(3, fn)), capsys)
    dv = rep.divergence
    assert (dv.step, dv.field, dv.sample_index) == (3, "turns", 3)
    assert (dv.token.what, dv.token.position, dv.token.a, dv.token.b) == \
        ("turns", 0, ["policy", 0, 3], ["policy", 0, 4])
    assert ("    first differing turn: turn 1: A=policy, completion tokens 0-2 B=policy, completion tokens 0-3 "
            "(the same tokens, split into turns differently)\n") in out


def test_single_turn_messages_unchanged(tmp_path, capsys):
    def run(path, change):
        path.mkdir()
        fw, rw = FingerprintWriter(path), RolloutWriter(path)
        d = single_turn_dicts()
        if change:
            d[0]["token_ids"] = [4, 9]
        rw.write(1, d)
        fw.write(fingerprint_from_samples(1, d, **KW))
        return path
    a, b = run(tmp_path / "a", False), run(tmp_path / "b", True)
    main_diff([str(a), str(b)])
    out = capsys.readouterr().out
    assert "  sample 0 (prompt_uid 'a', sample_index 0)\n    first differing token at position 1: A=5 B=9  " \
        "(logprobs A=-0.25 B=-0.25)\n  diverged steps: 1 of 1 (1)\n" in out
    assert "turn" not in out.replace(str(tmp_path), "RUNS")


def test_multi_turn_run_against_single_turn_run(tmp_path, capsys):
    """The same tokens recorded without masks and turns (an older run): named as a loss-mask difference."""
    def strip(step, samples):
        for s in samples:
            s.loss_mask = s.turns = None
    rep, out = report(make_run(tmp_path / "a"), make_run(tmp_path / "b", strip), capsys)
    dv = rep.divergence
    assert dv.field == "loss_masks" and dv.fields == ["loss_masks", "turns"] and dv.sample_index == 0
    assert "a multi-turn episode: A 3 turns, B no turns" in out
    assert "    loss mask: A=a loss mask of 7 tokens B=no loss mask\n" in out
    assert "    (run B has no loss_masks digest: its samples have no loss masks or turns, or it was recorded" in out


# ----------------------------------------------------------------------------------------------------- show


def test_show_prints_turns_and_marks_tool_turns(tmp_path):
    run = make_run(tmp_path / "a", steps=1)
    out = show_step(run, 1, n=0)
    assert ("[1] prompt_uid 'q0'  sample_index 1\n    reward 1.0   advantage 0.5   finish done   length 7 tokens "
            "(prompt 3)\n") in out
    assert ("    turns (3): 5 policy tokens (sampled), 2 tool tokens (context), loss mask 1 on 5 of 7 tokens\n"
            "      1. policy, 3 tokens:\n        | policy:[110, 111, 112]\n"
            "      2. tool, 2 tokens:\n        | tool:[113, 114]\n"
            "        ^ tool turn (completion tokens 3-4): context from the environment, not sampled by the policy "
            "(loss mask 0)\n"
            "      3. policy, 2 tokens:\n        | policy:[115, 116]\n") in out
    assert "    turns (1): 7 policy tokens (sampled), loss mask 1 on 7 of 7 tokens\n" in out
    assert "completion:" not in out
    # a policy turn whose mask is not all ones is marked too
    s = batch()
    s[0].loss_mask[1] = 0
    s[0].completion_text = None
    RolloutWriter(run).write(2, s)
    out = show_step(run, 2, n=1)
    assert "        ^ policy turn (completion tokens 0-2): loss mask 1 on 2 of 3\n" in out


def test_show_single_turn_unchanged(tmp_path):
    run = tmp_path / "s"
    RolloutWriter(run).write(1, [Sample.from_record({**single_turn_dicts()[0], "completion_text": "xy"})])
    out = show_step(run, 1)
    assert "    completion:\n      | xy" in out and "turns" not in out and "^" not in out


def test_copy_of_real_layout_rollout_round_trip(tmp_path):
    """A rollout record with turns reads back to the same fingerprint (what diff and verify rely on)."""
    run = make_run(tmp_path / "a", steps=1)
    from rlrepro.repro.records import read_rollouts
    recs = copy.deepcopy(read_rollouts(run, 1))
    assert fingerprint_from_samples(1, recs, loss=0.5, grad_norm=1.0, weights=None) == read_fingerprints(run)[1]
