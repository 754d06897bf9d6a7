"""The Python API's reference model computes in the policy's dtype: ``Trainer(model, cfg, ref_model=copy,
param_dtype=bf16)`` with a float32 copy of the policy used to compute the KL term's reference logprobs in float32,
so the KL of the unchanged policy was not 0 (the orchestration loads the reference in the compute dtype itself)."""
import copy

import torch

from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, token_logprobs


def _batch(model):
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (3 + i,), generator=gen).tolist() for i in range(4)]
    completions = [torch.randint(vocab, (2 + 2 * i,), generator=gen).tolist() for i in range(4)]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=(-1.0) ** i)
            for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


def test_a_float32_reference_is_cast_to_the_policys_compute_dtype_and_its_first_kl_is_zero():
    model = tiny_model(seed=1)
    ref = copy.deepcopy(model)
    assert ref.dtype == torch.float32
    trainer = Trainer(model, TrainConfig(lr=1e-3, steps=2, micro_batch_size=4, kl_coef=0.1), ref_model=ref,
                      param_dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and ref.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    metrics = trainer.train_step(_batch(model))
    assert metrics["train/kl"] == 0.0


def test_a_reference_already_in_the_compute_dtype_is_left_as_it_is():
    model = tiny_model(seed=1)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    before = {n: p.clone() for n, p in ref.named_parameters()}
    Trainer(model, TrainConfig(lr=1e-3, steps=2, micro_batch_size=4, kl_coef=0.1), ref_model=ref,
            param_dtype=torch.bfloat16)
    assert ref.dtype == torch.bfloat16
    assert all(torch.equal(before[n], p) for n, p in ref.named_parameters())
