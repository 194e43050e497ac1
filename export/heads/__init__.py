"""Draft heads as artifacts of their own: a head checkpoint exported beside the target artifact it drafts for.

    decodert export HEAD_FOLDER --target-artifact TARGET -o OUT
    decodert export TARGET_FOLDER --target-artifact TARGET -o OUT   (a checkpoint whose mtp.* layers are the head:
                                                                     Qwen3.5, models/families/qwen3_5.MTP_WEIGHTS)
        OUT/head.json   what the head is (family), which target it belongs to (the sha256 of the target's
                        weights.bin, as the target's manifest records it), the target layers whose K/V it reads,
                        its graph's I/O
        OUT/head.onnx   its step graph (+ head.bin: the weights)

A head reads the target's last hidden state, which the target's graphs return only when exported with
``--hidden-states`` (export/lowering/io_contract.hidden_outputs); a target without them is refused in one line, as
is loading a head beside any other target. Families: gemma4_assistant (models/families/gemma4_assistant.py; it
reads the target's K/V), qwen3_5_mtp (the MTP layer of a Qwen3.5 checkpoint, exported from the target's own
folder: the same ``--target-artifact`` path, SRC being the checkpoint the target was exported from; the head keeps
its own small K/V, runtime/speculation/mtp.py) and eagle3 (models/families/eagle3.py: a head folder in the
published layout; it reads three layers' inputs, which the target returns when exported with ``--hidden-layers``,
and keeps its own K/V as the MTP layer does).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from decodert.errors import DecodertError
from decodert.artifact.graph_contract import kv_storage
from decodert.artifact.heads import (HEAD_FAMILIES, HEAD_MANIFEST, has_hidden_states, load_head,  # noqa: F401
                                     target_embedding, target_identity)
from decodert.artifact.manifest import load_manifest
from decodert.artifact.safetensors_file import SafetensorsFile
from decodert.models import family_for
from decodert.models.families import eagle3 as eagle3_family
from decodert.models.families import gemma4_assistant as assistant_family
from decodert.models.families import qwen3_5 as mtp_family

HEAD_GRAPH = "head.onnx"


def is_head_checkpoint(src: str | Path) -> bool:
    """Whether ``src`` is a draft head's checkpoint folder (its config.json names a head family)."""
    config = Path(src) / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (raw.get("model_type") in HEAD_FAMILIES or eagle3_family.is_eagle3(raw))


def has_mtp_layers(src: str | Path) -> bool:
    """Whether ``src`` is a checkpoint folder of a family with MTP layers that carries them (mtp.fc.weight)."""
    src = Path(src)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if config.get("model_type") not in mtp_family.MTP_MODEL_TYPES:
        return False
    for f in sorted(src.glob("*.safetensors")):
        opened = SafetensorsFile(f)
        try:
            if mtp_family.MTP_WEIGHTS["fc"] in opened:
                return True
        finally:
            opened.close()
    return False


