"""``decodert export`` of an encoder-decoder family (``ENCODER_DECODER``, models/family.py): Whisper.

Both graphs follow the target's lowering (its ``seq2seq_*`` methods; a target with Target.encoder_decoder):
ort: com.microsoft GroupQueryAttention (self, in place) and MultiHeadAttention (cross, encoder); trt: standard ops
TensorRT parses: TensorScatter-24 into the cache and the decomposed attention, MatMul/Softmax/MatMul elsewhere.

    encoder.onnx   the encoder over one 30 s window, and every decoder layer's cross-attention K/V of it:
      input_features [B, M, 2T] fp32                          (T = max_source_positions, 1500: 3000 mel frames)
        x = gelu(conv2(gelu(conv1(features))))                [B, C, T]  (kernel 3, padding 1; conv2 stride 2)
        x = x^T + positions                                   [B, T, C]
        per layer: x += o(attention(q, k, v of LayerNorm(x)));  x += fc2(gelu(fc1(LayerNorm(x))))
        encoder_hidden = LayerNorm(x)                         [B, T, C]
        cross_key.i = encoder_hidden @ xk_i^T                 [B, H, T, D]  (no bias; heads split once here)
        cross_value.i = encoder_hidden @ xv_i^T + xv_bias_i   [B, H, T, D]
    decoder.onnx   one step (a prompt or one token a row) over the self-attention cache and the cross K/V:
      input_ids [B, S] int64, past_lengths [B] int64 (every row's tokens in the cache: all rows equal, the
      prompt is forced and a finished row keeps stepping), past_key.i / past_value.i [B, H, S_max, D] (bound as
      present_key.i / present_value.i too: written in place), cross_key.i / cross_value.i [B, H, T, D] (read only)
        x = embed[ids] (x sqrt C when scale_embedding) + positions[past + arange(S)]
        per layer: x += o(GQA(q, k, v of LN(x), past))        causal self-attention, the new K/V written in place
                   x += xo(MultiHeadAttention(xq(LN(x)), cross_key.i, cross_value.i))
                   x += fc2(gelu(fc1(LN(x))))
        logits = LN(x)[:, S-1] @ lm_head^T                    [B, V]

The cross K/V are computed once per window by encoder.onnx and bound like the cache (runtime/audio/whisper.py);
the decoder never projects the encoder output. Weights are stored once in weights.bin, [in, out] (transposed
at export; the head [V, C] as stored, read by a Gemm, and not stored again when tied to embed_tokens), both
graphs reading it as external data. ``seq2seq.json`` records the spec, the graphs' I/O, the
log-mel settings, the generation config and the files' digests (artifact/seq2seq.py).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from decodert.artifact.seq2seq import write_seq2seq
from decodert.export.artifact import destination
from decodert.artifact.weights import WeightsWriter
from decodert.errors import DecodertError
from decodert.export.lowering.audio.encoder_layers import encoder_layer, gelu, layer_norm, matmul, mlp, separate_qkv
from decodert.export.lowering.lowering import Lowering
from decodert.export.lowering.targets import TARGETS, get_target
from decodert.models import family_for
from decodert.plugins.onnx_builder import GraphBuilder

ENCODER_FILE, DECODER_FILE, WEIGHTS_FILE = "encoder.onnx", "decoder.onnx", "weights.bin"
OPSET = 17


def is_encoder_decoder(src: str | Path) -> bool:
    """Whether ``src`` is an HF folder whose model_type's family is an encoder-decoder one."""
    config = Path(src).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    try:
        return family_for(str(model_type)).encoder_decoder
    except DecodertError:
        return False


