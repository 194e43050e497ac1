"""``decodert inspect OUT``: the manifest and a summary of each graph (ops, I/O, weight bytes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from decodert.artifact.seq2seq import is_seq2seq_artifact
from decodert.artifact.manifest import SourceRecord, load_manifest
from decodert.artifact.onnx_check import load_graph
from decodert.export.checkpoints.sampling_defaults import describe
from decodert.export.quantize.weight_layouts import NBITS


def graph_summary(path: Path) -> dict[str, Any]:
    model = load_graph(path)  # DecodertError for a damaged file
    ops = Counter(f"{n.domain}::{n.op_type}" if n.domain else str(n.op_type) for n in model.graph.node)
    weight_bytes = 0
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        length = str(info.get("length", ""))
        weight_bytes += int(length) if length.isdigit() else len(t.raw_data)
    return {"opsets": {str(o.domain) or "ai.onnx": o.version for o in model.opset_import},
            "nodes": len(model.graph.node), "ops": dict(sorted(ops.items())), "weight_bytes": weight_bytes}


# MatMulNBits accuracy_level: the type the activations are computed in (0 = unset, fp32)
ACCURACY_COMPUTE = {0: "fp32", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}


def weight_precision(m: Any) -> str:
    """'fp32', or e.g. 'int4 (fp32 compute)' / 'int4+int8 (int8 activations, accuracy level 4)' (m: a Manifest)."""
    q = m.quant
    if q is None:
        return m.dtype
    bits = sorted({w.bits for w in q.per_weight.values()} or {q.bits})
    weights = "+".join(f"int{b}" for b in bits)
    if q.layout != NBITS.name:  # block DequantizeLinear, dequantized to the graph's dtype: the accuracy level plays no part
        return f"{weights} ({m.dtype} compute)"
    compute = ACCURACY_COMPUTE.get(q.accuracy_level, "?")
    if compute == "fp32" and m.dtype == "fp32":
        return f"{weights} (fp32 compute, accuracy level {q.accuracy_level})"
    return f"{weights} ({compute} activations, accuracy level {q.accuracy_level})"


def quant_line(m: Any) -> str:
    """``inspect``'s quantization line: bits, block size, accuracy level, zero points, where the weights came from."""
    q = m.quant
    if q is None:
        return f"none ({m.dtype} weights)"
    stored = list(q.per_weight.values())
    symmetric = sorted({w.symmetric for w in stored} or {q.symmetric})
    sym = {(True,): "symmetric", (False,): "asymmetric (zero points)"}.get(tuple(symmetric), "symmetric and asymmetric")
    exact = sum(w.source == "transcoded" for w in stored)
    parts = [weight_precision(m), f"block {q.block_size}", sym, f"layout {q.layout}",
             f"{len(stored)} weights ({exact} transcoded exactly, {len(stored) - exact} rounded)",
             "output projection quantized" if q.lm_head else "output projection in float"]
    if any(w.block_min for w in stored):
        parts.append("Q4_1 block minimums kept")
    return ", ".join(parts)


def _mib(n: Any) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, (int, float)) else f"{n!r} bytes"


def inspect_seq2seq(folder: Path) -> str:
    """An encoder-decoder artifact (artifact/seq2seq.py): its shape, graphs, features and forced prompt."""
    from decodert.artifact.seq2seq import read_seq2seq

    r = read_seq2seq(folder, verify="fast")
    s, f, g = r["spec"], r["features"], r["generation"]
    return "\n".join([
        f"artifact   {folder}",
        f"model      {r['family']} (encoder-decoder): encoder {s['encoder_layers']} layers, decoder "
        f"{s['decoder_layers']} layers, d_model {s['d_model']}, heads {s['encoder_heads']}/{s['decoder_heads']}, "
        f"vocab {s['vocab_size']}",
        f"target     {r['target']}  dtype {r['dtype']}  max_batch {r['max_batch']}  decoder positions "
        f"{s['max_target_positions']}",
        f"graphs     {r['graphs']['encoder']} (30 s window -> cross K/V of every decoder layer), {r['graphs']['decoder']}",
        f"features   {f['n_mels']} mels, n_fft {f['n_fft']}, hop {f['hop_length']}, {f['sampling_rate']} Hz, windows of "
        f"{f['window_samples'] / f['sampling_rate']:g} s",
        f"prompt     start {g['decoder_start_token_id']}, {len(g['lang_to_id'])} languages, tasks "
        f"{', '.join(sorted(g['task_to_id'])) or 'none'}, no-timestamps {g['no_timestamps_token_id']}; "
        f"{len(g['suppress_tokens'])} suppressed tokens, {len(g['begin_suppress_tokens'])} at the start",
        f"weights    weights.bin  {_mib(r['files']['weights.bin']['size'])}",
    ])


