"""Engine: logprobs equal a full-sequence forward bit for bit, outputs independent of the scheduling
configuration, seeded sampling, top-k/top-p, finish reasons, input errors, weight updates."""
import pytest
import torch

from rlrepro import kernels
from rlrepro.model import tiny_model, write_tiny_checkpoint
from rlrepro.rollout import Engine, SamplingParams, derive_seed
from rlrepro.rollout.sampler import gumbel_noise, keep_mask


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, initializer_range=0.3)


@pytest.fixture(scope="module")
def flat_model():
    return tiny_model(seed=6)  # the default 0.02 init: near-uniform logits, so sampling is very random


PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5], [7] * 21, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
           [42], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
MIXED_PARAMS = [SamplingParams(temperature=0.0, max_tokens=12),
                SamplingParams(temperature=1.0, max_tokens=16, seed=11),
                SamplingParams(temperature=0.7, top_k=5, max_tokens=9, seed=12),
                SamplingParams(temperature=1.3, top_p=0.8, max_tokens=14, seed=13),
                SamplingParams(temperature=1.0, top_k=8, top_p=0.9, max_tokens=16, seed=14),
                SamplingParams(temperature=0.0, max_tokens=15)]


def key(outs):
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


def full_forward_check(model, prompt, out, params):
    """The engine's numbers from one full-sequence forward of prompt + completion (the trainer's view)."""
    seq = prompt + out.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0, len(prompt) - 1:-1]
    completion = torch.tensor(out.token_ids)
    want = kernels.token_logprob(logits, completion, params.temperature)
    assert torch.equal(torch.tensor(out.logprobs, dtype=torch.float32), want)
    if params.temperature == 0:
        assert torch.equal(torch.argmax(logits.float(), -1), completion)
        return
    # the sampled tokens are the Gumbel-max draw from these very logits
    scaled = logits.float() / params.temperature
    positions = torch.arange(len(prompt), len(seq))
    scores = scaled.double() + gumbel_noise(torch.full_like(positions, out.seed), positions, logits.shape[-1])
    for j in range(len(out.token_ids)):
        if params.top_k > 0 or params.top_p < 1:
            scores[j].masked_fill_(~keep_mask(scaled[j], params.top_k, params.top_p), float("-inf"))
    assert torch.equal(torch.argmax(scores, -1), completion)


def test_logprobs_equal_a_full_sequence_forward(model):
    engine = Engine(model, max_num_batched_tokens=7, block_size=4, num_kv_blocks=64, max_num_seqs=4)
    outs = engine.generate(PROMPTS, MIXED_PARAMS)
    for prompt, out, params in zip(PROMPTS, outs, MIXED_PARAMS):
        assert len(out.token_ids) == len(out.logprobs) >= 1
        assert all(isinstance(x, float) for x in out.logprobs)
        full_forward_check(model, prompt, out, params)


CONFIGS = {
    "one_seq": dict(max_num_seqs=1),
    "three_seqs": dict(max_num_seqs=3),
    "budget_7": dict(max_num_batched_tokens=7),
    "budget_13": dict(max_num_batched_tokens=13),
    "budget_1": dict(max_num_batched_tokens=1, max_num_seqs=2),
    "no_prefix_cache": dict(enable_prefix_cache=False),
    "block_16": dict(block_size=16, num_kv_blocks=100),
    "preempt": dict(num_kv_blocks=9, max_num_batched_tokens=13),
    "preempt_no_cache": dict(num_kv_blocks=9, enable_prefix_cache=False, max_num_seqs=5),
}


