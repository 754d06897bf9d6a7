"""Engine leftovers: max_model_len past the model's positions, numpy stop ids, a batch given to add_request, and
the CUDA current device of an engine on another card."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, initializer_range=0.3)  # max_position_embeddings 1024, vocabulary 60


def _outs(engine, prompts, params):
    return [(o.token_ids, o.logprobs, o.finish_reason, o.seed, o.request_id) for o in engine.generate(prompts, params)]


# ---- 1. max_model_len above max_position_embeddings ------------------------------------------------------------
def test_max_model_len_past_the_models_positions_is_refused_before_any_work():
    model = tiny_model(seed=5, initializer_range=0.3)
    with pytest.raises(ValueError) as err:
        Engine(model, max_model_len=1025, num_kv_blocks=8, fuse_projections=True)
    assert str(err.value) == (
        "Engine max_model_len=1025 exceeds the model config's max_position_embeddings=1024: the model was not built "
        "for positions past 1024 and rlrepro has no RoPE scaling to stretch it; lower max_model_len "
        "(rollout.max_model_len) to at most 1024, or leave it None for the model's own length")
    assert model.model.layers[0].self_attn.qkv is None  # refused before the engine touched the model (no fusing)
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds .* max_position_embeddings=1024"):
        Engine.from_config(model, EngineConfig(max_model_len=4096, num_kv_blocks=8))
    assert Engine(model, max_model_len=1024, num_kv_blocks=8).max_model_len == 1024  # the limit itself is fine


# ---- 2. numpy integer stop ids ---------------------------------------------------------------------------------
@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint16])
def test_numpy_integer_stop_ids_are_python_ints(np_int):
    plain, numpy = SamplingParams(stop_token_ids=[7, 9]), SamplingParams(stop_token_ids=[np_int(7), np_int(9)])
    assert numpy == plain and hash(numpy) == hash(plain)
    assert [type(t) for t in numpy.stop_token_ids] == [int, int]
    assert json.dumps(dataclasses.asdict(numpy)) == json.dumps(dataclasses.asdict(plain))  # records the same


@pytest.mark.parametrize("bad", [np.bool_(True), True, np.float64(7.0), 7.0, np.int64(-1)])
def test_stop_ids_still_refuse_bools_floats_and_negatives(bad):
    with pytest.raises(ValueError, match=r"stop_token_ids must hold non-negative integer token ids; bad entries"):
        SamplingParams(stop_token_ids=[3, bad])


def test_numpy_stop_id_stops_a_request_as_the_int_does(model):
    prompt = [1, 5, 6, 7, 8, 9]
    free = Engine(model, block_size=4, num_kv_blocks=32).generate([prompt], SamplingParams(temperature=0.0,
                                                                                            max_tokens=12))[0]
    tokens = free.token_ids
    stop = next(t for i, t in enumerate(tokens) if i >= 1 and t not in tokens[:i])  # first seen after token 0
    outs = {}
    for name, stop_id in (("int", stop), ("numpy", np.int64(stop))):
        p = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
        outs[name] = _outs(Engine(model, block_size=4, num_kv_blocks=32), [prompt], p)
    assert outs["numpy"] == outs["int"]
    token_ids, _, reason, _, _ = outs["int"][0]
    assert reason == "stop" and token_ids == tokens[: tokens.index(stop) + 1] != tokens  # the stop id did stop it


# ---- 3. a batch passed to add_request --------------------------------------------------------------------------
BATCH_WORDS = (r"^add_request takes one prompt, a flat list of token ids, but got {} \(a batch of prompts\?\); "
               r"queue several prompts with one add_request call each, or run them all at once with "
               r"generate\(\[prompt, \.\.\.\]\)$")


@pytest.mark.parametrize("batch, got", [
    ([[1, 2, 3]], "a list holding lists"),
    (([1, 2], [3]), "a tuple holding lists"),
    ([torch.tensor([1, 2])], "a list holding Tensors"),
    (torch.tensor([[1, 2, 3]]), "a 2-D Tensor"),
    (np.array([[1, 2, 3]]), "a 2-D ndarray"),
])
def test_add_request_with_a_batch_says_how_to_submit_several(model, batch, got):
    engine = Engine(model, block_size=4, num_kv_blocks=16, max_model_len=32)
    p = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match=BATCH_WORDS.format(got)):
        engine.add_request(batch, p)
    assert engine.num_requests == 0 and not engine.has_unfinished()  # nothing was queued
    ids = [engine.add_request([1, 2, 3], p), engine.add_request(iter([np.int64(4), 5]), p),
           engine.add_request(torch.tensor([6, 7]), p), engine.add_request([torch.tensor(8)], p)]
    assert ids == [0, 1, 2, 3]
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [(o.request_id, o.prompt_token_ids) for o in done] == [(0, [1, 2, 3]), (1, [4, 5]), (2, [6, 7]), (3, [8])]


@pytest.mark.parametrize("token", [torch.tensor(True), np.bool_(True), torch.tensor([True])[0]])
def test_a_bool_tensor_is_no_token_id(model, token):
    # operator.index(torch.tensor(True)) is 1: the prompt [True] ran as token 1
    engine = Engine(model, block_size=4, num_kv_blocks=16, max_model_len=32)
    with pytest.raises(ValueError, match=r"request 0: token id .*True.* is not an integer in \[0, 60\)"):
        engine.add_request([3, token], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.num_requests == 0


# ---- 4. the engine's card is the current CUDA device while it works -------------------------------------------
class _DeviceGuard:
    """Stands in for ``torch.cuda.device`` on a CPU machine: records which device is current."""
    current: list = []
    entered: list = []

    def __init__(self, device) -> None:
        self.device = torch.device(device)

    def __enter__(self) -> None:
        _DeviceGuard.current.append(self.device)
        _DeviceGuard.entered.append(self.device)

    def __exit__(self, *exc) -> None:
        _DeviceGuard.current.pop()


@pytest.fixture
def device_guard(monkeypatch):
    _DeviceGuard.current, _DeviceGuard.entered = [], []
    monkeypatch.setattr(torch.cuda, "device", _DeviceGuard)
    return _DeviceGuard


def _watch(engine, seen: list) -> None:
    """Record the current (fake) CUDA device at each launch and each read-back of a step's tokens."""
    launch = engine.runner.launch

    def watched_launch(scheduled):
        seen.append(("launch", list(_DeviceGuard.current)))
        step = launch(scheduled)
        result = step.result
        step.result = lambda: (seen.append(("result", list(_DeviceGuard.current))), result())[1]
        return step

    engine.runner.launch = watched_launch


