"""gpt-oss's harmony chat format: the template renders; the reply's analysis channel is the reasoning and
its final channel the content, whole and streamed, through LLM.chat and the server."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_backend import make_llm, make_tokenizer  # noqa: E402

from decodert.runtime.chat.harmony import HarmonyOutput, markup_decoder  # noqa: E402
from decodert.runtime.chat.output import assemble  # noqa: E402

MARKUP = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# A template in harmony's shape (written for these tests), using what gpt-oss's own template needs from
# the sandbox: strftime_now, namespace, a macro, tojson, raise_exception.
HARMONY = (
    "{%- macro header(role) -%}<|start|>{{ role }}<|message|>{%- endmacro -%}"
    "{{- header('system') }}Current date: {{ strftime_now('%Y-%m-%d') }}\nReasoning: "
    "{{ reasoning_effort | default('medium') }}\n# Valid channels: analysis, commentary, final.<|end|>"
    "{%- set state = namespace(seen=0) -%}"
    "{%- for m in messages -%}{%- set state.seen = state.seen + 1 -%}"
    "{%- if m.role == 'user' -%}{{ header('user') }}{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.x to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{%- else -%}{{ raise_exception('unexpected role ' + m.role) }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
REPLY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there!")
USER = [{"role": "user", "content": "Hi"}]


def harmony_llm(reply: str):
    tok = make_tokenizer()
    tok.add_special_tokens(MARKUP)
    script = tok.encode(reply).ids + [tok.token_to_id("<|return|>")]
    starts: dict[int, int] = {}

    def rule(history: np.ndarray) -> int:
        start = starts.setdefault(int(history[0]), len(history))
        return script[min(len(history) - start, len(script) - 1)]

    return make_llm(tok, eos=[tok.token_to_id("<|return|>")], chat_template=HARMONY, rule=rule, max_seq=1024), tok


def test_markup_survives_decoding_only_for_harmony_templates():
    llm, tok = harmony_llm(REPLY)
    ids = tok.encode("<|channel|>final<|message|>ok<|eos|>").ids
    assert markup_decoder(tok, HARMONY).decode(ids) == "<|channel|>final<|message|>ok"  # other specials skipped
    assert markup_decoder(tok, "{{ messages }}") is tok


def test_chat_returns_final_as_text_and_analysis_as_reasoning():
    llm, _ = harmony_llm(REPLY)
    _, prompt, _ = llm._chat_prompt(USER, {})
    assert prompt.startswith("<|start|>system<|message|>Current date: ") and prompt.endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    got = llm.chat(USER, max_new_tokens=80)
    assert (got.text, got.reasoning, got.finish_reason) == ("Hello there!", "The user greets; answer briefly.", "stop")
    stream = llm.stream_chat(USER, max_new_tokens=80)
    assert "".join(stream) == "Hello there!"
    content, reasoning, _ = assemble(stream.deltas)
    assert (content, reasoning) == ("Hello there!", "The user greets; answer briefly.")


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_splitting_is_the_same_streamed_in_any_pieces(cut):
    whole = HarmonyOutput()
    expect = assemble(whole.feed(REPLY) + whole.finish())
    out = HarmonyOutput()
    deltas = [d for i in range(0, len(REPLY), cut) for d in out.feed(REPLY[i:i + cut])] + out.finish()
    assert assemble(deltas) == expect == ("Hello there!", "The user greets; answer briefly.", [])


def test_replies_without_markup_or_cut_short():
    for text, want in (("Just text.", ("Just text.", None)),
                       ("<|channel|>analysis<|message|>still thinking", (None, "still thinking")),  # max tokens
                       ("<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>B",
                        ("AB", None))):
        out = HarmonyOutput()
        assert assemble(out.feed(text) + out.finish())[:2] == want, text
