"""Quantized and narrower KV caches (``--kv-dtype``; plugins/ops/kv_dtypes.py, export/quantize/kv_calibrate.py).

Tiny random llama checkpoints, against the same model with an fp32 cache: logits close, the cache's bytes
halved / quartered / an eighth, ONNX Runtime's GroupQueryAttention codes equal to the standard-op Q/DQ
bodies', the prefix cache and sessions keeping the quantized rows, and one-line refusals.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from decodert.errors import DecodertError
from decodert.artifact.manifest import load_manifest
from decodert.export.pipeline import export_model
from decodert.plugins.ops import kv_dtypes
from decodert.plugins.onnx_builder import GraphBuilder
from decodert import LLM
from decodert.runtime.backends import memory
from decodert.runtime.backends.ort.backend import OrtBackend
from decodert.runtime.prefix_cache import PrefixCache

pytest.importorskip("transformers")

TEXTS = ["Once upon a time there was a small model", "def add(a, b):\n    return a + b"]  # text, as calibrated
# worst |logits - fp32 logits| / max |fp32 logits| over every row and step (tiny random llama, teacher-forced)
TOLERANCE = {"fp16": 2e-3, "int8": 0.03, "int4": 0.35}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def artifacts(ckpt, tmp_path_factory):
    made: dict[tuple[str, str], object] = {}

    def get(target: str, kv: str):
        if (target, kv) not in made:
            out = tmp_path_factory.mktemp(f"{target}-{kv}")
            export_model(ckpt, out, target=target, max_seq=64, max_batch=2, progress=False, kv_dtype=kv)
            made[target, kv] = out
        return made[target, kv]

    return get


def _prompts(out) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return [np.array(tok.encode(t).ids, np.int64) for t in TEXTS]


def _logits(out, steps: int = 12) -> list[np.ndarray]:
    """Prefill both prompts, then ``steps`` decode steps fed with the prompts' tokens: every row's logits."""
    be = OrtBackend(out, load_manifest(out), separate_decode=True)
    cache = be.allocate(2)
    prompts = _prompts(out)
    rows = [be.prefill(cache, [0, 1], prompts, want_logits=True).logits]
    fed = np.concatenate(prompts)[:steps]
    for j in range(steps):
        rows.append(be.decode(cache, [0, 1], np.array([fed[j], fed[-1 - j]], np.int64), want_logits=True).logits)
    return rows


@pytest.mark.parametrize("target,kv", [("ort", "fp16"), ("ort", "int8"), ("ort", "int4"), ("portable", "int8"),
                                       ("portable", "int4")])
def test_logits_close_to_fp32_cache(artifacts, target, kv):
    ref, got = _logits(artifacts(target, "fp32")), _logits(artifacts(target, kv))
    worst = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(ref, got))
    assert 0 < worst < TOLERANCE[kv]  # 0 would mean the cache was not narrowed at all


def test_ort_and_portable_store_the_same_codes(artifacts):
    """GQA's int8 / int4 codes are what the standard-op bodies write (one cache format per dtype)."""
    for kv in ("int8", "int4"):
        caches = []
        for target in ("ort", "portable"):
            be = OrtBackend(artifacts(target, kv), load_manifest(artifacts(target, kv)))
            cache = be.allocate(1)
            prompt = _prompts(artifacts(target, kv))[0]
            be.prefill(cache, [0], [prompt], want_logits=False)
            caches.append([b[0, :, : len(prompt)] for b in cache.buffers])
        if kv == "int4":  # compare the codes (nibbles): the float RoPE paths may round one code apart
            caches = [[np.stack([b & 15, b >> 4], -1).astype(np.int16) for b in c] for c in caches]
        diff = max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) for a, b in zip(*caches))
        assert diff <= 1, kv


def test_manifest_and_cache_bytes(artifacts):
    nbytes = {}
    for kv in ("fp32", "fp16", "int8", "int4"):
        m = load_manifest(artifacts("ort", kv))
        assert m.kv_dtype == kv and m.kv.dtype == kv_dtypes.KV_DTYPES[kv].storage
        assert m.kv.scales == ("per_channel" if kv in ("int8", "int4") else None)
        be = OrtBackend(artifacts("ort", kv), m)
        cache = be.allocate(2)
        nbytes[kv] = sum(b.nbytes for b in cache.buffers)
        assert be.kv_bytes(64) * 2 == nbytes[kv]
    assert nbytes["fp16"] * 2 == nbytes["int8"] * 4 == nbytes["int4"] * 8 == nbytes["fp32"]


