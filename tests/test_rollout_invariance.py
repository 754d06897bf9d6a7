"""A request's output does not depend on what else runs with it: >= 20 trials per case, exactly 1 unique output.

Every trial builds an engine with a random scheduling configuration (max_num_seqs, token budget including odd
chunk sizes, KV-cache size small enough to preempt, prefix cache on/off) and a random batch around the request
under test. The promise is bitwise, so outputs are compared as exact tuples of token ids and float32 logprobs.
"""
import random

import pytest

from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingParams

TRIALS = 20
BLOCK_SIZE = 4
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, max_tokens=MAX_TOKENS, seed=1234)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, initializer_range=0.3)  # peaked logits: greedy paths are non-trivial


def random_engine(model, rng: random.Random, min_blocks: int) -> Engine:
    return Engine(model, seed=rng.randrange(100), max_num_seqs=rng.randint(1, 8),
                  max_num_batched_tokens=rng.choice([1, 3, 7, 13, 16, 64, 512]),
                  enable_prefix_cache=rng.random() < 0.7, block_size=BLOCK_SIZE,
                  num_kv_blocks=min_blocks + rng.choice([0, 1, 3, 10, 200]))


def blocks_for(prompt, params):
    return -(-(len(prompt) + params.max_tokens - 1) // BLOCK_SIZE)


def random_prompt(rng: random.Random, lo: int = 1, hi: int = 24) -> list[int]:
    return [rng.randrange(60) for _ in range(rng.randint(lo, hi))]


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.8]),
                          top_k=rng.choice([-1, 5]), max_tokens=rng.randint(1, 14), seed=rng.randrange(1000))


def key(out):
    return tuple(out.token_ids), tuple(out.logprobs), out.finish_reason


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_single_prompt_at_every_batch_size(model, params):
    rng = random.Random(1)
    prompt = random_prompt(rng, 9, 9)
    seen = set()
    for trial in range(TRIALS):
        n = 1 + trial % 8
        engine = random_engine(model, rng, blocks_for(prompt, params))
        outs = engine.generate([prompt] * n, params)
        seen.update(key(o) for o in outs)
    assert len(seen) == 1


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mixed_batches(model, params):
    rng = random.Random(2)
    target = random_prompt(rng, 11, 11)
    seen = set()
    preempted = 0
    for trial in range(TRIALS):
        others = [random_prompt(rng) for _ in range(rng.randint(0, 7))]
        other_params = [random_params(rng) for _ in others]
        where = rng.randint(0, len(others))
        prompts = others[:where] + [target] + others[where:]
        plist = other_params[:where] + [params] + other_params[where:]
        engine = random_engine(model, rng, max(blocks_for(p, sp) for p, sp in zip(prompts, plist)))
        outs = engine.generate(prompts, plist)
        seen.add(key(outs[where]))
        preempted += engine.stats["num_preemptions"] > 0
    assert len(seen) == 1
    assert preempted > 0, "no trial preempted: the test lost its coverage"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prefixes_of_one_prompt(model, params, warm):
    rng = random.Random(3)
    long_prompt = random_prompt(rng, 33, 33)
    lengths = [1, 3, 4, 5, 8, 12, 13, 17, 24, 32, 33]
    seen: dict[int, set] = {n: set() for n in lengths}
    hits = 0
    for trial in range(TRIALS):
        chosen = [rng.choice(lengths) for _ in range(rng.randint(1, 6))]
        engine = random_engine(model, rng, blocks_for(long_prompt, params))
        if warm:
            engine.generate([long_prompt[: rng.choice(lengths)] for _ in range(2)], params)
        outs = engine.generate([long_prompt[:n] for n in chosen], params)
        for n, o in zip(chosen, outs):
            seen[n].add(key(o))
        hits += engine.stats["num_prefix_hit_blocks"] > 0
    assert all(len(s) <= 1 for s in seen.values()), {n: len(s) for n, s in seen.items()}
    assert sum(len(s) for s in seen.values()) >= len(lengths) - 2  # nearly every length was exercised
    assert hits > 0, "no prefix-cache hit in any trial"


def test_random_workloads_match_running_each_request_alone(model):
    """Many random batches under random configurations; every request must equal its solo run."""
    rng = random.Random(4)
    solo_engine = Engine(model, block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_seqs=1)
    solo: dict = {}
    for trial in range(40):
        prompts = [random_prompt(rng) for _ in range(rng.randint(1, 12))]
        params = [random_params(rng) for _ in prompts]
        engine = random_engine(model, rng, max(blocks_for(p, sp) for p, sp in zip(prompts, params)))
        for prompt, sp, out in zip(prompts, params, engine.generate(prompts, params)):
            k = (tuple(prompt), sp)
            if k not in solo:
                solo[k] = key(solo_engine.generate([prompt], sp)[0])
            assert key(out) == solo[k]
