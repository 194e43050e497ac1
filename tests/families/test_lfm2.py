"""LFM2 (gated short convolutions beside GQA): a hybrid model whose conv layers keep a rolling state.

The battery (tests/helpers/battery.py) on a tiny random checkpoint with every layer kind and a kernel of 4
(prompts and decode steps longer than the conv window): logits and greedy tokens of the ort, portable and trt
graphs against transformers, batching, speculation and sessions over the states, TensorRT-RTX builds and the
emulated trt backend, the manifest's states, a GGUF in llama.cpp's layout. Here: the spec, a hybrid draft
model, a session's states resumed from the prefix cache (more: tests/runtime/test_prefix_hybrid.py), inspect.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from battery import Family, LlamaCppGguf, Parity, Refused, Runtime, States, TrtBuild, TrtEmulator
from parity import random_prompts
from tiny import tiny_config

from decodert.errors import DecodertError
from decodert.export.pipeline import export_model
from decodert.models import family_for
from decodert.runtime.llm import LLM, Request
from decodert.runtime.decoding.sampling import SamplingParams
from decodert.runtime.speculation.speculative import SpeculativeConfig


def make_lfm2_gguf(src: Path, path: Path) -> Path:
    """The tiny checkpoint as llama.cpp's converter writes it (names from the gguf package's LFM2 map)."""
    import gguf
    from safetensors.numpy import load_file
    from tiny import _gguf_tokenizer_meta

    cfg = json.loads((src / "config.json").read_text())
    weights = load_file(src / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), "lfm2")
    arch, heads = "lfm2", cfg["num_attention_heads"]
    kv = [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in cfg["layer_types"]]
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]),
                       ("feed_forward_length", weights["model.layers.0.feed_forward.w1.weight"].shape[0]),
                       ("attention.head_count", heads), ("vocab_size", cfg["vocab_size"]),
                       ("shortconv.l_cache", cfg["conv_L_cache"])):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_array(f"{arch}.attention.head_count_kv", kv)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6))
    _gguf_tokenizer_meta(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, cfg["num_hidden_layers"])
    for key, w in weights.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        if key.endswith("conv.conv.weight"):
            w = w.reshape(w.shape[0], -1)  # the converter squeezes the taps to [C, K]
        writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def conv_engines(engines: dict, m, quant) -> None:
    """Two conv layers (TensorRT convolutions) and their states bound as engine io like K/V."""
    for name, rec in engines.items():
        assert rec.layers["CONVOLUTION"] == 2, (name, rec.layers)
        io = {t["name"]: t for t in rec.io["inputs"]}
        assert io["past_conv.2"]["shape"] == ["batch", 64, 3], name


LFM2 = Family("lfm2", max_seq=160, lengths=(11, 5, 1),  # ragged, one row shorter than the conv window
              trt_layers=conv_engines, kinds=("conv", "attention", "conv"), kv_layers=(1,),
              states=((0, "conv", ("batch", 64, 3)), (2, "conv", ("batch", 64, 3))),
              ops=(("ort", "prefill", frozenset({"CausalConvWithState"}), frozenset()),),
              refused=(({"layer_types": ["conv", "sliding_mamba", "conv"]}, "sliding_mamba"),),
              gguf=make_lfm2_gguf, llama_cpp_tol=1e-4,
              drafts_hit=False)  # its greedy text (conv weights scaled up: tests/helpers/tiny.py) repeats no n-gram


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator, States, Refused, LlamaCppGguf):
    entries = (LFM2,)


@pytest.fixture(scope="module")
def lfm2(family_artifacts):
    """(the tiny checkpoint, target -> its fp32 export), the battery's."""
    return family_artifacts.source(LFM2), lambda target: family_artifacts.artifact(LFM2, target)


def test_spec_declares_the_layer_kinds_and_states():
    spec = family_for("lfm2").spec_from_hf(tiny_config("lfm2"))
    assert spec.layer_kinds == ("conv", "attention", "conv") and spec.kv_layers == (1,)
    assert spec.mixer(0).kernel == 4 and spec.attention.qk_norm and spec.tie_word_embeddings
    assert spec.mlp_size(0) == 128  # Lfm2MLP: int(2 * 192 / 3) rounded up to a multiple of 32


