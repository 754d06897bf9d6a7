"""Review of rlrepro/rollout (session 29): a failed weight update must not leave K/V of the old weights in the
prefix cache; numpy scalars in SamplingParams; add_request given one token id."""
import numpy as np
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(seed):
    return Engine(tiny_model(seed=seed, initializer_range=0.3), block_size=4, num_kv_blocks=32)


@pytest.fixture(scope="module")
def new_weights():
    return dict(tiny_model(seed=9, initializer_range=0.3).named_parameters())


@pytest.fixture(scope="module")
def fresh_output():
    return _engine(9).generate([PROMPT], GREEDY)[0]


def _fill_then(failure, src):
    def fill(params):
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(src[name])
        if failure == "raise":
            raise RuntimeError("broadcast failed after the copy")
        return torch.tensor(1)  # not an int: receive_weights refuses it after the weights are in
    return fill


@pytest.mark.parametrize("how", ["load_bad_name", "receive_raises", "receive_bad_version"])
def test_failed_weight_update_drops_the_prefix_cache(how, new_weights, fresh_output):
    engine = _engine(5)
    engine.generate([PROMPT], GREEDY)  # fills the prefix cache with K/V of the old weights
    with pytest.raises((ValueError, RuntimeError)):
        if how == "load_bad_name":
            engine.load_weights([*new_weights.items(), ("no.such.weight", torch.zeros(1))], version=1)
        else:
            engine.receive_weights(_fill_then("raise" if how == "receive_raises" else "version", new_weights))
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == 0  # no block of the old weights was reused
    # a refused load_weights leaves every old weight (all-or-nothing, session 32); the receive paths copy first
    want = _engine(5).generate([PROMPT], GREEDY)[0] if how == "load_bad_name" else fresh_output
    assert out.token_ids == want.token_ids
    assert torch.equal(torch.tensor(out.logprobs), torch.tensor(want.logprobs))
    assert engine.weight_version == 0  # the failed update set no version


def test_sampling_params_take_numpy_scalars():
    got = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int32(3),
                         max_tokens=np.int64(5), seed=np.uint64(7))
    want = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, max_tokens=5, seed=7)
    assert got == want and hash(got) == hash(want)
    assert [type(got.top_k), type(got.max_tokens), type(got.seed), type(got.temperature)] == [int, int, int, float]
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=np.int64(0))
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=np.bool_(True))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.bool_(True))


@pytest.mark.parametrize("token", [5, np.int64(5), torch.tensor(5)])
def test_add_request_given_one_token_id_names_add_request(token):
    engine = _engine(5)
    with pytest.raises(ValueError, match=r"add_request takes one prompt.*single token id.*add_request\(\[5\]"):
        engine.add_request(token, SamplingParams(max_tokens=2))
    assert engine.num_requests == 0 and not engine.has_unfinished()
