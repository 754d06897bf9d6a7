"""Session 35 (second pass): environment seeds, final observations and info records as verl/slime/AReaL
multi-turn users write them, and the engine's advanced features (prefix cache, chunked prefill, continuous
batching, limit validation, stats) as an SGLang/vLLM user checks them on CPU."""
import numpy as np
import pytest

from rlrepro.data import PromptRecord
from rlrepro.envs import EnvError, Environment, EnvReset, Episode, StepResult, episode_seed, replay
from rlrepro.rollout import request_seed

REC = PromptRecord(uid="u1", prompt="1+1=", answer="2")


# ----------------------------------------------------------------------- 1. episode_seed takes numpy integers

@pytest.mark.parametrize("np_type", [np.int64, np.int32, np.uint16, np.int8])
def test_episode_seed_takes_numpy_integers_as_the_ints_they_hold(np_type):
    # before: "run_seed must be an int, got 3" although request_seed and derive_seed took np.int64 (ENGINE.md)
    want = episode_seed(3, 7, "uid", 2)
    assert episode_seed(np_type(3), np_type(7), "uid", np_type(2)) == want
    assert type(episode_seed(np_type(3), 7, "uid", 2)) is int
    assert episode_seed(3, 7, np_type(5), 2) == episode_seed(3, 7, 5, 2)  # an integer uid, as request_seed takes
    assert episode_seed(3, 7, 5, 2) != episode_seed(3, 7, "5", 2)         # 5 and "5" stay different keys
    # the same key gives request_seed and episode_seed different streams, numpy or not
    assert episode_seed(np.int64(3), 7, "uid", 2) != request_seed(np.int64(3), 7, "uid", 2)


def test_episode_seed_still_refuses_bools_floats_and_other_types():
    for bad in [True, np.bool_(True), 1.0, np.float64(1.0), "1", None]:
        with pytest.raises(ValueError, match="run_seed must be an int"):
            episode_seed(bad, 0, "u", 0)
    for bad in [True, 1.5, None, (1,)]:
        with pytest.raises(ValueError, match="prompt_uid must be an int or a str"):
            episode_seed(0, 0, bad, 0)


def test_episode_seed_values_are_unchanged_for_python_ints():
    # pinned: recorded runs' environment seeds must not move
    import hashlib
    import json
    key = json.dumps(["rlrepro.env", 1, 2, "u", 3], separators=(",", ":"))
    assert episode_seed(1, 2, "u", 3) == int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


# ----------------------------------------------------------------- 2. a done StepResult with messages is refused

def test_a_done_step_result_with_messages_is_refused_with_the_fix():
    # before: the messages were kept on the result but never reached the transcript, silently
    with pytest.raises(ValueError, match=r"a done StepResult has no messages.*info"):
        StepResult(messages=[{"role": "user", "content": "Correct!"}], done=True, reward=1.0)


class _FinalFeedback(Environment):
    def __init__(self, record, seed):
        self.record = record

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        return StepResult(messages=[{"role": "user", "content": "right"}], done=True, reward=1.0)


def test_an_environment_returning_final_messages_raises_env_error_naming_record_and_turn():
    ep = Episode(_FinalFeedback(REC, 0), max_turns=3, uid="u1")
    ep.reset()
    with pytest.raises(EnvError, match=r"record 'u1' at turn 1: ValueError: a done StepResult has no messages"):
        ep.step("2", 1)


# ------------------------------------------------------------------------ 3. StepResult.info is copied

class _ReusedInfo(Environment):
    """Keeps one info dict and mutates it every turn (a pattern of agent loops that accumulate metrics)."""

    def __init__(self, record, seed):
        self.record, self.info, self.turn = record, {"turn": 0, "calls": []}, 0

    def reset(self):
        return EnvReset(prompt=self.record.prompt)

    def step(self, text):
        self.turn += 1
        self.info["turn"] = self.turn
        self.info["calls"].append(text)
        if self.turn == 3:
            return StepResult(done=True, reward=1.0, info=self.info)
        return StepResult(messages=[{"role": "tool", "content": str(self.turn)}], info=self.info)


def test_info_of_earlier_turns_is_not_changed_by_an_environment_reusing_its_dict():
    ep = Episode(_ReusedInfo(REC, 0), max_turns=5, uid="u1")
    ep.reset()
    for t in ["a", "b", "c"]:
        ep.step(t, 1)
    # before: every result's info was the same dict, {"turn": 3, ...}
    assert [r.info["turn"] for r in ep.results] == [1, 2, 3]
    assert [r.info["calls"] for r in ep.results] == [["a"], ["a", "b"], ["a", "b", "c"]]
    _, results = replay(_ReusedInfo(REC, 0), ["a", "b", "c"])
    assert [r.to_json()["info"] for r in results] == [r.to_json()["info"] for r in ep.results]


def test_info_is_copied_on_construction_and_must_be_a_dict():
    info = {"k": [1]}
    r = StepResult(done=True, reward=0.0, info=info)
    info["k"].append(2)
    info["x"] = 1
    assert r.info == {"k": [1]}
    with pytest.raises(ValueError, match="StepResult.info must be a dict"):
        StepResult(done=True, reward=0.0, info=[("a", 1)])


# ------------------------------------------------------------------------------ 4. the engine (CPU, tiny model)