def export_seq2seq(src: str | Path, out_dir: str | Path, target: str = "ort", dtype: str = "fp32",
                   max_batch: int = 4, **unsupported: Any) -> dict:
    """Write the artifact of encoder-decoder checkpoint ``src`` into ``out_dir`` -> its seq2seq.json record."""
    src, out = Path(src).expanduser(), Path(out_dir).expanduser()
    given = sorted(k for k, v in unsupported.items() if v not in (None, False, (), "auto", "never"))
    if given:
        raise DecodertError(f"--{given[0].replace('_', '-')} does not apply to {src}, an encoder-decoder model "
                            "(exported for the ort target in fp32 at its own decoder length; no quantization, LoRA "
                            "or extra graphs yet)")
    chosen = get_target(target)
    if not chosen.encoder_decoder or dtype != "fp32":
        targets = " or ".join(t.name for t in TARGETS.values() if t.encoder_decoder)
        raise DecodertError(f"{src}: an encoder-decoder model (whisper) exports to --target {targets} with "
                            f"--dtype fp32 only (got {target}, {dtype})")
    if not 1 <= max_batch <= 64:
        raise DecodertError(f"--max-batch {max_batch} must be between 1 and 64")
    config = _json(src / "config.json")
    family = family_for(str(config.get("model_type")), str(src / "config.json"))
    spec = family.spec_from_hf(config)
    features = family.window_features(_json(src / "preprocessor_config.json", {}), spec)
    generation = family.generation(config, _json(src / "generation_config.json", {}))
    tensors = _read_safetensors(src)
    tokenizer = src / "tokenizer.json"
    if not tokenizer.is_file():
        raise DecodertError(f"{src}: no tokenizer.json (the artifact decodes the text with it)")
    out = destination.prepare(out)  # an empty folder, or a decodert artifact to replace
    with destination.staging(out) as tmp:
        writer = WeightsWriter(tmp / WEIGHTS_FILE)
        weights = _write_weights(writer, spec, family.hf_weights, tensors, src)
        writer.close()
        low = chosen.lowering
        enc, dec = build_encoder(spec, weights, low), build_decoder(spec, weights, spec.max_target_positions, low)
        for model, name in ((enc, ENCODER_FILE), (dec, DECODER_FILE)):
            onnx.save_model(model, tmp / name)
            onnx.checker.check_model(str(tmp / name), full_check=True)
        shutil.copy(tokenizer, tmp / "tokenizer.json")
        record = write_seq2seq(tmp, {"family": family.name, "target": target, "dtype": dtype,
                                     "max_batch": max_batch, "spec": spec.to_dict(), "features": features,
                                     "generation": generation,
                                     "graphs": {"encoder": ENCODER_FILE, "decoder": DECODER_FILE}},
                               [ENCODER_FILE, DECODER_FILE, WEIGHTS_FILE, "tokenizer.json"])
        destination.swap_in(tmp, out)
    return record


def _json(path: Path, default: Any = None) -> dict:
    if not path.is_file():
        if default is not None:
            return default
        raise DecodertError(f"{path}: no such file")
    try:
        value = json.loads(path.read_text())
    except ValueError as e:
        raise DecodertError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise DecodertError(f"{path}: not a JSON object")
    return value