def test_generate_and_step_run_on_the_engines_card(model, device_guard):
    # An engine on cuda:1 while cuda:0 is current: Triton launches, graph capture and the read-back event follow
    # the current device, so generate() and step() must make the engine's card current. Exercised on the CPU by
    # giving a CPU engine the device cuda:1 after construction (its tensors stay on the CPU) and a fake guard.
    prompts, p = [[1, 5, 6, 7], [3, 4]], SamplingParams(temperature=1.0, max_tokens=5, seed=3)
    expected = _outs(Engine(model, block_size=4, num_kv_blocks=32), prompts, p)
    assert device_guard.entered == []  # a CPU engine enters no CUDA device
    engine = Engine(model, block_size=4, num_kv_blocks=32)
    engine.device = torch.device("cuda", 1)
    seen: list = []
    _watch(engine, seen)
    assert _outs(engine, prompts, p) == expected
    ids = [engine.add_request(q, p) for q in prompts]
    stepped = []
    while engine.has_unfinished():
        stepped += engine.step()
    assert [o.request_id for o in stepped] == ids
    assert {what for what, _ in seen} == {"launch", "result"}
    assert all(current == [torch.device("cuda", 1)] for _, current in seen), seen
    assert device_guard.current == []  # left again after each call


def test_cpu_engine_work_enters_no_cuda_device(model, device_guard):
    engine = Engine(model, block_size=4, num_kv_blocks=32)
    seen: list = []
    _watch(engine, seen)
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))
    assert seen and all(current == [] for _, current in seen) and device_guard.entered == []