def test_outputs_do_not_depend_on_the_scheduling_configuration(model):
    base = dict(max_num_seqs=64, max_num_batched_tokens=4096, enable_prefix_cache=True, block_size=4,
                num_kv_blocks=200)
    reference = key(Engine(model, **base).generate(PROMPTS, MIXED_PARAMS))
    for name, overrides in CONFIGS.items():
        engine = Engine(model, **{**base, **overrides})
        assert key(engine.generate(PROMPTS, MIXED_PARAMS)) == reference, name
        if name.startswith("preempt"):
            assert engine.stats["num_preemptions"] > 0, name
    warm = Engine(model, **base)  # a warm prefix cache: the same requests again hit their own prefixes
    warm.generate(PROMPTS, MIXED_PARAMS)
    hits = warm.stats["num_prefix_hit_blocks"]
    assert key(warm.generate(PROMPTS, MIXED_PARAMS)) == reference
    assert warm.stats["num_prefix_hit_blocks"] > hits


def test_order_of_requests_does_not_matter(model):
    engine = Engine(model, block_size=4, num_kv_blocks=200)
    ref = key(engine.generate(PROMPTS, MIXED_PARAMS))
    order = [3, 0, 5, 1, 4, 2]
    outs = engine.generate([PROMPTS[i] for i in order], [MIXED_PARAMS[i] for i in order])
    assert key(outs) == [ref[i] for i in order]


def test_seeded_sampling_is_reproducible_and_seeds_differ(flat_model):
    prompt = [[4, 8, 15, 16, 23, 42]]
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in range(8)]
    a = Engine(flat_model, block_size=4, num_kv_blocks=64)
    b = Engine(flat_model, block_size=4, num_kv_blocks=64, seed=99, max_num_seqs=2)
    outs_a = a.generate(prompt * 8, params)
    assert key(outs_a) == key(b.generate(prompt * 8, params)) == key(a.generate(prompt * 8, params))
    assert len({tuple(o.token_ids) for o in outs_a}) == 8
    assert [o.seed for o in outs_a] == list(range(8))


def test_unseeded_requests_derive_their_seed_from_the_engine_seed(flat_model):
    prompt = [[4, 8, 15, 16, 23, 42]]
    p = SamplingParams(temperature=1.0, max_tokens=12)
    first = Engine(flat_model, seed=7, block_size=4, num_kv_blocks=64)
    o1 = first.generate(prompt * 3, p)
    o2 = first.generate(prompt, p)
    assert [o.seed for o in o1 + o2] == [derive_seed(7, i) for i in range(4)]
    assert len({tuple(o.token_ids) for o in o1 + o2}) == 4  # later calls do not repeat earlier samples
    again = Engine(flat_model, seed=7, block_size=4, num_kv_blocks=64, max_num_seqs=1)
    assert key(again.generate(prompt * 3, p) + again.generate(prompt, p)) == key(o1 + o2)
    other = Engine(flat_model, seed=8, block_size=4, num_kv_blocks=64)
    assert key(other.generate(prompt * 3, p)) != key(o1)
    explicit = SamplingParams(temperature=1.0, max_tokens=12, seed=derive_seed(7, 1))
    assert key(other.generate(prompt, explicit)) == key(o1[1:2])


def test_top_k_and_top_p_are_respected(flat_model):
    engine = Engine(flat_model, block_size=4, num_kv_blocks=256)
    prompt = [5, 6, 7]
    for top_k, top_p in [(1, 1.0), (3, 1.0), (-1, 0.1), (10, 0.3)]:
        params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=12, seed=s)
                  for s in range(6)]
        for out, sp in zip(engine.generate([prompt] * 6, params), params):
            full_forward_check(flat_model, prompt, out, sp)
            with torch.no_grad():
                logits = flat_model(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1:-1].float()
            for j, tok in enumerate(out.token_ids):  # an independent check of the kept set
                probs = torch.softmax(logits[j].double(), -1)
                rank = sorted(range(len(probs)), key=lambda v: (-float(logits[j, v]), v)).index(tok)
                if top_k > 0:
                    assert rank < top_k
                if top_p < 1:
                    top = probs if top_k < 0 else torch.where(
                        logits[j] >= torch.sort(logits[j], descending=True).values[top_k - 1], probs, 0.0)
                    mass_before = float(top[logits[j] > logits[j, tok]].sum()) / float(top.sum())
                    assert mass_before < top_p + 1e-6


