"""Gemma 3 / Gemma 2 families: config and GGUF readings against transformers and llama.cpp's rules,
multimodal checkpoint names, greedy tokens against transformers past the sliding window, soft-capping.

The battery (tests/helpers/battery.py) runs both: every target's logits and greedy tokens against
transformers, batching, speculation, sessions, TensorRT-RTX builds and the emulated trt backend at fp16.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import onnx
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.export.pipeline import export_model
from decodert.export.quantize.quant import QuantConfig, dequantize, quantize
from decodert.models import family_for
from decodert.models.families import gemma2, gemma3
from decodert.models.spec import RopeSpec
from battery import Family, Parity, Runtime, TrtBuild, TrtEmulator, attention_engines
from parity import backend, decodert_greedy, hf_reference, logits_parity
from tiny import gguf_meta, make_tiny_gguf, tiny_config

GEMMAS = ("gemma3", "gemma2")


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator):
    entries = tuple(Family(f, trt_layers=attention_engines, emulator="fp16") for f in GEMMAS)


def _spec(family: str, **overrides):
    config = tiny_config(family, **overrides)
    return family_for(config["model_type"]).spec_from_hf(config)


def layer_types(spec) -> tuple[str, ...]:
    return tuple("sliding" if spec.is_sliding(i) else "full" for i in range(spec.num_layers))


def window(spec) -> int | None:
    """The sliding layers' window."""
    return next(spec.layer_window(i) for i in range(spec.num_layers) if spec.is_sliding(i))