def _read_safetensors(src: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise DecodertError(f"{src}: no .safetensors weights")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _names(table: dict[str, str], spec: Any) -> list[tuple[str, str]]:
    """(canonical, checkpoint key) of every weight, {i} expanded over the encoder's or the decoder's layers."""
    out = []
    for canon, key in table.items():
        if "{i}" not in canon:
            out.append((canon, key))
            continue
        layers = spec.encoder_layers if canon.startswith("enc.") else spec.decoder_layers
        out += [(canon.format(i=i), key.format(i=i)) for i in range(layers)]
    return out


def _write_weights(writer: WeightsWriter, spec: Any, table: dict[str, str], tensors: dict[str, np.ndarray],
                   src: Path) -> dict[str, onnx.TensorProto]:
    """Every canonical weight into weights.bin (2-D linear weights transposed to [in, out])."""
    out: dict[str, onnx.TensorProto] = {}
    for canon, key in _names(table, spec):
        if canon == "dec.lm_head" and (spec.tie_word_embeddings or key not in tensors):
            if not spec.tie_word_embeddings:
                raise DecodertError(f"{src}: tie_word_embeddings is false but the checkpoint has no {key}")
            continue  # tied: the head reads dec.embed (no second copy)
        if key not in tensors:
            raise DecodertError(f"{src}: the checkpoint has no tensor {key} ({canon})")
        w = np.asarray(tensors[key], np.float32)
        linear = w.ndim == 2 and canon not in ("dec.embed", "dec.lm_head", "enc.positions", "dec.positions")
        out[canon] = writer.add(canon, np.ascontiguousarray(w.T) if linear else w, "fp32")
    return out


def build_encoder(spec: Any, weights: dict[str, onnx.TensorProto], low: type[Lowering]) -> onnx.ModelProto:
    g = GraphBuilder("decodert_whisper_encoder", {"": OPSET})
    c, t, eps = spec.d_model, spec.max_source_positions, spec.layer_norm_eps
    g.input("input_features", "fp32", ["batch", spec.num_mel_bins, 2 * t])
    for name, tensor in weights.items():
        if name.startswith("enc.") or name.endswith(("xk", "xv", "xv_bias")):
            g.add_initializer(tensor)
    with g.scope("encoder"):
        with g.scope("conv"):
            x = gelu(g, g.op("Conv", "input_features", "enc.conv1", "enc.conv1_bias", kernel_shape=[3], pads=[1, 1]))
            x = gelu(g, g.op("Conv", x, "enc.conv2", "enc.conv2_bias", kernel_shape=[3], strides=[2], pads=[1, 1]))
            x = g.op("Add", g.op("Transpose", x, perm=[0, 2, 1]), "enc.positions")  # [B, T, C]
        linear = matmul(g)  # weights stored [in, out]
        attend = lambda q, k, v: low.encoder_attention(g, q, k, v, spec.encoder_heads,  # noqa: E731
                                                       c // spec.encoder_heads, np.float32)
        for i in range(spec.encoder_layers):
            with g.scope(f"layers.{i}"):
                x = encoder_layer(g, x, f"enc.layers.{i}.", eps, linear, separate_qkv(linear, f"enc.layers.{i}."), attend)
        x = layer_norm(g, x, "enc.norm", eps)
    g.output(x, "encoder_hidden", "fp32", ["batch", t, c])
    heads, d = spec.decoder_heads, spec.head_dim
    with g.scope("cross"):
        for i in range(spec.decoder_layers):
            p = f"dec.layers.{i}."
            for kind, y in (("key", linear(x, p + "xk")), ("value", linear(x, p + "xv", p + "xv_bias"))):
                y = g.op("Transpose", g.op("Reshape", y, g.const([0, t, heads, d])), perm=[0, 2, 1, 3])
                g.output(y, f"cross_{kind}.{i}", "fp32", ["batch", heads, t, d])
    return g.to_model()


def build_decoder(spec: Any, weights: dict[str, onnx.TensorProto], max_seq: int, low: type[Lowering]) -> onnx.ModelProto:
    g = GraphBuilder("decodert_whisper_decoder", low.seq2seq_opsets)
    linear = matmul(g)
    c, t, eps = spec.d_model, spec.max_source_positions, spec.layer_norm_eps
    heads, d = spec.decoder_heads, spec.head_dim
    g.input("input_ids", "int64", ["batch", "seq"])
    g.input("past_lengths", "int64", ["batch"])
    for i in range(spec.decoder_layers):
        for kind in ("key", "value"):
            g.input(f"past_{kind}.{i}", "fp32", ["batch", heads, max_seq, d])
    for i in range(spec.decoder_layers):
        for kind in ("key", "value"):
            g.input(f"cross_{kind}.{i}", "fp32", ["batch", heads, t, d])
    for name, tensor in weights.items():
        if name.startswith("dec.") and not name.endswith(("xk", "xv", "xv_bias")):
            g.add_initializer(tensor)
    with g.scope("embed"):
        seq = g.op("Gather", g.op("Shape", "input_ids"), g.const(1), axis=0)  # S (scalar)
        steps = g.op("Range", g.const(np.array(0, np.int64)), seq, g.const(np.array(1, np.int64)))  # [S]
        positions = g.op("Add", g.op("Unsqueeze", "past_lengths", g.const([1])), g.op("Unsqueeze", steps, g.const([0])))
        x = g.op("Gather", "dec.embed", "input_ids", axis=0)  # [B, S, C]
        if spec.scale_embedding:
            x = g.op("Mul", x, g.const(np.array(math.sqrt(c), np.float32)))
        x = g.op("Add", x, g.op("Gather", "dec.positions", positions, axis=0))
        ctx = low.seq2seq_context(g, "past_lengths", "input_ids", max_seq)
    for i in range(spec.decoder_layers):
        p = f"dec.layers.{i}."
        with g.scope(f"layers.{i}"):
            with g.scope("self_attn"):
                h = layer_norm(g, x, p + "ln1", eps)
                q, k, v = linear(h, p + "q", p + "q_bias"), linear(h, p + "k"), linear(h, p + "v", p + "v_bias")
                cache = (f"past_key.{i}", f"past_value.{i}", f"present_key.{i}", f"present_value.{i}")
                y = low.seq2seq_self_attention(g, ctx, q, k, v, cache, "past_lengths", heads, d, max_seq)
                x = g.op("Add", x, linear(y, p + "o", p + "o_bias"))
            with g.scope("cross_attn"):
                q = linear(layer_norm(g, x, p + "lnx", eps), p + "xq", p + "xq_bias")
                y = low.seq2seq_cross_attention(g, q, f"cross_key.{i}", f"cross_value.{i}", heads, d)  # [B, H, T, D] K/V
                x = g.op("Add", x, linear(y, p + "xo", p + "xo_bias"))
            x = mlp(g, x, p, eps, linear)
    with g.scope("head"):
        last = g.op("Sub", seq, g.const(np.array(1, np.int64)))
        x = g.op("Gather", layer_norm(g, x, "dec.norm", eps), last, axis=1)  # [B, C] the last position
        head = "dec.embed" if spec.tie_word_embeddings else "dec.lm_head"  # [V, C]
        logits = g.op("Gemm", x, head, transB=1)  # [B, V]
    g.output(logits, "logits", "fp32", ["batch", spec.vocab_size])
    for i in range(spec.decoder_layers):
        for kind in ("key", "value"):
            g.outputs.append(onnx.helper.make_tensor_value_info(f"present_{kind}.{i}", onnx.TensorProto.FLOAT,
                                                                ["batch", heads, max_seq, d]))
    return g.to_model(ir_version=low.ir_version)