def test_stop_tokens_and_eos(model):
    prompt = [9, 8, 7, 6]
    engine = Engine(model, block_size=4, num_kv_blocks=64)
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.token_ids[5]
    cut = free.token_ids.index(stop) + 1
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:cut]
    assert out.logprobs == free.logprobs[:cut]
    eos_model = tiny_model(seed=5, initializer_range=0.3, eos_token_id=stop)
    eos_engine = Engine(eos_model, block_size=4, num_kv_blocks=64)
    out = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:cut]
    out = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert key([out]) == key([free])


BAD_PARAMS = [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e-9), "greedy"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"), (dict(seed=1.0), "seed"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize("kwargs,needle", BAD_PARAMS)
def test_invalid_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_inputs_raise_before_any_work_and_leave_the_engine_usable(model):
    engine = Engine(model, block_size=4, num_kv_blocks=8, max_model_len=40)
    p = SamplingParams(temperature=0.0, max_tokens=4)
    good = key(engine.generate([[1, 2, 3]], p))
    state = (engine.num_requests, engine.stats["num_steps"])
    cases = [
        (([[1, 2, 3], []], p), r"request 1: the prompt is empty"),
        (([[1, 2, 3], [1, 999]], p), r"request 1: token id 999 is not an integer in \[0, 60\)"),
        (([[1, -1]], p), r"request 0: token id -1"),
        (([[1, 2.0]], p), r"request 0: token id 2.0"),
        (([[1, True]], p), r"request 0: token id True"),
        (([[1, 2, 3]], SamplingParams(max_tokens=4, stop_token_ids=[60])), r"request 0: stop_token_ids \[60\]"),
        (([[1] * 40], p), r"request 0: the prompt has 40 tokens .* max_model_len=40"),
        (([[1] * 30], SamplingParams(max_tokens=20)), r"request 0: prompt \(30 tokens\) \+ max_tokens \(20\).*at most 10"),
        (([[1] * 30], SamplingParams(max_tokens=10)), r"request 0: .*needs 10 KV blocks .* cache has 8"),
        (([1, 2, 3], p), r"flat list of ints: wrap it as \[prompt\]"),
        ((torch.tensor([1, 2, 3]), p), r"one 1-D Tensor: wrap it as \[prompt\]"),
        (([torch.tensor(1), torch.tensor(2)], p), r"flat list of ints: wrap it as \[prompt\]"),
        (("hello", p), r"list of prompts"),
        (([[1, 2], [3]], [p]), r"got 1 SamplingParams for 2 prompts"),
        (([[1, 2]], [dict(max_tokens=3)]), r"request 0: sampling params must be a SamplingParams"),
        (([["a", "b"]], p), r"request 0: token id 'a'"),
    ]
    for (prompts, params), needle in cases:
        with pytest.raises(ValueError, match=needle):
            engine.generate(prompts, params)
        assert (engine.num_requests, engine.stats["num_steps"]) == state  # nothing ran, nothing was counted
        engine.block_manager.check_consistency()
        assert engine.block_manager.num_free_blocks == 8
    assert engine.generate([], p) == []
    assert key(engine.generate([[1, 2, 3]], p)) == good
    assert key(engine.generate([torch.tensor([1, 2, 3])], p)) == good  # tensors and numpy ints are fine