@pytest.fixture(scope="module")
def tiny():
    import torch

    from rlrepro.model import tiny_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model(seed=5, initializer_range=0.3)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kw,needle", [
    (dict(max_num_seqs=0), r"Engine max_num_seqs must be a positive integer, got 0; pass the most requests in one"),
    (dict(max_num_batched_tokens=-1), r"max_num_batched_tokens must be a positive integer, got -1; pass the most"),
    (dict(block_size=0), r"block_size must be a positive integer, got 0; pass tokens per KV block"),
    (dict(num_kv_blocks=0), r"num_kv_blocks must be a positive integer, got 0; pass KV blocks in the cache"),
    (dict(kv_cache_memory_bytes=2e9), r"kv_cache_memory_bytes must be a positive integer, got 2000000000.0; pass an "
                                      r"int, e.g. int\(2e9\)"),
    (dict(max_model_len=1), r"max_model_len must be >= 2 .*got 1; pass or None for the model's"),
    (dict(num_kv_blocks=4, kv_cache_memory_bytes=10**6), r"both size the KV cache: pass one of them"),
    (dict(enable_prefix_cache="false"), r"Engine enable_prefix_cache must be True or False, got 'false'"),
    (dict(fuse_projections=1), r"Engine fuse_projections must be True or False \(or None"),
    (dict(seed=1.5), r"Engine seed must be an integer, got 1.5"),
])
def test_bad_engine_arguments_are_refused_before_a_checkpoint_is_loaded(monkeypatch, tmp_path, kw, needle):
    # before: Engine(path, max_num_seqs=0) loaded the whole checkpoint first, and only then refused the value
    import rlrepro.model

    def load(*a, **k):
        raise AssertionError("the checkpoint was loaded before the arguments were checked")
    monkeypatch.setattr(rlrepro.model, "load_pretrained", load)
    from rlrepro.rollout import Engine
    with pytest.raises(ValueError, match=needle):
        Engine(str(tmp_path), **kw)


def test_engine_arguments_still_accept_numpy_integers_and_check_the_model(tiny):
    from rlrepro.rollout import Engine
    e = Engine(tiny, max_num_seqs=np.int64(3), max_num_batched_tokens=np.int32(5), block_size=np.int64(4),
               num_kv_blocks=np.int64(9), max_model_len=np.int64(64))
    got = (e.max_num_seqs, e.max_num_batched_tokens, e.block_size, e.num_kv_blocks, e.max_model_len)
    assert got == (3, 5, 4, 9, 64)
    with pytest.raises(ValueError, match="exceeds the model config's max_position_embeddings"):
        Engine(tiny, max_model_len=10**6)


def _key(o):
    return o.token_ids, o.logprobs, o.finish_reason


def test_prefix_cache_chunked_prefill_and_mid_flight_requests_give_each_request_its_alone_output(tiny):
    """What an SGLang/vLLM user checks first: prompts sharing a prefix, caches small enough to evict and preempt,
    chunk budgets from 1 token, requests added between steps: every output equals the request run alone without a
    cache, exactly (tokens, float logprobs, finish reason)."""
    import random

    from rlrepro.rollout import Engine, SamplingParams
    base = list(range(1, 17))
    prompts = [base + [20 + i] * (i % 5 + 1) for i in range(6)] + [[3, 4, 5], base[:9]]
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=8, seed=100 + i)
              for i in range(len(prompts))]
    alone = [_key(Engine(tiny, block_size=4, enable_prefix_cache=False, max_num_seqs=1).generate([p], [q])[0])
             for p, q in zip(prompts, params)]
    hits = 0
    for kw in [dict(max_num_batched_tokens=1), dict(max_num_batched_tokens=7, num_kv_blocks=9),
               dict(num_kv_blocks=8, max_num_seqs=3), dict(max_num_batched_tokens=5, num_kv_blocks=12)]:
        e = Engine(tiny, block_size=4, **kw)
        for _ in range(2):  # the second call meets a warm cache (or what eviction left of it)
            assert [_key(o) for o in e.generate(prompts, params)] == alone, kw
        e.block_manager.check_consistency()
        assert e.block_manager.num_free_blocks == e.num_kv_blocks  # nothing leaked
        hits += e.stats["num_prefix_hit_blocks"]
    assert hits > 0
    rng = random.Random(0)
    for trial in range(4):  # continuous batching: requests join at random steps
        e = Engine(tiny, block_size=4, num_kv_blocks=rng.choice([8, 10, 64]), max_num_seqs=rng.choice([1, 2, 3, 8]),
                   max_num_batched_tokens=rng.choice([1, 2, 5, 64]), enable_prefix_cache=trial != 1)
        order, ids, outs = rng.sample(range(len(prompts)), len(prompts)), {}, {}
        while order or e.has_unfinished():
            while order and (rng.random() < 0.4 or not e.has_unfinished()):
                i = order.pop()
                ids[e.add_request(prompts[i], params[i])] = i
            outs.update({ids[o.request_id]: _key(o) for o in e.step()})
        assert [outs[i] for i in range(len(prompts))] == alone, trial
        assert e.block_manager.num_free_blocks == e.num_kv_blocks


def test_engine_stats_are_the_documented_keys(tiny):
    import pathlib
    import re

    from rlrepro.rollout import Engine, SamplingParams
    e = Engine(tiny, block_size=4, num_kv_blocks=32)
    for _ in range(2):  # twin 2 waits a step for twin 1's 2 prompt blocks; the second call finds them for both
        outs = e.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 2, SamplingParams(temperature=0.0, max_tokens=3))
    assert [o.num_cached_tokens for o in outs] == [8, 8]
    stats = e.stats
    assert all(type(v) is int for v in stats.values())
    assert stats["num_prefix_hit_blocks"] == 6 and stats["num_kv_blocks"] == 32 and stats["num_graph_steps"] == 0
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "ENGINE.md").read_text()
    para = doc[doc.index("`engine.stats` is a dict"):]
    para = para[:para.index("\n\n")]
    assert set(re.findall(r"`(num_\w+)`", para)) - {"num_cached_tokens"} == set(stats)
