"""Session 35: the model API as a transformers/verl user meets it. The megatron tensor-parallel loader runs the same
pre-checks as ``load_pretrained`` (headers, then the tied-head comparison) before it reads a weight; and the defects
found auditing round trips, config.json fields, tokenizers, dtypes and bad paths stay fixed."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlrepro.model import Qwen3ForCausalLM, checkpoint_io, load_pretrained, write_tiny_checkpoint
from rlrepro.model.checkpoint_io import check_pretrained, iter_checkpoint_tensors, model_dir_config
from rlrepro.trainer.megatron.model import TPQwen3ForCausalLM, shard_tensor
from rlrepro.trainer.megatron.parallel import ParallelGroups, single_process_groups

GROUPS = {"tp1": single_process_groups, "tp2rank1": lambda: ParallelGroups(None, None, 1, 2, 0, 1)}


def _edit_tensors(path, fn, file="model.safetensors"):
    tensors = load_file(path / file)
    fn(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


class _CountingOpen:
    """safe_open that records every tensor read (get_tensor, or indexing a get_slice), not header reads."""
    reads: list = []

    def __init__(self, *a, **k):
        self.h = checkpoint_io.__dict__["_real_safe_open"](*a, **k)

    def __enter__(self):
        self.h.__enter__()
        return self

    def __exit__(self, *exc):
        return self.h.__exit__(*exc)

    def get_tensor(self, n):
        _CountingOpen.reads.append(n)
        return self.h.get_tensor(n)

    def get_slice(self, n):
        piece = self.h.get_slice(n)

        class Piece:
            def __getitem__(self, idx):
                _CountingOpen.reads.append(n)
                return piece[idx]

            def __getattr__(self, attr):
                return getattr(piece, attr)
        return Piece()

    def __getattr__(self, attr):
        return getattr(self.h, attr)


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setitem(checkpoint_io.__dict__, "_real_safe_open", checkpoint_io.safe_open)
    monkeypatch.setattr(checkpoint_io, "safe_open", _CountingOpen)
    _CountingOpen.reads = []
    return _CountingOpen


# ---- the megatron TP loader shares load_pretrained's pre-checks ----

@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_tp_from_pretrained_refuses_a_tied_config_with_a_different_lm_head(tmp_path, groups):
    # before: TPQwen3ForCausalLM.from_pretrained skipped the stored head and trained on the embedding, silently
    d = write_tiny_checkpoint(tmp_path / "m")
    _edit_tensors(d, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"] + 1))
    for load in (lambda: TPQwen3ForCausalLM.from_pretrained(d, GROUPS[groups]()), lambda: load_pretrained(d),
                 lambda: check_pretrained(d)):
        with pytest.raises(ValueError, match="tie_word_embeddings=true.*lm_head.weight differs"):
            load()


@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_tp_from_pretrained_accepts_an_equal_stored_head_and_gives_the_plain_shards(tmp_path, groups):
    d = write_tiny_checkpoint(tmp_path / "m")
    _edit_tensors(d, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    g = GROUPS[groups]()
    tp = TPQwen3ForCausalLM.from_pretrained(d, g)
    full = dict(load_pretrained(d).named_parameters())
    own = dict(tp.named_parameters())
    assert set(own) == set(full) and tp.lm_head is None
    for name, p in own.items():
        assert torch.equal(p, shard_tensor(name, full[name], g.tp_rank, g.tp_size)), name


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("bad", ["shape", "extra", "missing"])
def test_tp_from_pretrained_refuses_bad_headers_before_reading_a_tensor(tmp_path, counting, groups, bad):
    # before: a missing tensor was found after every other one was read; a mis-shaped one once reached
    d = write_tiny_checkpoint(tmp_path / "m", max_shard_bytes=20_000, tie_word_embeddings=False)
    last = sorted(d.glob("model-*.safetensors"))[-1]
    name = sorted(load_file(last))[-1]
    if bad == "shape":
        _edit_tensors(d, lambda t: t.__setitem__(name, torch.zeros(8, 8)), file=last.name)
        match = rf"'{name}' has shape \(8, 8\), config.json implies .*do not belong together"
    elif bad == "extra":
        _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)),
                      file=last.name)
        match = "'model.layers.0.self_attn.q_proj.bias', which a Qwen3ForCausalLM does not have"
    else:
        _edit_tensors(d, lambda t: t.pop(name), file=last.name)
        match = rf"lacks tensors \['{name}'\]"
    with pytest.raises(ValueError, match=match):
        TPQwen3ForCausalLM.from_pretrained(d, GROUPS[groups]())
    assert counting.reads == []


def test_the_shared_iterator_checks_full_shapes_whatever_the_callers_parameters(tmp_path, counting):
    """The exact path the TP loader takes: ``iter_checkpoint_tensors`` given the names only (a shard's shapes
    differ from the file's), refusing a mis-shaped tensor before it yields anything."""
    d = write_tiny_checkpoint(tmp_path / "m")
    _edit_tensors(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    path, config = model_dir_config(d)
    with torch.device("meta"):
        names = [n for n, _ in Qwen3ForCausalLM(config).named_parameters()]
    walk = iter_checkpoint_tensors(path, config, names)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(65,\), config.json implies \(64,\)"):
        next(walk)
    assert counting.reads == []


# ---- tokenizer files ----

@pytest.mark.parametrize("file,text,match", [
    ("tokenizer.json", None, r"cannot read .*tokenizer\.json .*damaged"),
    ("tokenizer_config.json", "{bad", r"tokenizer_config\.json is not valid JSON"),
    ("tokenizer_config.json", "[1]", r"tokenizer_config\.json holds a JSON list, not an object"),
    ("special_tokens_map.json", "{bad", r"special_tokens_map\.json is not valid JSON"),
])
def test_a_damaged_tokenizer_file_is_named_in_the_error(tmp_path, file, text, match):
    # before: "EOF while parsing a value at line 7 column 11", a bare JSONDecodeError, or an AttributeError
    from rlrepro.model import load_tokenizer
    d = write_tiny_checkpoint(tmp_path / "m")
    (d / file).write_text(text if text is not None else (d / file).read_text()[:100])
    with pytest.raises(ValueError, match=match):
        load_tokenizer(d)


def test_the_chat_template_sees_the_special_tokens_transformers_passes(tmp_path):
    # before: only eos_token reached the template; a template with {{ bos_token }} rendered it empty
    from rlrepro.model import load_tokenizer
    d = write_tiny_checkpoint(tmp_path / "m")
    raw = json.loads((d / "tokenizer_config.json").read_text())
    raw.update(bos_token="<|im_start|>",
               chat_template="{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ foo }}")
    (d / "tokenizer_config.json").write_text(json.dumps(raw))
    tok = load_tokenizer(d)
    assert tok.apply_chat_template([]) == "<|im_start|>|<|im_end|>|<|endoftext|>|<unk>|"
    assert tok.apply_chat_template([], eos_token="E", foo="F") == "<|im_start|>|E|<|endoftext|>|<unk>|F"
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs)


def test_loaders_take_transformers_habits(tmp_path, monkeypatch):
    """dtype="auto" (transformers' torch_dtype="auto") is the checkpoint's own dtype; a ``~/`` path is expanded; a
    hub id that is not a local directory is named as one, with the download fix; numpy bools are engine flags."""
    import numpy as np

    from rlrepro.model import load_pretrained, save_pretrained, tiny_model
    from rlrepro.model.checkpoint_io import load_dtype
    from rlrepro.rollout import Engine

    assert load_dtype("auto") is None
    model = tiny_model(seed=3)
    save_pretrained(model, tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    a, b = load_pretrained("~/m", dtype="auto"), load_pretrained(tmp_path / "m")
    assert a.dtype == b.dtype and all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                                         b.state_dict().values()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen3-0\.6B' looks like a Hugging Face hub id: .*"
                                                r"huggingface-cli download Qwen/Qwen3-0\.6B --local-dir DIR"):
        load_pretrained("Qwen/Qwen3-0.6B")
    with pytest.raises(FileNotFoundError) as e:
        load_pretrained("./nope")
    assert "hub id" not in str(e.value)
    assert Engine(model, deterministic=np.bool_(True), enable_prefix_cache=np.False_).block_manager.enable_prefix_cache \
        is False