def test_bad_engine_arguments(model):
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(model, max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size"):
        Engine(model, block_size=-4)
    with pytest.raises(ValueError, match="the model is on cpu but device='cuda'"):
        Engine(model, device="cuda")
    with pytest.raises(ValueError, match="dtype=None"):
        Engine(model, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="holds no block"):
        Engine(model, kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM or a model directory"):
        Engine(object())


def test_kv_cache_sizing(model):
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, block 4, 2 KV heads, head_dim 16, fp32
    assert Engine(model, block_size=4, kv_cache_memory_bytes=per_block * 10 + 5).num_kv_blocks == 10
    assert Engine(model, block_size=4, num_kv_blocks=3).runner.kv_caches[0][0].shape == (4, 4, 2, 16)
    default = Engine(model, block_size=4, max_num_seqs=2, max_model_len=64)
    assert default.num_kv_blocks == 2 * 16  # enough for max_num_seqs full-length sequences
    # both sizes given: refused, naming both (num_kv_blocks silently won before)
    with pytest.raises(ValueError, match=r"num_kv_blocks=3 and kv_cache_memory_bytes=\d+ both .*pass one of them"):
        Engine(model, block_size=4, num_kv_blocks=3, kv_cache_memory_bytes=per_block * 10)


def test_error_mid_generation_leaves_the_engine_usable(model, monkeypatch):
    engine = Engine(model, block_size=4, num_kv_blocks=64)
    p = SamplingParams(temperature=0.0, max_tokens=6)
    good = key(engine.generate([[1, 2, 3], [4, 5]], p))
    calls = {"n": 0}
    real = engine.runner.launch

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3], [4, 5]], p)
    monkeypatch.setattr(engine.runner, "launch", real)
    assert engine.block_manager.num_free_blocks == 64 and not engine.scheduler.has_unfinished()
    assert engine.scheduler.num_pending == 0
    assert key(engine.generate([[1, 2, 3], [4, 5]], p)) == good


def test_load_weights_changes_outputs_and_resets_the_prefix_cache():
    a, b = tiny_model(seed=1, initializer_range=0.3), tiny_model(seed=2, initializer_range=0.3)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [3, 1, 4, 1, 5, 9, 2, 6, 8]]
    p = SamplingParams(temperature=0.8, max_tokens=10, seed=3)
    ref_a = key(Engine(a, block_size=4, num_kv_blocks=64).generate(prompts, p))
    ref_b = key(Engine(b, block_size=4, num_kv_blocks=64).generate(prompts, p))
    assert ref_a != ref_b
    engine = Engine(tiny_model(seed=1, initializer_range=0.3), block_size=4, num_kv_blocks=64)
    assert key(engine.generate(prompts, p)) == ref_a
    assert engine.block_manager.num_cached_blocks > 0 and engine.weight_version == 0
    engine.load_weights(b.named_parameters(), version=1)
    assert engine.weight_version == 1 and engine.block_manager.num_cached_blocks == 0
    outs = engine.generate(prompts, p)
    assert key(outs) == ref_b  # a stale cache hit would have mixed a's K/V into b's outputs
    assert all(o.weight_version == 1 for o in outs)
    engine.load_weights(((k, v.to(torch.bfloat16).float()) for k, v in a.state_dict().items()), version=2)
    engine.load_weights(a.state_dict().items(), version=3)  # a generator or items(); bf16 round trip undone
    assert key(engine.generate(prompts, p)) == ref_a
    with pytest.raises(ValueError, match="no parameter 'nope.weight'"):
        engine.load_weights([("nope.weight", torch.zeros(1))], version=4)
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))], version=4)
    assert engine.weight_version == 3
    engine.reset_prefix_cache()
    assert engine.block_manager.num_cached_blocks == 0


def test_engine_from_a_checkpoint_path_matches_the_model_object(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "tiny", seed=4)
    prompts = [[5, 6, 7, 8], [9, 10]]
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=1)
    from_path = Engine(str(path), block_size=4, num_kv_blocks=32)
    from_model = Engine(tiny_model(seed=4), block_size=4, num_kv_blocks=32)
    assert key(from_path.generate(prompts, p)) == key(from_model.generate(prompts, p))
    assert from_path.max_model_len == 1024 and from_path.eos_token_ids == (2,)


