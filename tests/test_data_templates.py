import pytest

from rlrepro.data import PromptRecord, check_template, render_prompt, tokenize_prompt


class CharTokenizer:
    """Duck-typed tokenizer: one id per character, and a simple chat template."""

    def encode(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class HFStyleTokenizer(CharTokenizer):
    """Like a Hugging Face tokenizer: returns ids unless tokenize=False."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        text = super().apply_chat_template(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text


REC = PromptRecord(uid="r:0", prompt="1+1", answer="2")
CHAT = PromptRecord(uid="r:1", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                         {"role": "user", "content": "2+2"}], answer="4")
BOXED = "{prompt}\nPut the final answer in \\boxed{{}}."


def test_plain_prompt_and_template():
    assert render_prompt(REC, None) == "1+1"
    assert render_prompt(REC, None, template=BOXED) == "1+1\nPut the final answer in \\boxed{}."
    assert render_prompt(REC, None, template="q: {prompt} a: {prompt}") == "q: 1+1 a: 1+1"


def test_chat_template_with_system_prompt():
    tok = CharTokenizer()
    assert render_prompt(REC, tok, use_chat_template=True) == "<user>1+1</user><assistant>"
    assert (render_prompt(REC, tok, template="Q {prompt}", system_prompt="be brief", use_chat_template=True)
            == "<system>be brief</system><user>Q 1+1</user><assistant>")


def test_chat_record_template_fills_last_user_turn():
    text = render_prompt(CHAT, CharTokenizer(), template="[{prompt}]", system_prompt="s", use_chat_template=True)
    assert text == "<system>s</system><user>hi</user><assistant>yo</assistant><user>[2+2]</user><assistant>"
    assert CHAT.messages[2]["content"] == "2+2"  # the record is not modified


def test_hf_style_tokenizer_gets_tokenize_false():
    assert render_prompt(REC, HFStyleTokenizer(), use_chat_template=True) == "<user>1+1</user><assistant>"


def test_tokenize_prompt():
    assert tokenize_prompt(REC, CharTokenizer(), template="{prompt}=") == [49, 43, 49, 61]
    ids = tokenize_prompt(REC, CharTokenizer(), use_chat_template=True)
    assert ids == [ord(c) for c in "<user>1+1</user><assistant>"]
    assert all(type(t) is int for t in ids)


def test_template_errors():
    with pytest.raises(ValueError, match=r"uses the fields \['answer'\]"):
        check_template("{prompt} {answer}")
    with pytest.raises(ValueError, match="uses the fields"):
        render_prompt(REC, None, template="{prompt}\\boxed{}")
    with pytest.raises(ValueError, match="has no {prompt} field"):
        check_template("just text")
    with pytest.raises(ValueError, match="not a valid format string"):
        check_template("{prompt} }")


def test_mode_errors():
    with pytest.raises(ValueError, match="data.system_prompt needs data.use_chat_template=true"):
        render_prompt(REC, None, system_prompt="s")
    with pytest.raises(ValueError, match="chat messages, which need data.use_chat_template=true"):
        render_prompt(CHAT, None)
    with pytest.raises(ValueError, match="has no apply_chat_template"):
        render_prompt(REC, object(), use_chat_template=True)
    sys_rec = PromptRecord(uid="s", messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
                           answer="z")
    with pytest.raises(ValueError, match="already has a system turn"):
        render_prompt(sys_rec, CharTokenizer(), system_prompt="s", use_chat_template=True)

    class Empty(CharTokenizer):
        def encode(self, text):
            return []

    with pytest.raises(ValueError, match="encodes to no tokens"):
        tokenize_prompt(REC, Empty())
