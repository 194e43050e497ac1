"""Draft heads as artifacts of their own: a head checkpoint exported beside the target artifact it drafts for.

    decodert export HEAD_FOLDER --target-artifact TARGET -o OUT
        OUT/head.json   what the head is (family), which target it belongs to (the sha256 of the target's
                        weights.bin, as the target's manifest records it), the target layers whose K/V it reads,
                        its graph's I/O
        OUT/head.onnx   its step graph (+ head.bin: the weights)

A head reads the target's last hidden state, which the target's graphs return only when exported with
``--hidden-states`` (export/lowering/io_contract.hidden_outputs); a target without them is refused in one line, as
is loading a head beside any other target. Families: gemma4_assistant (models/families/gemma4_assistant.py). The
Qwen3.5 / Qwen3-Next MTP layers and EAGLE-3 heads fit the same record: their graphs take the same hidden state
(EAGLE-3: three layers' features, more outputs of the same kind) and keep their own small K/V in a KVCache of
their own, rewound with the target's rows as the draft model's cache is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx

from decodert.errors import DecodertError
from decodert.artifact.graph_contract import kv_storage
from decodert.artifact.heads import HEAD_FAMILIES, HEAD_MANIFEST, has_hidden_states, load_head, target_identity  # noqa: F401
from decodert.artifact.manifest import load_manifest
from decodert.artifact.safetensors_file import SafetensorsFile
from decodert.models.families import gemma4_assistant as assistant_family

HEAD_GRAPH = "head.onnx"


def is_head_checkpoint(src: str | Path) -> bool:
    """Whether ``src`` is a draft head's checkpoint folder (its config.json names a head family)."""
    config = Path(src) / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("model_type") in HEAD_FAMILIES
    except (OSError, ValueError):
        return False


def export_head(src: str | Path, out_dir: str | Path, target_artifact: str | Path, dtype: str | None = None) -> dict:
    """Export the head checkpoint ``src`` for the target artifact ``target_artifact`` into ``out_dir``; returns
    head.json's record. ``dtype``: the target's unless given (fp32 | fp16)."""
    from decodert.export.heads.gemma4_assistant import build_head_graph, head_contract

    src, out = Path(src), Path(out_dir)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DecodertError(f"{src / 'config.json'}: cannot read ({e})") from None
    if config.get("model_type") not in HEAD_FAMILIES:
        raise DecodertError(f"{src}: model_type {config.get('model_type')!r} is not a draft head "
                            f"(supported: {', '.join(HEAD_FAMILIES)})")
    target = load_manifest(target_artifact)
    spec = assistant_family.spec_from_hf(config)
    tspec = target.model.spec()
    if not has_hidden_states(target):
        raise DecodertError(f"{target_artifact}: its graphs do not return the hidden state a head reads; "
                            "export the target again with --hidden-states")
    if spec.backbone_hidden_size != tspec.hidden_size or spec.vocab_size != tspec.vocab_size:
        raise DecodertError(f"{src}: the head drafts for a model of hidden size {spec.backbone_hidden_size} and "
                            f"vocabulary {spec.vocab_size}; {target_artifact} has {tspec.hidden_size} and {tspec.vocab_size}")
    if kv_storage(target).quantized:
        raise DecodertError(f"{target_artifact}: a quantized KV cache ({target.kv_dtype}) is not read by draft heads yet")
    dtype = dtype or target.dtype
    if dtype != target.dtype or dtype not in ("fp32", "fp16"):
        raise DecodertError(f"the head's dtype {dtype} must be the target's, fp32 or fp16 (the target: {target.dtype})")
    sources = assistant_family.source_layers(tspec, spec)
    dims = {i: tspec.head_dim_of(i) for i in sources.values()}
    weights = _read_weights(src, assistant_family.weight_names(spec))
    out.mkdir(parents=True, exist_ok=True)
    model = build_head_graph(spec, weights, sources, dims, dtype, target.max_seq)
    onnx.save_model(model, out / HEAD_GRAPH, save_as_external_data=True, location="head.bin", size_threshold=1024)
    onnx.checker.check_model(str(out / HEAD_GRAPH), full_check=True)
    record = {"format": "decodert-head", "version": 1, "family": "gemma4_assistant", "dtype": dtype,
              "max_seq": target.max_seq,
              "target": {"weights_sha256": target_identity(target), "family": tspec.family,
                         "hidden_size": tspec.hidden_size, "vocab_size": tspec.vocab_size},
              "reads": {"hidden": "hidden_state", "kv_layers": {k: int(v) for k, v in sources.items()}},
              "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()
                       if not isinstance(v, dict)},
              "graph": {"file": HEAD_GRAPH, **head_contract(spec, sources, dims, dtype, target.max_seq)}}
    (out / HEAD_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _read_weights(src: Path, names: dict[str, str]) -> dict[str, np.ndarray]:
    """Canonical name -> float32 (token_ordering: int64) array, from the folder's safetensors files."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise DecodertError(f"{src}: no .safetensors weights")
    opened = [SafetensorsFile(f) for f in files]
    try:
        out = {}
        for canon, key in names.items():
            f = next((o for o in opened if key in o), None)
            if f is None:
                if canon.endswith("layer_scalar"):  # transformers' buffer, 1 unless saved
                    out[canon] = np.ones(1, np.float32)
                    continue
                raise DecodertError(f"{src}: weight {key} is missing")
            out[canon] = f.raw(key).astype(np.int64) if canon == "token_ordering" else f.read(key)
        return out
    finally:
        for o in opened:
            o.close()