def test_scales_per_channel_in_the_graphs(artifacts):
    g = onnx.load(str(artifacts("ort", "int8") / "decode.onnx"), load_external_data=False).graph
    scales = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer if t.name.startswith("kv_scale.")}
    assert sorted(scales) == ["kv_scale.key.0", "kv_scale.key.1", "kv_scale.value.0", "kv_scale.value.1"]
    k = scales["kv_scale.key.0"]
    assert k.shape == (1, 2, 1, 16) and (k > 0).all() and np.ptp(k) > 0  # one per (head, channel)
    np.testing.assert_array_equal(k[..., :8], k[..., 8:])  # a RoPE pair shares its scale
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all({a.name: a for a in n.attribute}["k_quant_type"].s == b"PER_CHANNEL" for n in gqa)


def test_prefix_cache_and_sessions_keep_the_quantized_rows(artifacts):
    art = artifacts("ort", "int8")
    off, on = LLM.load(art, prefix_cache_mb=0), LLM.load(art)
    on.prefix_cache = PrefixCache(on.backend, 1 << 20, 4)
    prompt = "Hello world! How are you today? The quick brown fox"
    expected = off.generate(prompt, max_new_tokens=6, temperature=0).token_ids
    assert on.generate(prompt, max_new_tokens=6, temperature=0).token_ids == expected
    again = on.generate(prompt, max_new_tokens=6, temperature=0)
    assert again.metrics.cached_tokens >= 4
    entries = list(on.prefix_cache._entries.values())
    assert entries and all(e.kv.dtype == np.int8 for e in entries)  # int8 blocks: a quarter of fp32's
    session = on.session()
    r = session.chat("Hello", max_new_tokens=4, temperature=0)
    assert r.token_ids == off.chat([{"role": "user", "content": "Hello"}], max_new_tokens=4, temperature=0).token_ids


def test_memory_error_names_the_kv_dtype(artifacts, monkeypatch):
    be = OrtBackend(artifacts("ort", "int8"), load_manifest(artifacts("ort", "int8")))
    be16 = OrtBackend(artifacts("ort", "fp16"), load_manifest(artifacts("ort", "fp16")))  # loading checks the weights
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(DecodertError, match="int8 KV cache needs .* lower --max-seq or --max-batch$"):
        be.allocate(1)
    with pytest.raises(DecodertError, match="fp16 KV cache .* or a smaller --kv-dtype"):
        be16.allocate(1)
    kv = kv_dtypes.KV_DTYPES
    assert memory.kv_cache_bytes(2, 64, 3, 2, 16, kv["int8"]) * 4 == memory.kv_cache_bytes(2, 64, 3, 2, 16, kv["fp32"])
    assert memory.kv_cache_bytes(2, 64, 3, 2, 16, kv["int4"]) * 2 == memory.kv_cache_bytes(2, 64, 3, 2, 16, kv["int8"])


@pytest.mark.parametrize("target,kv,message", [
    ("ort", "fp8", "no float8 KV cache kernel"), ("portable", "fp8", "ScatterND"),
    ("ort", "bf16", "no bf16 cache"), ("trt", "int8", "TensorScatter"), ("ort", "int3", "unknown --kv-dtype")])
def test_refused_in_one_line(ckpt, tmp_path, target, kv, message):
    with pytest.raises(DecodertError, match=message) as e:
        export_model(ckpt, tmp_path / "x", target=target, max_seq=32, progress=False, kv_dtype=kv)
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


def test_manifest_refuses_an_unknown_kv_dtype(artifacts, tmp_path):
    import shutil

    art = shutil.copytree(artifacts("ort", "int8"), tmp_path / "a")
    data = json.loads((art / "manifest.json").read_text())
    data["kv_dtype"] = "int2"
    (art / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DecodertError, match="kv_dtype 'int2'"):
        load_manifest(art, verify="none")