def export_head(src: str | Path, out_dir: str | Path, target_artifact: str | Path, dtype: str | None = None,
                quant: Any = None) -> dict:
    """Export the head checkpoint ``src`` (or the MTP layers of the target checkpoint ``src``) for the target
    artifact ``target_artifact`` into ``out_dir``; returns head.json's record. ``dtype``: the target's unless given
    (fp32 | fp16). ``quant`` (a QuantConfig; an ort target): the head's linears block-quantized, so that a drafted
    token reads a quarter (int8) or an eighth (int4) of the bytes (an MTP layer's lm_head is the target's whole
    vocabulary: most of its bytes; Gemma 4's assistant's is its embedding, which stays float)."""
    src, out = Path(src), Path(out_dir)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DecodertError(f"{src / 'config.json'}: cannot read ({e})") from None
    eagle3 = eagle3_family.is_eagle3(config)
    mtp = config.get("model_type") in mtp_family.MTP_MODEL_TYPES and not eagle3
    if mtp and not has_mtp_layers(src):
        raise DecodertError(f"{src}: this checkpoint carries no MTP layers ({mtp_family.MTP_WEIGHTS['fc']} is missing)")
    if config.get("model_type") not in HEAD_FAMILIES and not mtp and not eagle3:
        raise DecodertError(f"{src}: model_type {config.get('model_type')!r} is not a draft head (supported: "
                            f"gemma4_assistant, an EAGLE-3 head ({eagle3_family.ARCHITECTURES[0]}), or a "
                            f"{'/'.join(mtp_family.MTP_MODEL_TYPES)} checkpoint with mtp.* layers)")
    target = load_manifest(target_artifact)
    if not has_hidden_states(target):
        raise DecodertError(f"{target_artifact}: its graphs do not return the hidden state a head reads; "
                            "export the target again with --hidden-states")
    if kv_storage(target).quantized:
        raise DecodertError(f"{target_artifact}: a quantized KV cache ({target.kv_dtype}) is not read by draft heads yet")
    dtype = dtype or target.dtype
    if dtype != target.dtype or dtype not in ("fp32", "fp16"):
        raise DecodertError(f"the head's dtype {dtype} must be the target's, fp32 or fp16 (the target: {target.dtype})")
    if not eagle3 and target.hidden_layers:
        raise DecodertError(f"{target_artifact}: its hidden-state outputs are layer features (--hidden-layers), which "
                            "only an EAGLE-3 head reads; export the target again with --hidden-states alone")
    if quant is not None:
        from decodert.export.lowering.targets import get_target

        get_target(target.target).check_quantized_head()
    out.mkdir(parents=True, exist_ok=True)
    if eagle3:
        record = _export_eagle3(src, out, config, target, target_artifact, dtype, quant)
    elif mtp:
        record = _export_mtp(src, out, config, target, target_artifact, dtype, quant)
    else:
        record = _export_assistant(src, out, config, target, target_artifact, dtype, quant)
    (out / HEAD_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _quant_record(quant: Any) -> dict:
    """head.json's ``quant`` entry (none for a float head)."""
    if quant is None:
        return {}
    return {"quant": {"bits": quant.bits, "block_size": quant.block_size, "symmetric": quant.symmetric,
                      "accuracy_level": quant.accuracy_level, "lm_head": quant.lm_head}}


def _target_record(target, tspec) -> dict:
    return {"weights_sha256": target_identity(target), "family": tspec.family, "hidden_size": tspec.hidden_size,
            "vocab_size": tspec.vocab_size}


def _export_assistant(src: Path, out: Path, config: dict, target, target_artifact, dtype: str, quant: Any = None) -> dict:
    from decodert.export.heads.gemma4_assistant import build_head_graph, head_contract

    spec = assistant_family.spec_from_hf(config)
    tspec = target.model.spec()
    if spec.backbone_hidden_size != tspec.hidden_size or spec.vocab_size != tspec.vocab_size:
        raise DecodertError(f"{src}: the head drafts for a model of hidden size {spec.backbone_hidden_size} and "
                            f"vocabulary {spec.vocab_size}; {target_artifact} has {tspec.hidden_size} and {tspec.vocab_size}")
    sources = assistant_family.source_layers(tspec, spec)
    dims = {i: tspec.head_dim_of(i) for i in sources.values()}
    weights = _read_weights(src, assistant_family.weight_names(spec))
    quant = dataclasses.replace(quant, lm_head=False) if quant is not None else None  # its lm_head: the embedding
    model = build_head_graph(spec, weights, sources, dims, dtype, target.max_seq, quant)
    onnx.save_model(model, out / HEAD_GRAPH, save_as_external_data=True, location="head.bin", size_threshold=1024)
    onnx.checker.check_model(str(out / HEAD_GRAPH), full_check=True)
    return {"format": "decodert-head", "version": 1, "family": "gemma4_assistant", "dtype": dtype, **_quant_record(quant),
            "max_seq": target.max_seq, "target": _target_record(target, tspec),
            "reads": {"hidden": "hidden_state", "kv_layers": {k: int(v) for k, v in sources.items()}},
            "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()
                     if not isinstance(v, dict)},
            "graph": {"file": HEAD_GRAPH, **head_contract(spec, sources, dims, dtype, target.max_seq)}}


_EMBED_ROWS_CHECKED = 64  # rows of the embedding compared with the target's: the head is the target checkpoint's


