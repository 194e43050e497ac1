"""A draft head's record (head.json, written by export/heads/): what it is, the target it drafts for, what it reads.
Checked when a head is loaded beside a target (runtime/llm.py): a head exported for another target is refused in
one line (its record names the target by the sha256 of the target's weights file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from decodert.errors import DecodertError

HEAD_MANIFEST = "head.json"
# gemma4_assistant.py MODEL_TYPES; the MTP layers of qwen3_5.py; eagle3.py (found by its architecture)
HEAD_FAMILIES = ("gemma4_assistant", "qwen3_5_mtp", "eagle3")
HEAD_METHODS = {"gemma4_assistant": "assistant", "qwen3_5_mtp": "mtp", "eagle3": "eagle3"}  # family -> its speculative=
HEAD_METHOD_NAMES = tuple(dict.fromkeys(HEAD_METHODS.values()))  # the speculative= methods that draft with a head


def target_identity(manifest: Any) -> str:
    """The target's identity a head records: the sha256 of its weights file, from its manifest."""
    rec = manifest.files.get(manifest.weights.file)
    if rec is None:
        raise DecodertError(f"the target's manifest records no hash of {manifest.weights.file}")
    return rec.sha256


def head_method(folder: str | Path) -> str | None:
    """The speculative= method that drafts with the head artifact ``folder`` (None: not a head artifact)."""
    path = Path(folder) / HEAD_MANIFEST
    if not path.is_file():
        return None
    try:
        return HEAD_METHODS.get(json.loads(path.read_text()).get("family"), "assistant")
    except (OSError, ValueError):
        return "assistant"  # load_head says what is wrong with it


def has_hidden_states(manifest: Any) -> bool:
    return any(t.name == "hidden_state" for t in manifest.graphs["prefill"].outputs)


def hidden_width(manifest: Any) -> int:
    """The width of one row of the graphs' hidden-state outputs (hidden, or len(hidden_layers) x hidden for an
    EAGLE-3 target); 0 without them."""
    out = next((t for t in manifest.graphs["prefill"].outputs if t.name == "hidden_state"), None)
    return int(out.shape[-1]) if out is not None else 0


def load_head(folder: str | Path, target: Any) -> dict:
    """head.json of ``folder``, checked against the target's manifest ``target`` (one line when it is another's)."""
    path = Path(folder) / HEAD_MANIFEST
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        raise DecodertError(f"{folder}: not a draft head artifact (no readable {HEAD_MANIFEST}; export one with "
                            "`decodert export HEAD --target-artifact TARGET`)") from None
    if record.get("format") != "decodert-head" or record.get("family") not in HEAD_FAMILIES:
        raise DecodertError(f"{path}: not a decodert draft head record")
    cache = record.get("cache", {"layers": 1, "num_kv_heads": 1, "head_dim": 1})  # a head with a K/V of its own
    if not isinstance(cache, dict) or not all(isinstance(cache.get(k), int) and cache[k] > 0
                                              for k in ("layers", "num_kv_heads", "head_dim")):
        raise DecodertError(f"{path}: its 'cache' record must give layers, num_kv_heads and head_dim")
    if record["target"]["weights_sha256"] != target_identity(target):
        raise DecodertError(f"{folder}: this head was exported for another target (weights sha256 "
                            f"{record['target']['weights_sha256'][:12]}…); export it again with --target-artifact")
    if not has_hidden_states(target):
        raise DecodertError("the target's graphs do not return the hidden state a head reads; "
                            "export the target again with --hidden-states")
    reads = tuple(record.get("reads", {}).get("hidden_layers") or ())
    if reads != tuple(target.hidden_layers or ()):
        have = f"the inputs of layers {list(target.hidden_layers)}" if target.hidden_layers else "the final hidden state"
        raise DecodertError(f"{folder}: the head reads {f'the inputs of layers {list(reads)}' if reads else 'the final hidden state'}"
                            f"; the target's graphs return {have}")
    return record


def head_embedding(folder: str | Path, record: dict, target_folder: Path, target: Any) -> np.ndarray:
    """The token embedding a head reads [V, hidden]: the target's (``target_embedding``) unless its record names a
    file of its own beside head.onnx (an EAGLE-3 head with its own embed_tokens), opened read-only."""
    own = record.get("embedding", "target")
    if own == "target":
        return target_embedding(target_folder, target)
    try:
        return np.load(Path(folder) / own, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DecodertError(f"{folder}: cannot read the head's embedding {own} ({e})") from None


def target_embedding(folder: Path, manifest: Any) -> np.ndarray:
    """The target's token embedding table [V, hidden], a read-only view of its weights file (the prefill graph's
    ``embed`` initializer, stored in float); one line where it is stored quantized."""
    graph = onnx.load(str(folder / manifest.graphs["prefill"].file), load_external_data=False)
    init = next((t for t in graph.graph.initializer if t.name == "embed"), None)
    if init is None or init.data_location != onnx.TensorProto.EXTERNAL or init.data_type not in (1, 10):
        raise DecodertError(f"{folder}: the target's embedding table is not stored in float in its weights file "
                            "(a quantized embedding); draft heads need a float one")
    info = {e.key: e.value for e in init.external_data}
    dtype = np.float32 if init.data_type == 1 else np.float16
    return np.memmap(folder / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                     shape=tuple(init.dims))
