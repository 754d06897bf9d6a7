"""The engine on CUDA: graph-replayed decode equals eager decode bit for bit, logprobs equal the full-sequence
forward, and a request's output does not depend on its batch (run by scripts/gpu_check.sh on the H200)."""
import random
import warnings

import pytest
import torch

from rlrepro import kernels
from rlrepro.model import tiny_model
from rlrepro.rollout import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = [SamplingParams(temperature=0.0, max_tokens=20), SamplingParams(temperature=1.0, max_tokens=24, seed=1),
          SamplingParams(temperature=0.7, top_k=10, top_p=0.9, max_tokens=17, seed=2)]


def key(outs):
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


def workload(n, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(60) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    return prompts, [PARAMS[i % len(PARAMS)] for i in range(n)]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):
    return tiny_model(seed=7, dtype=request.param, initializer_range=0.3).cuda()


def test_inference_forward_equals_training_forward(model):
    """On CUDA the no-grad forward fuses each residual add into the following norm (one Triton pass); with
    autograd it runs the add and the norm apart. The engine samples with the first, the trainer trains with the
    second: they must give the same bits."""
    from rlrepro.kernels import AttentionMetadata
    ids = torch.randint(0, model.config.vocab_size, (300,), device="cuda")
    meta = AttentionMetadata.packed([120, 1, 179], device="cuda")
    with torch.no_grad():
        fused = model.forward_tokens(ids, meta)
    with torch.enable_grad():
        plain = model.forward_tokens(ids, meta)  # the plain path: chosen by grad mode, not by requires_grad
    assert torch.equal(fused, plain.detach())