@pytest.mark.parametrize("kv,cache_type,width", [("int8", TensorProto.INT8, 16), ("int4", TensorProto.UINT8, 8)])
def test_store_body_writes_gqa_codes(kv, cache_type, width):
    """GroupQueryAttention (PER_CHANNEL, no rotary) stores exactly ``store_body``'s codes, and
    ``load_body`` reads them back to within half a step."""
    rng = np.random.default_rng(0)
    h, hkv, d, s = 4, 2, 16, 5
    qkv = (rng.standard_normal((1, s, (h + 2 * hkv) * d)) * 3).astype(np.float32)
    scale = (0.05 + rng.random((1, hkv, 1, d)) * 0.2).astype(np.float32)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, sh) for n, sh in (("qkv", [1, s, qkv.shape[2]]),
                                                                                 ("ks", [1, hkv, 1, d]))]
    cache = [helper.make_tensor_value_info(n, cache_type, [1, hkv, 8, width]) for n in ("pk", "pv")]
    lens = [helper.make_tensor_value_info("sk", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("tl", TensorProto.INT32, [])]
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sk", "tl", "", "", "", "", "", "ks", "ks"],
                            ["y", "prk", "prv"], domain="com.microsoft", num_heads=h, kv_num_heads=hkv,
                            k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                            kv_cache_bit_width=kv_dtypes.KV_DTYPES[kv].bits)
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in (("y", TensorProto.FLOAT), ("prk", cache_type),
                                                                    ("prv", cache_type))]
    model = helper.make_model(helper.make_graph([node], "g", [io[0], *cache, *lens, io[1]], outs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    np_type = np.int8 if kv == "int8" else np.uint8
    zeros = np.zeros((1, hkv, 8, width), np_type)
    _, prk, _ = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"qkv": qkv, "pk": zeros, "pv": zeros, "sk": np.array([s - 1], np.int32), "tl": np.array(s, np.int32),
               "ks": scale})
    k = qkv[0, :, h * d:(h + hkv) * d].reshape(1, s, hkv, d).transpose(0, 2, 1, 3)  # [1,Hkv,S,D]
    stored, loaded = _run_bodies(k, scale, kv_dtypes.KV_DTYPES[kv])
    np.testing.assert_array_equal(prk[:, :, :s], stored)
    step = np.broadcast_to(scale, k.shape)
    inside = np.abs(k) <= step * kv_dtypes.KV_DTYPES[kv].qmax
    assert (np.abs(loaded - k)[inside] <= step[inside] / 2 + 1e-6).all()


def _run_bodies(x: np.ndarray, scale: np.ndarray, kv: kv_dtypes.KVDtype) -> tuple[np.ndarray, np.ndarray]:
    g = GraphBuilder("bodies", {"": 21})
    g.input("x", "fp32", list(x.shape))
    g.input("scale", "fp32", list(scale.shape))
    stored = kv_dtypes.store_body(g, "x", "scale", kv, "fp32")
    g.output(stored, "stored", kv.storage, [1, x.shape[1], x.shape[2], kv.width(x.shape[3])])
    g.output(kv_dtypes.load_body(g, stored, "scale", kv, "fp32"), "loaded", "fp32", list(x.shape))
    sess = ort.InferenceSession(g.to_model(ir_version=10).SerializeToString(), providers=["CPUExecutionProvider"])
    stored_v, loaded_v = sess.run(None, {"x": x, "scale": scale})
    return stored_v, loaded_v


def test_speculative_verify_reads_the_quantized_cache(artifacts):
    """The ort verify graph (standard-op attention) writes and reads the same int8 codes as GQA: prompt-lookup
    speculation answers as plain greedy decoding does."""
    llm = LLM.load(artifacts("ort", "int8"), prefix_cache_mb=0)
    prompt = "Once upon a time there was a small model. Once upon a time there was a small"
    plain = llm.generate(prompt, max_new_tokens=16, temperature=0).token_ids
    assert llm.generate(prompt, max_new_tokens=16, temperature=0, speculative="ngram").token_ids == plain


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_hybrid_models_take_a_quantized_kv_cache(tiny_checkpoint, tmp_path, family):
    """An int8 K/V cache beside a hybrid's conv / recurrent states: the scales are calibrated with zero states,
    the states stay in their own float type (not the K/V codes), and the answer stays the float cache's."""
    src = tiny_checkpoint(family)
    out = {}
    for kv in ("fp32", "int8"):
        export_model(src, tmp_path / kv, max_seq=64, max_batch=2, progress=False, kv_dtype=kv)
        llm = LLM.load(tmp_path / kv)
        cache = llm.backend.allocate(1)
        assert all(np.dtype(t).kind == "f" for t in cache.state_dtypes) and cache.state_dtypes
        out[kv] = llm.generate(list(range(5, 19)), max_new_tokens=8, stop_token_ids=[], logprobs=True)
    same = next((i for i, (a, b) in enumerate(zip(out["int8"].token_ids, out["fp32"].token_ids)) if a != b), 8)
    assert same >= 5, (out["int8"].token_ids, out["fp32"].token_ids)
    np.testing.assert_allclose([t.logprob for t in out["int8"].logprobs[:same]],
                               [t.logprob for t in out["fp32"].logprobs[:same]], atol=0.05)
