"""Review of the weight sync (session 31): a rollout worker never generates from a mix of two weight versions
(an update that failed part way), refuses an update that is not exactly its engine's parameters (a missing tensor
would stay stale under the new version; a dtype cast would not run the trainer's bits), and after a sync holds the
trainer's weights bit for bit (digests equal, tied embeddings included)."""
import pytest
import torch

from rlrepro.model import tiny_model
from rlrepro.model.tiny import write_tiny_checkpoint
from rlrepro.orchestration.weight_sync import WeightsRefused
from rlrepro.orchestration.workers import Request, RolloutWorker
from rlrepro.repro.fingerprint import weights_digest
from rlrepro.rollout import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=64)
REQ = [Request(("p", 0), [1, 5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=5,
                                                                         ignore_eos=True))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(d, seed=0)
    return str(d)


@pytest.fixture(scope="module")
def new_weights():
    return {n: p.detach().clone() for n, p in tiny_model(seed=9, initializer_range=0.3).named_parameters()}


@pytest.fixture(scope="module")
def new_output(new_weights):
    model = tiny_model(seed=9, initializer_range=0.3)
    return Engine.from_config(model, CONFIG, device="cpu", deterministic=True, seed=0).generate(
        [REQ[0].prompt_token_ids], [REQ[0].params])[0]


def _worker(model_dir):
    return RolloutWorker(model_dir, CONFIG, device="cpu", dtype=None, deterministic=True, seed=0)


class _BrokenBroadcast:
    """A collective receive whose peer dies half-way: some tensors written, then the connection fails."""

    def __init__(self, src):
        self.src = src

    def receive(self, params):
        for k, name in enumerate(sorted(params)):
            if k == len(params) // 2:
                raise ConnectionError("gloo: connection reset by peer")
            params[name].copy_(self.src[name])
        return 1


def _digest(worker):
    return weights_digest((n, p.detach()) for n, p in worker.engine.model.named_parameters())


def _same(out, want):
    assert out.token_ids == want.token_ids
    assert torch.equal(torch.tensor(out.logprobs), torch.tensor(want.logprobs))


def test_worker_refuses_to_generate_after_a_half_done_update_until_a_complete_load(model_dir, new_weights,
                                                                                    new_output):
    worker = _worker(model_dir)
    worker.generate(REQ)  # K/V of the old weights in the prefix cache
    worker._sync = _BrokenBroadcast(new_weights)
    with pytest.raises(ConnectionError):
        worker.sync_receive()
    for call in (lambda: worker.generate(REQ), lambda: worker.generate([])):
        with pytest.raises(RuntimeError, match="mix of two versions"):
            call()
    assert worker.load_weights(new_weights, 1) == 1  # a complete load restores it
    out = worker.generate(REQ)[0]
    _same(out, new_output)
    assert out.weight_version == 1 and out.num_cached_tokens == 0
    assert _digest(worker) == weights_digest(new_weights)


def test_a_load_that_fails_while_copying_marks_the_worker_broken(model_dir, new_weights, monkeypatch):
    worker = _worker(model_dir)
    real = worker.engine.load_weights

    def half_then_fail(named, version):
        named = list(named)
        real(named[: len(named) // 2], version)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker.engine, "load_weights", half_then_fail)
    with pytest.raises(RuntimeError, match="illegal memory"):
        worker.load_weights(new_weights, 1)
    with pytest.raises(RuntimeError, match="mix of two versions"):
        worker.generate(REQ)


@pytest.mark.parametrize("how", ["missing", "dtype", "shape", "extra"])
def test_an_update_that_is_not_the_engines_parameters_is_refused_before_any_copy(model_dir, new_weights, how):
    worker = _worker(model_dir)
    before = _digest(worker)
    want = worker.generate(REQ)[0]
    bad = dict(new_weights)
    if how == "missing":
        del bad["model.layers.0.mlp.up_proj.weight"]
    elif how == "dtype":
        bad = {n: t.to(torch.bfloat16) for n, t in bad.items()}
    elif how == "shape":
        bad["model.norm.weight"] = torch.zeros(3)  # sorted last: the old load copied everything before it
    else:
        bad["model.no_such.weight"] = torch.zeros(1)
    with pytest.raises(WeightsRefused, match="weight sync to version 1"):
        worker.load_weights(bad, 1)
    assert _digest(worker) == before and worker.engine.weight_version == 0
    _same(worker.generate(REQ)[0], want)  # still the previous version, whole: it may generate


def test_after_a_load_the_engine_holds_the_trainers_bits_tied_head_included(model_dir, new_weights, new_output):
    worker = _worker(model_dir)
    sent = dict(new_weights, **{"lm_head.weight": new_weights["model.embed_tokens.weight"]})  # tied: skipped
    assert worker.load_weights(sent, 3) == 3
    assert _digest(worker) == weights_digest(new_weights)
    assert "lm_head.weight" not in dict(worker.engine.model.named_parameters())  # the head is the embedding
    _same(worker.generate(REQ)[0], new_output)
