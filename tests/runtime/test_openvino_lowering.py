"""runtime/backends/openvino/lowering.py: the ort graph's GroupQueryAttention as OpenVINO's SDPA (placement's
``openvino-sdpa``), checked on one GroupQueryAttention node against attention written here in numpy: rotary
positions after the past rows, the K/V heads shared by their query groups, the causal mask offset by the past."""

import numpy as np
import pytest

from decodert.errors import DecodertError

pytest.importorskip("openvino")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

H, HKV, D, MAX = 6, 2, 16, 128


def _gqa_graph(path, **attrs):
    """One com.microsoft GroupQueryAttention over packed QKV with its rotary tables, as the ort target writes it."""
    rng = np.random.default_rng(5)
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    angles = np.arange(MAX)[:, None] * inv[None]
    tables = [helper.make_tensor(n, TensorProto.FLOAT, t.shape, t.astype(np.float32).ravel())
              for n, t in (("cos", np.cos(angles)), ("sin", np.sin(angles)))]
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key.0", "past_value.0", "seqlens_k", "total",
                                                    "cos", "sin"], ["out", "present_key.0", "present_value.0"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=HKV, do_rotary=1, **attrs)
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "gqa",
        [helper.make_tensor_value_info("qkv", f, [1, "s", (H + 2 * HKV) * D]),
         helper.make_tensor_value_info("past_key.0", f, [1, HKV, "p", D]),
         helper.make_tensor_value_info("past_value.0", f, [1, HKV, "p", D]),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("out", f, [1, "s", H * D]),
         helper.make_tensor_value_info("present_key.0", f, [1, HKV, "t", D]),
         helper.make_tensor_value_info("present_value.0", f, [1, HKV, "t", D])], tables)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return rng


def _reference(qkv, past_k, past_v, p):
    """numpy: rotate-half RoPE at positions p.., concat the past, each K/V head for H / HKV query heads, causal."""
    s = qkv.shape[1]
    x = qkv.reshape(1, s, H + 2 * HKV, D).transpose(0, 2, 1, 3)
    q, k, v = x[:, :H], x[:, H : H + HKV], x[:, H + HKV :]
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    ang = np.arange(p, p + s)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(t):
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    k_all = np.concatenate([past_k, rope(k)], 2)
    v_all = np.concatenate([past_v, v], 2)
    ke, ve = np.repeat(k_all, H // HKV, 1), np.repeat(v_all, H // HKV, 1)
    scores = rope(q) @ ke.transpose(0, 1, 3, 2) / np.sqrt(D)
    allowed = np.arange(p + s)[None, :] <= np.arange(p, p + s)[:, None]
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w @ ve).transpose(0, 2, 1, 3).reshape(1, s, H * D), k_all, v_all


@pytest.mark.parametrize("lowering, exact", [("sdpa", True), ("paged", True), ("paged", False)])
@pytest.mark.parametrize("past, s", [(0, 9), (7, 9), (40, 9), (0, 70), (32, 31)])
def test_lowered_attention_is_numpy_attention(tmp_path, past, s, lowering, exact):
    """Fresh and after held rows: the attention and the new K/V rows. Paged: the held rows written into its blocks
    and the new ones read back from them by the runner, in part blocks and whole ones (32 rows a block), in f32
    (exact) and in the bf16 blocks of a bf16 run (within bf16's rounding)."""
    import openvino as ov

    from decodert.runtime.backends.openvino.native import NativePrefill

    rng = _gqa_graph(tmp_path / "gqa.onnx")
    runner = NativePrefill(tmp_path / "gqa.onnx", threads=1, exact=exact, lowering=lowering)
    assert not runner.paged or runner.block == 32
    qkv = rng.standard_normal((1, s, (H + 2 * HKV) * D)).astype(np.float32)
    past_k, past_v = (rng.standard_normal((1, HKV, past, D)).astype(np.float32) for _ in range(2))
    feeds = {"qkv": qkv, "seqlens_k": np.array([past + s - 1], np.int32), "total": np.array(past + s, np.int32)}
    if lowering == "paged":
        cache = _Cache(1, HKV, D)
        cache.buffers[0][:, :, :past], cache.buffers[1][:, :, :past] = past_k, past_v
        cache.lengths[0] = past
        feeds.update(runner.paged_feeds(cache, 0, past, s, ["key.0", "value.0"]))
    else:
        feeds.update({"past_key.0": past_k, "past_value.0": past_v})
    for name, arr in feeds.items():
        if name in runner.names:
            runner.request.set_tensor(name, arr if isinstance(arr, ov.Tensor) else ov.Tensor(arr))
    runner.request.infer()
    if lowering == "paged":  # the new rows, read back from the blocks the attention wrote them into
        runner.collect(cache, 0, past, s)
        got = [runner.request.get_tensor("out").data, *(b[:, :, : past + s] for b in cache.buffers)]
    else:
        got = [runner.request.get_tensor(n).data for n in ("out", "present_key.0", "present_value.0")]
    want = list(_reference(qkv, past_k, past_v, past))
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.abs(g - w).max() < (1e-4 if exact else 0.02 * np.abs(w).max())


@pytest.mark.parametrize("lowering", ["sdpa", "paged"])
@pytest.mark.parametrize("attrs, named", [({"softcap": 30.0}, "softcap"), ({"local_window_size": 4}, "local_window_size"),
                                          ({"rotary_interleaved": 1}, "rotary_interleaved")])
