"""``{prompt!r}`` and ``{prompt:>9}`` passed check_template and rendered something else than the prompt (its repr
with quotes and escapes, padding); ``{prompt:{prompt}}`` raised a bare "Invalid format specifier" only for some
prompts. Only a plain ``{prompt}`` is allowed now (docs/DATA.md §3: the template's only field is ``{prompt}``)."""
import pytest

from rlrepro.data import PromptRecord, build_prompts
from rlrepro.data.templates import check_template, render_prompt

REC = PromptRecord(uid="u", prompt="hi {x}\n", answer="1")


@pytest.mark.parametrize("template", ["{prompt!r}", "{prompt!s}", "{prompt!a}", "{prompt:>10}", "Q: {prompt:.3}",
                                      "{prompt:{prompt}}", "{prompt}\n{prompt!r}"])
def test_conversion_or_format_spec_is_refused(template):
    with pytest.raises(ValueError, match=r"only a plain \{prompt\} is filled in.*Fix: write \{prompt\} instead"):
        check_template(template)
    with pytest.raises(ValueError, match=r"^data\.template="):
        render_prompt(REC, template=template)


@pytest.mark.parametrize("template,text", [
    ("{prompt}", "hi {x}\n"),
    ("Q: {prompt}\nPut the final answer in \\boxed{{}}.", "Q: hi {x}\n\nPut the final answer in \\boxed{}."),
    ("{prompt}{prompt}", "hi {x}\nhi {x}\n"),
])
def test_plain_prompt_fields_render_the_text_as_is(template, text):
    check_template(template)
    assert render_prompt(REC, template=template) == text


class _Chars:
    def encode(self, text):
        return [ord(c) for c in text]


def test_build_prompts_refuses_before_tokenizing_any_prompt():
    with pytest.raises(ValueError, match=r"data\.template='\{prompt!r\}' writes \{prompt!r\}"):
        build_prompts([REC], _Chars(), template="{prompt!r}")