def test_fast_mode_runs_and_stays_close(model):
    p = SamplingParams(temperature=0.0, max_tokens=8)
    det = Engine(model, block_size=4, num_kv_blocks=64).generate(PROMPTS[:3], p)
    fast_engine = Engine(model, deterministic=False, block_size=4, num_kv_blocks=64, max_num_batched_tokens=5)
    fast = fast_engine.generate(PROMPTS[:3], p)
    assert kernels.current_mode() == "deterministic"  # the mode is restored after generate
    for d, f in zip(det, fast):
        assert len(f.token_ids) == 8
        if f.token_ids == d.token_ids:
            assert torch.allclose(torch.tensor(f.logprobs), torch.tensor(d.logprobs), atol=1e-4)


def test_add_request_and_step_give_generates_outputs_whenever_requests_arrive(model):
    """Requests added one at a time while others run (arrival at different steps, different batches) give the
    outputs of one generate() of them all: tokens, logprobs, finish reasons, seeds, ids."""
    want = Engine(model, max_num_batched_tokens=7, block_size=4, num_kv_blocks=64,
                  max_num_seqs=3).generate(PROMPTS, MIXED_PARAMS)
    engine = Engine(model, max_num_batched_tokens=7, block_size=4, num_kv_blocks=64, max_num_seqs=3)
    got, ids, steps = {}, [], 0
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]}  # step -> requests added before it
    while len(got) < len(PROMPTS):
        for i in arrivals.get(steps, []):
            ids.append(engine.add_request(PROMPTS[i], MIXED_PARAMS[i]))
        for out in engine.step():
            assert out.request_id not in got
            got[out.request_id] = out
        steps += 1
        assert steps < 500
    assert not engine.has_unfinished() and ids == list(range(len(PROMPTS)))
    for w in want:
        g = got[w.request_id]
        assert (g.token_ids, g.logprobs, g.finish_reason, g.seed) == (w.token_ids, w.logprobs, w.finish_reason,
                                                                      w.seed)
    assert [w.request_id for w in want] == list(range(len(PROMPTS)))
    # generate() keeps working afterwards, and the ids go on counting
    again = engine.generate(PROMPTS[:1], MIXED_PARAMS[:1])
    assert again[0].request_id == len(PROMPTS) and again[0].token_ids == want[0].token_ids


def test_add_request_errors_and_generate_while_requests_are_in_flight(model):
    engine = Engine(model, num_kv_blocks=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="request 0: the prompt is empty"):
        engine.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="one SamplingParams"):
        engine.add_request([1, 2], [SamplingParams()])
    assert not engine.has_unfinished() and engine.step() == []
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="call step"):
        engine.generate([[4, 5]], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="load_weights while requests are unfinished"):
        engine.load_weights(model.named_parameters(), version=1)
    assert engine.weight_version == 0
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 3
    assert engine.generate([[4, 5]], SamplingParams(max_tokens=2))[0].request_id == rid + 1


def test_error_in_step_aborts_the_added_requests_and_leaves_the_engine_usable(model, monkeypatch):
    engine = Engine(model, block_size=4, num_kv_blocks=64)
    p = SamplingParams(temperature=0.0, max_tokens=6)
    good = key(engine.generate([[1, 2, 3], [4, 5]], p))
    real = engine.runner.launch
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(scheduled)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    engine.add_request([1, 2, 3], p)
    engine.add_request([4, 5], p)
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(10):
            engine.step()
    monkeypatch.setattr(engine.runner, "launch", real)
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 64
    assert engine.step() == []
    assert key(engine.generate([[1, 2, 3], [4, 5]], p)) == good