def test_what_it_does_not_lower_is_refused(tmp_path, attrs, named, lowering):
    from decodert.runtime.backends.openvino.native import NativePrefill

    _gqa_graph(tmp_path / "gqa.onnx", **attrs)
    with pytest.raises(DecodertError, match=f"OpenVINO cannot compile the graph.*{named}"):
        NativePrefill(tmp_path / "gqa.onnx", threads=1, exact=True, lowering=lowering)


def test_int4_lowering_is_the_frontends_translation(tiny_checkpoint, tmp_path):
    """On an int4 ort prefill (q/k/v and gate/up fused MatMulNBits), in f32: the lowered graph (one FullyConnected
    per projection, no split left) gives OpenVINO's own translation's logits and new K/V rows, fresh and after a past."""
    from decodert.artifact.manifest import load_manifest
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig
    from decodert.runtime.backends.openvino.native import NativePrefill

    art = tmp_path / "int4"
    export_model(tiny_checkpoint("llama"), art, target="ort", max_seq=64, max_batch=1,
                 quant=QuantConfig(bits=4, accuracy_level=4), progress=False)
    m = load_manifest(art)
    runners = [NativePrefill(art / m.graphs["prefill"].file, threads=1, exact=True, lowering=k)
               for k in ("frontend", "sdpa", "paged")]
    kinds = [{o.get_rt_info()["layerType"].astype(str) for o in r.request.get_compiled_model().get_runtime_model().get_ops()}
             for r in runners]
    assert "Split" in kinds[0] and "Split" not in kinds[1] and "Split" not in kinds[2]
    assert "PagedAttention" in kinds[2] and "PagedAttention" not in kinds[1]
    ids = np.random.default_rng(11).integers(0, m.model.vocab_size, 20)
    kv = m.kv
    for past in (0, 12):
        outs = []
        for r in runners:
            cache = _Cache(kv.num_layers, kv.num_kv_heads, kv.head_dim)
            if past:
                runners[0].run(cache, 0, ids[:past])  # the same held rows for both
                cache.lengths[0] = past
            outs.append((r.run(cache, 0, ids[past:]), [b.copy() for b in cache.buffers]))
        for logits, buffers in outs[1:]:
            assert np.abs(outs[0][0] - logits).max() < 1e-4
            assert max(np.abs(a - b).max() for a, b in zip(outs[0][1], buffers)) < 1e-4


class _Cache:
    """What NativePrefill.run reads of a KVCache: the buffers [1, H_kv, max, D], the lengths, the layers."""

    def __init__(self, layers, heads, dim):
        self.buffers = [np.zeros((1, heads, MAX, dim), np.float32) for _ in range(2 * layers)]
        self.lengths = np.zeros(1, np.int64)
        self.kv_layers = list(range(layers))


def test_a_graph_openvino_cannot_read_names_the_ops(tiny_checkpoint, tmp_path):
    """A mixture-of-experts prefill (com.microsoft.QMoE, which OpenVINO's ONNX frontend has no rule for): the error
    names the op, not OpenVINO's source location."""
    from decodert.artifact.manifest import load_manifest
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig
    from decodert.runtime.backends.openvino.native import NativePrefill

    art = tmp_path / "moe"
    export_model(tiny_checkpoint("qwen3_moe"), art, target="ort", max_seq=64, max_batch=1,
                 quant=QuantConfig(bits=4, accuracy_level=4), progress=False)
    for lowering in ("frontend", "paged"):
        with pytest.raises(DecodertError, match=r"OpenVINO cannot compile the graph \(No conversion rule found for operations: "
                                                r"com\.microsoft\.QMoE"):
            NativePrefill(art / load_manifest(art).graphs["prefill"].file, threads=1, lowering=lowering)


@pytest.mark.parametrize("exact", [True, False])
def test_int4_embedding_gather_is_numpy_dequantization(tmp_path, exact):
    """com.microsoft GatherBlockQuantized (the int4 embedding table) lowered to a gather over the u4 codes: the rows
    numpy dequantizes (two codes a byte, the low nibble first; (code - zero point) * scale per block of 32), in f32
    exactly and in a bf16 run within f16's rounding of the scales."""
    import openvino as ov

    from decodert.runtime.backends.openvino.native import NativePrefill

    rng = np.random.default_rng(21)
    v, k, block = 50, 64, 32
    values = rng.integers(0, 16, (v, k)).astype(np.uint8)
    packed = (values[:, 0::2] | (values[:, 1::2] << 4)).reshape(v, k // block, block // 2)
    scales = rng.uniform(0.01, 0.1, (v, k // block, 1)).astype(np.float32)
    zeros = rng.integers(0, 16, (v, k // block, 1)).astype(np.uint8)
    node = helper.make_node("GatherBlockQuantized", ["table", "ids", "scales", "zeros"], ["rows"], domain="com.microsoft",
                            bits=4, block_size=block, gather_axis=0, quantize_axis=2)
    graph = helper.make_graph(
        [node], "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, "s", k])],
        [onnx.numpy_helper.from_array(a, n) for a, n in ((packed, "table"), (scales, "scales"), (zeros, "zeros"))])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]),
              str(tmp_path / "embed.onnx"))
    runner = NativePrefill(tmp_path / "embed.onnx", threads=1, exact=exact, lowering="sdpa")
    ids = rng.integers(0, v, (1, 7))
    runner.request.set_tensor("ids", ov.Tensor(ids))
    runner.request.infer()
    want = ((values.reshape(v, k // block, block).astype(np.float32) - zeros) * scales).reshape(v, k)[ids]
    got = runner.request.get_tensor("rows").data
    assert np.abs(got - want).max() <= (1e-6 if exact else 2e-3 * np.abs(want).max())
