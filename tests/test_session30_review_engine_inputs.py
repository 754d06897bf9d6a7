"""Engine review (session 30): inputs that were refused or misread, and corners of the promise.

* a one-token prompt given as a 1-D tensor (``torch.tensor([5])``, or a row of ``torch.tensor([[5], [6]])``) was
  taken for a single token id (``operator.index`` accepts one-element tensors) and refused;
* ``load_weights`` given a state dict failed with "too many values to unpack (expected 2)";
* ``generate``'s sampling_params as a SamplingConfig, a number or a dict gave a bare TypeError or "got 2
  SamplingParams for 1 prompts" (a dict's keys);
* ``abort(0.0)`` aborted request 0 (``0.0 == 0`` as a dict key), as ``abort(True)`` once aborted request 1;
* the Engine's integer arguments refused numpy integers, which SamplingParams takes.
"""
import numpy as np
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, initializer_range=0.3)


def key(outs):
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


SEEDED = SamplingParams(temperature=1.0, max_tokens=4, seed=7, ignore_eos=True)


def test_a_one_token_prompt_as_a_1d_tensor_is_a_prompt(model):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    want = key(engine.generate([[5], [6]], SEEDED))
    assert key(engine.generate([torch.tensor([5]), torch.tensor([6])], SEEDED)) == want
    assert key(engine.generate(torch.tensor([[5], [6]]), SEEDED)) == want
    assert key(engine.generate(np.array([[5], [6]]), SEEDED)) == want
    rid = engine.add_request(torch.tensor([5]), SEEDED)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [rid] and key(outs) == want[:1]
    # a one-element tensor inside a prompt is no token id either (it was read as one)
    with pytest.raises(ValueError, match=r"^request 0: token id tensor\(\[5\]\) is not an integer in \[0, 60\)"):
        engine.generate([[torch.tensor([5]), 6]], SEEDED)
    # the flat-list errors still hold
    with pytest.raises(ValueError, match="got one flat list of ints: wrap it as"):
        engine.generate([torch.tensor(5), torch.tensor(6)], SEEDED)
    with pytest.raises(ValueError, match="add_request takes one prompt.*single token id"):
        engine.add_request(torch.tensor(5), SEEDED)


def test_load_weights_takes_a_state_dict():
    target = tiny_model(seed=7, initializer_range=0.3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    want = key(Engine(target, block_size=4, num_kv_blocks=16).generate([[1, 2, 3], [9, 8]], greedy))
    engine = Engine(tiny_model(seed=5, initializer_range=0.3), block_size=4, num_kv_blocks=16)
    before = key(engine.generate([[1, 2, 3], [9, 8]], greedy))
    assert before != want  # the test can tell the weights apart
    engine.load_weights({k: v.clone() for k, v in target.state_dict().items()}, version=1)
    assert key(engine.generate([[1, 2, 3], [9, 8]], greedy)) == want and engine.weight_version == 1


@pytest.mark.parametrize("item,got", [(("model.norm.weight", [1.0] * 4), "the list of 'model.norm.weight'"),
                                      ("model.norm.weight", "str 'model.norm.weight'")])
def test_load_weights_names_a_pair_that_is_no_name_and_tensor(model, item, got):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"load_weights takes \(name, tensor\) pairs .*got " + got):
        engine.load_weights([item], version=1)
    assert engine.weight_version == 0


@pytest.mark.parametrize("bad,kind", [(SamplingConfig(), "SamplingConfig"), (0.5, "float"),
                                      ({"temperature": 0.0, "max_tokens": 2}, "dict")])
def test_sampling_params_of_another_type_name_the_fix(model, bad, kind):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match=f"sampling_params must be a SamplingParams or a list of them.*got {kind}.*"
                                         r"SamplingConfig\(...\).params\(seed=...\)"):
        engine.generate([[1, 2]], bad)
    assert engine.num_requests == 0 and not engine.has_unfinished()


def test_abort_with_a_float_does_not_abort_request_zero(model):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    p = SamplingParams(temperature=0.0, max_tokens=3)
    ids = [engine.add_request([1, 2, 3], p) for _ in range(2)]
    with pytest.raises(ValueError, match=r"abort: 0.0 is not an unfinished request"):
        engine.abort(0.0)  # 0.0 == 0 as a dict key
    engine.abort(np.int64(ids[1]))  # a numpy integer is an id
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [(ids[0], "length"), (ids[1], "abort")]


def test_engine_integer_arguments_take_numpy_integers(model):
    a = Engine(model, seed=np.int64(3), max_num_seqs=np.int64(2), block_size=np.int32(4), num_kv_blocks=np.int64(16))
    b = Engine(model, seed=3, max_num_seqs=2, block_size=4, num_kv_blocks=16)
    assert type(a.seed) is int and (a.max_num_seqs, a.block_size, a.num_kv_blocks) == (2, 4, 16)
    p = SamplingParams(temperature=1.0, max_tokens=3)  # unseeded: derived from the engine seed
    outs_a, outs_b = a.generate([[1, 2], [3]], p), b.generate([[1, 2], [3]], p)
    assert key(outs_a) == key(outs_b) and [o.seed for o in outs_a] == [o.seed for o in outs_b]


def test_a_single_stop_id_says_how_to_wrap_it():
    with pytest.raises(ValueError, match=r"stop_token_ids must be a sequence of token ids, got 5; wrap one id as "
                                         r"stop_token_ids=\(5,\)"):
        SamplingParams(stop_token_ids=5)