def _export_mtp(src: Path, out: Path, config: dict, target, target_artifact, dtype: str, quant: Any = None) -> dict:
    """The MTP layer of the checkpoint ``src`` (the one ``target_artifact`` was exported from: its family, sizes and
    the first rows of its embedding must be the target's) -> head.onnx with the target's lm_head."""
    from decodert.export.heads.qwen3_5_mtp import build_mtp_graph, mtp_contract

    tspec = target.model.spec()
    ckpt = family_for(config["model_type"], str(src)).spec_from_hf(config)
    spec = mtp_family.mtp_spec(config, ckpt)
    if tspec.family != ckpt.family or spec.hidden_size != tspec.hidden_size or spec.vocab_size != tspec.vocab_size:
        raise DecodertError(f"{src}: its MTP layers draft for a {ckpt.family} model of hidden size "
                            f"{spec.hidden_size} and vocabulary {spec.vocab_size}; {target_artifact} is a {tspec.family} "
                            f"model of {tspec.hidden_size} and {tspec.vocab_size}")
    keys = _checkpoint_keys(src)
    names = {k: v for k, v in mtp_family.MTP_WEIGHTS.items() if not (spec.moe and k in mtp_family.MTP_DENSE)}
    if spec.moe is not None:
        for canon, key in mtp_family.MTP_MOE_WEIGHTS.items():
            if "{j}" in key:
                names.update({f"{canon}.{j}": key.format(j=j) for j in range(spec.moe.num_experts)})
            else:
                names[canon] = key
    plain = {mtp_family.sanitize(k): k for k in keys if mtp_family.sanitize(k) is not None}
    head = plain.get("lm_head.weight") or (plain.get("model.embed_tokens.weight") if tspec.tie_word_embeddings else None)
    embed = plain.get("model.embed_tokens.weight")
    if head is None or embed is None:
        raise DecodertError(f"{src}: no lm_head / embed_tokens weight for the MTP head")
    names["lm_head"], names["embed_rows"] = head, embed
    weights = _read_weights(src, names)
    rows = weights.pop("embed_rows")[:_EMBED_ROWS_CHECKED]
    theirs = np.asarray(target_embedding(Path(target_artifact), target)[: len(rows)], np.float32)
    if not np.allclose(rows, theirs, atol=1e-2 if dtype == "fp16" else 1e-6):
        raise DecodertError(f"{src}: its embedding is not {target_artifact}'s; export the MTP head from the "
                            "checkpoint the target was exported from")
    for name in mtp_family.MTP_ONE_PLUS_W:
        weights[name] = weights[name] + np.float32(1.0)
    if spec.moe is not None:  # the canonical experts: gate_up [E, 2 Ie, hidden] with gate and up rows interleaved
        n = spec.moe.num_experts
        gate, up = (np.stack([weights.pop(f"experts.{w}.{j}") for j in range(n)]) for w in ("gate", "up"))
        weights["experts.gate_up"] = np.stack([gate, up], axis=2).reshape(n, -1, spec.hidden_size)
        weights["experts.down"] = np.stack([weights.pop(f"experts.down.{j}") for j in range(n)])
    onnx.save_model(build_mtp_graph(spec, weights, dtype, target.max_seq, quant), out / HEAD_GRAPH,
                    save_as_external_data=True, location="head.bin", size_threshold=1024)
    onnx.checker.check_model(str(out / HEAD_GRAPH), full_check=True)
    return {"format": "decodert-head", "version": 1, "family": "qwen3_5_mtp", "dtype": dtype, **_quant_record(quant),
            "max_seq": target.max_seq, "target": _target_record(target, tspec),
            "reads": {"hidden": "hidden_state", "kv_layers": {}},
            "cache": {"layers": 1, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
            "spec": {k: v for k, v in dataclasses.asdict(spec).items() if k != "rope"},
            "graph": {"file": HEAD_GRAPH, **mtp_contract(spec, dtype)}}


def _export_eagle3(src: Path, out: Path, config: dict, target, target_artifact, dtype: str, quant: Any = None) -> dict:
    """An EAGLE-3 head folder (config.json + safetensors in the published layout) -> head.onnx (+ embed.npy where
    the head has an embedding of its own that is not the target's)."""
    from decodert.export.heads.eagle3 import build_eagle3_graph, eagle3_contract

    spec = eagle3_family.spec_from_hf(config)
    tspec = target.model.spec()
    if spec.target_hidden_size != tspec.hidden_size or spec.vocab_size != tspec.vocab_size:
        raise DecodertError(f"{src}: the head drafts for a model of hidden size {spec.target_hidden_size} and "
                            f"vocabulary {spec.vocab_size}; {target_artifact} has {tspec.hidden_size} and {tspec.vocab_size}")
    if tspec.embed_scale is not None:
        raise DecodertError(f"{target_artifact}: a target with scaled embeddings ({tspec.family}) is not read by "
                            "EAGLE-3 heads yet")
    ids = eagle3_family.layer_ids(spec, tspec.num_layers)
    if tuple(target.hidden_layers or ()) != ids:
        raise DecodertError(f"{target_artifact}: the head reads the inputs of the target's layers {list(ids)}; export "
                            f"the target again with --hidden-layers {','.join(map(str, ids))}")
    names = eagle3_family.weight_names(_checkpoint_keys(src))
    weights = _read_weights(src, names, raw=("d2t", "t2d"))
    want = {"fc": (spec.hidden_size, 3 * spec.target_hidden_size), "lm_head": (spec.draft_vocab_size, spec.hidden_size),
            "q": (spec.num_heads * spec.head_dim, 2 * spec.hidden_size)}
    for name, shape in want.items():
        if weights[name].shape != shape:
            raise DecodertError(f"{src}: {names[name]} is {list(weights[name].shape)}, the config says {list(shape)}")
    t2d = weights.pop("t2d", None)  # d2t maps every draft id to its target id; t2d only checked against it
    if "d2t" in weights:
        d2t = weights["d2t"].astype(np.int64).reshape(-1)
        ids_in_target = np.arange(len(d2t)) + d2t
        if len(d2t) != spec.draft_vocab_size or ids_in_target.min() < 0 or ids_in_target.max() >= spec.vocab_size:
            raise DecodertError(f"{src}: d2t must map each of the {spec.draft_vocab_size} draft ids to a target id "
                                f"below {spec.vocab_size}")
        if t2d is not None and (t2d.reshape(-1).shape != (spec.vocab_size,) or not t2d.reshape(-1)[ids_in_target].all()
                                or int(t2d.sum()) != len(set(ids_in_target.tolist()))):
            raise DecodertError(f"{src}: t2d does not mark the target ids d2t maps the draft ids to")
        weights["d2t"] = d2t
    elif spec.draft_vocab_size != spec.vocab_size:
        raise DecodertError(f"{src}: a draft vocabulary of {spec.draft_vocab_size} (not the target's "
                            f"{spec.vocab_size}) needs its d2t table")
    embedding = _head_embedding(src, out, weights.pop("embed", None), spec, target, target_artifact, dtype)
    onnx.save_model(build_eagle3_graph(spec, weights, dtype, target.max_seq, quant), out / HEAD_GRAPH,
                    save_as_external_data=True, location="head.bin", size_threshold=1024)
    onnx.checker.check_model(str(out / HEAD_GRAPH), full_check=True)
    return {"format": "decodert-head", "version": 1, "family": "eagle3", "dtype": dtype,
            **_quant_record(quant),
            "max_seq": target.max_seq, "target": _target_record(target, tspec),
            "reads": {"hidden": "hidden_state", "hidden_layers": list(ids), "kv_layers": {}},
            "cache": {"layers": 1, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
            "embedding": embedding,
            "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()
                     if k != "rope"},
            "graph": {"file": HEAD_GRAPH, **eagle3_contract(spec, dtype)}}


HEAD_EMBEDDING = "embed.npy"  # an EAGLE-3 head's own token embedding, where it is not the target's


def _head_embedding(src: Path, out: Path, embed, spec, target, target_artifact, dtype: str) -> str:
    """"target" where the head reads the target's embedding (it has none, or a copy of the target's), else the
    file of its own (the head's dtype) beside head.onnx."""
    if embed is not None and embed.shape != (spec.vocab_size, spec.hidden_size):
        raise DecodertError(f"{src}: embed_tokens.weight is {list(embed.shape)}, not [{spec.vocab_size}, "
                            f"{spec.hidden_size}]")
    if embed is None:
        if spec.hidden_size != spec.target_hidden_size:
            raise DecodertError(f"{src}: a head of hidden size {spec.hidden_size} (the target's: "
                                f"{spec.target_hidden_size}) needs embed_tokens.weight of its own")
        return "target"
    if spec.hidden_size == spec.target_hidden_size:
        theirs = np.asarray(target_embedding(Path(target_artifact), target), np.float32)
        if np.allclose(embed, theirs, atol=1e-2 if dtype == "fp16" else 1e-6):
            return "target"
    np.save(out / HEAD_EMBEDDING, embed.astype(np.float16 if dtype == "fp16" else np.float32))
    return HEAD_EMBEDDING


def _checkpoint_keys(src: Path) -> set[str]:
    keys: set[str] = set()
    for f in sorted(src.glob("*.safetensors")):
        opened = SafetensorsFile(f)
        try:
            keys.update(opened.keys())
        finally:
            opened.close()
    return keys


def _read_weights(src: Path, names: dict[str, str], raw: tuple[str, ...] = ("token_ordering",)) -> dict[str, np.ndarray]:
    """Canonical name -> float32 (those named in ``raw``: int64) array, from the folder's safetensors files."""
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
            out[canon] = f.raw(key).astype(np.int64) if canon in raw else f.read(key)
        return out
    finally:
        for o in opened:
            o.close()
