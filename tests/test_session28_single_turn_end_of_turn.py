"""Single-turn runs with the chat template stop at the template's end-of-turn token too (decided 2026-12-06).

A Base-like tokenizer (EOS ``<|endoftext|>``, as Qwen3-*-Base; its ChatML template closes an assistant turn with
``<|im_end|>``) with ``data.use_chat_template=true``: before, a single-turn response ran on past ``<|im_end|>``
until the EOS or the length limit, while the prompt had taught it ``<|im_end|>`` closes a turn. Now:

* the rollout requests and the eval requests stop at both (``turn_stop_token_ids``), so no response holds an
  ``<|im_end|>`` before its last token, and some end with it;
* the warm start's targets close with ``<|im_end|>`` (never the EOS);
* ``rlrepro eval`` after the fact stops as the run did, so its numbers equal the logged ones exactly;
* two runs are equal bit for bit;
* without the chat template, or with a tokenizer whose EOS closes a turn (the tiny model's, Qwen3 instruct), the
  stop ids are the EOS alone, as before.
"""
import json

import pytest

from rlrepro.cli import compose_config
from rlrepro.data import make_synthetic_records, write_jsonl
from rlrepro.model import write_tiny_checkpoint
from rlrepro.orchestration import driver as driver_mod
from rlrepro.orchestration.evaluation import evaluate_checkpoint
from test_leftovers_27_end_of_turn import ENDOFTEXT, IM_END, _retokenize, _rollouts
from test_review26_pipe_pipeline import LocalActors as PipeLocalActors

pytestmark = pytest.mark.usefixtures("one_thread")

SINGLE = ["recipe=grpo_tiny", "model.init=pretrained", "model.tiny_overrides={}", "data.use_chat_template=true",
          "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_tokens=10",
          "warm_start.steps=20", "warm_start.batch_size=16", "warm_start.target=answer", "checkpoint.every=2",
          "logger.progress=false", "train.micro_batch_size=8", "train.warmup_steps=1", "data.synthetic.num=64"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("base") / "model", seed=3, eos_token_id=ENDOFTEXT)
    return _retokenize(model_dir, eos_token="<|endoftext|>")


class LocalActors(PipeLocalActors):
    """test_review26_pipe_pipeline's in-process actor group; records every request's stop ids and the warm start's
    examples."""
    stops: list = []

    def generate(self, requests):
        LocalActors.stops.append([tuple(r.params.stop_token_ids) for r in requests])
        return super().generate(requests)

    def warm_start(self, examples, **kw):
        LocalActors.examples = examples
        return super().warm_start(examples, **kw)


def test_a_single_turn_chat_run_stops_at_im_end(base_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: LocalActors)
    held = tmp_path / "held.jsonl"
    write_jsonl(make_synthetic_records("first_letter", 5, 99, alphabet="abcd"), held)
    args = [*SINGLE, f"model.path={base_dir}", "eval.every=2", f"eval.source={held}", "eval.num_samples=2"]
    runs = []
    for name in ("a", "b"):
        LocalActors.stops = []
        driver_mod.GRPODriver(compose_config([*args, f"run.dir={tmp_path / name}"])).run()
        runs.append((LocalActors.stops, LocalActors.examples))
    (stops, examples), _ = runs
    # every request (two rollout steps and the eval after step 2) stops at the EOS and at <|im_end|>
    assert len(stops) == 3 and all(s == (ENDOFTEXT, IM_END) for call in stops for s in call)
    assert examples and all(target[-1] == IM_END and ENDOFTEXT not in target for _, target in examples)
    records = _rollouts(tmp_path / "a")
    assert len(records) == 2 * 4 * 2
    ends = 0
    for rec in records:
        ids = rec["token_ids"]  # the completion's tokens (Sample.to_record)
        assert IM_END not in ids[:-1]  # stopped at its first <|im_end|> (before: ran on past it)
        ends += bool(ids) and ids[-1] == IM_END
    assert ends > 0  # not vacuous: responses that stopped there
    # bit for bit: the second run equals the first
    assert (tmp_path / "a" / "fingerprints.jsonl").read_bytes() == (tmp_path / "b" / "fingerprints.jsonl").read_bytes()
    assert _rollouts(tmp_path / "a") == _rollouts(tmp_path / "b")
    # after the fact: the checkpoint of step 2 evaluated again stops as the run did, the same numbers exactly
    logged = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    want = {k: v for k, v in logged[-1].items() if k.startswith("eval/")}
    assert want, logged[-1]
    recs: list = []
    step, got = evaluate_checkpoint(tmp_path / "a", step=2, records=recs)
    assert step == 2 and {k: got[k] for k in want} == want
    # responses that stopped (at <|im_end|>: the warm start never taught the EOS), none cut at a stray one
    assert recs and any(r["finish_reason"] == "stop" for r in recs)


@pytest.mark.parametrize("chat", [True, False])
def test_the_stop_ids_without_a_distinct_end_of_turn_are_the_eos_alone(base_dir, tmp_path, monkeypatch, chat):
    """Without the chat template the Base tokenizer stops at its EOS alone; the tiny tokenizer (EOS <|im_end|>,
    which closes its turns) with or without it too: the bits of every earlier single-turn run stay."""
    class NoActors:
        def __init__(self, *a, **k):
            raise RuntimeError("set-up done")

    monkeypatch.setattr(driver_mod, "actor_group_class", lambda: NoActors)
    tiny = write_tiny_checkpoint(tmp_path / "tiny", seed=3)
    cases = [(tiny, IM_END)] + ([] if chat else [(base_dir, ENDOFTEXT)])
    for i, (model_dir, eos) in enumerate(cases):
        d = driver_mod.GRPODriver(compose_config([*SINGLE, f"model.path={model_dir}", f"run.dir={tmp_path / str(i)}",
                                                  f"data.use_chat_template={str(chat).lower()}"]))
        with pytest.raises(RuntimeError, match="set-up done"):
            d.setup()
        assert d.turn_stop_token_ids == d.stop_token_ids == [eos] and d.turn_close_ids() == [eos]
