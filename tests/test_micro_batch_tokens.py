"""train.micro_batch_tokens: micro-batches cut by a token budget, a pure function of the batch's order and lengths
(issue #26's "fixed micro-batch composition by sample order and token budget"). The layouts' equality with it is
in tests/test_layout_invariance.py (the "tokens" runs over 1, 2 and 4 gloo ranks)."""
import pytest
import torch

from rlrepro.checks import ConfigError
from rlrepro.model import tiny_model
from rlrepro.trainer import TrainConfig, Trainer, micro_batches, token_logprobs


def _lists(chunks):
    return [list(c) for c in chunks]


def test_without_a_budget_the_chunks_are_fixed_size():
    assert _lists(micro_batches(7, 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert _lists(micro_batches(7, 3, lengths=[100] * 7, max_tokens=0)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert micro_batches(0, 3) == []


def test_the_budget_cuts_consecutive_runs():
    lengths = [2, 8, 8, 5, 2, 3, 2, 8, 8]
    # a micro-batch ends before the sample that would take it past 10 tokens
    assert _lists(micro_batches(9, 99, lengths=lengths, max_tokens=10)) == [[0, 1], [2], [3, 4, 5], [6, 7], [8]]
    # and at micro_batch_size samples, whichever comes first
    assert _lists(micro_batches(9, 2, lengths=lengths, max_tokens=10)) == [[0, 1], [2], [3, 4], [5, 6], [7], [8]]
    # exactly at the budget stays together; one token more does not
    assert _lists(micro_batches(3, 99, lengths=[4, 6, 1], max_tokens=10)) == [[0, 1], [2]]
    assert _lists(micro_batches(3, 99, lengths=[4, 7, 1], max_tokens=10)) == [[0], [1, 2]]
    # a sample longer than the budget is a micro-batch of its own (a sequence is never split)
    assert _lists(micro_batches(4, 99, lengths=[3, 25, 3, 3], max_tokens=10)) == [[0], [1], [2, 3]]
    assert micro_batches(0, 4, lengths=[], max_tokens=10) == []


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_once_in_order_within_the_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=gen))
    lengths = torch.randint(1, 30, (n,), generator=gen).tolist()
    budget, size = int(torch.randint(1, 60, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    chunks = micro_batches(n, size, lengths=lengths, max_tokens=budget)
    assert [i for c in chunks for i in c] == list(range(n))
    for c in chunks:
        assert 1 <= len(c) <= size
        assert len(c) == 1 or sum(lengths[i] for i in c) <= budget
    for a, b in zip(chunks, chunks[1:]):  # greedy: the next sample would not have fitted
        assert len(a) == size or sum(lengths[i] for i in a) + lengths[b[0]] > budget
    assert chunks == micro_batches(n, size, lengths=list(lengths), max_tokens=budget)


def test_a_budget_needs_the_lengths():
    with pytest.raises(ValueError, match=r"max_tokens=10 needs one length per sample \(3\), got 2"):
        micro_batches(3, 2, lengths=[1, 2], max_tokens=10)
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=-5 must be an integer >= 0"):
        TrainConfig(micro_batch_tokens=-5)


# ----------------------------------------------------------------------------------------------- in the trainer

def _batch(model, step: int):
    gen = torch.Generator().manual_seed(40 + step)
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab, (1 + i % 3,), generator=gen).tolist() for i in range(8)]
    completions = [torch.randint(vocab, (1 + (i * 5) % 7,), generator=gen).tolist() for i in range(8)]
    with torch.no_grad():
        lps = token_logprobs(model, prompts, completions)
    return [dict(prompt_token_ids=p, completion_token_ids=c, rollout_logprobs=lp.tolist(), advantage=(-1.0) ** i)
            for i, (p, c, lp) in enumerate(zip(prompts, completions, lps))]


def _run(steps=2, **config):
    model = tiny_model(seed=3)
    trainer = Trainer(model, TrainConfig(lr=3e-3, steps=steps, **config))
    chunks, metrics = [], []
    for s in range(steps):
        batch = _batch(model, s)
        chunks.append(_lists(trainer.micro_batches(batch)))
        metrics.append(trainer.train_step(batch))
    return chunks, metrics, {n: w.clone() for n, w in trainer.named_weights()}


def test_the_trainer_runs_the_budgets_micro_batches():
    # the samples' lengths are 2, 8, 7, 3 | 9, 8, 4, 3 tokens: a budget of 24 that binds (at micro_batch_size=8)
    # cuts exactly micro_batch_size=4's micro-batches, hence its bits, and not the one micro-batch of 8 samples;
    # a budget that never binds changes nothing; a smaller one: other micro-batches, exactly on-policy
    fixed = _run(micro_batch_size=2)
    assert fixed[0][0] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    same = _run(micro_batch_size=2, micro_batch_tokens=10_000)
    assert same[0] == fixed[0] and same[1] == fixed[1]
    assert all(torch.equal(w, fixed[2][n]) for n, w in same[2].items())
    fours, eights, binding = _run(micro_batch_size=4), _run(micro_batch_size=8), _run(micro_batch_size=8,
                                                                                      micro_batch_tokens=24)
    assert binding[0] == fours[0] == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2
    assert binding[1] == fours[1] and all(torch.equal(w, fours[2][n]) for n, w in binding[2].items())
    assert not all(torch.equal(w, eights[2][n]) for n, w in binding[2].items())  # the budget is what cut them
    budget = _run(micro_batch_size=8, micro_batch_tokens=12)
    lengths = [[len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) for s in _batch(tiny_model(seed=3), 0)]]
    assert budget[0][0] == _lists(micro_batches(8, 8, lengths=lengths[0], max_tokens=12))
    assert budget[0][0] != fixed[0][0] and len(budget[0][0]) > 1
    assert all(m["train/rollout_logprob_abs_diff"] == 0.0 for m in budget[1])
    assert budget[1] == _run(micro_batch_size=8, micro_batch_tokens=12)[1]  # and it repeats itself
    # the loss is normalised by the whole batch: the micro-batches change rounding only, not the step's value
    assert budget[1][0]["train/loss"] == pytest.approx(fixed[1][0]["train/loss"], rel=1e-5, abs=1e-7)
