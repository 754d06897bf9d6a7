"""The engine stops on generation_config.json's eos_token_id as well as config.json's (as vLLM does): Qwen3's
generation config lists <|im_end|> and <|endoftext|> while its config.json names one."""
import json

import pytest

from rlrepro.model import load_pretrained
from rlrepro.model.config import Qwen3Config
from rlrepro.model.tiny import write_tiny_checkpoint
from rlrepro.rollout import Engine, SamplingParams


def _dir(tmp_path, gen):
    d = tmp_path / "m"
    write_tiny_checkpoint(d, seed=1)
    if gen is None:
        (d / "generation_config.json").unlink(missing_ok=True)
    else:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_generation_config_eos_ids_are_read_and_not_saved_as_a_config_key(tmp_path):
    d = _dir(tmp_path, {"eos_token_id": [7, 3]})
    cfg = Qwen3Config.from_file(d)
    assert cfg.generation_eos_token_ids == (7, 3)
    assert "generation_eos_token_ids" not in cfg.to_dict()
    assert Qwen3Config.from_file(_dir(tmp_path / "x", None)).generation_eos_token_ids == ()
    assert Qwen3Config.from_file(_dir(tmp_path / "y", {"eos_token_id": 5})).generation_eos_token_ids == (5,)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        Qwen3Config.from_file(_dir(tmp_path / "z", {"eos_token_id": "</s>"}))


def test_the_engine_stops_on_generation_eos(tmp_path):
    """A token the model samples (seeded), put in generation_config.json's eos list only: the engine stops there,
    with the same tokens and logprobs up to it."""
    d = _dir(tmp_path, None)
    model_eos = load_pretrained(d).config.eos_token_id
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16)
    for prompt in ([5, 9, 2, 11], [1, 2, 3], [40, 41, 7, 7, 9], [13]):
        free = Engine(str(d), device="cpu").generate([prompt], params)[0]
        firsts = [i for i, t in enumerate(free.token_ids) if i > 0 and t not in free.token_ids[:i] and t != model_eos]
        if firsts:
            break
    else:
        raise AssertionError(f"no prompt gave a token to stop on: {free.token_ids}")
    cut = firsts[0]
    stop = free.token_ids[cut]
    d2 = _dir(tmp_path / "g", {"eos_token_id": [stop]})
    eng = Engine(str(d2), device="cpu")
    assert stop in eng.eos_token_ids and model_eos in eng.eos_token_ids
    out = eng.generate([prompt], params)[0]
    assert out.token_ids == free.token_ids[:cut + 1] and out.finish_reason == "stop"
    assert out.logprobs == free.logprobs[:cut + 1]
