"""Chat templates: rendering, the sandbox, and LLM.chat over the fake backend (runtime/chat/chat.py)."""


import numpy as np
import pytest

from fake_backend import make_llm, make_tokenizer  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.chat.chat import render_chat  # noqa: E402

CHATML = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]

# Uses what real templates use: loop controls, tojson, raise_exception, strftime_now, bos_token.
RICH = """{{ bos_token }}{% for m in messages %}
{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
{% if loop.index > 5 %}{% break %}{% endif %}
{{ m.role }}: {{ m.content | tojson }}
{% endfor %}
{% if add_generation_prompt %}assistant ({{ strftime_now('%Y') | length }}):{% endif %}"""


def test_render_chatml():
    out = render_chat(CHATML, MESSAGES, eos_token="<|eos|>")
    assert out == "<|system|>Be brief.<|eos|><|user|>héllo<|eos|><|assistant|>"
    no_prompt = render_chat(CHATML, MESSAGES, eos_token="<|eos|>", add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>")


def test_render_matches_transformers_apply_chat_template():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(), bos_token="<|user|>")
    hf.chat_template = RICH
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert render_chat(RICH, MESSAGES, bos_token="<|user|>") == expected
    assert '"héllo"' in expected  # tojson keeps non-ASCII


def test_raise_exception_becomes_decodert_error():
    with pytest.raises(DecodertError, match="bad role tool"):
        render_chat(RICH, [{"role": "tool", "tool_call_id": "call_1", "content": "x"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox_blocks_unsafe_templates(template):
    with pytest.raises(DecodertError, match="chat template"):
        render_chat(template, MESSAGES)


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "user"}], [3]])
def test_bad_messages_rejected(messages):
    with pytest.raises(DecodertError, match="message"):
        render_chat(CHATML, messages)


def test_missing_template_and_syntax_error():
    with pytest.raises(DecodertError, match="no chat template"):
        render_chat(None, MESSAGES)
    with pytest.raises(DecodertError, match="syntax error"):
        render_chat("{% for m in messages %}", MESSAGES)


def test_llm_chat_prefills_the_rendered_template():
    seen = []

    def rule(history):
        seen.append(history.copy())
        return 0  # eos at once

    llm = make_llm(eos=[0], chat_template=CHATML, add_bos_token=True, rule=rule)
    result = llm.chat(MESSAGES)
    rendered = "<|system|>Be brief.<|eos|><|user|>héllo<|eos|><|assistant|>"
    assert llm.apply_chat_template(MESSAGES) == rendered
    np.testing.assert_array_equal(seen[0], llm.tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert result.finish_reason == "stop" and result.text == "" and result.token_ids == [0]


def test_llm_chat_without_template_fails_before_work():
    llm = make_llm(chat_template=None)
    with pytest.raises(DecodertError, match="no chat template"):
        llm.chat(MESSAGES)
    assert llm.backend.calls == []
