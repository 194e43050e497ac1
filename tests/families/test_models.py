"""Family files: config / GGUF metadata -> ModelSpec, weight tables, llama's GGUF row permutation; and the
battery (tests/helpers/battery.py) of the llama-shaped families (llama, llama3, tied llama, mistral, qwen2, qwen3,
phi3): every target's logits and greedy tokens against transformers, batching, speculation, sessions,
TensorRT-RTX builds and the emulated trt backend at fp16."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import numpy as np
import pytest

from battery import Family, Parity, Runtime, TrtBuild, TrtEmulator, attention_engines
from tiny import FAMILIES, HYBRIDS, MOE_FAMILIES, OWN_CONFIGS, gguf_meta, tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints.checkpoint import source_keys  # noqa: E402
from decodert.models import families, family_for, family_names, registry  # noqa: E402
from decodert.models.family import Family as ModelFamily  # noqa: E402
from decodert.models.families import llama, mistral, phi3, qwen2, qwen3  # noqa: E402
from decodert.models.canonical import canonical_names  # noqa: E402
from decodert.models.layers import AttentionSpec, DenseMLPSpec, LayerSpec  # noqa: E402
from decodert.models.spec import ModelSpec, RopeSpec  # noqa: E402

MODULES = (llama, mistral, qwen2, qwen3, phi3)


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator):
    entries = tuple(Family(f, trt_layers=attention_engines, emulator="fp16",
                           lengths=(70, 9, 33) if f == "mistral" else (11, 4, 7))  # the long row crosses mistral's window (64)
                    for f in ("llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3", "phi3"))


def hf(family: str, **overrides) -> ModelSpec:
    config = tiny_config(family, **overrides)
    return family_for(config["model_type"]).spec_from_hf(config)


def test_family_for_known_and_unknown():
    for module in MODULES:
        for t in (*module.MODEL_TYPES, *module.GGUF_ARCHITECTURES):
            assert family_for(t).module is module and family_for(t) == ModelFamily.of(module)
    assert family_for("LLAMA").module is llama
    with pytest.raises(DecodertError) as e:
        family_for("gpt_neox", "/x/config.json")
    assert str(e.value) == (
        f"unknown architecture 'gpt_neox' in /x/config.json; supported: {', '.join(family_names())}"
    )
    assert {"llama", "mistral", "phi3", "qwen2", "qwen3"} <= set(family_names())


def test_registry_is_built_from_the_declarations():
    """Every file in models/families/ is found, under each name it declares, and only there."""
    reg = registry()
    assert set(MODULES) <= {f.module for f in reg.values()}
    folder = Path(__file__).resolve().parents[2] / "models" / "families"
    assert {f.name for f in families()} == {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    for family in families():
        declared = {n.lower() for n in (*family.model_types, *family.gguf_architectures)}
        assert {name for name, f in reg.items() if f is family} == declared
        assert callable(family.spec_from_hf) and family.hf_weights
        if family.gguf_architectures:  # a family that reads GGUF files
            assert callable(family.spec_from_gguf) and family.gguf_weights
    assert {f.name for f in families() if "vision" in f.tags} == {f.name for f in families() if f.vision_from_hf}
    assert family_for("qwen3_5_moe").tags == {"hybrid", "moe", "vision"} and family_for("llama").tags == set()


@pytest.mark.parametrize("declarations,match", [
    (dict(spec_from_hf=len, HF_WEIGHTS={"embed": "e"}), "declares no MODEL_TYPES"),
    (dict(MODEL_TYPES=("x",), HF_WEIGHTS={"embed": "e"}), "declares no spec_from_hf"),
    (dict(MODEL_TYPES="x", spec_from_hf=len, HF_WEIGHTS={"embed": "e"}), "MODEL_TYPES must be a tuple of strings"),
    (dict(MODEL_TYPES=("x",), spec_from_hf=len, HF_WEIGHTS={"embed": "e"}, GGUF_ARCHITECTURES=("x",)),
     "GGUF_ARCHITECTURES needs spec_from_gguf and GGUF_WEIGHTS"),
    (dict(MODEL_TYPES=("x",), spec_from_hf=len, HF_WEIGHTS={"embed": "e"}, TAGS=("dense",)), "TAGS 'dense'"),
    (dict(MODEL_TYPES=("x",), spec_from_hf=len, HF_WEIGHTS={"embed": "e"}, vision_from_hf=len,
          VISION_WEIGHTS={"v": "v"}), "tagged 'vision'"),
    (dict(MODEL_TYPES=("x",), spec_from_hf=len, HF_WEIGHTS={"embed": "e"}, hf_fix=3), "hf_fix must be a function"),
    (dict(MODEL_TYPES=("x",), spec_from_hf=len, HF_WEIGHTS={"embed": "e"}, ENCODER_DECODER=True, generation=len),
     "ENCODER_DECODER = True, window_features and generation come together"),
    (dict(MODEL_TYPES=("x",), spec_from_hf=len, HF_WEIGHTS={"embed": "e"}, window_features=len, generation=len),
     "ENCODER_DECODER = True, window_features and generation come together"),
])
def test_a_family_file_missing_a_part_is_refused_naming_it(declarations, match):
    module = types.ModuleType("decodert.models.families.broken")
    module.__dict__.update(declarations)
    with pytest.raises(TypeError, match=match) as e:
        ModelFamily.of(module)
    assert "decodert.models.families.broken" in str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_canonical_name_has_a_source(family):
    spec = hf(family)
    family = family_for(spec.family)
    for table in (family.hf_weights, family.gguf_weights):
        for name in canonical_names(spec):
            keys = source_keys(table, name)
            assert all("{i}" not in k for k in keys)
            if name.startswith("layers.1."):
                assert all(".1." in k for k in keys)


def test_spec_values_from_tiny_configs():
    s = hf("llama")
    assert (s.family, s.vocab_size, s.hidden_size, s.mlp_size(0), s.num_layers) == ("llama", 512, 64, 128, 2)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.attention.group_size) == (4, 2, 16, 2)
    assert s.rms_norm_eps == 1e-5 and s.max_position == 1024 and s.rope == RopeSpec(theta=10000.0)
    assert (s.bos_token_id, s.eos_token_ids, s.tie_word_embeddings) == (0, (2,), False)
    assert s.layers == (LayerSpec(AttentionSpec(4, 2, 16), DenseMLPSpec(128)),) * 2  # one instance, every layer
    assert s.layers[0] is s.layers[1]
    assert hf("llama_tied").tie_word_embeddings
    assert hf("mistral").attention.window == 64 and hf("mistral").num_kv_heads == 1
    assert hf("mistral", sliding_window=None).attention.window is None
    q2 = hf("qwen2").attention
    assert q2.qkv_bias and not q2.qk_norm and hf("qwen2").rope.theta == 1e6
    q3 = hf("qwen3").attention
    assert q3.qk_norm and not q3.qkv_bias and (q3.head_dim, q3.num_kv_heads, q3.qkv_rows) == (32, 4, 384)


def test_llama3_rope_scaling_both_config_styles():
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    want = RopeSpec(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=8192)
    v4 = llama.spec_from_hf(tiny_config("llama", rope_theta=500000.0, rope_scaling=rope))
    v5 = llama.spec_from_hf(tiny_config("llama", rope_parameters={**rope, "rope_theta": 500000.0}))
    assert v4.rope == want and v5.rope == want and hf("llama3").rope == want
    assert hf("llama3").eos_token_ids == (2, 0)


def test_linear_rope_and_head_dim_default():
    s = hf("llama", head_dim=None, rope_scaling={"type": "linear", "factor": 2.0})
    assert s.head_dim == 16 and s.rope.scaling == "linear" and s.rope.factor == 2.0
    np.testing.assert_allclose(s.rope.inv_freq(16), RopeSpec().inv_freq(16) / 2)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])  # yarn: tests/families/test_gpt_oss.py
def test_unsupported_rope_types(kind):
    with pytest.raises(DecodertError, match=f"rope scaling '{kind}' is not supported yet"):
        hf("llama", rope_scaling={"rope_type": kind, "factor": 2.0})


def test_phi3_rope_and_partial_rotary():
    s = hf("phi3")
    assert s.family == "phi3" and s.head_dim == 16 and s.rope.rotary_dim == 8
    assert hf("phi3", partial_rotary_factor=None).rope.rotary_dim is None
    assert hf("phi3", sliding_window=2047).attention.window == 2047
    for kind in ("longrope", "su"):
        with pytest.raises(DecodertError, match=f"rope scaling '{kind}' is not supported yet"):
            hf("phi3", rope_scaling={"type": kind, "short_factor": [1.0], "long_factor": [1.0]})


@pytest.mark.parametrize("overrides,match", [
    (dict(num_local_experts=8, num_experts_per_tok=2), "mixture-of-experts"),
    (dict(num_experts=4), "mixture-of-experts"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=3), "not a multiple"),
])
def test_rejects_unsupported_llama_configs(overrides, match):
    with pytest.raises(DecodertError, match=match):
        hf("llama", **overrides)


def test_rejects_qwen_sliding_layers_and_missing_fields():
    with pytest.raises(DecodertError, match="sliding window"):
        hf("qwen2", use_sliding_window=True)
    with pytest.raises(DecodertError, match="sliding window"):
        hf("qwen3", layer_types=["sliding_attention", "full_attention"])
    config = tiny_config("llama")
    del config["hidden_size"]
    with pytest.raises(DecodertError, match="'hidden_size'"):
        llama.spec_from_hf(config)


def test_spec_from_gguf_metadata():
    s = llama.spec_from_gguf(gguf_meta("llama"))
    assert (s.num_layers, s.hidden_size, s.mlp_size(0), s.num_heads, s.num_kv_heads, s.head_dim) == (
        2, 64, 128, 4, 2, 16)
    assert s.rms_norm_eps == 1e-5 and s.rope.theta == 10000.0 and s.max_position == 2048
    assert (s.bos_token_id, s.eos_token_ids, s.vocab_size) == (1, (2, 7), 512)
    q3 = qwen3.spec_from_gguf(gguf_meta("qwen3", **{"attention.key_length": 32}))
    assert q3.attention.qk_norm and q3.head_dim == 32
    assert qwen2.spec_from_gguf(gguf_meta("qwen2")).attention.qkv_bias
    p3 = phi3.spec_from_gguf(gguf_meta("phi3", **{"rope.dimension_count": 8, "attention.sliding_window": 2047}))
    assert p3.rope.rotary_dim == 8 and p3.attention.window == 2047
    lin = llama.spec_from_gguf(gguf_meta("llama", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}))
    assert lin.rope.scaling == "linear" and lin.rope.factor == 4.0
    with pytest.raises(DecodertError, match="rope scaling 'yarn'"):
        llama.spec_from_gguf(gguf_meta("llama", **{"rope.scaling.type": "yarn"}))
    with pytest.raises(DecodertError, match="mixture-of-experts"):
        llama.spec_from_gguf(gguf_meta("llama", **{"expert_count": 8}))
    with pytest.raises(DecodertError, match="'llama.block_count'"):
        llama.spec_from_gguf({k: v for k, v in gguf_meta("llama").items() if k != "llama.block_count"})


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (rotate-half -> interleaved pairs)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, d, cols in ((4, 16, 8), (3, 64, 5), (1, 2, 3)):
        w = rng.standard_normal((heads * d, cols)).astype(np.float32)
        np.testing.assert_array_equal(llama.unpermute_rows(llama_cpp_permute(w, heads), heads), w)
    spec = llama.spec_from_gguf(gguf_meta("llama"))
    q = rng.standard_normal((64, 64)).astype(np.float32)
    k = rng.standard_normal((32, 64)).astype(np.float32)
    np.testing.assert_array_equal(llama.gguf_fix("blk.0.attn_q.weight", llama_cpp_permute(q, 4), spec), q)
    np.testing.assert_array_equal(llama.gguf_fix("blk.0.attn_k.weight", llama_cpp_permute(k, 2), spec), k)
    np.testing.assert_array_equal(llama.gguf_fix("blk.0.attn_v.weight", k, spec), k)


def test_llama3_rope_from_gguf_frequency_factors():
    spec = llama.spec_from_gguf(gguf_meta("llama", **{"rope.freq_base": 500000.0}))
    want = RopeSpec(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=8192)
    factors = (RopeSpec(theta=500000.0).inv_freq(16) / want.inv_freq(16)).astype(np.float32)
    assert llama.gguf_rope_freqs(spec, {}, factors).rope == want
    with pytest.raises(DecodertError, match="rope_freqs"):
        llama.gguf_rope_freqs(spec, {}, np.linspace(1, 3, 8, dtype=np.float32))


def test_every_family_is_tested():
    """Found by convention, not listed: every family is the family of a tiny config (tests/helpers/tiny.py) or is named,
    by its file name or a model_type, in a test file (its own tests/families/test_<family>.py, or the vision tests)."""
    tiny = {hf(f).family for f in FAMILIES + MOE_FAMILIES + HYBRIDS + tuple(OWN_CONFIGS)}
    sources = "\n".join(p.read_text() for p in Path(__file__).parents[1].rglob("test_*.py"))
    for family in families():
        names = (family.name, *family.model_types)
        assert family.name in tiny or any(f'"{n}"' in sources for n in names), f"no test names {family.name}"
    assert set(FAMILIES) >= {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma2", "smollm3"}
    assert {hf(f).attention.group_size for f in FAMILIES} >= {1, 2, 4}
    assert {hf(f).head_dim for f in FAMILIES} == {16, 32}


def test_family_declarations_default_to_llama_and_round_trip():
    s = hf("llama")
    assert (s.sandwich_norm, s.embed_scale, s.local_rope, s.final_softcap) == (False, None, None, None)
    a = s.attention
    assert (a.window, a.rope_table, a.scale, a.softcap, a.softmax_scale, s.mlp(0).activation) == (
        None, "rope", None, None, 0.25, "silu")
    assert [s.layer_window(i) for i in range(2)] == [None, None] and s.layer_rope(1) is s.rope
    m = hf("mistral")
    assert [m.is_sliding(i) for i in range(2)] == [True, True] and m.layer_window(0) == 64
    full = AttentionSpec(4, 2, 4, scale=0.5, softcap=50.0)
    sliding = dataclasses.replace(full, window=8, rope_table="rope_local")
    mlp = DenseMLPSpec(24, activation="gelu_tanh")
    mixed = ModelSpec("x", 32, 16, 1e-6, (LayerSpec(sliding, mlp), LayerSpec(full, mlp)), local_rope=RopeSpec(theta=10.0),
                      final_softcap=30.0, sandwich_norm=True, embed_scale=4.0)
    assert [mixed.layer_window(i) for i in range(2)] == [8, None]
    assert mixed.layer_rope(0).theta == 10.0 and mixed.layer_rope(1).theta == 10000.0
    assert ModelSpec.from_dict(mixed.to_dict()) == mixed
    assert ModelSpec.from_dict(json.loads(json.dumps(mixed.to_dict()))) == mixed  # through the manifest's JSON
    names = canonical_names(mixed)
    assert names[names.index("layers.0.o") + 1] == "layers.0.attn_out_norm"
    assert names[names.index("layers.0.down") + 1] == "layers.0.mlp_out_norm"


V1 = json.loads((Path(__file__).parents[1] / "fixtures" / "model_specs_v1.json").read_text())


@pytest.mark.parametrize("source", sorted(V1))
def test_format_1_specs_read_as_the_spec_they_were_written_from(source):
    """The flat model dict of artifacts exported before the layers were declared by kind (written by that exporter,
    tests/fixtures/model_specs_v1.json; the sources: scripts/graph_hashes.py's) reads as the spec today's family
    declares for the same checkpoint; every format-1 setting lands in the layer it describes."""
    flat, old = V1[source], ModelSpec.from_dict(V1[source])
    if source in tiny_configs():  # the tiny checkpoints' config.json is tiny_config's
        config = tiny_config(source)
        assert old == family_for(config["model_type"]).spec_from_hf(config)
    assert ModelSpec.from_dict(old.to_dict()) == old
    assert (old.num_layers, old.layer_kinds, old.head_dim) == (flat["num_layers"], tuple(flat["layer_kinds"]),
                                                               flat["head_dim"])
    assert [old.layer_window(i) for i in range(old.num_layers)] == [
        flat["sliding_window"] if (flat["layer_types"][i] == "sliding" if flat["layer_types"] else flat["sliding_window"])
        and old.layer_kind(i) == "attention" else None for i in range(old.num_layers)]
    assert [old.is_moe(i) for i in range(old.num_layers)] == [
        (flat["mlp_types"][i] == "moe") if flat["mlp_types"] else bool(flat["num_experts"]) for i in range(old.num_layers)]


def tiny_configs() -> set[str]:
    return set(FAMILIES) | set(MOE_FAMILIES) | set(HYBRIDS) | set(OWN_CONFIGS)


def test_a_format_1_dict_without_later_keys_takes_their_defaults():
    flat = {k: v for k, v in V1["llama"].items() if k not in ("activation", "layer_types", "local_rope", "nope_layers")}
    assert ModelSpec.from_dict(flat) == hf("llama")  # a manifest written before these keys existed


@pytest.mark.parametrize("make,match", [
    (lambda: DenseMLPSpec(8, activation="relu"), "activation 'relu'"),
    (lambda: AttentionSpec(4, 3, 4), "not a multiple"),
    (lambda: AttentionSpec(4, 2, 4, softcap=0.0), "softcap 0.0 must be positive"),
    (lambda: AttentionSpec(4, 2, 4, rope_table="rope_global"), "rope_table 'rope_global'"),
    (lambda: LayerSpec(None, None), "needs a mixer or an MLP"),
    (lambda: ModelSpec("x", 32, 16, 1e-6, (LAYER,) * 2, local_rope=RopeSpec(rotary_dim=2)), "same dims"),
    (lambda: ModelSpec("x", 32, 16, 1e-6, (LayerSpec(AttentionSpec(4, 2, 4, rope_table="rope_local"), None),)),
     "needs a local_rope"),
    (lambda: ModelSpec("x", 32, 16, 1e-6, [LAYER]), "tuple of LayerSpec"),
])
def test_bad_declarations_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


LAYER = LayerSpec(AttentionSpec(4, 2, 4), DenseMLPSpec(24))