def test_abort_stops_one_request_and_changes_no_other(model):
    """abort(): the request comes back from the next step() with finish_reason "abort" and a prefix of the tokens
    generate() gives it (waiting: none; running: those it had, plus one in flight); the others are unchanged, the
    KV blocks all free at the end."""
    prompts = PROMPTS[:5]
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=40 + i) for i in range(5)]
    want = Engine(model, block_size=4, num_kv_blocks=64, max_num_seqs=2).generate(prompts, params)
    engine = Engine(model, block_size=4, num_kv_blocks=64, max_num_seqs=2)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    got = {}
    for n in range(400):
        if n == 3:
            engine.abort(ids[0])  # running, a token in flight
            engine.abort(ids[4])  # still waiting (max_num_seqs=2)
            engine.abort(ids[4])  # a second abort is a no-op
        for out in engine.step():
            got[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert sorted(got) == ids and engine.block_manager.num_free_blocks == 64
    assert got[ids[0]].finish_reason == "abort" and 0 < len(got[ids[0]].token_ids) < len(want[0].token_ids)
    assert got[ids[0]].token_ids == want[0].token_ids[:len(got[ids[0]].token_ids)]
    assert got[ids[0]].logprobs == want[0].logprobs[:len(got[ids[0]].token_ids)]
    assert got[ids[4]].finish_reason == "abort" and got[ids[4]].token_ids == []
    for i in (1, 2, 3):
        assert key([got[ids[i]]]) == key([want[i]])
    with pytest.raises(ValueError, match="not an unfinished request"):
        engine.abort(ids[1])
    with pytest.raises(ValueError, match="not an unfinished request"):
        engine.abort(12345)


def test_abort_the_only_request_before_it_runs(model):
    engine = Engine(model, block_size=4, num_kv_blocks=64)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    engine.abort(rid)
    assert engine.has_unfinished()  # its output is still to be returned
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [(rid, "abort", [])]
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 64


def test_receive_weights_fills_in_place_with_the_unfinished_requests_guard():
    """The collective weight-sync path writes parameters through Engine.receive_weights: the same guard as
    load_weights, the version set, the prefix cache dropped, and the same outputs as the new model's own."""
    a, b = tiny_model(seed=1, initializer_range=0.3), tiny_model(seed=2, initializer_range=0.3)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [3, 1, 4, 1, 5, 9, 2, 6, 8]]
    p = SamplingParams(temperature=0.8, max_tokens=10, seed=3)
    ref_b = key(Engine(b, block_size=4, num_kv_blocks=64).generate(prompts, p))
    engine = Engine(a, block_size=4, num_kv_blocks=64)
    engine.generate(prompts, p)
    assert engine.block_manager.num_cached_blocks > 0
    source = dict(b.named_parameters())

    def fill(params):
        for name, t in params.items():
            t.copy_(source[name])
        return 7

    rid = engine.add_request(prompts[0], p)
    with pytest.raises(RuntimeError, match="receive_weights while requests are unfinished"):
        engine.receive_weights(fill)
    engine.abort(rid)
    engine.step()
    assert engine.receive_weights(fill) == 7
    assert engine.weight_version == 7 and engine.block_manager.num_cached_blocks == 0
    assert key(engine.generate(prompts, p)) == ref_b
    with pytest.raises(ValueError, match="not an integer"):
        engine.receive_weights(lambda params: None)


def test_engine_from_config_takes_the_rollout_keys():
    from rlrepro.rollout import EngineConfig

    model = tiny_model(seed=1)
    engine = Engine.from_config(model, EngineConfig(max_num_seqs=3, prefix_cache=False, block_size=4,
                                                    num_kv_blocks=40, max_num_batched_tokens=64), seed=5)
    assert (engine.max_num_seqs, engine.enable_prefix_cache, engine.block_size, engine.num_kv_blocks,
            engine.max_num_batched_tokens, engine.seed) == (3, False, 4, 40, 64, 5)
    p = SamplingParams(temperature=0.8, max_tokens=6, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    assert key(engine.generate(prompts, p)) == key(Engine(model, num_kv_blocks=64).generate(prompts, p))
