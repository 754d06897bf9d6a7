"""Tool schemas through the chat template: rlrepro's Tokenizer renders Qwen3's tool template as transformers does
(its ``tojson``: keys in insertion order, non-ASCII and ``< > & '`` unescaped), and ``render_prompt`` /
``tokenize_prompt`` / ``build_prompts`` pass ``tools`` to the template only when there are some (renders without
tools are the text they were before)."""
import json

import pytest

from rlrepro.data import PromptRecord
from rlrepro.data.prompts import build_prompts
from rlrepro.data.templates import render_prompt, tokenize_prompt
from rlrepro.model import load_tokenizer, write_tiny_checkpoint
from rlrepro.model.tiny import CHAT_TEMPLATE

from test_envs_tools import QWEN3_TEMPLATE  # the tool-calling parts of Qwen3's chat template

# insertion order is not sorted order ("type" before "function", "name" before "description"), and the text has
# what json.dumps escapes by default (non-ASCII) and what jinja2's tojson escapes (< > & ')
TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Évalue «a<b && c>d» exactly; it's 計算",
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}}}}},
    {"type": "function", "function": {"name": "python", "description": "Run code", "parameters": {}}},
]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12*34?"}]


def model_dir(tmp_path, chat_template: str):
    path = write_tiny_checkpoint(tmp_path / "m")
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = chat_template
    cfg_file.write_text(json.dumps(cfg))
    return path


@pytest.fixture
def qwen3_tok(tmp_path):
    return load_tokenizer(model_dir(tmp_path, QWEN3_TEMPLATE))


def test_tool_schemas_render_in_insertion_order_unescaped(qwen3_tok):
    text = qwen3_tok.apply_chat_template(MESSAGES, tools=TOOLS)
    first = ('{"type": "function", "function": {"name": "calculator", "description": "Évalue «a<b && c>d» '
             'exactly; it\'s 計算", "parameters": {"type": "object", "required": ["expression"], "properties": '
             '{"expression": {"type": "string", "description": "e.g. 12*34"}}}}}')
    assert first == json.dumps(TOOLS[0], ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n\n")
    assert f"<tools>\n{first}\n{json.dumps(TOOLS[1], ensure_ascii=False)}\n</tools>" in text
    assert text.endswith("<|im_start|>user\n12*34?<|im_end|>\n<|im_start|>assistant\n")


def test_tojson_takes_transformers_arguments(tmp_path):
    template = ("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
                "{{ messages[0] | tojson(sort_keys=true) }}|{{ messages[0] | tojson(separators=(',', ':')) }}|"
                "{{ messages[0] | tojson(ensure_ascii=true) }}")
    tok = load_tokenizer(model_dir(tmp_path, template))
    message = {"role": "user", "content": "<ü> & 'x'"}
    expected = "|".join([json.dumps(message, ensure_ascii=False), json.dumps(message, ensure_ascii=False, indent=2),
                         json.dumps(message, ensure_ascii=False, sort_keys=True),
                         json.dumps(message, ensure_ascii=False, separators=(",", ":")), json.dumps(message)])
    assert tok.apply_chat_template([message]) == expected


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_rendering_equals_transformers(tmp_path, tools):
    transformers = pytest.importorskip("transformers")
    path = model_dir(tmp_path, QWEN3_TEMPLATE)
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    messages = MESSAGES + [{"role": "assistant", "content": "<think>\nuse it\n</think>\n\n<tool_call>x</tool_call>"},
                           {"role": "tool", "content": "408"}]
    ours = load_tokenizer(path).apply_chat_template(messages, tools=tools)
    theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and ("<tools>" in ours) == (tools is not None)


def test_render_prompt_without_tools_is_the_text_it_was(tmp_path, qwen3_tok):
    """No tools, None and [] give the same text: the template never sees `tools` (a template that tests whether
    it is defined would tell)."""
    rec = PromptRecord(uid="u:0", prompt="12*34?", answer="408")
    tiny = load_tokenizer(write_tiny_checkpoint(tmp_path / "tiny"))
    assert tiny.chat_template == CHAT_TEMPLATE
    for tools in ([], None):  # the tiny model's ChatML template, as before tools existed
        assert render_prompt(rec, tiny, use_chat_template=True, system_prompt="be brief", tools=tools) == \
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12*34?<|im_end|>\n<|im_start|>assistant\n"
    plain = render_prompt(rec, qwen3_tok, use_chat_template=True, system_prompt="be brief")
    assert plain == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12*34?<|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert render_prompt(rec, qwen3_tok, use_chat_template=True, system_prompt="be brief", tools=[]) == plain
    assert render_prompt(rec, None, template="Q: {prompt}", tools=[]) == "Q: 12*34?"
    probe = load_tokenizer(model_dir(tmp_path / "probe",
                                     "{% if tools is defined %}T{% endif %}{{ messages[0].content }}"))
    assert render_prompt(rec, probe, use_chat_template=True, tools=[]) == "12*34?"
    assert render_prompt(rec, probe, use_chat_template=True, tools=TOOLS[:1]) == "T12*34?"


def test_render_tokenize_and_build_prompts_pass_the_tools(qwen3_tok, capsys):
    rec = PromptRecord(uid="u:0", prompt="12*34?", answer="408")
    text = render_prompt(rec, qwen3_tok, use_chat_template=True, system_prompt="be brief", tools=TOOLS)
    assert text == qwen3_tok.apply_chat_template(MESSAGES, tools=TOOLS)
    ids = tokenize_prompt(rec, qwen3_tok, use_chat_template=True, system_prompt="be brief", tools=TOOLS)
    assert ids == qwen3_tok.encode(text)
    without = tokenize_prompt(rec, qwen3_tok, use_chat_template=True, system_prompt="be brief")
    prompts, _ = build_prompts([rec], qwen3_tok, use_chat_template=True, system_prompt="be brief", tools=TOOLS)
    assert prompts[0].token_ids == ids and len(ids) > len(without)
    prompts, _ = build_prompts([rec], qwen3_tok, use_chat_template=True, system_prompt="be brief")
    assert prompts[0].token_ids == without


def test_hf_style_tokenizers_get_the_tools_when_they_take_them():
    seen = {}

    class WithTools:
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None):
            seen.update(tools=tools, tokenize=tokenize)
            return "ok"

    class WithoutTools:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "ok"

    rec = PromptRecord(uid="u:0", prompt="hi", answer="x")
    assert render_prompt(rec, WithTools(), use_chat_template=True, tools=TOOLS) == "ok"
    assert seen == {"tools": TOOLS, "tokenize": False}
    assert render_prompt(rec, WithoutTools(), use_chat_template=True) == "ok"
    with pytest.raises(ValueError, match="takes no tools argument"):
        render_prompt(rec, WithoutTools(), use_chat_template=True, tools=TOOLS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tools=TOOLS), "tools need the chat template"),
    (dict(tools=TOOLS[0], use_chat_template=True), "tools must be a list of tool schemas"),
    (dict(tools="calculator", use_chat_template=True), "tools must be a list of tool schemas"),
    (dict(tools=[TOOLS[0], "python"], use_chat_template=True), r"tools\[1\] is a str")])
def test_bad_tools_are_refused(qwen3_tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_prompt(PromptRecord(uid="u:0", prompt="hi", answer="x"), qwen3_tok, **kwargs)
