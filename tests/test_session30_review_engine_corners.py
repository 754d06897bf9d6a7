"""Engine review (session 30): corners of the promise, checked with exact equality against each request run alone
on a fresh engine without the prefix cache, and against the trainer's full-sequence forward: prompts that exactly
fill KV blocks, duplicate prompts sharing the prefix cache, max_tokens=1, a stop token as the first sampled token,
chunked prefill, preemption with a warm prefix cache, and repeated generate calls on one engine."""
import pytest
import torch

from rlrepro import kernels
from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, initializer_range=0.3)


def key(o):
    return (o.token_ids, o.logprobs, o.finish_reason)


BLOCK = [4, 9, 13, 21]  # one KV block of 4
PROMPTS = [BLOCK, BLOCK, BLOCK * 2, BLOCK * 2 + [7], BLOCK[:3], [30], BLOCK * 3]


def params(first_token_stop: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=1.0, max_tokens=6, seed=1, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=5, seed=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(first_token_stop,)),
            SamplingParams(temperature=1.3, max_tokens=1, seed=3),
            SamplingParams(temperature=1.0, max_tokens=7, seed=1, ignore_eos=True),
            SamplingParams(temperature=0.7, max_tokens=4, seed=4, ignore_eos=True)]


@pytest.mark.parametrize("cfg", [dict(block_size=4, num_kv_blocks=64),
                                 dict(block_size=4, num_kv_blocks=5, max_num_batched_tokens=3),
                                 dict(block_size=4, num_kv_blocks=4, max_num_seqs=2, max_num_batched_tokens=5)])
def test_corners_equal_each_request_alone_and_the_full_forward(model, cfg):
    greedy_first = Engine(model, enable_prefix_cache=False).generate(
        [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids[0]
    ps = params(greedy_first)
    alone = [key(Engine(model, block_size=4, enable_prefix_cache=False).generate([p], [q])[0])
             for p, q in zip(PROMPTS, ps)]
    assert alone[3] == ([greedy_first], alone[3][1], "stop")  # the stop token as the first sampled token
    assert [len(a[0]) for a in (alone[0], alone[4])] == [1, 1] and alone[0][2] == "length"
    engine = Engine(model, **cfg)
    for _ in range(2):  # the second call runs on a warm prefix cache
        assert [key(o) for o in engine.generate(PROMPTS, ps)] == alone
        assert [key(o) for o in engine.generate(PROMPTS[::-1], ps[::-1])] == alone[::-1]
    engine.block_manager.check_consistency()
    assert engine.stats["num_prefix_hit_blocks"] > 0  # the duplicates and the second call did share blocks
    assert (engine.stats["num_preemptions"] > 0) == (cfg["num_kv_blocks"] < 16)  # small caches did preempt
    for p, (tokens, logprobs, _), q in zip(PROMPTS, alone, ps):
        with torch.no_grad():
            logits = model(torch.tensor([p + tokens]))[0, len(p) - 1:-1]
        want = kernels.token_logprob(logits, torch.tensor(tokens), q.temperature)
        assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), want)