def test_graph_decode_equals_eager_decode(model):
    prompts, params = workload(37)
    eager = Engine(model, device="cuda", enable_cuda_graphs=False, max_num_seqs=48, num_kv_blocks=512)
    ref = key(eager.generate(prompts, params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture must not pass silently here
        graphed = Engine(model, device="cuda", max_num_seqs=48, num_kv_blocks=512)
    assert sorted(graphed.runner.graphs) == [1, 2, 4, 8, 16, 32, 48]
    for n in (1, 3, 8, 37):  # replays at several padded sizes
        assert key(graphed.generate(prompts[:n], params[:n])) == ref[:n]
    assert graphed.stats["num_graph_steps"] > 0


def test_graphs_keep_their_rope_table_when_the_model_grows_another(model):
    """The captured graphs gather cos/sin from the model's rope table as it was at capture. A longer forward
    elsewhere (another engine, the trainer) replaces the model's table; the old one must stay alive for the graphs,
    not go back to the allocator to be overwritten."""
    prompts, params = workload(5, seed=3)
    graphed = Engine(model, device="cuda", max_num_seqs=8, num_kv_blocks=64, max_model_len=128)
    ref = key(graphed.generate(prompts, params))
    old_cos = model._rope[0]
    shape, dtype = old_cos.shape, old_cos.dtype
    del old_cos
    model.rope(torch.zeros(1, dtype=torch.int64, device="cuda"), max_len=shape[0] * 4)  # a new, longer table
    junk = [torch.full(shape, 1e3, dtype=dtype, device="cuda") for _ in range(8)]  # reuse any freed block
    assert key(graphed.generate(prompts, params)) == ref
    assert graphed.stats["num_graph_steps"] > 0
    del junk


def test_logprobs_equal_the_full_forward_on_cuda(model):
    prompts, params = workload(12, seed=1)
    engine = Engine(model, device="cuda", max_num_batched_tokens=29, num_kv_blocks=512, max_num_seqs=16)
    assert model.model.layers[0].self_attn.qkv is not None  # the engine fused q/k/v and gate/up on CUDA
    for prompt, out, p in zip(prompts, engine.generate(prompts, params), params):
        # with gradients on, the model runs one product per projection, as the trainer does: the engine's fused
        # products must give the same bits
        logits = model(torch.tensor([prompt + out.token_ids], device="cuda"))[0, len(prompt) - 1:-1].detach()
        want = kernels.token_logprob(logits, torch.tensor(out.token_ids, device="cuda"), p.temperature)
        assert torch.equal(torch.tensor(out.logprobs, dtype=torch.float32, device="cuda"), want)


def test_single_prompt_any_batch_size_on_cuda(model):
    rng = random.Random(3)
    prompt = [rng.randrange(60) for _ in range(23)]
    seen = set()
    for trial in range(20):
        engine = Engine(model, device="cuda", max_num_seqs=rng.choice([4, 16, 64]),
                        max_num_batched_tokens=rng.choice([7, 64, 4096]), num_kv_blocks=rng.choice([12, 400]),
                        enable_prefix_cache=rng.random() < 0.5)
        outs = engine.generate([prompt] * (1 + 3 * trial), PARAMS[1])
        seen.update(tuple(map(tuple, k[:2])) for k in key(outs))
    assert len(seen) == 1


def test_fast_mode_runs_on_cuda_with_graphs(model):
    """Fast mode (cuBLAS GEMMs, paged Triton attention) decodes through CUDA graphs, so the benchmark's
    deterministic-vs-fast ratio compares kernels, not graphs against eager launches."""
    prompts, params = workload(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns: it must not happen
        engine = Engine(model, device="cuda", deterministic=False, num_kv_blocks=256)
        outs = engine.generate(prompts, params)
    assert all(len(o.token_ids) == len(o.logprobs) > 0 for o in outs)
    assert engine.runner.num_graph_steps > 0


def test_fused_sampler_equals_the_eager_definition():
    from rlrepro.rollout.sampler import SampleRequest, gumbel_noise, sample
    from rlrepro.rollout.sampler_triton import FAST_NOISE_ERROR, gumbel_argmax

    torch.manual_seed(0)
    rows, vocab = 67, 151936
    scaled = torch.randn(rows, vocab, device="cuda") * 4
    scaled[3, 1000:] = float("-inf")
    scaled[5] = 2.0  # all tied: the noise alone decides
    scaled[6, :] = float("-inf")  # no candidate: index 0
    scaled[7, 77777] = float("nan")
    scaled[8, 5000] = scaled[8, 90000] = float("inf")
    scaled[9] = torch.linspace(40.0, -40.0, vocab, device="cuda")
    seeds = torch.randint(0, 2**62, (rows,), device="cuda")
    positions = torch.randint(0, 40000, (rows,), device="cuda")
    idx, noise = gumbel_argmax(scaled, seeds, positions, return_noise=True)
    want_noise = gumbel_noise(seeds, positions, vocab)
    assert torch.equal(noise[0], want_noise)
    # the float32 estimate (the GPU's own log) within its stated error of the exact noise: 10M values
    assert (noise[1] - want_noise).abs().max().item() < FAST_NOISE_ERROR
    expect = torch.argmax(scaled.double() + want_noise, -1)
    finite = [i for i in range(rows) if i != 7]  # a NaN row: torch.argmax takes the NaN, the kernel a number
    assert torch.equal(idx[finite], expect[finite])
    unpruned, evaluated = gumbel_argmax(scaled, seeds, positions, prune=False, return_evaluated=True)
    assert (evaluated.sum(1) == 75).all()  # unpruned: every 2048-wide chunk of every row
    assert torch.equal(unpruned[finite], expect[finite])
    for splits in (None, 1, 2, 7, 75, 500):  # vocabulary ranges per row: speed only, never the token
        for block in (2048, 512):
            for passes in (1, 2):
                got = gumbel_argmax(scaled, seeds, positions, splits=splits, block=block, passes=passes)
                assert torch.equal(got, unpruned), (splits, block, passes)  # skipped or not, the NaN row included
    _, evaluated = gumbel_argmax(scaled, seeds, positions, return_evaluated=True)  # default ranges, 75 chunks a row
    assert evaluated[6].sum() == 0 and evaluated[10:].sum() < (rows - 10) * 75 // 2  # most chunks were skipped
    _, two = gumbel_argmax(scaled, seeds, positions, passes=2, return_evaluated=True)
    assert (two <= evaluated).all() and two[10:].sum() < evaluated[10:].sum()  # a subset, smaller
    half = scaled.to(torch.bfloat16)  # bfloat16 logits widen exactly in the kernel
    assert torch.equal(gumbel_argmax(half, seeds, positions), gumbel_argmax(half.float(), seeds, positions))
    logits = torch.randn(40, 5000, device="cuda", dtype=torch.bfloat16) * 3
    reqs = [SampleRequest([1.0, 0.7, 0.0, 1.3][r % 4], [-1, 7, -1, 50][r % 4], [1.0, 1.0, 0.8, 0.9][r % 4],
                          seed=r, position=r * 3) for r in range(40)]
    assert sample(logits, reqs, fused=True) == sample(logits, reqs, fused=False)
    plain = [SampleRequest(1.0, -1, 1.0, seed=r, position=r * 3) for r in range(40)]  # bf16 passed unconverted
    assert sample(logits, plain, fused=True) == sample(logits.float(), plain, fused=False)


def test_gpu_picked_log_softmax_equals_the_gather():
    """The sampler's logprob (one value a row from the log-softmax's partials) == the written log-softmax's
    value there, for bfloat16 and float32 inputs and vocabularies of one to many ranges; a bad id gives NaN."""
    from rlrepro.kernels import triton_rowwise as rw

    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for rows, vocab in ((64, 151936), (5, 4096), (3, 4097), (7, 100), (1, 1)):
            x = (torch.randn(rows, vocab, device="cuda") * 5).to(dtype)
            ids = torch.randint(0, vocab, (rows,), device="cuda")
            want = rw.log_softmax_fwd(x).gather(-1, ids[:, None])[:, 0]
            assert torch.equal(rw.picked_log_softmax(x, ids), want), (dtype, rows, vocab)
            assert torch.equal(kernels.scaled_token_logprob(x, ids), want)
            assert torch.equal(kernels.token_logprob(x, ids), want)  # the trainer's definition, t = 1
    bad = rw.picked_log_softmax(x, torch.tensor([1], device="cuda"))
    assert torch.isnan(bad).all()


def test_gpu_batched_keep_masks_equal_one_row_masks():
    """A row's top-k/top-p mask is the same in a batch of 100 as alone, and equals the rule written out with
    Python integers (``_sampler_reference``), at the full Qwen3 vocabulary; logits with and without ties."""
    from _sampler_reference import one_row_reference_mask
    from rlrepro.rollout.sampler import keep_mask, keep_masks
    gen = torch.Generator(device="cuda").manual_seed(3)
    v, rows = 151936, 100  # two batched sorts of FILTER_ROWS = 64 and 36 rows
    ks = [[-1, 50, 1, 1000][i % 4] for i in range(rows)]
    ps = [[0.9, 1.0, 0.95, 0.5, 0.123456789][i % 5] for i in range(rows)]
    for decimals in (None, 2):
        scaled = torch.randn(rows, v, device="cuda", generator=gen) * 3
        if decimals is not None:
            scaled = scaled.round(decimals=decimals)  # many ties
        masks = keep_masks(scaled, ks, ps)
        for i in range(rows):
            assert torch.equal(masks[i], keep_mask(scaled[i], ks[i], ps[i])), (decimals, i, ks[i], ps[i])
        for i in (0, 3, 5, 20, 21):  # top-p only (0, 20), top-k then top-p (3, 5), top-k only (21)
            assert torch.equal(masks[i].cpu(), one_row_reference_mask(scaled[i], ks[i], ps[i])), (decimals, i)
        half = keep_masks(scaled[::2].contiguous(), ks[::2], ps[::2])
        assert torch.equal(half, masks[::2])