def test_gemma3_declarations_from_config():
    s = _spec("gemma3")
    a = s.attention
    assert (s.family, s.mlp(0).activation, s.sandwich_norm, a.qk_norm, s.tie_word_embeddings) == (
        "gemma3", "gelu_tanh", True, True, True)
    assert layer_types(s) == ("sliding", "full") and window(s) == 4
    assert [s.attention_of(i).rope_table for i in range(2)] == ["rope_local", "rope"]
    assert s.rope == RopeSpec(theta=1e6) and s.local_rope == RopeSpec(theta=1e4)
    assert s.embed_scale == 8.0 and a.scale == 24 ** -0.5
    assert (a.softcap, s.final_softcap) == (None, None)
    # transformers 4.x spelling: rope_theta + rope_local_base_freq, rope_scaling for the full layers only
    legacy = {k: v for k, v in tiny_config("gemma3").items() if k != "rope_parameters"}
    legacy.update(rope_theta=5e5, rope_local_base_freq=1e3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    old = gemma3.spec_from_hf(legacy)
    assert old.rope == RopeSpec(theta=5e5, scaling="linear", factor=8.0) and old.local_rope == RopeSpec(theta=1e3)


def test_gemma3_defaults_are_transformers_defaults():
    """A multimodal config.json lists only what differs; the rest must be Gemma3TextConfig's defaults."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    mine = gemma3.spec_from_hf({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]})
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert (mine.vocab_size, mine.num_heads, mine.num_kv_heads, mine.head_dim) == (
        ref.vocab_size, ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert layer_types(mine) == tuple(t.split("_")[0] for t in ref.layer_types)
    assert mine.attention.scale == ref.query_pre_attn_scalar ** -0.5 and mine.rms_norm_eps == ref.rms_norm_eps
    assert mine.rope.theta == ref.rope_parameters["full_attention"]["rope_theta"] and mine.rope.factor == 8.0
    assert mine.local_rope == RopeSpec(theta=ref.rope_parameters["sliding_attention"]["rope_theta"])
    assert mine.eos_token_ids == (1, 106) and mine.tie_word_embeddings and mine.max_position == 131072


def test_gemma2_declarations_and_transformers_defaults():
    s = _spec("gemma2")
    a = s.attention
    assert (s.family, s.mlp(0).activation, s.sandwich_norm, a.qk_norm, s.local_rope) == ("gemma2", "gelu_tanh", True, False, None)
    assert layer_types(s) == ("sliding", "full") and window(s) == 4 and s.rope == RopeSpec(theta=10000.0)
    assert {s.attention_of(i).rope_table for i in range(2)} == {"rope"}  # one RoPE for every layer
    assert (a.softcap, s.final_softcap, a.scale, s.tie_word_embeddings) == (0.5, 0.5, 32 ** -0.5, False)
    assert "layers.{i}.q_norm" not in gemma2.HF_WEIGHTS and "layers.{i}.attn_out_norm" in gemma2.GGUF_WEIGHTS
    bare = {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
            "num_key_value_heads": 8}
    mine, ref = gemma2.spec_from_hf(bare), transformers.Gemma2Config(**{k: v for k, v in bare.items() if k != "model_type"})
    assert (mine.attention.softcap, mine.final_softcap) == (ref.attn_logit_softcapping, ref.final_logit_softcapping)
    assert layer_types(mine) == tuple(t.split("_")[0] for t in ref.layer_types) and window(mine) == ref.sliding_window
    assert mine.attention.scale == ref.query_pre_attn_scalar ** -0.5 and mine.head_dim == ref.head_dim
    assert mine.rope.theta == ref.rope_parameters["rope_theta"] and mine.vocab_size == ref.vocab_size
    assert gemma2.spec_from_hf({**tiny_config("gemma2"), "attn_logit_softcapping": None}).attention.softcap is None  # null: off


def test_gemma2_gguf_follows_llama_cpp_rules():
    """gemma2 GGUFs store both soft-caps and the window; layers alternate sliding/full; the 46-layer 27B
    scales by 1/sqrt(hidden/heads)."""
    keys = {"block_count": 4, "attention.key_length": 32, "attention.sliding_window": 4096,
            "attn_logit_softcapping": np.float32(50.0), "final_logit_softcapping": np.float32(30.0)}
    s = gemma2.spec_from_gguf(gguf_meta("gemma2", **keys))
    assert layer_types(s) == ("sliding", "full") * 2 and (s.attention.softcap, s.final_softcap) == (50.0, 30.0)
    assert s.attention.scale == 32 ** -0.5 and s.local_rope is None and not s.attention.qk_norm
    assert gemma2.spec_from_gguf(gguf_meta("gemma2", **{**keys, "block_count": 46})).attention.scale == 16 ** -0.5


def test_softcapped_attention_has_no_plugin(tiny_checkpoint, tmp_path):
    with pytest.raises(DecodertError, match="soft-capping has no CachedAttention plugin kernel"):
        export_model(tiny_checkpoint("gemma2"), tmp_path / "p", target="trt", max_seq=32, progress=False,
                     plugins="always")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("overrides,match", [
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
])
def test_gemma3_rejects_what_it_cannot_run(overrides, match):
    """(use_bidirectional_attention, EmbeddingGemma's, is read: the export refuses it without --embeddings and
    LLM.prepare refuses to generate with it, tests/runtime/test_embeddings.py.)"""
    with pytest.raises(DecodertError, match=match):
        _spec("gemma3", **overrides)
    with pytest.raises(DecodertError, match="text_config"):
        gemma3.spec_from_hf({"model_type": "gemma3"})


def test_gemma3_gguf_follows_llama_cpp_rules():
    """llama.cpp stores no pattern, local base or softmax scale for gemma3: every 6th layer is full, the
    local base is 10000, the scale 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 62-layer 27B."""
    meta = gguf_meta("gemma3", **{"block_count": 12, "attention.key_length": 32, "attention.sliding_window": 512})
    s = gemma3.spec_from_gguf(meta)
    assert layer_types(s) == ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",)
    assert s.local_rope == RopeSpec(theta=10000.0) and s.rope.theta == 10000.0 and window(s) == 512
    assert s.attention.scale == 32 ** -0.5 and s.embed_scale == 8.0 and s.sandwich_norm and s.attention.qk_norm
    big = gemma3.spec_from_gguf(gguf_meta("gemma3", **{"block_count": 62, "attention.key_length": 32,
                                                       "attention.sliding_window": 512}))
    assert big.attention.scale == (64 / 4) ** -0.5
    stored = gemma3.spec_from_gguf({**meta, "gemma3.attention.sliding_window_pattern": [True, False] * 6,
                                    "gemma3.rope.freq_base_swa": np.float32(500.0),
                                    "gemma3.attention.scale": np.float32(0.125)})
    assert layer_types(stored) == ("sliding", "full") * 6 and stored.local_rope.theta == 500.0
    assert stored.attention.scale == 0.125
    with pytest.raises(DecodertError, match="lists 2 layers"):
        gemma3.spec_from_gguf({**meta, "gemma3.attention.sliding_window_pattern": [True, False]})


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tiny_checkpoint, tmp_path):
    """model_type gemma3: text_config + model.language_model.* keys; the vision tower is left out."""
    src = tiny_checkpoint("gemma3")
    dst = tmp_path / "mm"
    shutil.copytree(src, dst)
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.vision_tower.patch_embedding.weight"] = np.zeros((2, 3), np.float32)
    save_file(tensors, dst / "model.safetensors")
    with open_checkpoint(src) as plain, open_checkpoint(dst) as mm:
        assert mm.spec == plain.spec and mm.names() == plain.names()
        for name in plain.names():
            np.testing.assert_array_equal(mm.tensor(name), plain.tensor(name))
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.language_model.layers.0.input_layernorm.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(DecodertError, match="both load as 'model.layers.0.input_layernorm.weight'"):
        open_checkpoint(dst)


@pytest.fixture(scope="module")
def gemma_exports(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(family: str, target: str):
        if (family, target) not in made:
            src = tiny_checkpoint(family)
            out = tmp_path_factory.mktemp(f"{family}-{target}") / "artifact"
            export_model(src, out, target=target, max_seq=64, progress=False)
            made[family, target] = out, transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        return made[family, target]

    return get


@pytest.mark.parametrize("target", ["ort", "portable"])
@pytest.mark.parametrize("family", GEMMAS)
def test_greedy_tokens_equal_transformers_past_the_window(gemma_exports, family, target):
    """24 greedy tokens (window 4): batch 1 and a ragged batch of 3 equal transformers' own decoding."""
    out, model = gemma_exports(family, target)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, model.config.vocab_size, n).astype(np.int64) for n in (9, 3, 6)]
    be = backend(out)
    batched = decodert_greedy(be, prompts, 24)
    for p, row in zip(prompts, batched):
        assert hf_reference(model, p, 24)[0] == row
    assert decodert_greedy(be, prompts[:1], 24)[0] == batched[0]


