"""Engine review (session 34), as a user coming from vLLM/SGLang:

* a tokenizer's output (a dict or ``BatchEncoding`` of ``input_ids``) or vLLM's ``{"prompt_token_ids": ...}``
  given as prompts was iterated by its keys: the error said "tokenize text first" or "token id 'input_ids' is not
  an integer ... check that the tokenizer matches the model", the wrong fix for tokenized input;
* ``SamplingParams(stop_token_ids=torch.tensor(5))`` (or ``np.array(5)``) failed with a bare TypeError
  "iteration over a 0-d tensor"; stop ids given as a tensor were refused, though prompts take tensors ("as prompts
  do", docs/ENGINE.md);
* ``SamplingConfig.params(seed=..., stop_token_ids=5)`` failed with a bare TypeError instead of SamplingParams'
  "wrap one id" message;
* ``load_weights(version=np.int64(3))`` and a ``receive_weights`` filler returning a numpy integer were refused,
  though every other integer argument of the engine takes numpy integers;
* stop ids outside the vocabulary: the message gave no fix, and docs/ENGINE.md quoted another message.
"""
from collections import UserDict

import numpy as np
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, initializer_range=0.3)


def key(outs):
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


@pytest.mark.parametrize("batch", [
    {"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]},
    UserDict({"input_ids": [[1, 2], [3]]}),  # transformers' BatchEncoding is a UserDict
    {"input_ids": torch.tensor([[1, 2]])},
])
def test_a_tokenizer_output_as_the_prompts_names_input_ids(model, batch):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"^generate\(\) takes a list of prompts.*got a \w+ with keys \['input_ids'"
                                         r".*encoding\['input_ids'\]") as err:
        engine.generate(batch, GREEDY)
    assert "tokenize text first" not in str(err.value)
    assert engine.num_requests == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("prompt, field", [
    ({"input_ids": [1, 2], "attention_mask": [1, 1]}, "input_ids"),
    (UserDict({"input_ids": [1, 2]}), "input_ids"),
    ({"prompt_token_ids": [1, 2]}, "prompt_token_ids"),  # vLLM's TokensPrompt
])
def test_a_dict_as_one_prompt_names_its_token_ids(model, prompt, field):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    fix = rf"prompt\['{field}'\]"
    with pytest.raises(ValueError, match=rf"^request 0: a prompt must be a list of token ids, got a \w+ with keys "
                                         rf"\['{field}'.*{fix}") as err:
        engine.generate([[5, 6], prompt][1:], GREEDY)
    assert "tokenizer matches" not in str(err.value)
    with pytest.raises(ValueError, match=rf"^request 0: a prompt must be .*{fix}"):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=rf"^request 1: a prompt must be .*{fix}"):
        engine.generate([[5, 6], prompt], GREEDY)
    assert engine.num_requests == 0 and not engine.has_unfinished()
    # the fix the message gives works
    assert key(engine.generate([prompt[field]], GREEDY)) == key(engine.generate([[1, 2]], GREEDY))


@pytest.mark.parametrize("one", [torch.tensor(5), np.array(5)])
def test_a_0d_tensor_or_array_of_stop_ids_says_how_to_wrap_it(one):
    with pytest.raises(ValueError, match=r"^SamplingParams.stop_token_ids must be a sequence of token ids, got .*; "
                                         r"wrap one id as stop_token_ids=\(5,\)"):
        SamplingParams(stop_token_ids=one)


@pytest.mark.parametrize("stops", [torch.tensor([5, 6]), [torch.tensor(5), torch.tensor(6)], np.array([5, 6]),
                                   [np.array(5), 6]])
def test_stop_ids_take_integer_tensors_as_prompts_do(model, stops):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, stop_token_ids=stops)
    assert params.stop_token_ids == (5, 6) and all(type(t) is int for t in params.stop_token_ids)
    assert params == SamplingParams(temperature=1.0, max_tokens=8, seed=3, stop_token_ids=(5, 6))
    assert hash(params) == hash(SamplingParams(temperature=1.0, max_tokens=8, seed=3, stop_token_ids=(5, 6)))


@pytest.mark.parametrize("bad", [torch.tensor(True), torch.tensor(5.0), torch.tensor([True, False]),
                                 torch.tensor([5.0]), np.array(True), torch.tensor([[5]])])
def test_stop_ids_still_refuse_bool_float_and_nested_tensors(bad):
    with pytest.raises(ValueError, match=r"^SamplingParams.stop_token_ids must"):
        SamplingParams(stop_token_ids=bad)


def test_sampling_config_params_with_one_stop_id_names_the_fix():
    with pytest.raises(ValueError, match=r"wrap one id as stop_token_ids=\(5,\)"):
        SamplingConfig().params(seed=1, stop_token_ids=5)
    assert SamplingConfig().params(seed=1, stop_token_ids=[5, np.int64(6)]).stop_token_ids == (5, 6)


def test_weight_versions_take_numpy_integers(model):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    engine.load_weights({}, version=np.int64(3))
    assert engine.weight_version == 3 and type(engine.weight_version) is int
    out = engine.generate([[1, 2]], GREEDY)[0]
    assert out.weight_version == 3 and type(out.weight_version) is int
    assert engine.receive_weights(lambda params: np.int32(4)) == 4 and type(engine.weight_version) is int
    for bad in (True, np.bool_(True), 3.0):
        with pytest.raises(ValueError, match="load_weights version must be an integer"):
            engine.load_weights({}, version=bad)
    assert engine.weight_version == 4


def test_stop_ids_outside_the_vocabulary_name_the_fix(model):
    engine = Engine(model, block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"^request 0: stop_token_ids \[60, 99\] lie outside the vocabulary "
                                         r"\[0, 60\).*remove them"):
        engine.generate([[1, 2]], SamplingParams(stop_token_ids=(3, 60, 99), max_tokens=3))
    assert engine.num_requests == 0