def test_a_hybrid_draft_model_equals_plain(lfm2, tmp_path):
    """Greedy speculation with a hybrid draft model (the checkpoint with its conv output projections
    perturbed: it agrees with the target on some tokens, not all): rows that reject a draft go back
    to their snapshot and replay what they accepted; the draft model resumes from its own snapshot."""
    src, get = lfm2
    from safetensors.numpy import load_file, save_file

    draft_src = tmp_path / "draft-src"
    shutil.copytree(src, draft_src)
    weights = load_file(draft_src / "model.safetensors")
    rng = np.random.default_rng(1)
    for key in [k for k in weights if k.endswith("conv.out_proj.weight")]:
        weights[key] = (weights[key] + 0.01 * rng.standard_normal(weights[key].shape)).astype(np.float32)
    save_file(weights, draft_src / "model.safetensors", metadata={"format": "pt"})
    export_model(draft_src, tmp_path / "draft", target="ort", dtype="fp32", max_seq=160, max_batch=4, progress=False)
    llm = LLM.load(get("ort"), backend="ort", draft=tmp_path / "draft")
    ps = random_prompts((6, 9, 3), seed=4)
    plain = [llm.generate(p, max_new_tokens=30) for p in ps]
    fixed = SpeculativeConfig(method="draft", adaptive=False, draft_len=5)
    assert [llm.generate(p, max_new_tokens=30, speculative=fixed).token_ids for p in ps] == [r.token_ids for r in plain]
    prefills = []
    real = llm.backend.prefill
    llm.backend.prefill = lambda cache, slots, ids, want_logits: prefills.append(len(slots)) or real(cache, slots, ids, want_logits)
    batch = llm.generate_many([Request(p, SamplingParams(max_new_tokens=30), speculative=fixed) for p in ps])
    assert [r.token_ids for r in batch] == [r.token_ids for r in plain]
    rates = [r.metrics.acceptance_rate for r in batch]
    assert max(r.metrics.accepted_per_step for r in batch) > 1.0 and max(rates) < 1.0  # drafts accepted and rejected
    assert sum(prefills) == len(ps)  # the prompts only: rejections took their states from the pass's windows, no replay


def test_session_turns_with_the_prefix_cache_equal_reprefill(lfm2):
    _, get = lfm2
    llm = LLM.load(get("ort"), backend="ort", prefix_cache_mb=8)
    assert llm.prefix_cache is not None  # K/V blocks with states at block boundaries (tests/runtime/test_prefix_hybrid.py)
    session = llm.session(system="be brief")
    reused = []
    for question in ("Hello world!", "Why?", "Ok."):
        r = session.chat(question, max_new_tokens=8)
        again = llm.generate(llm.prepare(session.history[:-1], chat=True).ids, max_new_tokens=8)
        assert r.token_ids == again.token_ids
        assert session.last_turn.dropped_turns == 0
        reused.append(session.last_turn.reused_tokens)
    assert reused[0] == 0 and all(n > 0 for n in reused[1:])  # the row's states resumed, at least from the last prompt's end


def test_inspect_names_the_layer_kinds(lfm2):
    from decodert.export.artifact.inspect import inspect_artifact

    _, get = lfm2
    text = inspect_artifact(get("ort"))
    assert "layers     2 conv, 1 attention; states conv.0 ['batch', 64, 3], conv.2 ['batch', 64, 3]" in text


def test_gguf_metadata_without_layer_kinds_is_one_line():
    lfm2 = family_for("lfm2")
    meta = {"general.architecture": "lfm2", "lfm2.attention.head_count_kv": 2, "lfm2.shortconv.l_cache": 3}
    with pytest.raises(DecodertError, match="per-layer 'lfm2.attention.head_count_kv'"):
        lfm2.spec_from_gguf(meta)
    with pytest.raises(DecodertError, match="shortconv.l_cache"):
        lfm2.spec_from_gguf({"general.architecture": "lfm2", "lfm2.attention.head_count_kv": [0, 2]})
