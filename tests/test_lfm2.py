"""LFM2 (gated short convolutions beside GQA): a hybrid model whose conv layers keep a rolling state.

Against transformers on a tiny random checkpoint with every layer kind and a kernel of 4 (prompts and
decode steps longer than the conv window): logits and greedy tokens for the ort, portable and trt
graphs (the trt graph run by ONNX Runtime), a ragged batch equal to the singles; then the runtime
over the state: speculative equals plain, a session's turns equal re-prefill (the prefix cache: tests/test_prefix_hybrid.py).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parity import backend, check_greedy, hf_reference, logits_parity, random_prompts  # noqa: E402
from tiny import make_tiny_checkpoint, tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.artifact.manifest import load_manifest  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.models import family_for  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402
from decodert.runtime.speculation.speculative import SpeculativeConfig  # noqa: E402


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    src = make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2-src"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    made: dict[str, Path] = {}

    def get(target: str) -> Path:
        if target not in made:
            made[target] = tmp_path_factory.mktemp(f"lfm2-{target}")
            export_model(src, made[target], target=target, dtype="fp32", max_seq=160, max_batch=4, progress=False)
        return made[target]

    return src, model, get


def test_spec_declares_the_layer_kinds_and_states():
    spec = family_for("lfm2").spec_from_hf(tiny_config("lfm2"))
    assert spec.layer_kinds == ("conv", "attention", "conv") and spec.kv_layers == (1,)
    assert spec.mixer(0).kernel == 4 and spec.attention.qk_norm and spec.tie_word_embeddings
    assert spec.mlp_size(0) == 128  # Lfm2MLP: int(2 * 192 / 3) rounded up to a multiple of 32


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
def test_logits_and_greedy_match_transformers(lfm2, target):
    _, model, get = lfm2
    prompts = random_prompts((11, 5, 1))  # ragged: rows right-padded in one prefill, one shorter than the window
    refs = [hf_reference(model, p, 17) for p in prompts]
    assert logits_parity(get(target), refs, prompts) < 1e-4
    check_greedy(get(target), prompts, refs, 17)


def test_manifest_records_kinds_and_state_shapes(lfm2):
    _, _, get = lfm2
    m = load_manifest(get("ort"))
    assert m.kv.layer_kinds == ("conv", "attention", "conv") and m.kv.num_layers == 1 and m.kv.layers == (1,)
    assert [(s.layer, s.name, s.shape) for s in m.kv.states] == [(0, "conv", ("batch", 64, 3)), (2, "conv", ("batch", 64, 3))]
    names = {t.name for t in m.graphs["decode"].inputs}
    assert {"past_key.1", "past_conv.0", "past_conv.2"} <= names and "past_key.0" not in names
    import onnx

    graph = onnx.load(str(get("ort") / "prefill.onnx"), load_external_data=False)
    assert "CausalConvWithState" in {n.op_type for n in graph.graph.node}


def test_ort_binds_the_states_in_place(lfm2):
    _, _, get = lfm2
    be = backend(get("ort"))
    cache = be.allocate(2)
    be.prefill(cache, [0, 1], random_prompts((7, 3)), want_logits=False)
    assert [s.shape for s in cache.states] == [(2, 64, 3), (2, 64, 3)]
    assert all(np.abs(s[r]).max() > 0 for s in cache.states for r in (0, 1))  # written by the graph, in place


def test_speculative_equals_plain(lfm2, tmp_path):
    """Greedy speculation with a hybrid draft model (the checkpoint with its conv output projections
    perturbed: it agrees with the target on some tokens, not all): rows that reject a draft go back
    to their snapshot and replay what they accepted; the draft model resumes from its own snapshot."""
    src, _, get = lfm2
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


def test_session_turns_equal_reprefill(lfm2):
    _, _, get = lfm2
    llm = LLM.load(get("ort"), backend="ort", prefix_cache_mb=8)
    assert llm.prefix_cache is not None  # K/V blocks with states at block boundaries (tests/test_prefix_hybrid.py)
    session = llm.session(system="be brief")
    reused = []
    for question in ("Hello world!", "Why?", "Ok."):
        r = session.chat(question, max_new_tokens=8)
        again = llm.generate(llm._chat_ids(session.history[:-1]), max_new_tokens=8)
        assert r.token_ids == again.token_ids
        assert session.last_turn.dropped_turns == 0
        reused.append(session.last_turn.reused_tokens)
    assert reused[0] == 0 and all(n > 0 for n in reused[1:])  # the row's states resumed, at least from the last prompt's end


def test_unknown_layer_kind_is_one_line(tmp_path):
    src = make_tiny_checkpoint("lfm2", tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config["layer_types"] = ["conv", "sliding_mamba", "conv"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match="sliding_mamba") as e:
        export_model(src, tmp_path / "out", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


def test_trt_graphs_build_with_tensorrt_rtx(tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build

    out = tmp_path / "art"
    export_model(make_tiny_checkpoint("lfm2", tmp_path / "m"), out, target="trt", dtype="fp16", max_seq=32,
                 max_batch=2, progress=False)
    trt_build.build_engines(out, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    for name in ("prefill", "decode", "verify"):
        layers = m["engines"][name]["layers"]
        assert layers["CONVOLUTION"] == 2 and layers["KV_CACHE_UPDATE"] == 2  # two conv layers, one attention layer
        io = {t["name"]: t for t in m["engines"][name]["io"]["inputs"]}
        assert io["past_conv.2"]["shape"] == ["batch", 64, 3]


def test_trt_backend_on_the_emulator(lfm2, monkeypatch):
    """The trt backend binds the states like K/V (tests/trt_emulator.py runs the engines' graphs on the CPU):
    the ort backend's tokens, a ragged batch, continuous batching and speculation at batch 2."""
    import trt_emulator

    _, _, get = lfm2
    art = get("trt")
    trt_emulator.emulate_engines(art)
    trt_emulator.install(monkeypatch)
    rng = np.random.default_rng(2)
    ps = [np.tile(rng.integers(3, 512, 5), 3), rng.integers(3, 512, 9), rng.integers(3, 512, 2)]
    with LLM.load(art, backend="ort") as ref, LLM.load(art, backend="trt") as llm:
        want = [ref.generate(p, max_new_tokens=20, temperature=0).token_ids for p in ps]
        assert [llm.generate(p, max_new_tokens=20, temperature=0).token_ids for p in ps] == want
        uneven = [SamplingParams(max_new_tokens=n, temperature=0) for n in (20, 5, 12)]  # rows end, slots move
        got = llm.generate_many([Request(p, sp) for p, sp in zip(ps, uneven)])
        assert [r.token_ids for r in got] == [w[: sp.max_new_tokens] for w, sp in zip(want, uneven)]
        fixed = SpeculativeConfig(adaptive=False, draft_len=6)
        reqs = [Request(p, SamplingParams(max_new_tokens=20, temperature=0), speculative=fixed) for p in ps[:2]]
        prefills = []
        real = llm.backend.prefill
        llm.backend.prefill = lambda cache, slots, ids, want_logits: prefills.append(len(slots)) or real(cache, slots, ids, want_logits)
        got = llm.generate_many(reqs)
        assert [r.token_ids for r in got] == want[:2]
        assert llm.backend.stats["verify_runs"] > 0 and sum(prefills) == 2  # rejections used the windows: no replay


def test_continuous_batching_more_requests_than_slots(lfm2):
    """Six requests of uneven lengths over four slots: rows finish, new ones are admitted into the freed
    slots and the active rows are moved together (move_slot copies the states too); each equals its single run."""
    _, _, get = lfm2
    llm = LLM.load(get("ort"), backend="ort")
    ps = random_prompts((3, 14, 6, 1, 9, 5), seed=3)
    lengths = (12, 3, 20, 7, 5, 16)
    alone = [llm.generate(p, max_new_tokens=n).token_ids for p, n in zip(ps, lengths)]
    got = llm.generate_many([Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(ps, lengths)])
    assert [r.token_ids for r in got] == alone


def test_inspect_names_the_layer_kinds(lfm2):
    from decodert.export.artifact.inspect import inspect_artifact

    _, _, get = lfm2
    text = inspect_artifact(get("ort"))
    assert "layers     2 conv, 1 attention; states conv.0 ['batch', 64, 3], conv.2 ['batch', 64, 3]" in text


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


def test_gguf_as_llama_cpp_writes_it(lfm2, tmp_path):
    """An lfm2 GGUF in llama.cpp's layout: llama.cpp itself (llama-cpp-python) reads it as transformers' model
    (so the layout and metadata are llama.cpp's), and decodert's export of it gives transformers' logits."""
    src, model, _ = lfm2
    path = make_lfm2_gguf(src, tmp_path / "tiny-lfm2.gguf")
    prompt = random_prompts((13,), seed=3)[0]
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0)  # an F32 KV cache
    llm.eval(list(map(int, prompt)))
    want = model(torch.tensor([list(map(int, prompt))])).logits[0, -1].detach().numpy()
    assert np.abs(np.asarray(llm.scores[len(prompt) - 1]) - want).max() < 1e-4 * np.abs(want).max()
    out = tmp_path / "out"
    export_model(path, out, target="ort", dtype="fp32", max_seq=32, max_batch=1, progress=False)
    assert load_manifest(out).kv.layer_kinds == ("conv", "attention", "conv")
    assert logits_parity(out, [hf_reference(model, prompt, 9)], [prompt], steps=8) < 1e-4


def test_gguf_metadata_without_layer_kinds_is_one_line():
    lfm2 = family_for("lfm2")
    meta = {"general.architecture": "lfm2", "lfm2.attention.head_count_kv": 2, "lfm2.shortconv.l_cache": 3}
    with pytest.raises(DecodertError, match="per-layer 'lfm2.attention.head_count_kv'"):
        lfm2.spec_from_gguf(meta)
    with pytest.raises(DecodertError, match="shortconv.l_cache"):
        lfm2.spec_from_gguf({"general.architecture": "lfm2", "lfm2.attention.head_count_kv": [0, 2]})