def inspect_artifact(folder: str | Path) -> str:
    folder = Path(folder)
    if is_seq2seq_artifact(folder):
        return inspect_seq2seq(folder)
    m = load_manifest(folder, verify="fast")
    spec = m.model
    source = m.source or SourceRecord()
    lines = [
        f"artifact   {folder}",
        f"model      {spec.family}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"heads {spec.num_heads}/{spec.num_kv_heads} x {spec.head_dim}, vocab {spec.vocab_size}",
        f"target     {m.target}  dtype {m.dtype}  kv_dtype {m.kv_dtype or m.dtype}  max_seq {m.max_seq}  "
        f"max_batch {m.max_batch}",
        f"quant      {quant_line(m)}",
        f"weights    {m.weights.file}  {_mib(m.weights.bytes)}",
        f"source     {source.kind}: {source.path}",
        f"sampling   {describe(m.sampling)}",
        f"made by    decodert {m.decodert_version} onnx {m.onnx_version} on {m.created}",
    ]
    if m.kv.states:  # a hybrid model: which layers keep K/V and which keep states
        kinds = {kind: sum(k == kind for k in m.kv.layer_kinds) for kind in dict.fromkeys(m.kv.layer_kinds)}
        states = ", ".join(f"{st.name}.{st.layer} {list(st.shape)}" for st in m.kv.states[:2])
        more = f" (+ {len(m.kv.states) - 2} more)" if len(m.kv.states) > 2 else ""
        lines.insert(2, "layers     " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + f"; states {states}{more}")
    graphs = [("prefill", m.graphs["prefill"]), ("decode", m.graphs["decode"])]
    if m.vision is not None:  # vision-language: the tower + projector, and the image processor it was exported with
        v, p = m.vision.spec, m.vision.processor
        if "max_pixels" in p:  # Qwen-VL: patch rows of any image size, min/max pixels
            lines.append(f"vision     {v['num_layers']} layers ({v.get('tower')}), hidden {v['hidden_size']}, "
                         f"{v['patch_size']}-px patches, {v['scale_factor']}x{v['scale_factor']} merge -> a token per "
                         f"{v['patch_size'] * v['scale_factor']} px square; {p['min_pixels']}..{p['max_pixels']} pixels")
            if p.get("video"):  # runtime/vision/qwen_video.py
                vid = p["video"]
                rate = f"{vid['fps']} frames/s sampled" if vid["do_sample_frames"] and vid.get("fps") else "every frame"
                lines.append(f"video      {rate}, frame pairs as grid slices, {vid['min_pixels']}..{vid['max_pixels']} "
                             f"pixels{' over the clip' if vid['sampling'] == 'qwen3' else ' a frame'}"
                             f"{', timestamps' if vid.get('timestamps') else ''}")
        else:
            size = p["size"]
            resize = f"{size['longest_edge']} px" if "longest_edge" in size else f"{size['height']}x{size['width']}"
            lines.append(f"vision     {v['num_layers']} layers, hidden {v['hidden_size']}, {v['image_size']}-px tiles of "
                         f"{v['patch_size']}-px patches, {v.get('connector', 'pixel_shuffle')} {v['scale_factor']} -> "
                         f"{p['image_seq_len']} tokens a tile; resize to {resize}, "
                         f"splitting {'on' if p.get('do_image_splitting') else 'off'}")
        graphs.append(("vision", m.vision.graph))
    if m.audio is not None:  # audio-language: the encoder + projector, and the log-mel settings (runtime/audio/)
        a, f = m.audio.spec, m.audio.features
        shape = (f"chunks of {2 * a['n_window']} frames, windows of {a['n_window_infer']}" if "n_window" in a else
                 f"blocks of {a['chunk']} rows, {a['context_left'] - 1} rows of left and {a['context_right']} of right "
                 "context")  # the gemma4 conformer
        lines.append(f"audio      {a['num_layers']} layers ({a.get('encoder')}), d_model {a['hidden_size']}, "
                     f"{f['n_mels']} mels at {f['sampling_rate']} Hz (hop {f['hop_length']}), {shape}")
        graphs.append(("audio", m.audio.graph))
    for name, pg in (m.phase_graphs or {}).items():  # export/phase_graphs.py: another backend's graph of a phase
        graphs.append((f"{name} (for OpenVINO; weights {pg.weights})", pg.graph))
    for kind, g in graphs:
        s = graph_summary(folder / g.file)
        lines.append(f"\n{kind}: {g.file}  {s['nodes']} nodes  opsets {s['opsets']}")
        lines.append("  ops     " + ", ".join(f"{k} x{v}" for k, v in s["ops"].items()))
        for io_kind, tensors in (("inputs", g.inputs), ("outputs", g.outputs)):
            shown = [io for io in tensors if not io.name.startswith(("past_", "present_")) or io.name.endswith(".0")]
            text = ", ".join(f"{io.name} {io.dtype}{list(io.shape)}" for io in shown)
            lines.append(f"  {io_kind:7} {text}" + (f" (+ {len(tensors) - len(shown)} more per layer)" if len(shown) < len(tensors) else ""))
    if m.engines:
        lines.append("\nengines: " + ", ".join(m.engines))
    lines.append("\nfiles:   " + ", ".join(f"{k} ({v.size} B)" for k, v in m.files.items()))
    return "\n".join(lines)
