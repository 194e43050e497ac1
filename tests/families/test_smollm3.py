"""SmolLM3: layers without RoPE (NoPE) and the template's thinking switch.

The battery (tests/helpers/battery.py): every target's logits and greedy tokens against transformers, batching,
speculation, sessions, TensorRT-RTX builds and the emulated trt backend at fp16; the GGUF reader:
tests/export/test_checkpoint_gguf.py over tiny.FAMILIES.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import transformers

from battery import Family, Parity, Runtime, TrtBuild, TrtEmulator, attention_engines
from fake_backend import scripted_llm  # noqa: E402
from parity import hf_reference, logits_parity  # noqa: E402
from tiny import tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints import checkpoint_hf  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.models.common import replace_attention  # noqa: E402
from decodert.models.family import Family as ModelFamily  # noqa: E402
from decodert.models.families import smollm3  # noqa: E402
from decodert.models.spec import rope_table_of, rope_tables  # noqa: E402


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator):
    entries = (Family("smollm3", trt_layers=attention_engines, emulator="fp16"),)


def test_nope_layers_from_the_interval_or_the_list():
    assert nope_layers(smollm3.spec_from_hf(tiny_config("smollm3"))) == (3,)
    assert nope_layers(smollm3.spec_from_hf(tiny_config("smollm3", no_rope_layer_interval=2))) == (1, 3)
    spec = smollm3.spec_from_hf(tiny_config("smollm3", no_rope_layers=[0, 1, 1, 0]))
    assert nope_layers(spec) == (0, 3) and spec.rope.theta == 2000000.0
    assert [rope_table_of(spec, i) for i in range(4)] == ["rope_none", "rope", "rope", "rope_none"]
    cos, sin = rope_tables(spec)["rope_none"].cos_sin(spec.head_dim, 8)
    assert (cos == 1).all() and (sin == 0).all()  # the identity rotation: x*1 + rot(x)*0 is x exactly
    with pytest.raises(DecodertError, match="no_rope_layers must list 4 flags"):
        smollm3.spec_from_hf(tiny_config("smollm3", no_rope_layers=[1, 1]))
    with pytest.raises(DecodertError, match="use_sliding_window"):
        smollm3.spec_from_hf(tiny_config("smollm3", use_sliding_window=True, sliding_window=8))
    meta = {"general.architecture": "smollm3", "smollm3.block_count": 8, "smollm3.embedding_length": 64,
            "smollm3.attention.head_count": 4, "smollm3.feed_forward_length": 128, "smollm3.vocab_size": 512}
    assert nope_layers(smollm3.spec_from_gguf(meta)) == (3, 7)  # llama.cpp's fixed rule: every 4th layer


def nope_layers(spec) -> tuple[int, ...]:
    return tuple(i for i in range(spec.num_layers) if rope_table_of(spec, i) == "rope_none")


def test_rope_on_the_nope_layers_would_not_match(tiny_checkpoint, tmp_path, monkeypatch):
    """The declaration matters: with RoPE on every layer the logits are far from transformers'."""
    src = tiny_checkpoint("smollm3", no_rope_layer_interval=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    prompts = [np.random.default_rng(0).integers(3, 512, 12).astype(np.int64)]
    refs = [hf_reference(model, p, 6) for p in prompts]
    export_model(src, tmp_path / "ok", target="ort", max_seq=64, progress=False)
    assert logits_parity(tmp_path / "ok", refs, prompts, steps=5) < 1e-4
    real = smollm3.spec_from_hf
    monkeypatch.setattr(smollm3, "spec_from_hf", lambda c: replace_attention(real(c), rope_table="rope"))
    monkeypatch.setattr(checkpoint_hf, "family_for", lambda *a: ModelFamily.of(smollm3))
    export_model(src, tmp_path / "bad", target="ort", max_seq=64, progress=False)
    assert logits_parity(tmp_path / "bad", refs, prompts, steps=5) > 1e-2


# A template with SmolLM3's thinking switch (written for this test): thinking unless enable_thinking is
# false or the system message says /no_think; a no-think reply starts after an empty think block.
SMOLLM3_LIKE = (
    "{%- set think = enable_thinking is not defined or enable_thinking -%}"
    "{%- if messages[0].role == 'system' and '/no_think' in messages[0].content -%}{%- set think = false -%}{%- endif -%}"
    "<|im_start|>system\nReasoning Mode: {{ '/think' if think else '/no_think' }}<|im_end|>\n"
    "{%- for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% if not think %}<think>\n\n</think>\n{% endif %}{%- endif -%}"
)
USER = [{"role": "user", "content": "Weather?"}]


def test_thinking_switch_renders_and_splits_the_reply():
    llm, _ = scripted_llm("<think>Warm, probably.</think>Sunny.", chat_template=SMOLLM3_LIKE, max_seq=512)
    _, prompt, _ = llm.prepare(USER, chat=True).rendered
    assert "Reasoning Mode: /think" in prompt and not prompt.endswith("</think>\n")
    got = llm.chat(USER, max_new_tokens=40)
    assert (got.text, got.reasoning) == ("Sunny.", "Warm, probably.")
    for messages, options in ((USER, {"enable_thinking": False}),
                              ([{"role": "system", "content": "Be brief. /no_think"}, *USER], {})):
        _, prompt, _ = llm.prepare(messages, chat=True, **options).rendered
        assert "Reasoning Mode: /no_think" in prompt and prompt.endswith("<think>\n\n</think>\n")
    quiet, _ = scripted_llm("Sunny.", chat_template=SMOLLM3_LIKE, max_seq=512)
    got = quiet.chat(USER, max_new_tokens=20, enable_thinking=False)
    assert (got.text, got.reasoning) == ("Sunny.", None)