def test_embed_scale_is_rounded_to_the_graph_dtype(tiny_checkpoint, tmp_path):
    """transformers multiplies by sqrt(hidden) cast to the weights' dtype: fp16 graphs hold the fp16 value."""
    src = tiny_checkpoint("gemma3", hidden_size=80)
    export_model(src, tmp_path / "a", target="portable", dtype="fp16", max_seq=16, progress=False)
    graph = onnx.load(str(tmp_path / "a" / "decode.onnx")).graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    muls = [n for n in graph.node if n.op_type == "Mul" and n.name.startswith("/model/embed/")]
    assert len(muls) == 1
    scale = consts[muls[0].input[1]]
    assert scale.dtype == np.float16 and scale == np.float16(math.sqrt(80)) and scale != np.float32(math.sqrt(80))


def test_gemma3_plugin_export_runs_on_onnx_runtime(gemma_exports, tiny_checkpoint, tmp_path):
    """--plugins always: one CachedAttention node per layer with that layer's window and RoPE tables."""
    _, model = gemma_exports("gemma3", "ort")
    out = tmp_path / "plug"
    export_model(tiny_checkpoint("gemma3"), out, target="trt", max_seq=64, progress=False, plugins="always")
    graph = onnx.load(str(out / "decode.onnx"), load_external_data=False).graph
    attn = [n for n in graph.node if n.op_type == "CachedAttention"]
    windows = [next(a.i for a in n.attribute if a.name == "sliding_window") for n in attn]
    assert windows == [4, 0] and [n.input[6] for n in attn] == ["rope_local.cos", "rope.cos"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 512, n).astype(np.int64) for n in (7, 3)]
    assert logits_parity(out, [hf_reference(model, p, 9) for p in prompts], prompts, steps=8) < 1e-4


@pytest.mark.parametrize("family", GEMMAS)
def test_tiny_gguf_export_matches_transformers(family, tmp_path):
    """The GGUF llama.cpp's converter would write (norms as 1 + w, no lm_head) exports to the same logits."""
    path = make_tiny_gguf(family, tmp_path / f"{family}.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.with_suffix(".hf"), dtype=torch.float32)
    export_model(path, tmp_path / "a", target="ort", max_seq=64, progress=False)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 512, n).astype(np.int64) for n in (8, 5)]
    assert logits_parity(tmp_path / "a", [hf_reference(model, p, 11) for p in prompts], prompts, steps=10) < 1e-4


def test_int4_export_equals_transformers_with_the_rounded_weights(tiny_checkpoint, tmp_path):
    """Quantized Gemma 3 (tied: the embedding is gathered from the int4 head, then scaled) is exact to
    its rounded weights: transformers with every Linear replaced by dequantize(quantize(w))."""
    cfg = QuantConfig(bits=4, block_size=32)
    src = tiny_checkpoint("gemma3")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):  # lm_head is the embedding (tied): both rounded
                module.weight.copy_(torch.from_numpy(dequantize(quantize(module.weight.numpy(), cfg), cfg)))
    export_model(src, tmp_path / "q", target="ort", max_seq=64, progress=False, quant=cfg)
    graph = onnx.load(str(tmp_path / "q" / "decode.onnx"), load_external_data=False).graph
    assert {"GatherBlockQuantized", "MatMulNBits"} <= {n.op_type for n in graph.node}
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 512, n).astype(np.int64) for n in (10, 4)]
    assert logits_parity(tmp_path / "q", [hf_reference(model, p, 9) for p in prompts], prompts, steps=8) < 1e-4
